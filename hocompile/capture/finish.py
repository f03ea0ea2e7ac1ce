"""Finishing a traced step graph: lift hyperparameter constants, make writes outputs.

Two traces of the same step with different sentinel payloads: a constant
that differs between them depends on a hyperparameter and becomes a host
scalar placeholder (it must have been tracked, or capture refuses). The
trailing ``copy_`` into inputs that functionalisation leaves become graph
outputs with a write-back action each.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from ..errors import CaptureError
from ..ir.graph import ORIGIN, ROLE, InputSlot
from .hyper_params import ScalarTracker
from .scalars import Expr


@dataclass(frozen=True)
class OutputAction:
    """What the runtime does with one graph output."""

    mode: str  # "copy": write into the input tensor; "assign": state[p][key] = value
    slot: InputSlot



def lift_scalars(
    gm: fx.GraphModule, other: fx.GraphModule, ta: ScalarTracker, tb: ScalarTracker
) -> list[Expr]:
    """Replace hyperparameter-dependent constants by host scalar placeholders."""
    nodes_a = list(gm.graph.nodes)
    nodes_b = list(other.graph.nodes)
    if [(n.op, n.target) for n in nodes_a] != [(n.op, n.target) for n in nodes_b]:
        raise CaptureError(
            "the step's program changes with hyperparameter values in a way that was not "
            "recorded as a branch (two traces with different values gave different graphs)"
        )
    exprs: list[Expr] = []
    placeholders: dict[Expr, fx.Node] = {}
    last_input = [n for n in nodes_a if n.op == "placeholder"][-1]

    def lift(node: fx.Node, a: Any, b: Any) -> Any:
        if not isinstance(a, float) or isinstance(a, bool):
            return a
        if _same(a, b):
            expr = _nudged_in_both(a, b)
            return a if expr is None else placeholder(expr)
        in_b = set(tb.by_payload.get(b, []))  # once, not per candidate: thousands of payloads share a value
        common = [e for e in ta.by_payload.get(a, []) if e in in_b]
        if not common:
            raise CaptureError(
                f"a constant of `{node.format_node()}` depends on a hyperparameter but was computed "
                "outside what hocompile can follow (e.g. math.sqrt(lr) or float(...) on it); "
                "write the arithmetic with Python operators or mark the key structural"
            )
        return placeholder(common[0])

    def _nudged_in_both(a: float, b: float) -> Expr | None:
        """The tracked expression behind a constant that is equal in both traces, if it carries the
        traces' sentinel nudges: they cancel in a ratio of two inputs (``lr / read0``: each input's
        nudge moves by the same factor between traces), so ``1 - lr / r * 0.01`` came out the same
        double twice and was baked in. A payload equal to its expression's real value is a natural
        number (a counter, a constant): that one stays a constant."""
        in_b = set(tb.by_payload.get(b, []))
        for e in ta.by_payload.get(a, []):
            if e in in_b and e.inputs() and ta.real_value(e) != a and tb.real_value(e) != b:
                return e
        return None

    def placeholder(expr: Expr) -> fx.Node:
        if expr not in placeholders:
            with gm.graph.inserting_after(last_input if not placeholders else list(placeholders.values())[-1]):
                ph = gm.graph.placeholder(f"h{len(exprs)}")
            ph.meta[ROLE] = expr
            ph.meta["val"] = ta.real_value(expr)
            placeholders[expr] = ph
            exprs.append(expr)
        return placeholders[expr]

    for na, nb in zip(nodes_a, nodes_b):
        if na.op != "call_function":
            continue
        flat_a, spec = pytree.tree_flatten((na.args, na.kwargs))
        flat_b, _ = pytree.tree_flatten((nb.args, nb.kwargs))
        if any(isinstance(a, float) and (not _same(a, b) or a in ta.by_payload) for a, b in zip(flat_a, flat_b)):
            new = [lift(na, a, b) for a, b in zip(flat_a, flat_b)]
            na.args, na.kwargs = pytree.tree_unflatten(new, spec)
    for name in _tensor_constant_names(gm):
        if not torch.equal(getattr(gm, name), getattr(other, name)):
            raise CaptureError(f"a hyperparameter was baked into tensor constant {name}")
    return exprs


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    return bool(a == b)


def _tensor_constant_names(gm: fx.GraphModule) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes if n.op == "get_attr"]


def functional_outputs(
    gm: fx.GraphModule, slots: list[InputSlot], assigns: list[InputSlot]
) -> list[OutputAction]:
    """Turn trailing ``copy_(input, value)`` into graph outputs and write-backs."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    slot_of = dict(zip(placeholders, slots))
    output = next(n for n in gm.graph.nodes if n.op == "output")
    assigned_values = list(pytree.tree_leaves(output.args[0]))
    copies: list[tuple[InputSlot, fx.Node]] = []
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is torch.ops.aten.copy_.default:
            dest, value = node.args
            if dest not in slot_of:
                raise CaptureError(f"unexpected in-place copy into a non-input: {node.format_node()}")
            copies.append((slot_of[dest], value))
            gm.graph.erase_node(node)
    actions = [OutputAction("assign", s) for s in assigns]
    actions += [OutputAction("copy", s) for s, _ in copies]
    output.args = (tuple(assigned_values) + tuple(v for _, v in copies),)
    for node in gm.graph.nodes:
        if node.op == "call_function":
            node.meta.setdefault(ORIGIN, "capture")
    return actions


def finish_placeholders(gm: fx.GraphModule, slots: list[InputSlot], exprs: list[Expr]) -> None:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, slot in zip(placeholders, slots):
        node.meta[ROLE] = slot
        node.name = node.target = slot.label()
    gm.graph.eliminate_dead_code()
