"""tp-newton-schulz: run a sharded matrix's Newton–Schulz tensor-parallel, in the mode chosen for it.

route-sharded (passes/route_sharded.py) decides, per NS call on a sharded
matrix, between routing it whole to an owner rank and a tensor-parallel mode
(:func:`choose_mode`: the cost model of distributed/tp_plan.py, or the
``tp_mode`` setting). A call it keeps for a TP mode it marks
(:func:`mark_for_tp`): its input joins as a batch of one, so batch-by-shape
leaves it alone (a shard must not stack with a routed owner's whole matrix of
the same shape), and choose-algorithm / choose-precision plan it as any NS.
This pass, last in the pipeline, inlines the marked calls' modes
(``rewrite_ns_node``): duplicated (all-gather, the op, the own slice),
distributed (a Gram all-reduce per iteration and one for the norm), blockwise
(the op on the shard, with a warning; only when asked for). Before (rank 0 of
2, a 6×8 ``Shard(1)`` matrix, marked distributed)::

    t3 = aten.unsqueeze(t2, 0)                          # fp32[1, 6, 8] (columns 0..3 here)
    t4 = hocompile.newton_schulz(t3, ..., fp32, ...)    # route-sharded: distributed
    t5 = aten.squeeze(t4, 0)

After::

    t6 = _c10d_functional.all_reduce(<squared norm of the shard>, 'sum', '0'); t7 = wait_tensor(t6)
    ... five times: t = _c10d_functional.all_reduce(X Xᵀ of the shard, 'sum', '0'); then B X locally ...
    t5 = aten.squeeze(t40, 0)                           # tp-newton-schulz: distributed, ...

:func:`require_tp_done` refuses a step where a marked call was not inlined
(the pass disabled, or a pass that dropped the mark): each rank would
orthogonalise its own shard alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.fx as fx

from ..distributed.sharded import chunk_rows
from ..distributed.tp_plan import TPChoice, choose_tp_mode, ns_flops_as_given, rewrite_ns_node
from ..errors import CaptureError
from ..ir.registry import family_of
from ..ops.newton_schulz_spec import NewtonSchulzSpec
from ..targets import Target
from .base import Pass, PassResult

aten = torch.ops.aten

TP_MARK = "hocompile.tp_mark"  # node meta on a marked NS call: its TPMark
TP_MARKED = "hocompile.tp_marked"  # graph meta: how many calls route-sharded marked
TP_DONE = "hocompile.tp_done"  # graph meta: how many this pass inlined


@dataclass(frozen=True)
class TPMark:
    """What the rewrite needs: the mode, the shard dim of the (batch-of-one) input, its full length there,
    this rank's shard shape, and the choice (shown by explain())."""

    choice: TPChoice
    shard_dim: int
    full_size: int
    local_shape: tuple[int, ...]


def choose_mode(
    node: fx.Node, dim: int, world: int, calls: list[fx.Node], tp_mode: str, target: Target | None
) -> TPChoice:
    """Route or a TP mode for one call on a matrix sharded along ``dim`` (``calls``: the step's calls on
    sharded matrices, which routing would spread over the ranks)."""
    family = family_of(node)
    if family is None or family.name != "newton_schulz":
        name = family.name if family is not None else node.name
        return TPChoice("route", f"{name}: the tensor-parallel modes are Newton–Schulz only")
    if tp_mode == "route":
        return TPChoice("route", "requested (tp_mode='route')")
    if target is None and tp_mode == "auto":
        return TPChoice("route", "no target to price the tensor-parallel modes with")
    spec = NewtonSchulzSpec.from_node(node)
    x, out = spec.x_node.meta["val"], node.meta["val"]
    rates = target or Target("unpriced")
    requested = None if tp_mode == "auto" else tp_mode
    return choose_tp_mode(
        tuple(x.shape), dim, world, len(spec.a), rates, transpose=bool(spec.transpose),
        compute_dtype=spec.compute_dtype, in_bytes=x.element_size(), out_bytes=out.element_size(),
        routed_matrices=len(calls), routed_flops=sum(_flops(c) for c in calls), requested=requested,
    )


