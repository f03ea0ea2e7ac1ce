"""What explain() and plan() return: the report's text, with its facts as fields.

A report is a ``str`` (``print(hocompile.explain(opt))`` and every string operation read it as
they always did) that also carries what it says as data: a tool or a test reads
``report.programs[0].passes`` instead of searching the text, and does not depend on its wording
or column padding.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, TypeVar

from ...passes import PassRecord

R = TypeVar("R", bound="Report")


class Report(str):
    """Text plus fields; the fields a subclass declares (each with its default) are set by :meth:`make`."""

    @classmethod
    def make(cls: type[R], text: str, **facts: Any) -> R:
        report = cls(text)
        unknown = set(facts) - set(cls.__annotations__)
        if unknown:
            raise TypeError(f"{cls.__name__} has no field(s) {sorted(unknown)}")
        vars(report).update(facts)
        return report


@dataclass(frozen=True)
class ProgramReport:
    """One compiled step (a program selected by its guard signature), as explain() shows it."""

    number: int  # 1-based, in compile order: "compiled step #number"
    reason: str  # why it was compiled: "first step", or the recompile reason
    compile_seconds: float
    eager: str  # why this program runs eagerly ('' where it runs compiled)
    stamped: bool  # traced on one representative per parameter class
    traced_whole: str  # why it was traced whole ('' where stamped, or not said)
    classes: tuple[str, ...]  # each parameter class, described, where stamped
    verification: str  # verify=N's summary ('' where not verified)
    self_check: str  # the self-check's summary ('' before its first check or skip)
    passes: tuple[PassRecord, ...]
    plans: tuple[str, ...]  # the passes' decisions, one line each
    backend: str  # the lowering ("aten", "triton"); '' where it runs eagerly
    launches: int  # kernel launches per step (Triton); 0 on aten
    cache_key: str  # the first 16 hex digits of the lowered module's key

    def fired(self) -> tuple[str, ...]:
        """The passes that changed the graph, in pipeline order."""
        return tuple(r.name for r in self.passes if r.status == "changed")


class Explanation(Report):
    """``hocompile.explain(opt)``."""

    optimizer: str = ""  # the user's optimizer class, module-qualified
    steps: int = 0
    counters: Mapping[str, Any] = MappingProxyType({})  # CompiledOptimizer.counters, as a dict
    runs_eagerly: str = ""  # why every step runs eagerly ('' where steps compile)
    as_is: str = ""  # why the step runs as torch runs it (torch's own fused kernel), once seen
    programs: tuple[ProgramReport, ...] = ()
    inside: tuple[Explanation, ...] = ()  # a training stack's wrapper: each optimizer compiled inside it


class PlanReport(Report):
    """``hocompile.plan(opt, ...)``."""

    optimizer: str = ""  # the optimizer class
    target: str = ""  # what the plan was made for, described
    as_is: str = ""  # why the step would run as torch runs it ('' otherwise)
    stamped: bool = False
    traced_whole: str = ""  # why it is traced whole ('' where stamped, or not said)
    classes: tuple[str, ...] = ()  # each parameter class, described, where stamped
    passes: tuple[PassRecord, ...] = ()
    plans: tuple[str, ...] = ()  # the passes' decisions, one line each (a step traced whole)
