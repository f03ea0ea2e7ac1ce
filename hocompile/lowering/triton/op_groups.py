"""Registered op groups: how a ``hocompile::`` op family is lowered to Triton, one unit per call.

A family takes part by registering an emitter (:class:`GroupEmitter`) with
``registry.register_lowering(op, "triton", emitter)``; the region builder
and the wrapper know no family by name. A call becomes an :class:`OpGroup`
when the op has a Triton emitter and is a *matrix function*: one tensor
argument, a result of the same shape, 2-D (one matrix) or 3-D fed by the
``stack`` batch-by-shape made (a batch of members). The ``stack`` feeding
it and the ``unbind`` leaving it are absorbed: the pointwise kernel that
produces a member stores it straight into the group's stacked *workspace*
(transposed where the family's batch rule joined an n×m member to an m×n
batch), and the kernels reading a member load it from the stacked result.
A registered call with several tensor inputs is call_group.py's (a call
unit reading its inputs where they are); any other registered call (no
emitter, another shape) stays an aten call.

The wrapper allocates, per group, the workspace ``ws<g>`` ``[batch, m, n]``
(in :attr:`Workspace.dtype`, which the feeding kernels round to), optional
norm partials ``part<g>`` (per feeding program, its sum of squares: a
Frobenius norm without a reduction launch) and the result ``out<g>``; the
emitter writes everything between: its kernels, its own buffers (allocated
once in ``buffers()``, never inside ``launch()``) and its launch lines,
and says how many launches those lines make.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.fx as fx

from ...ir.registry import OpFamily, family_of
from .code import KernelSource

aten = torch.ops.aten
BACKEND = "triton"


@dataclass(frozen=True)
class GroupRef:
    """Member ``slot`` of op group ``group``: its input (``feed``) or its result."""

    group: int
    slot: int
    transposed: bool
    feed: bool


@dataclass
class OpGroup:
    """One call of a registered op lowered as a unit: ``batch`` members of ``m``×``n`` (the wide orientation)."""

    index: int
    node: fx.Node
    family: OpFamily
    emitter: GroupEmitter
    batch: int
    m: int
    n: int
    feeds: list[fx.Node]  # the value stored into each workspace slot
    feed_transposed: list[bool]
    absorbed: set[fx.Node] = field(default_factory=set)  # stack/unbind/getitem/permute views

    @property
    def spec(self) -> Any:
        return self.family.spec_of(self.node)

    @property
    def out_dtype(self) -> torch.dtype:
        return self.node.meta["val"].dtype  # type: ignore[no-any-return]


@dataclass(frozen=True)
class Workspace:
    """How feeding pointwise kernels store a member: rounded to ``dtype``, plus norm partials if asked."""

    dtype: torch.dtype
    norm_partials: bool = False


@dataclass(frozen=True)
class Buffer:
    """A buffer an emitter's launches use, allocated once per step in ``buffers()``."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype


def allocations(buffers: list[Buffer], device: str) -> list[str]:
    """``name = torch.empty(...)`` lines for ``buffers`` on the device expression ``device``."""
    return [f"{b.name} = torch.empty({b.shape}, dtype={b.dtype}, device={device})" for b in buffers]


@dataclass(frozen=True)
class GroupNames:
    """What the wrapper calls a group's values, for the emitter's launch lines."""

    x: str  # the workspace, [batch, m, n] in Workspace.dtype
    partials: str | None  # [batch, P] fp32 sums of squares, when the workspace asked for them
    n_partials: int  # P
    out: str  # the result, [batch, m, n] in the op's output dtype
    prefix: str  # for the emitter's own buffer names ("g0_")
    scalar: Callable[[Any], str]  # a scalar's 0-d device view in the step's scalar table
    upcast: str  # the expression launchers take as ``upcast`` (half precision in the interpreter)
    arch: str


@dataclass
class GroupCode:
    """An emitter's answer: kernels, buffers, launch lines, and how many launches the lines make."""

    kernels: list[KernelSource]
    buffers: list[Buffer]
    lines: list[str]
    launches: int
    summary: str  # one line for explain(): what the unit does


