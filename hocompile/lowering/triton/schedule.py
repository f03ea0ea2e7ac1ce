"""Launch units of the Triton step and their order.

A unit is a *pointwise group* (one horizontally fused kernel), a
*registered op group* (one call of a ``hocompile::`` op whose family has a
Triton emitter, op_groups.py) or an *aten call* (any other node, a
registered op without a Triton emitter included), or a *call unit* (a
registered op with several tensor inputs whose emitter reads them where
they are, call_group.py). Units are ordered so every unit follows the units
producing its inputs; fusing regions across parameters can create a cycle
(region A of p0 feeding region B of p1 while B's twin feeds A's twin:
REKLS does, through its aten calls), in which case :func:`schedule` raises
:class:`ScheduleError` naming the units on cycles, and the wrapper launches
those groups one member at a time (wrapper.py).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from enum import Enum

import torch.fx as fx

from .call_group import CallGroup
from .op_groups import OpGroup
from .pointwise import PointwiseSpec
from .regions import Region


class ScheduleError(RuntimeError):
    def __init__(self, message: str, cyclic: frozenset[int] = frozenset()) -> None:
        super().__init__(message)
        self.cyclic = cyclic  # the units that lie on a dependency cycle


@dataclass
class PointwiseGroup:
    spec: PointwiseSpec
    members: list[Region] = field(default_factory=list)


class UnitKind(Enum):
    POINTWISE = "pointwise group"
    REGISTERED = "registered op group"
    ATEN = "aten call"
    CALL = "registered op call"


@dataclass
class Unit:
    kind: UnitKind
    pointwise: PointwiseGroup | None = None
    group: OpGroup | None = None
    node: fx.Node | None = None
    call: CallGroup | None = None
    deps: set[int] = field(default_factory=set)


def build_units(
    gm: fx.GraphModule,
    groups: list[PointwiseGroup],
    op_groups: list[OpGroup],
    calls: list[CallGroup] | None = None,
) -> tuple[list[Unit], dict[fx.Node, int]]:
    """Units, and which unit produces each node's value."""
    units: list[Unit] = []
    producer: dict[fx.Node, int] = {}
    absorbed: set[fx.Node] = set()
    for group in groups:
        units.append(Unit(UnitKind.POINTWISE, pointwise=group))
        for region in group.members:
            for node in region.nodes:
                producer[node] = len(units) - 1
    for op_group in op_groups:
        units.append(Unit(UnitKind.REGISTERED, group=op_group))
        producer[op_group.node] = len(units) - 1
        for node in op_group.absorbed:
            absorbed.add(node)
            producer.setdefault(node, len(units) - 1)
    for call in calls or []:
        units.append(Unit(UnitKind.CALL, call=call))
        producer[call.node] = len(units) - 1
    for node in gm.graph.nodes:
        if node.op == "call_function" and node not in producer and node not in absorbed:
            units.append(Unit(UnitKind.ATEN, node=node))
            producer[node] = len(units) - 1
    for index, unit in enumerate(units):
        for node in _reads(unit):
            source = producer.get(node)
            if source is not None and source != index:
                unit.deps.add(source)
    # An op-group unit waits for the regions storing into its workspace.
    unit_of_group = {u.group.index: i for i, u in enumerate(units) if u.group is not None}
    for index, unit in enumerate(units):
        if unit.pointwise is not None:
            for region in unit.pointwise.members:
                if region.feed is not None:
                    units[unit_of_group[region.feed.group]].deps.add(index)
    return units, producer


def _reads(unit: Unit) -> list[fx.Node]:
    if unit.pointwise is not None:
        return [n for r in unit.pointwise.members for n in r.inputs]
    if unit.group is not None:
        # Feeds arrive through regions; other inputs (eps) are host scalars.
        return [n for n in unit.group.node.all_input_nodes if n.op != "call_function"]
    if unit.call is not None:
        return unit.call.node.all_input_nodes  # its tensors, read where they are, and host scalars
    assert unit.node is not None
    return unit.node.all_input_nodes


def schedule(units: list[Unit]) -> list[int]:
    """A topological order of the units (Kahn), earliest-created unit first where free, except
    that units nothing reads (the updates that only produce write-backs) come after all others:
    by then the op groups' buffers are dead, and the write fence places their results there
    (fence.py)."""
    waiting = [len(u.deps) for u in units]
    users: list[list[int]] = [[] for _ in units]
    for index, unit in enumerate(units):
        for dep in unit.deps:
            users[dep].append(index)
    key = [(not users[i], i) for i in range(len(units))]
    ready = [key[i] for i, n in enumerate(waiting) if n == 0]
    heapq.heapify(ready)
    order: list[int] = []
    while ready:
        _, index = heapq.heappop(ready)
        order.append(index)
        for user in users[index]:
            waiting[user] -= 1
            if waiting[user] == 0:
                heapq.heappush(ready, key[user])
    if len(order) != len(units):
        raise ScheduleError("fused groups depend on each other in a cycle", _on_cycles(units, set(order)))
    return order


def _on_cycles(units: list[Unit], done: set[int]) -> frozenset[int]:
    """The units not scheduled that reach themselves through their dependencies."""
    left = [i for i in range(len(units)) if i not in done]
    cyclic: set[int] = set()
    for start in left:
        seen: set[int] = set()
        stack = [d for d in units[start].deps if d not in done]
        while stack:
            unit = stack.pop()
            if unit == start:
                cyclic.add(start)
                break
            if unit not in seen:
                seen.add(unit)
                stack += [d for d in units[unit].deps if d not in done]
    return frozenset(cyclic)


def units_in_order(
    gm: fx.GraphModule, groups: list[PointwiseGroup], op_groups: list[OpGroup], calls: list[CallGroup]
) -> tuple[list[Unit], list[int]]:
    """The launch units and their order; fused groups on a dependency cycle launch per member."""
    while True:
        units, _ = build_units(gm, groups, op_groups, calls)
        try:
            return units, schedule(units)
        except ScheduleError as error:
            split = {id(units[i].pointwise) for i in error.cyclic if units[i].pointwise is not None}
            split -= {id(g) for g in groups if len(g.members) == 1}
            if not split:
                raise
            groups = [
                part
                for g in groups
                for part in ([PointwiseGroup(g.spec, [m]) for m in g.members] if id(g) in split else [g])
            ]
