"""Launch units of the Triton step and their order.

A unit is one horizontally fused pointwise group, one Newton–Schulz group,
or one leftover aten node. Units are ordered so every unit follows the units
producing its inputs; fusing regions across parameters could in principle
create a cycle (region A of p0 feeding region B of p1 while B's twin feeds
A's twin), in which case :func:`schedule` raises :class:`ScheduleError` and
the compile fails with it: no optimizer seen so far does this, and a
fallback that launches each region alone is not built.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import torch.fx as fx

from .pointwise import PointwiseSpec
from .regions import NSGroup, Region


class ScheduleError(RuntimeError):
    pass


@dataclass
class PointwiseGroup:
    spec: PointwiseSpec
    members: list[Region] = field(default_factory=list)


@dataclass
class Unit:
    kind: str  # "pointwise" | "ns" | "node"
    pointwise: PointwiseGroup | None = None
    ns: NSGroup | None = None
    node: fx.Node | None = None
    deps: set[int] = field(default_factory=set)


def build_units(
    gm: fx.GraphModule, groups: list[PointwiseGroup], ns_groups: list[NSGroup]
) -> tuple[list[Unit], dict[fx.Node, int]]:
    """Units, and which unit produces each node's value."""
    units: list[Unit] = []
    producer: dict[fx.Node, int] = {}
    absorbed: set[fx.Node] = set()
    for group in groups:
        units.append(Unit("pointwise", pointwise=group))
        for region in group.members:
            for node in region.nodes:
                producer[node] = len(units) - 1
    for ns in ns_groups:
        units.append(Unit("ns", ns=ns))
        producer[ns.node] = len(units) - 1
        for node in ns.absorbed:
            absorbed.add(node)
            producer.setdefault(node, len(units) - 1)
    for node in gm.graph.nodes:
        if node.op == "call_function" and node not in producer and node not in absorbed:
            units.append(Unit("node", node=node))
            producer[node] = len(units) - 1
    for index, unit in enumerate(units):
        for node in _reads(unit):
            source = producer.get(node)
            if source is not None and source != index:
                unit.deps.add(source)
    # A Newton–Schulz unit waits for the regions storing into its workspace.
    for index, unit in enumerate(units):
        if unit.kind == "pointwise":
            assert unit.pointwise is not None
            for region in unit.pointwise.members:
                if region.feed is not None:
                    ns_unit = next(
                        i for i, u in enumerate(units) if u.ns is not None and u.ns.index == region.feed.group
                    )
                    units[ns_unit].deps.add(index)
    return units, producer


def _reads(unit: Unit) -> list[fx.Node]:
    if unit.kind == "pointwise":
        assert unit.pointwise is not None
        return [n for r in unit.pointwise.members for n in r.inputs]
    if unit.kind == "ns":
        assert unit.ns is not None
        # Feeds arrive through regions; other inputs (eps) are host scalars.
        return [n for n in unit.ns.node.all_input_nodes if n.op != "call_function"]
    assert unit.node is not None
    return unit.node.all_input_nodes


def schedule(units: list[Unit]) -> list[int]:
    """A topological order of the units (Kahn), earliest-created unit first where free."""
    waiting = [len(u.deps) for u in units]
    users: list[list[int]] = [[] for _ in units]
    for index, unit in enumerate(units):
        for dep in unit.deps:
            users[dep].append(index)
    ready = [i for i, n in enumerate(waiting) if n == 0]
    heapq.heapify(ready)
    order: list[int] = []
    while ready:
        index = heapq.heappop(ready)
        order.append(index)
        for user in users[index]:
            waiting[user] -= 1
            if waiting[user] == 0:
                heapq.heappush(ready, user)
    if len(order) != len(units):
        raise ScheduleError("fused groups depend on each other in a cycle")
    return order