class GroupEmitter(Protocol):
    """What a family provides to be lowered to Triton as registered op groups."""

    def workspace(self, group: OpGroup) -> Workspace:
        """The dtype the feeding kernels store members in, and whether they write norm partials."""
        ...

    def scalars(self, group: OpGroup) -> list[Any]:
        """Scalar arguments the kernels read from the device scalar table (constants or host scalars)."""
        ...

    def emit(self, group: OpGroup, names: GroupNames) -> GroupCode:
        """The group's kernels, buffers and launch lines: from ``names.x`` (and partials) to ``names.out``."""
        ...


def triton_emitter(node: fx.Node) -> tuple[OpFamily, GroupEmitter] | None:
    """The family and Triton emitter of a registered call; None when it has none (an aten call)."""
    family = family_of(node)
    if family is None:
        return None
    emitter = family.lowering(BACKEND)
    return None if emitter is None else (family, emitter)


def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def _is_transpose(node: fx.Node) -> bool:
    dims: Any = node.args[1] if len(node.args) > 1 else None
    return node.op == "call_function" and node.target is aten.permute.default and list(dims) == [1, 0]


def find_op_groups(gm: fx.GraphModule) -> tuple[list[OpGroup], dict[fx.Node, GroupRef]]:
    """Op groups, and the group-result reference each absorbed view node stands for."""
    groups: list[OpGroup] = []
    refs: dict[fx.Node, GroupRef] = {}
    for node in gm.graph.nodes:
        found = triton_emitter(node)
        if found is None:
            continue
        family, emitter = found
        spec = family.spec_of(node)
        tensors = [name for name in spec.tensor_fields() if isinstance(getattr(spec, name), fx.Node)]
        if len(tensors) != 1:
            continue  # not a matrix function: an aten call
        x = spec.node_of(tensors[0])
        val, out = _val(x), _val(node)
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(val.shape):
            continue
        index = len(groups)
        if val.dim() == 3 and x.target is aten.stack.default and len(x.users) == 1:
            members = list(x.args[0])  # type: ignore[arg-type]
            feeds: list[fx.Node] = []
            flips: list[bool] = []
            for member in members:
                flip = _is_transpose(member) and len(member.users) == 1
                feeds.append(member.args[0] if flip else member)  # type: ignore[arg-type, union-attr]
                flips.append(flip)
            m, n = int(val.shape[1]), int(val.shape[2])
            group = OpGroup(index, node, family, emitter, len(members), m, n, feeds, flips)
            group.absorbed.add(x)
            group.absorbed.update(m for m, f in zip(members, flips) if f)
            _absorb_unbind(group, refs)
        elif val.dim() == 2:
            # The family's batch rule says whether the op works on the transpose (NS on a tall matrix).
            flip = bool(family.batch.transposed(spec)) if family.batch is not None else False
            rows, cols = int(val.shape[0]), int(val.shape[1])
            m, n = (cols, rows) if flip else (rows, cols)
            group = OpGroup(index, node, family, emitter, 1, m, n, [x], [flip])
            refs[node] = GroupRef(index, 0, flip, feed=False)
        else:
            continue  # a batched call fed by something other than a stack: an aten call
        groups.append(group)
    return groups, refs


def _absorb_unbind(group: OpGroup, refs: dict[fx.Node, GroupRef]) -> None:
    users = list(group.node.users)
    if len(users) != 1 or users[0].target is not aten.unbind.int:
        return  # the result is used whole: the wrapper reads it as a tensor
    unbind = users[0]
    group.absorbed.add(unbind)
    for item in unbind.users:
        if item.target is not operator.getitem:
            continue
        slot = int(item.args[1])  # type: ignore[arg-type]
        group.absorbed.add(item)
        refs[item] = GroupRef(group.index, slot, False, feed=False)
        for user in item.users:
            if _is_transpose(user):
                group.absorbed.add(user)
                refs[user] = GroupRef(group.index, slot, True, feed=False)


__all__ = [
    "Buffer",
    "allocations",
    "GroupCode",
    "GroupEmitter",
    "GroupNames",
    "GroupRef",
    "OpGroup",
    "Workspace",
    "find_op_groups",
    "triton_emitter",
]
