"""batch-by-shape: same-shaped calls of a registered op become one batched call.

Every op family with a :class:`~hocompile.ir.registry.BatchRule` batches; the
example is Newton–Schulz. Before (two 768×3072 and one 3072×768 matrix, same
coefficients)::

    t2 = hocompile.newton_schulz(t1, [...], eps=h2 clamp, wide, fp32->bf16, gram, native)
    t7 = hocompile.newton_schulz(t6, [...], eps=h2 clamp, wide, fp32->bf16, gram, native)
    t12 = hocompile.newton_schulz(t11, [...], eps=h2 clamp, transpose, fp32->bf16, gram, native)

After::

    t13 = aten.permute(t11, [1, 0])                 # n×m shares the m×n batch
    t14 = aten.stack([t1, t6, t13])
    t15 = hocompile.newton_schulz(t14, [...], eps=h2 clamp, wide, fp32->bf16, gram, native)
    t16 = aten.unbind.int(t15)
    t2 = getitem(t16, 0); t7 = getitem(t16, 1)
    t12 = aten.permute(getitem(t16, 2), [1, 0])

Calls batch together when their family's ``batch.key`` is equal (for NS:
everything but the batch index: wide shape, coefficients, eps, rounding,
algorithm); a call whose key is None (an input already batched) stays alone.
A cap bounds each stack (count and bytes), since the stacked inputs and
outputs of a whole group are alive at once.

Whether batching pays is the target's call: on GPUs one launch per group
instead of per matrix; on this project's CPUs stacking measured no faster
than a loop of ``mm`` and multiplied the step's peak memory (see
targets.cpu_target), so there the pass declines unless ``force=True``.
"""

from __future__ import annotations

import operator
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.fx as fx

from ..ir.graph import stable_topological_sort
from ..ir.registry import BatchRule, registered_calls
from ..targets import Target
from .base import Pass, PassResult

aten = torch.ops.aten


