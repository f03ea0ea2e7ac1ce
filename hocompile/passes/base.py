"""What every pass is: a frozen dataclass with a kebab-case name."""

from __future__ import annotations

import hashlib
import inspect
import logging
from dataclasses import dataclass, field, fields
from typing import ClassVar

import torch.fx as fx

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
    pass's source change.
    """

    name: ClassVar[str] = "pass"

    def __call__(self, gm: fx.GraphModule) -> PassResult:
        raise NotImplementedError

    def decline(self, reason: str) -> str:
        log.info("%s declined: %s", self.name, reason)
        return reason

    def identity(self) -> str:
        options = ",".join(f"{f.name}={getattr(self, f.name)!r}" for f in fields(self))
        source = inspect.getsource(type(self))
        digest = hashlib.sha256(source.encode()).hexdigest()[:12]
        return f"{self.name}({options})@{digest}"
