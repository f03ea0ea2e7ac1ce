"""``distributed="replicated"`` (DDP): the graph side of dist-ownership, and its configuration.

passes/dist_ownership.py decides (items, buckets, owners); this module
rewrites one bucket (:func:`rewrite_bucket`) and orders the result
(:func:`schedule`). Every compile then proves the ranks agree (check.py).
"auto" means "local" for plain tensors: nothing in a plain tensor says its
grads are the same on every rank, and assuming so when they are not would
be a silently wrong step.

A call is one item, or (``DistOwnership(split_experts=True)``) one item per
leading slice of an ``[E, m, n]`` input (MoE experts: one Newton–Schulz per
expert). A rank that owns some slices of such a call computes them as one
call on their stack, and readers get the slices restacked: every rank ends
with the same params, but a batched GEMM over fewer slices may round unlike
the full batch, so that step is not bitwise the single-process one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx

from ..ir import dtypes
from ..ir.decisions import Choice, Decision, record
from .plan import DistPlan

aten = torch.ops.aten
funcol = torch.ops._c10d_functional

DIST_PLAN = "hocompile.dist_plan"
"""``gm.meta`` key: the :class:`OwnershipPlan` dist-ownership applied (explain() and check.py read it)."""


def resolve_group(group_name: str | None) -> Any:
    """The process group named ``group_name`` (None: the default group)."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "distributed='replicated' needs torch.distributed initialised (dist.init_process_group) "
            "before the first step"
        )
    if group_name is None:
        return dist.group.WORLD
    return dist.distributed_c10d._resolve_process_group(dist.distributed_c10d.GroupName(group_name))


@dataclass(frozen=True)
class BucketLayout:
    """One bucket as gathered: which items, and where each rank's results sit in the buffer."""

    index: int
    dtype: str
    items: tuple[int, ...]  # indices into the plan's items
    share: int  # elements per rank (the largest rank's total; the others are padded)
    owned_here: int  # items this rank computes


@dataclass(frozen=True)
class OwnershipPlan:
    """What dist-ownership applied on this rank (``gm.meta[DIST_PLAN]``)."""

    plan: DistPlan
    rank: int
    group_name: str
    buckets: tuple[BucketLayout, ...]

    def describe(self) -> list[str]:
        """explain()'s lines: the plan, then its buckets (the first and last three of many)."""
        lines = [f"replicated params, rank {self.rank} of group {self.group_name!r}: " + self.plan.describe()[0]]
        lines += self.plan.describe()[1:] if self.plan.world <= 16 else self.plan.summary()[1:]
        for k, b in enumerate(self.buckets):
            if 3 <= k < len(self.buckets) - 3:
                if k == 3:
                    lines.append(f"  ... {len(self.buckets) - 6} more buckets")
                continue
            padding = self.plan.world * b.share - sum(_numel(self.plan.items[i].shape) for i in b.items)
            lines.append(
                f"  bucket {b.index}: {len(b.items)} {b.dtype} results, {b.share} elements per rank "
                f"({padding} padding), {b.owned_here} computed here, 1 all-gather"
            )
        return lines


@dataclass(frozen=True)
class Member:
    """One call of a bucket: its items, and how to rebuild it on part of its input."""

    node: fx.Node
    items: tuple[int, ...]  # plan items: one, or one per leading slice (split)
    split: bool  # one item per leading slice of a [E, m, n] call
    transposed: bool  # the result is the transpose of a contiguous tensor (its memory order)
    x: fx.Node  # the call's one tensor input
    args_with: Any  # x -> the call's args with that input instead


@dataclass(frozen=True)
class Rewritten:
    layout: BucketLayout
    anchor_after: int  # graph position (before the rewrite) after which the gather is issued
    chain: tuple[fx.Node, ...]  # owned calls' flattening, cat, pad, gather: issued at the anchor
    on_demand: tuple[fx.Node, ...]  # wait, views, restacking: placed just before their first reader


