"""What every pass is: a frozen dataclass with a kebab-case name."""

from __future__ import annotations

import hashlib
import inspect
import logging
from dataclasses import dataclass, field, fields
from typing import ClassVar

import torch.fx as fx

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
    :class:`~hocompile.decisions.Decision` choices), so the identity names
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
        source = inspect.getsource(type(self))
        digest = hashlib.sha256(source.encode()).hexdigest()[:12]
        return f"{self.name}({options})@{digest}"


def _option_identity(value: object) -> str:
    # A target's rates are predictions (a recalibration measures new ones):
    # what a pass decides from them lands in the graph the cache key hashes,
    # so hashing the rates too would recompile an identical plan.
    if isinstance(value, Target):
        return f"Target({value.name!r})"
    return repr(value)
