"""Partition a step graph into what the Triton wrapper launches: pointwise regions.

- **Pointwise regions**: connected elementwise aten ops over one shape
  (momentum, nesterov, weight decay, the lr-scaled update). A region is one
  kernel body; isomorphic regions (same ops, shapes, dtypes, input kinds)
  of different parameters form a *group*, launched once for all members
  through a pointer table (one program row per member).
- **Registered op groups** (op_groups.py): calls of ``hocompile::`` ops
  whose family registered a Triton emitter. A region producing a member of
  one also stores it into the group's workspace (``Region.feed``); a member
  with no producing region gets an identity region (load, round, store).

Anything else stays an aten call in the wrapper.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from ...ir.graph import ROLE, InputSlot
from .op_groups import GroupRef, OpGroup
from .pointwise_ops import is_scalar_arg, supported

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass
class Region:
    nodes: list[fx.Node]
    inputs: list[fx.Node] = field(default_factory=list)  # external tensors, first-use order
    outputs: list[fx.Node] = field(default_factory=list)  # values that escape
    scalars: list[Any] = field(default_factory=list)  # host-scalar placeholders / constants
    feed: GroupRef | None = None  # an output stored into an op group's workspace slot
    feed_value: fx.Node | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        value = self.feed_value if self.feed_value is not None else self.nodes[-1]
        return tuple(int(s) for s in value.meta["val"].shape)


def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def is_pointwise(node: fx.Node) -> bool:
    if node.op != "call_function" or not supported(node):
        return False
    out = _val(node)
    if not isinstance(out, torch.Tensor) or out.dtype not in _DTYPES or out.numel() == 0:
        return False
    for arg in node.all_input_nodes:
        val = _val(arg)
        if isinstance(val, torch.Tensor):
            if val.dtype not in _DTYPES and val.dim() > 0:
                return False
            if val.dim() > 0 and tuple(val.shape) != tuple(out.shape):
                return False  # broadcasting is left to aten
        elif not is_scalar_arg(arg):
            return False
    return True


def find_regions(gm: fx.GraphModule, groups: list[OpGroup]) -> list[Region]:
    """Connected same-shape pointwise regions, plus identity regions for op-group feeds."""
    parent: dict[fx.Node, fx.Node] = {}

    def root(n: fx.Node) -> fx.Node:
        while parent[n] is not n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    nodes = [n for n in gm.graph.nodes if is_pointwise(n)]
    for n in nodes:
        parent[n] = n
    # A region is one kernel: it must not both feed and read what runs outside it (PolarGrad's
    # ``O * G`` reads the Newton–Schulz result and its input, which feeds it). Per component, the
    # other calls it depends on (``up``) and that depend on it (``down``), as bitsets; two components
    # whose union would have a call on both sides stay apart.
    up, down = _outside_calls(gm, set(parent))
    for n in nodes:
        for arg in n.all_input_nodes:
            if arg in parent and tuple(_val(arg).shape) == tuple(_val(n).shape):
                a, b = root(arg), root(n)
                if a is b or (up[a] | up[b]) & (down[a] | down[b]):
                    continue
                parent[a] = b
                up[b] |= up[a]
                down[b] |= down[a]
    by_root: dict[fx.Node, list[fx.Node]] = {}
    for n in nodes:
        by_root.setdefault(root(n), []).append(n)
    regions = [Region(members) for members in by_root.values()]
    owner = {n: r for r in regions for n in r.nodes}
    for group in groups:
        for slot, (feed, flip) in enumerate(zip(group.feeds, group.feed_transposed)):
            ref = GroupRef(group.index, slot, flip, feed=True)
            region = owner.get(feed)
            if region is None or region.feed is not None:
                region = Region([])  # an identity region: load, round, store, add up the norm
                regions.append(region)
            region.feed, region.feed_value = ref, feed
    # A group reads its members from the workspace the feeding regions store
    # into: the op node and the stack (and transposing views) it absorbed do
    # not make a value escape (storing it too would be a buffer nobody reads).
    # An identity region does read its value, from wherever it was stored.
    consumed = {n for g in groups for n in (g.node, *g.absorbed)}
    identity_reads = {r.feed_value for r in regions if not r.nodes}
    for region in regions:
        _collect_boundary(region, consumed, identity_reads)
    return regions


def _outside_calls(gm: fx.GraphModule, pointwise: set[fx.Node]) -> tuple[dict[fx.Node, int], dict[fx.Node, int]]:
    """For each node, the calls outside ``pointwise`` it depends on and that depend on it (bitsets)."""
    order = list(gm.graph.nodes)
    bit = {n: 1 << i for i, n in enumerate(n for n in order if n.op == "call_function" and n not in pointwise)}
    up: dict[fx.Node, int] = {}
    for n in order:
        up[n] = 0
        for arg in n.all_input_nodes:
            up[n] |= up[arg] | bit.get(arg, 0)
    down: dict[fx.Node, int] = {}
    for n in reversed(order):
        down[n] = 0
        for user in n.users:
            down[n] |= down[user] | bit.get(user, 0)
    return up, down


def _collect_boundary(region: Region, consumed: set[fx.Node], identity_reads: set[fx.Node | None]) -> None:
    inside = set(region.nodes)
    for node in region.nodes:
        for arg in [*node.args, *node.kwargs.values()]:
            if isinstance(arg, fx.Node) and arg not in inside:
                if is_scalar_arg(arg):
                    if arg not in region.scalars:
                        region.scalars.append(arg)
                elif arg not in region.inputs:
                    region.inputs.append(arg)
        if node in identity_reads or any(u not in inside and u not in consumed for u in node.users):
            region.outputs.append(node)
    if not region.nodes and region.feed_value is not None:
        region.inputs.append(region.feed_value)


def is_placeholder_slot(node: fx.Node) -> bool:
    return node.op == "placeholder" and isinstance(node.meta.get(ROLE), InputSlot)


def operand_layouts(
    gm: fx.GraphModule,
    regions: list[Region],
    groups: list[OpGroup],
    calls: list[fx.Node],
    refs: dict[fx.Node, GroupRef],
) -> dict[fx.Node, bool]:
    """How a kernel reads each operand it takes by address: True for transposed. A member of a
    stacked group result through its group (a joined n x m member); what an aten call made, as its
    value's layout says (the wrapper lays a strided one out at run time, fence.py's ``_laid_out``);
    step buffers and the step's inputs (made dense by ``forward``) row-major."""
    made = {n for r in regions for n in r.nodes} | {g.node for g in groups} | set(calls)
    made |= {n for g in groups for n in g.absorbed}
    layout = {n: ref.transposed for n, ref in refs.items()}
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if node.op == "call_function" and node not in made and isinstance(val, torch.Tensor):
            # a permute view of a row-major matrix: read through transposed offsets, no copy
            layout.setdefault(node, bool(val.dim() == 2 and not val.is_contiguous() and val.mT.is_contiguous()))
    return layout