def rewrite_bucket(
    gm: fx.GraphModule, plan: DistPlan, bucket: int, members: list[Member], rank: int, group_name: str, anchor: int
) -> Rewritten:
    """Keep this rank's items of ``members``, all-gather the bucket, and read the rest from the gather."""
    graph, world = gm.graph, plan.world
    ids = [i for m in members for i in m.items]
    numel = {i: _numel(plan.items[i].shape) for i in ids}
    loads = [sum(numel[i] for i in ids if plan.owners[i] == r) for r in range(world)]
    share = max(loads)
    offset: dict[int, int] = {}
    filled = [0] * world
    for i in ids:  # each rank's items in item order: the order owners flatten them below
        owner = plan.owners[i]
        offset[i] = owner * share + filled[owner]
        filled[owner] += numel[i]
    ref = members[0].node.meta["val"]
    chain: list[fx.Node] = []
    on_demand: list[fx.Node] = []

    def call(target: Any, args: tuple[Any, ...], val: Any, into: list[fx.Node], **kwargs: Any) -> fx.Node:
        node = graph.call_function(target, args, kwargs)
        node.meta["val"] = val
        into.append(node)
        return node

    output = next(n for n in graph.nodes if n.op == "output")
    with graph.inserting_before(output):  # placed by schedule()
        flats: list[fx.Node] = []
        computed: dict[fx.Node, tuple[fx.Node, list[int]]] = {}
        for m in members:
            mine = [j for j, i in enumerate(m.items) if plan.owners[i] == rank]
            if not mine:
                continue
            out = m.node
            if len(mine) < len(m.items):  # some slices of a split call: one call on their stack
                xv = m.x.meta["val"]
                picks = [call(aten.select.int, (m.x, 0, j), xv[j], chain) for j in mine]
                stacked = call(aten.stack.default, (picks,), torch.stack([p.meta["val"] for p in picks]), chain)
                out = call(m.node.target, m.args_with(stacked), m.node.meta["val"][: len(mine)], chain)
            computed[m.node] = (out, mine)
            flat = out
            if m.transposed:
                flat = call(aten.permute.default, (flat, _swap_last(flat)), _stored(flat.meta["val"]), chain)
            flats.append(call(aten.reshape.default, (flat, [-1]), flat.meta["val"].reshape(-1), chain))
        if flats:
            buf = call(aten.cat.default, (flats,), torch.cat([f.meta["val"] for f in flats]), chain)
            if share > loads[rank]:
                pad = (buf, [0, share - loads[rank]], 0.0)
                buf = call(aten.constant_pad_nd.default, pad, ref.new_empty([share]), chain)
        else:  # this rank owns nothing here, but takes part in the gather all the same
            kwargs = dict(dtype=ref.dtype, layout=torch.strided, device=ref.device, pin_memory=False)
            buf = call(aten.full.default, ([share], 0.0), ref.new_empty([share]), chain, **kwargs)
        gathered = ref.new_empty([world * share])
        ag = call(funcol.all_gather_into_tensor.default, (buf, world, group_name), gathered, chain)
        wait = call(funcol.wait_tensor.default, (ag,), gathered, on_demand)
        for m in members:
            out, mine = computed.get(m.node, (m.node, []))
            if len(mine) == len(m.items):
                continue  # computed whole here: its readers keep reading it
            val = m.node.meta["val"]
            pieces = []  # in stored (contiguous) order
            for j, i in enumerate(m.items):
                piece_val = val[j] if m.split else val
                piece_val = _stored(piece_val) if m.transposed else piece_val
                if j in mine:
                    piece = call(aten.select.int, (out, 0, mine.index(j)), out.meta["val"][0], on_demand)
                    if m.transposed:
                        piece = call(aten.permute.default, (piece, [1, 0]), piece_val, on_demand)
                else:
                    where = (wait, 0, offset[i], offset[i] + numel[i])
                    flat = call(aten.slice.Tensor, where, gathered[: numel[i]], on_demand)
                    piece = call(aten.view.default, (flat, list(piece_val.shape)), piece_val, on_demand)
                pieces.append(piece)
            result = pieces[0]
            if m.split:
                result = call(aten.stack.default, (pieces,), torch.stack([p.meta["val"] for p in pieces]), on_demand)
            if m.transposed:  # back to the op's own strides: readers see what they see on one rank
                # (its fake value too: the op's fake is contiguous, the Triton wrapper reads strides there)
                swap = _swap_last(result)
                result = call(aten.permute.default, (result, swap), result.meta["val"].permute(swap), on_demand)
            m.node.replace_all_uses_with(result)
            graph.erase_node(m.node)
    owned_here = sum(1 for i in ids if plan.owners[i] == rank)
    dtype = dtypes.name(ref.dtype)
    label = f"bucket {bucket}: {len(ids)} {dtype} results, {owned_here} computed on rank {rank}, "
    label += f"{share} elements per rank"
    choices: dict[str, Choice] = {"bucket": bucket, "owners": tuple(plan.owners[i] for i in ids), "share": share}
    record(ag, Decision("dist-ownership", choices, label=label, why=f"plan {plan.digest()}"))
    layout = BucketLayout(bucket, dtype, tuple(ids), share, owned_here)
    return Rewritten(layout, anchor, tuple(chain), tuple(on_demand))