def _flops(call: fx.Node) -> float:
    """NS FLOPs of a call as given (for any routed family: the NS of a matrix of its shape, 5 steps)."""
    family = family_of(call)
    shape = tuple(int(s) for s in call.meta["val"].shape)
    if family is None or family.name != "newton_schulz":
        return float(ns_flops_as_given(shape, 5))
    spec = NewtonSchulzSpec.from_node(call)
    return float(ns_flops_as_given(shape, len(spec.a), bool(spec.transpose)))


def mark_for_tp(gm: fx.GraphModule, node: fx.Node, dim: int, world: int, rank: int, choice: TPChoice) -> None:
    """Make ``node`` (NS on a 2-D matrix sharded along ``dim``) a call on a batch of one, and mark it."""
    spec = NewtonSchulzSpec.from_node(node)
    x = spec.x_node
    shape = tuple(int(s) for s in x.meta["val"].shape)
    local = list(shape)
    local[dim] = chunk_rows(shape[dim], world)[rank]
    val, out = x.meta["val"], node.meta["val"]
    graph = gm.graph
    with graph.inserting_before(node):
        batch = graph.call_function(aten.unsqueeze.default, (x, 0))
    with val.fake_mode:  # global shapes, as every sharded value in the graph
        batch.meta["val"] = torch.empty((1, *shape), dtype=val.dtype, device=val.device)
        batched_out = torch.empty((1, *out.shape), dtype=out.dtype, device=out.device)
    spec.replace(x=batch).apply(node)
    node.meta["val"] = batched_out
    with graph.inserting_after(node):
        single = graph.call_function(aten.squeeze.dim, (node, 0))
    single.meta["val"] = out
    node.replace_all_uses_with(single, delete_user_cb=lambda user: user is not single)
    node.meta[TP_MARK] = TPMark(choice, dim + 1, shape[dim], (1, *local))
    gm.meta[TP_MARKED] = gm.meta.get(TP_MARKED, 0) + 1


@dataclass(frozen=True)
class TensorParallelNS(Pass):
    name: ClassVar[str] = "tp-newton-schulz"
    world: int = 1
    rank: int = 0
    group_name: str = ""

    def __call__(self, gm: fx.GraphModule) -> PassResult:
        marked = [n for n in gm.graph.nodes if TP_MARK in n.meta]
        if not marked:
            return PassResult(gm, False, "no Newton–Schulz call marked for tensor-parallel modes")
        modes: dict[str, int] = {}
        for node in marked:
            mark: TPMark = node.meta.pop(TP_MARK)  # not copied onto the op the mode inlines
            rewrite_ns_node(
                gm, node, shard_dim=mark.shard_dim, group_name=self.group_name, mode=mark.choice.mode,
                full_size=mark.full_size, choice=mark.choice, local_shape=mark.local_shape,
            )
            modes[mark.choice.mode] = modes.get(mark.choice.mode, 0) + 1
        gm.meta[TP_DONE] = gm.meta.get(TP_DONE, 0) + len(marked)
        gm.graph.lint()
        summary = ", ".join(f"{count} {mode}" for mode, count in sorted(modes.items()))
        return PassResult(gm, True, f"inlined {summary} tensor-parallel NS on rank {self.rank} of {self.world}")


def require_tp_done(gm: Any) -> None:
    """Refuse a step whose marked calls were not all inlined: they would run on each rank's shard alone."""
    left = [n.name for n in gm.graph.nodes if TP_MARK in n.meta]
    if left or gm.meta.get(TP_MARKED, 0) != gm.meta.get(TP_DONE, 0):
        raise CaptureError(
            f"route-sharded kept {gm.meta.get(TP_MARKED, 0)} Newton–Schulz call(s) on sharded matrices for "
            f"tensor-parallel modes but tp-newton-schulz inlined {gm.meta.get(TP_DONE, 0)} "
            f"(left: {left}; HOCOMPILE_DISABLE_PASSES?); without it each rank would orthogonalise only its shard"
        )
