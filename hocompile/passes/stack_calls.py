"""stack-calls: same-shaped Newton–Schulz calls of a step traced whole run stacked, where that is
measured faster on this CPU and computes the very same bits.

batch-by-shape declines on a CPU: there a loop of ``mm`` is as fast as a batched GEMM for large
matrices, and a stack costs copies and memory. For small and middling matrices it is not: one
call per matrix is host- and thread-bound (measured here: 12 Muon matrices of 128² to 128×512,
a stacked step 1.2-1.3× eager's). A stamped step stacks its classes' members (stack-members); a
step traced whole (``stamp=False``, a step that cannot be stamped, ``torch.compile(...,
backend="hocompile")``) holds its same-shaped calls side by side, and this pass stacks those.

It runs after the plan (choose-algorithm, choose-precision: the op as it will run), per group of
calls with one batch key, shape, orientation and thread count. It times one call per member
against calls on stacks of ``k`` (the stack, the batched call and the unbind, interleaved, min of
a few rounds) and stacks only where that is ≥10 % faster **and** bitwise one call per member's at
every stack size it will use (a batched GEMM may take another kernel). So the step that stacks is
bitwise the one that does not. Answers are cached per CPU, op, shape and stack size; timing stays
within a budget per compile (stack_members.BUDGET_S), and a group it would overrun is not stacked.

Before::

    t5 = hocompile.newton_schulz(t4, ...)    t9 = hocompile.newton_schulz(t8, ...)   ...

After::

    t20 = aten.stack([t4, t8, ...]);  t21 = hocompile.newton_schulz(t20, ...)  # stack-calls: 4 per call
    t22 = aten.unbind(t21);  t5 = t22[0];  t9 = t22[1]  ...
"""

from __future__ import annotations

import hashlib
import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, cast

import torch
import torch.fx as fx
from torch.utils._python_dispatch import _disable_current_modes

from ..capture.collectives import collective_launches
from ..diskcache import read_json, write_json
from ..ir import dtypes
from ..ir.decisions import DECISION, Alternative, Decision, format_seconds, record
from ..ir.graph import stable_topological_sort
from ..ir.registry import registered_calls
from ..targets import Target, cpu_id
from .base import Pass, PassResult, with_declines
from .batch_by_shape import stack_bytes_of
from .stack_members import (
    BUDGET_S,
    MARGIN,
    MIN_MEMBERS,
    Budget,
    PlannedCall,
    chosen_threads,
    far_apart,
    measure_stacking,
    one_call_seconds,
    parse_stacking,
    stacking_cost,
)

STACK_CALLS_VERSION = 2


