"""What every pass is: a frozen dataclass with a kebab-case name."""

from __future__ import annotations

import hashlib
import inspect
import logging
from dataclasses import dataclass, field, fields
from typing import ClassVar

import torch.fx as fx

from ..ir.registry import OpSpec
from ..targets import Target

log = logging.getLogger("hocompile.passes")


@dataclass
class PassResult:
    """A pass's answer: the (possibly same) graph, whether it changed, and why."""

    gm: fx.GraphModule
    changed: bool
    summary: str = ""  # one line for explain(): what it did, or why it declined
    declined: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Pass:
    """Base class. Subclasses set ``name`` and implement ``__call__``.

    Options are dataclass fields, so ``repr(pass)`` shows them and
    :meth:`identity` (which enters the cache key) changes when they or the
    pass's source change. A pass that plans from a target's measured rates
    records what it chose in the graph (op arguments, structure, and
    :class:`~hocompile.ir.decisions.Decision` choices), so the identity names
    the target but not its rates.
    """

    name: ClassVar[str] = "pass"

    def __call__(self, gm: fx.GraphModule) -> PassResult:
        raise NotImplementedError

    def decline(self, reason: str) -> str:
        log.info("%s declined: %s", self.name, reason)
        return reason

    def identity(self) -> str:
        options = ",".join(f"{f.name}={_option_identity(getattr(self, f.name))}" for f in fields(self))
        return f"{self.name}({options})@{_source_digest(type(self))}"


_DIGESTS: dict[type, str] = {}


def _source_digest(cls: type) -> str:
    """The class's source, hashed once per class object (inspect.getsource re-reads and re-parses
    the file: ~10 ms a pass, on every compile). A reloaded module makes a new class, a new entry."""
    if (known := _DIGESTS.get(cls)) is None:
        known = _DIGESTS[cls] = hashlib.sha256(inspect.getsource(cls).encode()).hexdigest()[:12]
    return known


def with_declines(summary: str, reasons: list[str]) -> str:
    """``summary`` and, when candidates were declined, how many and the first reason
    (explain() shows one line per pass; the full list is in the PassResult)."""
    if not reasons:
        return summary
    return summary + f"; declined {len(reasons)}: " + reasons[0] + (" ..." if len(reasons) > 1 else "")


def replace_with_op(gm: fx.GraphModule, end: fx.Node, spec: OpSpec) -> fx.Node:
    """A call of ``spec``'s op inserted before ``end``, taking over its value and readers
    (``end`` and the chain before it are left to the caller or dead-code elimination)."""
    with gm.graph.inserting_before(end):
        op = gm.graph.call_function(type(spec).op(), spec.to_args())
    op.meta["val"] = end.meta["val"]
    end.replace_all_uses_with(op)
    return op


def _option_identity(value: object) -> str:
    # A target's rates are predictions (a recalibration measures new ones):
    # what a pass decides from them lands in the graph the cache key hashes,
    # so hashing the rates too would recompile an identical plan.
    if isinstance(value, Target):
        return f"Target({value.name!r})"
    return repr(value)