def _swap_last(node: fx.Node) -> list[int]:
    dims = list(range(node.meta["val"].dim()))
    return dims[:-2] + [dims[-1], dims[-2]]


def _stored(val: Any) -> Any:
    """A result's value as stored in memory: its last two dims swapped."""
    return val.transpose(-2, -1)


def _numel(shape: tuple[int, ...]) -> int:
    total = 1
    for d in shape:
        total *= d
    return total


def schedule(graph: fx.Graph, buckets: list[Rewritten], position: dict[fx.Node, int]) -> None:
    """Order the body: gathers at their anchors, waits and readers as late as overlap wants.

    Every node keeps its place except: bucket k's chain goes right after its anchor;
    a node that needs bucket k's wait waits (with its dependents) until bucket k+1's
    gather is issued, then runs, its wait and views just before it.
    """
    output = next(n for n in graph.nodes if n.op == "output")
    bucket_of = {n: i for i, b in enumerate(buckets) for n in b.on_demand}
    chained = {n for b in buckets for n in b.chain}
    at_anchor: dict[int, list[fx.Node]] = {}
    for b in buckets:
        at_anchor.setdefault(b.anchor_after, []).extend(b.chain)
    anchor_positions = sorted(at_anchor)
    stream: list[fx.Node] = []
    emitted: set[fx.Node] = set()
    for node in graph.nodes:
        if node.op == "placeholder":
            emitted.add(node)
        elif node is not output and node not in chained and node not in bucket_of:
            stream.append(node)
    # Anchors are positions before the rewrite (the anchor itself may be gone): each chain
    # goes after the last surviving node that came no later than its anchor.
    placed: list[fx.Node] = []
    cursor = 0
    for node in stream:
        pos = position[node]  # every stream node is an old one: new ones are chains or on demand
        while cursor < len(anchor_positions) and pos > anchor_positions[cursor]:
            placed += at_anchor[anchor_positions[cursor]]
            cursor += 1
        placed.append(node)
    for anchor in anchor_positions[cursor:]:
        placed += at_anchor[anchor]
    released: set[int] = set()
    order: list[fx.Node] = []

    def ready(node: fx.Node) -> bool:
        for arg in node.all_input_nodes:
            if arg in emitted:
                continue
            if arg not in bucket_of or bucket_of[arg] not in released or not ready(arg):
                return False
        return True

    def emit(node: fx.Node) -> None:
        for arg in node.all_input_nodes:
            if arg not in emitted:
                emit(arg)
        emitted.add(node)
        order.append(node)

    pending: list[fx.Node] = []

    def flush() -> None:
        progress = True
        while progress:
            progress = False
            for node in list(pending):
                if ready(node):
                    emit(node)
                    pending.remove(node)
                    progress = True

    gathers = {b.chain[-1]: i for i, b in enumerate(buckets)}
    for node in placed:
        if ready(node):
            emit(node)
        else:
            pending.append(node)
        if node in gathers:
            released.add(gathers[node] - 1)
            flush()
    released.update(range(len(buckets)))
    flush()
    if pending:
        raise AssertionError(f"dist-ownership could not place {[n.name for n in pending]}")
    for node in order:
        output.prepend(node)