@dataclass(frozen=True)
class StackCalls(Pass):
    name: ClassVar[str] = "stack-calls"
    target: Target = field(default_factory=lambda: Target("unset"))
    max_batch: int = 64
    max_stack_bytes: int = 64 * 2**20
    cache_dir: Path | None = None
    budget_s: float = BUDGET_S  # seconds of timing per compile (stack_members.BUDGET_S)

    def __call__(self, gm: fx.GraphModule) -> PassResult:
        if not (self.target.measured and self.target.name == "cpu"):
            return PassResult(gm, False, self.decline(f"{self.target.name}: not this CPU, nothing to time"))
        if collective_launches(gm):
            # every rank must issue the same collectives in the same order, and a stack is this rank's timing
            why = "the step issues collectives: no stack chosen by one rank's timing"
            return PassResult(gm, False, self.decline(why))
        groups: dict[Any, list[tuple[fx.Node, Any]]] = {}
        for node, family in registered_calls(gm.graph):
            if family.batch is None or family.name != "newton_schulz":
                continue
            spec = family.spec_of(node)
            key = family.batch.key(spec)
            val = node.meta["val"]
            if key is None or val.dim() != 2:
                continue
            orientation = bool(family.batch.transposed(spec))
            groups.setdefault((key, tuple(val.shape), orientation, chosen_threads(node)), []).append((node, family))
        made, declined = 0, []
        budget = Budget(self.budget_s)
        for group in groups.values():
            if len(group) < MIN_MEMBERS:
                declined.append(f"{group[0][0].name}: {len(group)} call(s) of its shape")
                continue
            # A call that reads another of its group stays alone, whichever stack that one is in (a
            # stack reading its own output, or two stacks reading each other's, is a cycle). Asked of
            # the graph as the earlier groups' stacks left it, before the sizes are chosen: every
            # stack is one of the sizes measured bitwise.
            dependent = _reading_another(gm.graph, {node for node, _ in group})
            declined += [f"{n.name}: reads another call of its shape" for n in dependent]
            members = [(node, family) for node, family in group if node not in dependent]
            if len(members) < MIN_MEMBERS:
                declined.append(f"{group[0][0].name}: {len(members)} call(s) of its shape to stack")
                continue
            rule = members[0][1].batch
            assert rule is not None
            per_call = stack_bytes_of(rule, members[0][0], members[0][1].spec_of(members[0][0]))
            k = max(1, min(len(members), self.max_batch, self.max_stack_bytes // max(1, per_call)))
            chunks = [members[i : i + k] for i in range(0, len(members), k)]
            sizes = sorted({len(c) for c in chunks if len(c) > 1})
            decision = self._decide(members[0][0], members[0][1], sizes, budget)
            if not decision.chose:
                declined.append(f"{members[0][0].name}: {decision.why}")
                continue
            for chunk in chunks:
                if len(chunk) > 1:
                    _stack(gm, [(node, family.spec_of(node)) for node, family in chunk], decision)
                    made += 1
        if not made:
            reason = declined[0] if declined else "no Newton–Schulz calls of one shape to stack"
            return PassResult(gm, False, self.decline(reason), declined)
        stable_topological_sort(gm.graph)
        gm.graph.eliminate_dead_code()
        gm.recompile()
        return PassResult(gm, True, with_declines(f"{made} stacked call(s)", declined), declined)

    def _decide(self, node: fx.Node, family: Any, sizes: list[int], budget: Budget) -> Decision:
        if not sizes:
            return Decision(self.name, {}, why="no stack of two or more")
        planned = PlannedCall.of(node, family)
        x = planned.x
        text = f"{STACK_CALLS_VERSION};{cpu_id()};{planned.without_input()!r};{tuple(x.shape)};{x.dtype}"
        digest = hashlib.sha256(f"{text};{sizes};{planned.threads}".encode()).hexdigest()[:24]
        path = self.cache_dir / f"stack-calls-{digest}.json" if self.cache_dir is not None else None
        found = read_json(path, parse_stacking) if path is not None else None
        if found is None:
            with _disable_current_modes(), torch.no_grad():  # real tensors, even under AOTAutograd's fake mode
                if apart := far_apart(node, family, planned, self.target, budget):
                    return Decision(self.name, {}, why=apart)
                one_s = budget.spend_on(one_call_seconds, planned.one_by_one, tuple(x.shape), x.dtype)
                cost = stacking_cost(one_s, max(sizes), [*sizes, 1])
                if not budget.fits(cost):
                    why = f"not measured: stacks of {sizes} would take {format_seconds(cost)} to time"
                    return Decision(self.name, {}, why=why + f", {format_seconds(budget.left())} of the budget left")
                found = budget.spend_on(
                    measure_stacking, planned.one_by_one, planned.stacked, tuple(x.shape), x.dtype, sizes
                )
            if path is not None:
                write_json(path, found)
        loop_s, stacked_s = found["loop_s"], found["stacked_s"]
        k = max(sizes)
        each = f"{format_seconds(stacked_s)} vs {format_seconds(loop_s)} per call one by one"
        one_by_one = Alternative("one call per matrix", loop_s)
        if not found["bitwise"]:
            return Decision(self.name, {}, why=f"a stack of {k} rounds differently here ({each})")
        if stacked_s > MARGIN * loop_s:
            why = f"a stack of {k} is not faster here ({each})"
            return Decision(self.name, {}, why=why, alternatives=(one_by_one,))
        return Decision(
            self.name, {"stack": k}, f"{k} calls per stack", stacked_s, alternatives=(one_by_one,),
            why=f"measured here ({each}), bitwise one call per matrix ({dtypes.name(x.dtype)}{list(x.shape)})",
        )


def _reading_another(graph: fx.Graph, members: set[fx.Node]) -> set[fx.Node]:
    """The members that read another member, directly or through any chain of nodes: one walk
    over the graph per group (memoised), not one per member (a step whose calls all read a global
    grad norm would make that quadratic in the number of params)."""
    reaches: dict[fx.Node, bool] = {}  # node -> some member is among its inputs' ancestors (or them)
    for root in graph.nodes:  # iterative post-order: the order of graph.nodes need not be topological
        stack = [(root, False)]
        while stack:
            node, expanded = stack.pop()
            if node in reaches:
                continue
            if expanded:
                reaches[node] = any(a in members or reaches[a] for a in node.all_input_nodes)
                continue
            stack.append((node, True))
            stack += [(a, False) for a in node.all_input_nodes if a not in reaches]
    return {m for m in members if any(a in members or reaches[a] for a in m.all_input_nodes)}


def _stack(gm: fx.GraphModule, chunk: list[tuple[fx.Node, Any]], decision: Decision) -> None:
    """``chunk``'s calls as one call on the stack of their inputs, unbound after: the very call
    _decide timed (a tall input stays tall, the op transposes each matrix of the stack as it does
    one; stacking their transposes instead rounds differently)."""
    graph = gm.graph
    nodes, specs = [n for n, _ in chunk], [s for _, s in chunk]
    (name,) = specs[0].tensor_fields()
    output = next(n for n in graph.nodes if n.op == "output")
    with graph.inserting_before(output):  # placed anywhere; the topological sort fixes order
        xs = [spec.node_of(name) for spec in specs]
        stacked = graph.call_function(torch.ops.aten.stack.default, (xs,))
        stacked.meta["val"] = torch.stack([x.meta["val"] for x in xs])
        target = cast(Callable[..., Any], nodes[0].target)
        call = graph.call_function(target, specs[0].replace(**{name: stacked}).to_args())
        call.meta["val"] = torch.stack([n.meta["val"] for n in nodes])
        call.meta[DECISION] = nodes[0].meta.get(DECISION, ())  # the plan the members share
        record(call, decision)
        parts = graph.call_function(torch.ops.aten.unbind.int, (call,))
        parts.meta["val"] = list(call.meta["val"].unbind(0))
        for i, node in enumerate(nodes):
            part = graph.call_function(operator.getitem, (parts, i))
            part.meta["val"] = node.meta["val"]
            node.replace_all_uses_with(part)
    for node in nodes:
        graph.erase_node(node)
