"""Python-side optimizer state that the step itself updates: host slots.

Many optimizers keep counters and flags in plain Python objects rather than
tensors: ``group["step"] += 1``, ``state["step"] = state.get("step", 0) + 1``,
``self.t += 1``, ``state["initialized"] = True``. A traced graph cannot hold
such an update; dropping it would make every later compiled step use the
first step's value. So the capture finds each such write (by comparing the
objects before and after a trace), and

- a *number* that the step reads and rewrites becomes a host input (a
  :class:`~hocompile.capture.hyper_params.HyperParam` during the trace, like ``lr``),
  masked out of the guard signature, and its new value an expression the
  runtime evaluates after every step (:class:`HostUpdate`);
- a value the step sets from constants (``True``, ``0``) is written back as
  that constant;
- anything else (a list that grows, a new object) cannot be repeated by a
  compiled step, and capture refuses with a :class:`CaptureError` naming it.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import CaptureError
from .hyper_params import HyperParam
from .scalars import Expr

MISSING: Any = object()  # a slot the optimizer does not have (yet)


@dataclass(frozen=True)
class HostSlot:
    """Where a Python value lives: a group entry, a param's state entry, or an optimizer attribute."""

    kind: str  # "group", "state" or "attr"
    key: str
    group: int = -1
    index: int = -1

    def name(self) -> str:
        """The host input's name, as explain() shows it."""
        if self.kind == "group":
            return f"g{self.group}.{self.key}"
        if self.kind == "state":
            return f"g{self.group}.p{self.index}.state.{self.key}"
        return f"opt.{self.key}"

    def describe(self) -> str:
        if self.kind == "group":
            return f"param_groups[{self.group}][{self.key!r}]"
        if self.kind == "state":
            return f"state[param_groups[{self.group}]['params'][{self.index}]][{self.key!r}]"
        return f"optimizer attribute {self.key!r}"

    def read(self, opt: torch.optim.Optimizer) -> Any:
        if self.kind == "group":
            return opt.param_groups[self.group].get(self.key, MISSING)
        if self.kind == "state":
            p = opt.param_groups[self.group]["params"][self.index]
            return opt.state.get(p, {}).get(self.key, MISSING) if p in opt.state else MISSING
        return vars(opt).get(self.key, MISSING)

    def write(self, opt: torch.optim.Optimizer, value: Any) -> None:
        if self.kind == "group":
            opt.param_groups[self.group][self.key] = value
        elif self.kind == "state":
            opt.state[opt.param_groups[self.group]["params"][self.index]][self.key] = value
        else:
            setattr(opt, self.key, value)


@dataclass(frozen=True)
class HostUpdate:
    """After each step: ``slot = expr`` evaluated on the values from before the step."""

    slot: HostSlot
    expr: Expr | None  # None: write ``constant``
    constant: Any = None

    def value(self, env: dict[str, Any]) -> Any:
        return self.constant if self.expr is None else self.expr.evaluate(env)

    def describe(self) -> str:
        value = repr(self.constant) if self.expr is None else self.expr.pretty()
        return f"{self.slot.describe()} = {value}"


def is_number(value: Any) -> bool:
    """Ints and floats (numpy ones too), not bools: what a host slot may hold."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and not isinstance(value, torch.Tensor)


def is_constant(value: Any) -> bool:
    """An immutable value a compiled step can write back as it is."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return not isinstance(value, HyperParam)
    if isinstance(value, tuple):
        return all(is_constant(v) for v in value)
    return False


@dataclass(frozen=True)
class Change:
    """One write the traced step made to a host slot."""

    slot: HostSlot
    before: Any  # the value the trace started from (MISSING: the slot was absent)
    after: Any  # the value it left (MISSING: deleted)


def needs_lifting(changes: list[Change], lifted: frozenset[HostSlot]) -> set[HostSlot]:
    """Slots holding a number the step rewrote: they must be host inputs."""
    return {c.slot for c in changes if c.slot not in lifted and is_number(c.before)}


def host_updates(first: list[Change], second: list[Change]) -> tuple[HostUpdate, ...]:
    """The updates to replay, from two traces that used different sentinels."""
    seconds = {c.slot: c for c in second}
    updates: list[HostUpdate] = []
    for change in first:
        other = seconds.get(change.slot)
        a, b = change.after, other.after if other is not None else MISSING
        where = change.slot.describe()
        if a is MISSING:
            raise CaptureError(f"the step deletes {where}; a compiled step cannot repeat that")
        if isinstance(a, HyperParam):
            if not isinstance(b, HyperParam) or a.expr != b.expr:
                raise CaptureError(f"the step's update of {where} could not be followed on the host")
            updates.append(HostUpdate(change.slot, a.expr))
        elif is_constant(a) and is_constant(b) and type(a) is type(b) and a == b:
            updates.append(HostUpdate(change.slot, None, a))
        elif is_number(a):
            raise CaptureError(
                f"the step sets {where} to a number computed outside what hocompile can follow "
                "(e.g. math.sqrt or a numpy call on a hyperparameter); a compiled step would repeat "
                "the first step's value"
            )
        else:
            raise CaptureError(
                f"the step sets {where} to a {type(a).__name__}; only numbers and constants kept in "
                "Python can be updated by a compiled step (keep such state in tensors)"
            )
    return tuple(updates)
