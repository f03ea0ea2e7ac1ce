"""Is a traced step one program per param? Ownership of every node, and each member's program as data.

A node *belongs* to the param (the *member*) whose inputs it reads: its
param, grad, state tensors, and host scalars computed from its own
counters (``g0.p5.state.step``). A node that reads no member's input (a
constant tensor, a factory) belongs to the one member that uses it, or is
*global* when several members or none use it (``torch.tensor(lr)`` made
once before the loop). A node that reads two members' inputs mixes params
(a global grad norm, a flatten of everything): the step is then not
separable and is traced whole.

Foreach ops (``torch._foreach_mul_(params, x)``) read every member at once
but compute each list position from that position alone; :func:`split_foreach`
gives every position its own one-element call first, which on CPU is the very
kernel the whole call loops over.

:func:`member_program` renders what one member computes, with its inputs
named by role (its param, its grad, state key) and its host scalars by
expressions in which its own counters are generic (``g0.p*.state.step``):
two members whose renderings are equal run the same program.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from ..capture.finish import OutputAction
from ..capture.scalars import Expr
from ..ir.graph import ORIGIN, PER_PARAM, ROLE, InputSlot

MemberId = tuple[int, int]  # (group, index into the group's params)

_MEMBER_NAME = re.compile(r"^g(\d+)\.p(\d+)\.state\.")


def member_of_slot(slot: InputSlot) -> MemberId | None:
    """The member a tensor input belongs to; None for optimizer attributes and group tensors (shared)."""
    return (slot.group, slot.index) if slot.kind in PER_PARAM else None


def member_of_name(name: str) -> MemberId | None:
    """The member a host input belongs to (its counters and Python state numbers), else None."""
    match = _MEMBER_NAME.match(name)
    return (int(match.group(1)), int(match.group(2))) if match else None


def generic_name(name: str) -> str:
    """``g0.p5.state.step`` -> ``g0.p*.state.step``: the same input of whichever member runs."""
    return _MEMBER_NAME.sub(lambda m: f"g{m.group(1)}.p*.state.", name)


def expr_members(expr: Expr) -> set[MemberId]:
    return {m for m in map(member_of_name, expr.inputs()) if m is not None}


def generic_expr(expr: Expr) -> str:
    return expr.render({name: generic_name(name) for name in expr.inputs()})


# ------------------------------------------------------------------ foreach


def _aligned(arg: Any, schema_type: str, length: int) -> bool:
    return schema_type.startswith("List[") and isinstance(arg, (list, tuple)) and len(arg) == length


def split_foreach(gm: fx.GraphModule) -> int:
    """Replace every multi-element ``_foreach_*`` call by one call per list position; returns how many."""
    graph, split = gm.graph, 0
    for node in list(graph.nodes):
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
            continue
        if not target._schema.name.startswith("aten::_foreach_") or not node.args:
            continue
        first = node.args[0]
        length = len(first) if isinstance(first, (list, tuple)) else 0
        if length < 2:
            continue
        types = [str(a.type) for a in target._schema.arguments]
        vals = node.meta.get("val")
        parts: list[fx.Node] = []
        with graph.inserting_before(node):
            for k in range(length):
                args = tuple(
                    [a[k]] if _aligned(a, t, length) else a for a, t in zip(node.args, types + [""] * len(node.args))
                )
                part = graph.call_function(target, args, dict(node.kwargs))
                part.meta.update({key: v for key, v in node.meta.items() if key != "val"})
                if isinstance(vals, (list, tuple)) and len(vals) == length:
                    part.meta["val"] = [vals[k]]
                parts.append(part)
        returns_list = bool(target._schema.returns) and str(target._schema.returns[0].type).startswith("List[")
        for user in list(node.users):
            if user.op == "call_function" and user.target is operator.getitem and returns_list:
                k = user.args[1]
                assert isinstance(k, int)
                user.args = (parts[k], 0)
            else:  # a use of the whole list: not separable per position, undo
                for part in parts:
                    graph.erase_node(part)
                parts = []
                break
        if parts:
            graph.erase_node(node)
            split += 1
    if split:
        gm.recompile()
    return split


# ------------------------------------------------------------------ ownership

GLOBAL: MemberId = (-1, -1)  # the owner of nodes computed once for the whole step


@dataclass
class Partition:
    """Which member owns each node of a step graph, or why the step is not one program per member."""

    owner: dict[fx.Node, MemberId] = field(default_factory=dict)  # GLOBAL for shared nodes and inputs
    problem: str = ""

    def nodes_of(self, gm: fx.GraphModule, member: MemberId) -> list[fx.Node]:
        return [n for n in gm.graph.nodes if n.op not in ("placeholder", "output") and self.owner.get(n) == member]

    def members(self) -> set[MemberId]:
        return {m for m in self.owner.values() if m != GLOBAL}


def _describe(member: MemberId) -> str:
    return f"param_groups[{member[0]}]['params'][{member[1]}]"


def partition(gm: fx.GraphModule, outputs: tuple[OutputAction, ...]) -> Partition:
    """Owners of every node (see the module docstring); ``problem`` names the first node that mixes members."""
    part = Partition()
    deps: dict[fx.Node, frozenset[MemberId]] = {}
    nodes = list(gm.graph.nodes)
    for node in nodes:
        if node.op == "output":
            continue
        if node.op == "placeholder":
            role = node.meta.get(ROLE)
            if isinstance(role, InputSlot):
                member = member_of_slot(role)
                deps[node] = frozenset([member] if member is not None else [])
            else:
                deps[node] = frozenset(expr_members(role)) if isinstance(role, Expr) else frozenset()
        else:
            deps[node] = frozenset().union(*(deps[a] for a in node.all_input_nodes))
        if len(deps[node]) > 1:
            first, second = sorted(deps[node])[:2]
            what = "host scalar" if node.op == "placeholder" else f"`{node.format_node()}`"
            part.problem = (
                f"{what} reads {len(deps[node])} params' values ({_describe(first)} and {_describe(second)}): "
                "the step mixes params (a global norm, a foreach over a combined value, a flatten of everything)"
            )
            return part
    output = nodes[-1]
    # Who uses each output value: the member whose slot it is written to, or the whole step.
    written_to: dict[fx.Node, MemberId] = {}
    for action, value in zip(outputs, output.args[0]):
        if isinstance(value, fx.Node):
            member = member_of_slot(action.slot)
            written_to[value] = member if member is not None else GLOBAL
    for node in reversed(nodes):
        if node.op == "output":
            continue
        if deps[node]:
            (part.owner[node],) = deps[node]
            continue
        if node.op == "placeholder":
            part.owner[node] = GLOBAL
            continue
        users = {part.owner[u] for u in node.users if u.op != "output"}
        if node in written_to:
            users.add(written_to[node])
        part.owner[node] = next(iter(users)) if len(users) == 1 else GLOBAL
    for node, member in written_to.items():
        if part.owner[node] != member and member != GLOBAL:
            part.problem = f"{_describe(member)} is written a value another param owns (`{node.format_node()}`)"
            return part
    for node in nodes:
        if node.op == "call_function" and part.owner[node] == GLOBAL and any(
            part.owner.get(a) not in (GLOBAL, None) for a in node.all_input_nodes
        ):
            part.problem = f"`{node.format_node()}` is shared by several params but reads one of them"
            return part
    return part


# ------------------------------------------------------------------ rendering


def _val(node: fx.Node) -> Hashable:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return (val.dtype, tuple(val.shape))
    if isinstance(val, (list, tuple)):
        return tuple((v.dtype, tuple(v.shape)) if isinstance(v, torch.Tensor) else type(v).__name__ for v in val)
    return type(val).__name__


def _constant_key(gm: fx.GraphModule, node: fx.Node) -> Hashable:
    value = getattr(gm, str(node.target))
    if isinstance(value, torch.Tensor):
        return ("tensor", value.dtype, tuple(value.shape), tuple(value.reshape(-1).tolist()[:64]))
    return ("attr", repr(value))


class _Renderer:
    """Renders nodes of one member (or of the global part) with names that do not depend on who runs them."""

    def __init__(self, gm: fx.GraphModule, part: Partition, member: MemberId) -> None:
        self.gm, self.part, self.member = gm, part, member
        self.local: dict[fx.Node, int] = {}
        self.global_index = {n: k for k, n in enumerate(part.nodes_of(gm, GLOBAL))}

    def arg(self, a: Any) -> Hashable:
        if isinstance(a, fx.Node):
            if a in self.local:
                return ("local", self.local[a])
            if a.op == "placeholder":
                role = a.meta.get(ROLE)
                if isinstance(role, InputSlot):
                    if member_of_slot(role) is None:
                        return ("shared", role.kind, role.group, role.key)
                    return ("in", role.kind, role.key)
                return ("scalar", generic_expr(role) if isinstance(role, Expr) else repr(role))
            if a in self.global_index:
                return ("global", self.global_index[a])
            return ("foreign", a.name)  # another member's node: never equal to a rendering that is separable
        if isinstance(a, (list, tuple)):
            return ("seq", tuple(self.arg(x) for x in a))
        if isinstance(a, dict):
            return ("dict", tuple(sorted((k, self.arg(v)) for k, v in a.items())))
        if isinstance(a, float):
            return ("float", a.hex())
        return ("const", type(a).__name__, repr(a))

    def node(self, node: fx.Node) -> Hashable:
        self.local[node] = len(self.local)
        if node.op == "get_attr":
            return ("get_attr", _constant_key(self.gm, node))
        return (
            node.op,
            str(node.target),
            self.arg(node.args),
            self.arg(node.kwargs),
            _val(node),
            node.meta.get(ORIGIN, ""),
        )


def member_program(gm: fx.GraphModule, part: Partition, member: MemberId, outputs: tuple[OutputAction, ...]) -> Any:
    """What ``member`` (or GLOBAL) computes and writes, in names that do not depend on which member it is."""
    renderer = _Renderer(gm, part, member)
    body = tuple(renderer.node(n) for n in part.nodes_of(gm, member))
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    writes = []
    for action, value in zip(outputs, output.args[0]):
        slot_member = member_of_slot(action.slot)
        if (slot_member if slot_member is not None else GLOBAL) != member:
            continue
        writes.append((action.mode, action.slot.kind, action.slot.key, renderer.arg(value)))
    return (body, tuple(writes))
