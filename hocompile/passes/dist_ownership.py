"""dist-ownership: each rank orthogonalises a cost-balanced share; one all-gather per bucket.

For replicated parameters (DDP: params and grads identical on every rank).
Each orthogonalisation (``hocompile::newton_schulz``) becomes an
:class:`~hocompile.distributed.plan.Item` costed by its NS work (steps from
its coefficient lists, Gram NS if the op already says so, its batch counted;
``split_experts``: one item per slice of an ``[E, m, n]`` call); calls are
bucketed by output dtype in step order (``bucket_bytes`` per rank, at least
``MIN_ITEMS_PER_RANK`` calls per rank), and
:func:`~hocompile.distributed.plan.assign_owners` gives each an owner rank
(LPT, loads carried across buckets, the same answer on every rank). Owned
calls stay; per bucket their results are flattened into one buffer padded
to the largest rank's share and all-gathered with torch's functional
collectives; every other call's readers read a view of the gathered buffer,
and its input chain becomes dead and is removed.

Before (world 2, one fp32 bucket)::

    t2 = hocompile.newton_schulz(t1, ...)          # p0's update
    t3 = aten.add(t0, t2, alpha=h4)
    t6 = hocompile.newton_schulz(t5, ...)          # p1's update
    t7 = aten.add(t4, t6, alpha=h4)

After, on rank 0 (the plan gave it p0, rank 1 p1)::

    t2 = hocompile.newton_schulz(t1, ...)
    t3 = aten.add(t0, t2, alpha=h4)
    t8 = aten.reshape(t2, [-1]); t9 = aten.cat([t8]); t10 = aten.constant_pad_nd(t9, [0, 2048], 0.0)
    t11 = _c10d_functional.all_gather_into_tensor(t10, 2, '0')   # dist-ownership: bucket 0 ...
    t12 = _c10d_functional.wait_tensor(t11)
    t13 = aten.slice.Tensor(t12, 0, 4096, 6144); t14 = aten.view(t13, [32, 64])
    t7 = aten.add(t4, t14, alpha=h4)

Order: bucket k's gather is issued where its last call was (the same place
on every rank, so collectives match), its wait just before the first reader,
and readers are held back until bucket k+1's gather is issued: bucket k+1's
Newton–Schulz runs while bucket k's gather is in flight. A result keeps the
memory order the op gives it (NS returns a transposed input transposed
back): owners send it in that order and readers rebuild the same strides,
so every kernel after it sees what it sees on one rank.

Declines: one rank; no orthogonalisation; one that reads another's result
(its owner would wait for a gather issued after it); per call, an op that is
not a pure function of its input or that may raise on its data (the exact
SVD polar: one rank raising while the others wait in the gather would hang
them), which every rank then computes itself, as before.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch.fx as fx

from ..distributed.plan import Item, assign_buckets, assign_owners, ns_cost
from ..distributed.replicated import DIST_PLAN, Member, OwnershipPlan, rewrite_bucket, schedule
from ..ir import dtypes
from ..ir.registry import OpFamily, registered_calls
from .base import Pass, PassResult

__all__ = ["DIST_PLAN", "DistOwnership", "OwnershipPlan"]

# Bytes each rank contributes to one gather, on average: DDP's bucket size
# (DistributedDataParallel bucket_cap_mb=25), large enough that a collective's latency is
# small next to its bytes, small enough that a big model has several buckets (the gather of
# one overlaps the Newton–Schulz of the next). Per rank, not per bucket: LPT balances a
# bucket only when every rank gets a few items of it (ranks meet at every gather), so a
# bucket also holds at least MIN_ITEMS_PER_RANK items per rank. GPT-2-small at world 8 is
# then one bucket (1.02x ideal); a fixed 25 MiB bucket would give 8 buckets at 1.14x.
BUCKET_BYTES = 25 * 2**20
MIN_ITEMS_PER_RANK = 2

ORTHOGONALISATIONS = ("newton_schulz", "polar")


def _ns_item_cost(spec: Any) -> float:
    batch, m, n = spec.wide_shape()
    return ns_cost((m, n), len(spec.a), gram=spec.algorithm == "gram", batch=batch)


# Families this pass can own: how to cost a call, and whether its result is the transpose of
# a contiguous tensor (its memory order, which readers on other ranks must see too). The cost
# reads the op as it is now: choose-algorithm's later Gram/standard choice is timed on each
# machine, and a plan every rank must agree on cannot depend on timings.
ITEM_COST: dict[str, Callable[[Any], float]] = {"newton_schulz": _ns_item_cost}
TRANSPOSED_RESULT: dict[str, Callable[[Any], bool]] = {"newton_schulz": lambda spec: bool(spec.transpose)}


@dataclass(frozen=True)
class DistOwnership(Pass):
    name: ClassVar[str] = "dist-ownership"
    world: int = 1
    rank: int = 0
    group_name: str = ""
    bucket_bytes: int = field(default=BUCKET_BYTES)
    # Own a [E, m, n] call per slice (MoE experts): better balance, but an owner runs the NS
    # on a stack of its slices only, and a batched GEMM of another batch size may round
    # differently (measured here: 1e-5 on fp32 bmm), so the step is no longer bitwise the
    # single-process one. Off: such a call is one item, its cost counting its batch.
    split_experts: bool = False

    def __call__(self, gm: fx.GraphModule) -> PassResult:
        if self.world < 2:
            return PassResult(gm, False, self.decline(f"world size {self.world}: nothing to share"))
        if not 0 <= self.rank < self.world:
            raise ValueError(f"dist-ownership: rank {self.rank} outside world size {self.world}")
        calls = [(n, f) for n, f in registered_calls(gm.graph) if f.name in ORTHOGONALISATIONS]
        if not calls:
            return PassResult(gm, False, self.decline("no orthogonalisation to share"))
        declined: list[str] = []
        ownable: list[tuple[fx.Node, OpFamily]] = []
        for node, family in calls:
            reason = _not_ownable(node, family)
            if reason:
                declined.append(self.decline(f"{node.name}: {reason}; every rank computes it"))
            else:
                ownable.append((node, family))
        if not ownable:
            return PassResult(gm, False, declined[0], declined)
        chained = _reads_another(gm.graph, {n for n, _ in ownable})
        if chained is not None:
            reason = f"{chained.name} reads another orthogonalisation's result (its gather would come too late)"
            return PassResult(gm, False, self.decline(reason), declined)
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        buckets = _buckets(ownable, self.bucket_bytes, self.world)
        items: list[Item] = []
        laid_out: list[list[Member]] = []
        for b, calls_b in enumerate(buckets):
            laid_out.append([])
            for node, family in calls_b:
                spec = family.spec_of(node)
                (field_name,) = spec.tensor_fields()
                val = node.meta["val"]
                split = self.split_experts and val.dim() == 3  # [E, m, n]: one item per slice
                cost = ITEM_COST[family.name](spec) / (val.shape[0] if split else 1)
                shapes = [tuple(val.shape[1:])] * val.shape[0] if split else [tuple(val.shape)]
                first = len(items)
                for j, shape in enumerate(shapes):
                    key = f"{family.name}#{order[node]}" + (f"[{j}]" if split else "")
                    items.append(Item(key, shape, dtypes.name(val.dtype), cost, b))
                member = Member(
                    node,
                    tuple(range(first, len(items))),
                    split,
                    TRANSPOSED_RESULT[family.name](spec),
                    spec.node_of(field_name),
                    lambda x, spec=spec, name=field_name: spec.replace(**{name: x}).to_args(),
                )
                laid_out[-1].append(member)
        plan = assign_owners(items, self.world)
        rewritten = []
        for b, members in enumerate(laid_out):
            anchor = max(order[m.node] for m in members)
            rewritten.append(rewrite_bucket(gm, plan, b, members, self.rank, self.group_name, anchor))
        schedule(gm.graph, rewritten, order)
        gm.graph.eliminate_dead_code()  # the inputs of calls another rank computes
        gm.recompile()
        applied = OwnershipPlan(plan, self.rank, self.group_name, tuple(r.layout for r in rewritten))
        gm.meta[DIST_PLAN] = applied
        mine = len(plan.owned(self.rank))
        summary = (
            f"{len(plan.items)} ops in {len(buckets)} bucket(s) over {self.world} ranks, {mine} computed here; "
            f"max-rank NS cost {plan.imbalance():.3f}x ideal (plan {plan.digest()})"
        )
        return PassResult(gm, True, summary, declined)


def _not_ownable(node: fx.Node, family: OpFamily) -> str:
    """Why ``node`` cannot be computed on one rank and gathered ("" when it can)."""
    schema = family.op._schema
    pure = not schema.is_mutable and len(schema.returns) == 1 and str(schema.returns[0].type) == "Tensor"
    if not pure:
        return f"{family.name} is not a pure function of its inputs"
    if family.fallible:
        return f"{family.name} may raise on its data, and the other ranks would wait for its result forever"
    if family.name not in ITEM_COST:
        return f"no cost model for {family.name}"
    if len(family.spec.tensor_fields()) != 1 or node.meta["val"].dim() not in (2, 3):
        return "not one [m, n] or [E, m, n] input"
    return ""


def _reads_another(graph: fx.Graph, calls: set[fx.Node]) -> fx.Node | None:
    """A call in ``calls`` that depends (transitively) on another one, if any."""
    downstream: set[fx.Node] = set()
    for node in graph.nodes:
        feeds = [i for i in node.all_input_nodes if i in calls or i in downstream]
        if feeds:
            if node in calls:
                return node
            downstream.add(node)
    return None


def _buckets(calls: list[tuple[fx.Node, OpFamily]], cap: int, world: int) -> list[list[tuple[fx.Node, OpFamily]]]:
    """The calls (in step order) in :func:`~hocompile.distributed.plan.assign_buckets`'s buckets."""
    vals = [node.meta["val"] for node, _ in calls]
    sizes = [(dtypes.name(v.dtype), int(v.numel() * v.element_size())) for v in vals]
    buckets: list[list[tuple[fx.Node, OpFamily]]] = []
    for call, b in zip(calls, assign_buckets(sizes, cap * world, MIN_ITEMS_PER_RANK * world)):
        while len(buckets) <= b:
            buckets.append([])
        buckets[b].append(call)
    return buckets
