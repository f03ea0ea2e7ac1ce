"""Partition a step graph into what the Triton wrapper launches.

- **Pointwise regions**: connected elementwise aten ops over one shape
  (momentum, nesterov, weight decay, the lr-scaled update). A region is one
  kernel body; isomorphic regions (same ops, shapes, dtypes, input kinds)
  of different parameters form a *group*, launched once for all members
  through a pointer table (one program row per member).
- **Newton–Schulz groups**: each ``hocompile::newton_schulz`` op (batched by
  batch-by-shape, or a single matrix). The ``stack`` feeding it and the
  ``unbind`` leaving it are absorbed: the pointwise kernel producing a member
  stores straight into the stacked workspace (transposed where
  batch-by-shape joined an n×m matrix to the m×n batch) and adds up its
  Frobenius norm, and the kernels reading a member load from the stacked
  result.

Anything else stays an aten call in the wrapper.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from ...graph import ROLE, InputSlot
from ...ops_schema import NewtonSchulzSpec
from .pointwise_ops import is_scalar_arg, supported

aten = torch.ops.aten
NS = torch.ops.hocompile.newton_schulz.default
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class NSRef:
    """Member ``slot`` of NS group ``group``: its input (``feed``) or result."""

    group: int
    slot: int
    transposed: bool
    feed: bool


@dataclass
class NSGroup:
    index: int
    node: fx.Node
    batch: int
    m: int
    n: int
    feeds: list[fx.Node | None]  # the value stored into each workspace slot
    feed_transposed: list[bool]
    absorbed: set[fx.Node] = field(default_factory=set)  # stack/unbind/getitem/permute views


@dataclass
class Region:
    nodes: list[fx.Node]
    inputs: list[fx.Node] = field(default_factory=list)  # external tensors, first-use order
    outputs: list[fx.Node] = field(default_factory=list)  # values that escape
    scalars: list[Any] = field(default_factory=list)  # host-scalar placeholders / constants
    feed: NSRef | None = None  # an output stored into an NS workspace slot
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


def _is_transpose(node: fx.Node) -> bool:
    dims: Any = node.args[1] if len(node.args) > 1 else None
    return node.op == "call_function" and node.target is aten.permute.default and list(dims) == [1, 0]


def find_ns_groups(gm: fx.GraphModule) -> tuple[list[NSGroup], dict[fx.Node, NSRef]]:
    """NS groups, and the NS-result reference each absorbed view node stands for."""
    groups: list[NSGroup] = []
    refs: dict[fx.Node, NSRef] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not NS:
            continue
        spec = NewtonSchulzSpec.from_node(node)
        x = spec.x_node
        index = len(groups)
        val = x.meta["val"]
        if val.dim() == 3 and x.target is aten.stack.default and len(x.users) == 1:
            members = list(x.args[0])  # type: ignore[arg-type]
            feeds: list[fx.Node | None] = []
            flips: list[bool] = []
            for member in members:
                flip = _is_transpose(member) and len(member.users) == 1
                feeds.append(member.args[0] if flip else member)  # type: ignore[arg-type, union-attr]
                flips.append(flip)
            group = NSGroup(index, node, len(members), int(val.shape[1]), int(val.shape[2]), feeds, flips)
            group.absorbed.add(x)
            group.absorbed.update(m for m, f in zip(members, flips) if f)
            _absorb_unbind(group, node, refs)
        elif val.dim() == 2:
            flip = bool(spec.transpose)
            rows, cols = int(val.shape[0]), int(val.shape[1])
            m, n = (cols, rows) if flip else (rows, cols)
            group = NSGroup(index, node, 1, m, n, [x], [flip])
            refs[node] = NSRef(index, 0, flip, feed=False)
        else:
            continue  # a batched op fed by something other than a stack: aten
        groups.append(group)
    return groups, refs


def _absorb_unbind(group: NSGroup, node: fx.Node, refs: dict[fx.Node, NSRef]) -> None:
    users = list(node.users)
    if len(users) != 1 or users[0].target is not aten.unbind.int:
        return  # the result is used whole: the wrapper reads it as a tensor
    unbind = users[0]
    group.absorbed.add(unbind)
    for item in unbind.users:
        if item.target is not operator.getitem:
            continue
        slot = int(item.args[1])  # type: ignore[arg-type]
        group.absorbed.add(item)
        refs[item] = NSRef(group.index, slot, False, feed=False)
        for user in item.users:
            if _is_transpose(user):
                group.absorbed.add(user)
                refs[user] = NSRef(group.index, slot, True, feed=False)


def find_regions(gm: fx.GraphModule, ns_groups: list[NSGroup]) -> list[Region]:
    """Connected same-shape pointwise regions, plus identity regions for NS feeds."""
    parent: dict[fx.Node, fx.Node] = {}

    def root(n: fx.Node) -> fx.Node:
        while parent[n] is not n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    nodes = [n for n in gm.graph.nodes if is_pointwise(n)]
    for n in nodes:
        parent[n] = n
    for n in nodes:
        for arg in n.all_input_nodes:
            if arg in parent and tuple(_val(arg).shape) == tuple(_val(n).shape):
                parent[root(arg)] = root(n)
    by_root: dict[fx.Node, list[fx.Node]] = {}
    for n in nodes:
        by_root.setdefault(root(n), []).append(n)
    regions = [Region(members) for members in by_root.values()]
    owner = {n: r for r in regions for n in r.nodes}
    for group in ns_groups:
        for slot, (feed, flip) in enumerate(zip(group.feeds, group.feed_transposed)):
            assert feed is not None
            ref = NSRef(group.index, slot, flip, feed=True)
            region = owner.get(feed)
            if region is None or region.feed is not None:
                region = Region([])  # an identity region: load, round, store, add up the norm
                regions.append(region)
            region.feed, region.feed_value = ref, feed
    for region in regions:
        _collect_boundary(region)
    return regions


def _collect_boundary(region: Region) -> None:
    inside = set(region.nodes)
    for node in region.nodes:
        for arg in [*node.args, *node.kwargs.values()]:
            if isinstance(arg, fx.Node) and arg not in inside:
                if is_scalar_arg(arg):
                    if arg not in region.scalars:
                        region.scalars.append(arg)
                elif arg not in region.inputs:
                    region.inputs.append(arg)
        if any(u not in inside for u in node.users):
            region.outputs.append(node)
    if not region.nodes and region.feed_value is not None:
        region.inputs.append(region.feed_value)


def is_placeholder_slot(node: fx.Node) -> bool:
    return node.op == "placeholder" and isinstance(node.meta.get(ROLE), InputSlot)
