"""Which params share a program: the parameter classes of an optimizer as it is now.

Two params of one group are in the same class when everything the traced
program could depend on is equal for them: the param's and the grad's type,
shape, strides, dtype, device, layout and ``requires_grad``, the param's Python
attributes (stand_ins.py), and the state's
keys with, per key, the same for a tensor or the value itself for a Python
object (a number the step rewrites is a host input, so its value is left
out: members of one class may be at different step counts). Values the step
reads and does not rewrite are baked into the traced program, so they are
part of the class.

Whether the members' programs really are equal, and independent of each
other, is for stamp.py to prove: classes are only the candidates.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..capture.host_state import HostSlot
from ..capture.stand_ins import frozen_attributes, tensor_attributes
from ..ir import dtypes

Layout = tuple[Any, ...]


@dataclass(frozen=True)
class ParamClass:
    """The params of one group that share a program; ``members`` index the group's list, in order."""

    group: int
    members: tuple[int, ...]
    title: str  # what the members are, for explain(): "fp32[128, 48], state momentum_buffer"
    key: Hashable = field(repr=False, compare=False)

    @property
    def rep(self) -> int:
        """The member whose trace is the class's program."""
        return self.members[0]

    def describe(self) -> str:
        count = len(self.members)
        return f"group {self.group}, {count:,} param{'s' if count != 1 else ''} {self.title}"


def _layout(t: torch.Tensor) -> Layout:
    return (type(t), t.shape, t.stride(), t.dtype, t.device, t.layout, t.requires_grad)


def _value_key(value: Any) -> Hashable:
    if isinstance(value, torch.Tensor):
        return ("tensor",) + _layout(value)
    try:
        hash(value)
    except TypeError:
        return ("unhashable", id(value))  # a list or dict in state: its own class, never shared
    return ("value", type(value), value)


_HOST = ("host",)


def param_key(
    opt: torch.optim.Optimizer, g: int, i: int, p: torch.Tensor, lifted: frozenset[HostSlot]
) -> Hashable:
    """Everything the traced program of param ``i`` of group ``g`` can depend on (see the module doc)."""
    state = opt.state.get(p, {})
    entries = []
    for key in sorted(state, key=repr):
        value = state[key]
        masked = not isinstance(value, torch.Tensor) and HostSlot("state", key, g, i) in lifted
        entries.append((key, _HOST if masked else _value_key(value)))
    assert p.grad is not None
    return (g, _layout(p), _layout(p.grad), tuple(entries), frozen_attributes(p))


def _title(opt: torch.optim.Optimizer, p: torch.Tensor) -> str:
    def show(t: torch.Tensor) -> str:
        return f"{dtypes.name(t.dtype)}[{', '.join(str(s) for s in t.shape)}]"

    state = opt.state.get(p, {})
    keys = [f"{k} {show(v)}" if isinstance(v, torch.Tensor) else str(k) for k, v in state.items()]
    hung = [f"{k} {show(v)}" for k, v in tensor_attributes(p)]  # main_grad: an input of each member too
    held = f", .{', .'.join(hung)}" if hung else ""
    return show(p) + held + (f", state {', '.join(keys)}" if keys else ", no state yet")


def classify(opt: torch.optim.Optimizer, lifted: frozenset[HostSlot] = frozenset()) -> list[ParamClass]:
    """The classes of the params that have grads, in the order of their first member."""
    found: dict[Hashable, list[int]] = {}
    firsts: dict[Hashable, torch.Tensor] = {}
    groups: dict[Hashable, int] = {}
    for g, group in enumerate(opt.param_groups):
        for i, p in enumerate(group["params"]):
            if p.grad is None:
                continue
            key = param_key(opt, g, i, p, lifted)
            if key not in found:
                found[key], firsts[key], groups[key] = [], p, g
            found[key].append(i)
    return [ParamClass(groups[k], tuple(m), _title(opt, firsts[k]), k) for k, m in found.items()]


def shared_storage(opt: torch.optim.Optimizer, classes: list[ParamClass]) -> str:
    """The first two members whose tensors overlap in memory ('' if none): their updates would not be
    independent.

    Disjoint views of one base are independent: a MoE's ``[E, m, n]`` experts handed to Muon as
    ``w.detach()[e]`` with grads ``w.grad[e]`` (torch.optim.Muon refuses 3-D params) are members
    like separate tensors. Each tensor counts as the byte range from its first to its last element
    in its storage, so strided views that interleave count as overlapping (traced whole).
    """
    spans: dict[int, list[tuple[int, int, str]]] = {}
    for cls in classes:
        params = opt.param_groups[cls.group]["params"]
        for i in cls.members:
            p = params[i]
            if p.device.type == "meta":
                return ""  # no memory to share (hocompile.plan on meta tensors)
            where = f"param_groups[{cls.group}]['params'][{i}]"
            tensors = [p, p.grad] + [v for v in opt.state.get(p, {}).values() if isinstance(v, torch.Tensor)]
            tensors += [v for _, v in tensor_attributes(p)]  # main_grads: disjoint slices of one buffer
            for t in tensors:
                if t is None or t.numel() == 0:
                    continue
                begin, end = _extent(t)
                held = spans.setdefault(t.untyped_storage().data_ptr(), [])
                other = next((w for b, e, w in held if w != where and b < end and begin < e), None)
                if other is not None:
                    return f"{other} and {where} share memory"
                held.append((begin, end, where))
    return ""


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """The bytes ``t`` may touch in its storage: [first element, one past its last)."""
    first = int(t.storage_offset())
    last = first + sum((int(n) - 1) * int(s) for n, s in zip(t.shape, t.stride()))  # torch strides are >= 0
    return first * t.element_size(), (last + 1) * t.element_size()