@dataclass(frozen=True)
class BatchByShape(Pass):
    name: ClassVar[str] = "batch-by-shape"
    target: Target = field(default_factory=lambda: Target("unset"))
    max_batch: int = 64
    max_stack_bytes: int | None = None  # None: the target's stack_bytes
    force: bool = False
    # On a target that declines stacking, still stack the calls whose family runs its
    # batch one LAPACK thread per matrix, where its rule says that pays.
    per_matrix_threads: bool = True

    def __call__(self, gm: fx.GraphModule) -> PassResult:
        calls = [(node, family) for node, family in registered_calls(gm.graph) if family.batch is not None]
        if not calls:
            return PassResult(gm, False, self.decline("no op with a batch rule to batch"))
        if not (self.force or self.target.prefers_batched):
            reason = (
                f"{self.target.name} does not gain from stacking (a loop of mm is as fast there); "
                "batching would only add copies and memory"
            )
            # Except the families whose batched call is one LAPACK call per matrix, one
            # thread each: on several cores that beats eager's loop of multi-threaded calls
            # (SOAP's QR refresh from n = 256; ops/eigenbasis.py). MOP's polar does not
            # opt in: its exact path is bitwise eager, one-thread SVDs round differently.
            calls = [(n, f) for n, f in calls if self.per_matrix_threads and _threads_pay(n, f)]
            if not calls:
                return PassResult(gm, False, self.decline(reason))
        # Keyed by op too: two families never share a stack, whatever their keys.
        groups: dict[tuple[Any, Hashable], list[tuple[fx.Node, Any]]] = {}
        rules: dict[Any, BatchRule] = {}
        families: dict[Any, Any] = {}
        declined: list[str] = []
        for node, family in calls:
            assert family.batch is not None
            spec = family.spec_of(node)
            key = family.batch.key(spec)
            if key is None:
                declined.append(self.decline(f"{node.name}: input already batched"))
                continue
            groups.setdefault((family.op, key), []).append((node, spec))
            rules[family.op] = family.batch
            families[family.op] = family
        limit = self.max_stack_bytes if self.max_stack_bytes is not None else self.target.stack_bytes
        made = 0
        for (op, _), members in groups.items():
            if len(members) < 2:
                continue
            rule = rules[op]
            per_call = max(stack_bytes_of(rule, node, spec) for node, spec in members)
            cap = max(1, min(self.max_batch, limit // max(1, per_call)))
            for start in range(0, len(members), cap):
                # Specs are re-read now: an earlier group's rewrite may have replaced a
                # member's argument (SOAP's projections read power_qr's Q), and a spec
                # read before it would still name the erased node.
                chunk = [(node, families[op].spec_of(node)) for node, _ in members[start : start + cap]]
                chunk, dependent = _independent(chunk)
                declined += [self.decline(f"{n.name}: reads another call of its batch") for n in dependent]
                if len(chunk) > 1:
                    _batch(gm, rule, chunk)
                    made += 1
        if not made:
            return PassResult(gm, False, self.decline("no two calls of one op share a batch key"), declined)
        stable_topological_sort(gm.graph)
        gm.graph.eliminate_dead_code()
        gm.recompile()
        batched = sum(len(v) for v in groups.values() if len(v) > 1)
        return PassResult(gm, True, f"{batched} ops in {made} batched op(s)", declined)

    def stacks_anything(self, gm: fx.GraphModule) -> bool:
        """Whether some call of ``gm`` is one this pass stacks where it meets another of its key.

        A stamped step (classes/stamp.py) asks, of its representatives' graph: each call
        there stands for every member of its class, which a step traced whole would stack.
        """
        calls = [(node, family) for node, family in registered_calls(gm.graph) if family.batch is not None]
        if not (self.force or self.target.prefers_batched):
            calls = [(n, f) for n, f in calls if self.per_matrix_threads and _threads_pay(n, f)]
        return bool(calls)


def _independent(chunk: list[tuple[fx.Node, Any]]) -> tuple[list[tuple[fx.Node, Any]], list[fx.Node]]:
    """The members no other kept member depends on; a stack of dependent calls is a cycle."""
    kept: list[tuple[fx.Node, Any]] = []
    dropped: list[fx.Node] = []
    members = {node for node, _ in chunk}
    for node, spec in chunk:
        seen: set[fx.Node] = set()
        stack = list(node.all_input_nodes)
        hit = False
        while stack and not hit:
            n = stack.pop()
            if n in seen:
                continue
            seen.add(n)
            hit = n in members
            stack += n.all_input_nodes
        if hit:
            dropped.append(node)
        else:
            kept.append((node, spec))
    return kept, dropped


def _threads_pay(node: fx.Node, family: Any) -> bool:
    rule = family.batch
    if rule is None or rule.per_matrix_threads is None or torch.get_num_threads() < 2:
        return False
    return bool(rule.per_matrix_threads(family.spec_of(node)))


def stack_bytes_of(rule: BatchRule, node: fx.Node, spec: Any) -> int:
    """Bytes one member adds to a stack: the rule's, else its tensor inputs plus its output."""
    if rule.stack_bytes is not None:
        return int(rule.stack_bytes(spec))
    vals = [spec.node_of(name).meta["val"] for name in spec.tensor_fields()] + [node.meta["val"]]
    return sum(int(v.numel() * v.element_size()) for v in vals)


def _batch(gm: fx.GraphModule, rule: BatchRule, chunk: list[tuple[fx.Node, Any]]) -> None:
    """Replace ``chunk`` (calls of one op with one key) by stack → one call → unbind."""
    graph = gm.graph
    output = next(n for n in graph.nodes if n.op == "output")
    nodes, specs = [n for n, _ in chunk], [s for _, s in chunk]
    flips = [bool(rule.transposed(spec)) for spec in specs]
    with graph.inserting_before(output):  # placed anywhere; the topological sort fixes order
        members: dict[str, list[fx.Node]] = {name: [] for name in specs[0].tensor_fields()}
        for spec, flip in zip(specs, flips):
            for name in members:
                x = spec.node_of(name)
                if flip:  # a tall input batches as its transpose with the wide ones
                    x = _call(graph, aten.permute.default, (x, [1, 0]), _t(x.meta["val"]))
                members[name].append(x)
        stacked = {
            name: _call(graph, aten.stack.default, (xs,), torch.stack([x.meta["val"] for x in xs]))
            for name, xs in members.items()
        }
        first = nodes[0]
        batched_spec = rule.batched(specs[0], stacked)
        out_vals = [n.meta["val"] for n in nodes]
        outs = [_t(v) if flip else v for flip, v in zip(flips, out_vals)]
        batched = _call(graph, first.target, batched_spec.to_args(), torch.stack(outs))
        # The batched call inherits the first member's recorded decisions (all share the key).
        batched.meta.update({k: v for k, v in first.meta.items() if k.startswith("hocompile.decision")})
        parts = _call(graph, aten.unbind.int, (batched,), list(outs))
        for i, (node, flip) in enumerate(zip(nodes, flips)):
            part = _call(graph, operator.getitem, (parts, i), outs[i])
            if flip:
                part = _call(graph, aten.permute.default, (part, [1, 0]), out_vals[i])
            node.replace_all_uses_with(part)
    for node in nodes:
        graph.erase_node(node)


def _t(val: Any) -> Any:
    return val.permute(1, 0)


def _call(graph: fx.Graph, target: Any, args: tuple[Any, ...], val: Any) -> fx.Node:
    node = graph.call_function(target, args)
    node.meta["val"] = val
    return node
