"""A program's first self-check on row slices of its huge elementwise members.

The first check of a program runs it and eager on copies of the members it samples, before the
real step (self_check.py). For a class whose one member is a 151,936x1,024 embedding under AdamW
that is two more runs of the step and four 600 MB copies each: 12.4 s of a Qwen3-shaped model's
first step, against 0.3 s of compiling.

Where a class's program is elementwise, row ``r`` of every result depends on row ``r`` of the
member's tensors and on host scalars alone; so the program run on the first rows is the program's
answer on those rows, and eager's step on copies of those rows is eager's. The first check then runs
both on a slice of such a member: the arithmetic, the scalars, the branches and the Python state
the step rewrites are all compared as on the whole, in a few milliseconds. What a slice cannot see is
an effect of the tensor's full size (how threads split it), so the program's later checks
(steps 2, 4, 8, ..., within the self-check's budget) run on the whole member.

Elementwise, decided from the program and the real tensors: an aten lowering; no host value read from
the device (its reduction would see the slice) and no global program (a value over every member);
every op pointwise and not random, or a copy / ``*_like`` allocation; every tensor the member's
program reads either of the param's shape (sliced alike) or a single element.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx
from torch._ops import OpOverload

from ...capture.stand_ins import tensor_attributes
from ...capture.trace import slot_tensor
from ...ir.graph import InputSlot

if TYPE_CHECKING:
    from ..entries import CompiledEntry

aten = torch.ops.aten
SLICE_FROM = 1 << 22  # a member this large (elements) is checked on a slice on its program's first check
SLICE_TO = 1 << 16  # ... of about this many elements (whole rows)
_ALLOWED = frozenset({
    aten.copy_.default, aten.copy.default, aten.clone.default, aten.detach.default, aten.alias.default,
    aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default, aten.full_like.default,
})


def elementwise(gm: fx.GraphModule) -> bool:
    """Whether every op of ``gm`` acts element by element, broadcasting nothing but single elements
    (so tensors of one shape are sliced alike and meet nothing else of their size)."""
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output", "get_attr"):
            continue
        target = node.target
        if node.op != "call_function" or not isinstance(target, OpOverload) or target.namespace != "aten":
            return False
        if target not in _ALLOWED:
            tags = target.tags
            if torch.Tag.pointwise not in tags or torch.Tag.nondeterministic_seeded in tags:
                return False
        out = node.meta.get("val")
        if out is None and target is aten.copy_.default:  # a write-back the lowering added: its destination
            out = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
        if not isinstance(out, torch.Tensor):
            return False
        for arg in node.all_input_nodes:
            value = arg.meta.get("val")
            if isinstance(value, torch.Tensor) and value.numel() != 1 and value.shape != out.shape:
                return False
    return True


def first_check_slices(
    opt: torch.optim.Optimizer, entry: CompiledEntry, keep: list[list[int]]
) -> dict[tuple[int, int], slice]:
    """For a program's first check: the kept members (group, index) to check on their first rows."""
    run, captured, lowered = entry.stamped, entry.captured, entry.lowered
    if captured is None or captured.reads or captured.trees or captured.sharded or captured.holds_containers:
        return {}
    backends = [p.lowered.backend for p in run.programs if p.lowered is not None] if run is not None else []
    if any(b != "aten" for b in backends + ([lowered.backend] if lowered is not None else [])):
        return {}
    if run is None:  # traced whole: the whole graph elementwise, every tensor it reads per member or single
        if not elementwise(captured.gm) or not _singles(opt, [s for s in captured.inputs if s.kind in SHARED]):
            return {}
        return _members(opt, [(g, i) for g, k in enumerate(keep) for i in k])
    if any(n.op == "call_function" for n in run.global_program.gm.graph.nodes):
        return {}
    out: dict[tuple[int, int], slice] = {}
    for cls, program in zip(run.stamp.classes, run.programs):
        shared = [src.slot for src in program.inputs if src.kind == "shared" and src.slot is not None]
        if not elementwise(program.gm) or any(src.kind == "global" for src in program.inputs):
            continue
        if _singles(opt, shared):
            out.update(_members(opt, [(cls.group, i) for i in keep[cls.group] if i in cls.members]))
    return out


SHARED = ("group", "attr")


def _singles(opt: torch.optim.Optimizer, slots: list[InputSlot]) -> bool:
    """Whether each of ``slots`` (a group's or the optimizer's tensors) holds a single element."""
    try:
        return all(isinstance(t := slot_tensor(opt, s), torch.Tensor) and t.numel() == 1 for s in slots)
    except (KeyError, IndexError, AttributeError):
        return False


def _members(opt: torch.optim.Optimizer, members: list[tuple[int, int]]) -> dict[tuple[int, int], slice]:
    out = {}
    for g, i in members:
        rows = _rows(opt, opt.param_groups[g]["params"][i])
        if rows:
            out[(g, i)] = slice(0, rows)
    return out


def _rows(opt: torch.optim.Optimizer, p: torch.Tensor) -> int:
    """How many leading rows of ``p`` to check on (0: the whole param): its grad and every state
    tensor of its shape or a single element, the shape's rows alone setting the count, so members of
    one shape are sliced alike."""
    if p.dim() < 1 or p.numel() < SLICE_FROM or (p.grad is not None and p.grad.shape != p.shape):
        return 0
    if tensor_attributes(p):  # main_grad: a copy of its own, not sliced with the param
        return 0
    state = opt.state.get(p, {}).values()
    if any(isinstance(v, torch.Tensor) and v.numel() != 1 and v.shape != p.shape for v in state):
        return 0
    rows = math.ceil(SLICE_TO / max(1, p[0].numel()))
    return rows if rows < p.shape[0] else 0


def sliced(value: Any, like: torch.Tensor, rows: slice) -> Any:
    """``value``'s leading rows where it has the param's shape; itself otherwise."""
    if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape == like.shape:
        return value[rows]
    return value
