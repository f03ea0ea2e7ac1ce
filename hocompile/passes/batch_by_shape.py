"""batch-by-shape: same-shaped Newton–Schulz ops become one batched op.

Before (two 768×3072 and one 3072×768 matrix, same coefficients)::

    t2 = hocompile.newton_schulz(t1, [...], eps=h2 clamp, wide, f32->bf16, gram, native)
    t7 = hocompile.newton_schulz(t6, [...], eps=h2 clamp, wide, f32->bf16, gram, native)
    t12 = hocompile.newton_schulz(t11, [...], eps=h2 clamp, transpose, f32->bf16, gram, native)

After::

    t13 = aten.permute(t11, [1, 0])                 # n×m shares the m×n batch
    t14 = aten.stack([t1, t6, t13])
    t15 = hocompile.newton_schulz(t14, [...], eps=h2 clamp, wide, f32->bf16, gram, native)
    t16 = aten.unbind.int(t15)
    t2 = getitem(t16, 0); t7 = getitem(t16, 1)
    t12 = aten.permute(getitem(t16, 2), [1, 0])

Ops batch together when everything but the batch index is equal: wide shape,
coefficients, eps, rounding, algorithm. A cap bounds the stack (count and
bytes), since stacked inputs and outputs of a whole group are alive at once.

Whether batching pays is the target's call: on GPUs one launch per group
instead of per matrix; on this project's CPUs stacking measured no faster
than a loop of ``mm`` and multiplied the step's peak memory (see
targets.cpu_target), so there the pass declines unless ``force=True``.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import torch
import torch.fx as fx

from ..graph import stable_topological_sort
from ..ops_schema import NewtonSchulzSpec
from ..targets import Target
from .base import Pass, PassResult

aten = torch.ops.aten
NS = "hocompile.newton_schulz"


def _key(node: fx.Node) -> tuple[Any, ...]:
    """Ops batch together when they agree on everything but their input (tall ones as their transpose)."""
    spec = NewtonSchulzSpec.from_node(node)
    x = spec.x_node.meta["val"]
    rows, cols = int(x.shape[-2]), int(x.shape[-1])
    wide = (cols, rows) if spec.transpose else (rows, cols)
    options = tuple(getattr(spec, f.name) for f in fields(spec) if f.name not in ("x", "transpose"))
    return (wide, x.dtype, *options)


@dataclass(frozen=True)
class BatchByShape(Pass):
    name: ClassVar[str] = "batch-by-shape"
    target: Target = field(default_factory=lambda: Target("unset"))
    max_batch: int = 64
    max_stack_bytes: int | None = None  # None: the target's stack_bytes
    force: bool = False

    def __call__(self, gm: fx.GraphModule) -> PassResult:
        ns = torch.ops.hocompile.newton_schulz.default
        ops = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is ns]
        if not ops:
            return PassResult(gm, False, self.decline("no Newton–Schulz op to batch"))
        if not (self.force or self.target.prefers_batched):
            reason = (
                f"{self.target.name} does not gain from stacking (a loop of mm is as fast there); "
                "batching would only add copies and memory"
            )
            return PassResult(gm, False, self.decline(reason))
        groups: dict[tuple[Any, ...], list[fx.Node]] = {}
        declined: list[str] = []
        for node in ops:
            if NewtonSchulzSpec.from_node(node).x_node.meta["val"].dim() != 2:
                declined.append(self.decline(f"{node.name}: input already batched"))
                continue
            groups.setdefault(_key(node), []).append(node)
        made = 0
        for key, members in groups.items():
            if len(members) < 2:
                continue
            (m, n), dtype = key[0], key[1]
            per_matrix = m * n * dtype.itemsize * 2  # stacked input + output
            limit = self.max_stack_bytes if self.max_stack_bytes is not None else self.target.stack_bytes
            cap = max(1, min(self.max_batch, limit // per_matrix))
            for start in range(0, len(members), cap):
                chunk = members[start : start + cap]
                if len(chunk) > 1:
                    _batch(gm, chunk)
                    made += 1
        if not made:
            return PassResult(gm, False, self.decline("no two Newton–Schulz ops share a shape"), declined)
        stable_topological_sort(gm.graph)
        gm.graph.eliminate_dead_code()
        gm.recompile()
        batched = sum(len(v) for v in groups.values() if len(v) > 1)
        return PassResult(gm, True, f"{batched} ops in {made} batched op(s)", declined)


def _batch(gm: fx.GraphModule, chunk: list[fx.Node]) -> None:
    graph = gm.graph
    output = next(n for n in graph.nodes if n.op == "output")
    with graph.inserting_before(output):  # placed anywhere; the topological sort fixes order
        inputs = []
        specs = [NewtonSchulzSpec.from_node(node) for node in chunk]
        for spec in specs:
            x = spec.x_node
            if spec.transpose:  # tall: batch its transpose with the wide ones
                x = _call(graph, aten.permute.default, (x, [1, 0]), _t(x.meta["val"]))
            inputs.append(x)
        first = chunk[0]
        vals = [x.meta["val"] for x in inputs]
        stacked = _call(graph, aten.stack.default, (inputs,), torch.stack(vals))
        args = specs[0].replace(x=stacked, transpose=False).to_args()
        out_vals = [n.meta["val"] for n in chunk]
        wide_outs = [_t(v) if s.transpose else v for s, v in zip(specs, out_vals)]
        batched = _call(graph, first.target, args, torch.stack(wide_outs))
        batched.meta.update({k: v for k, v in first.meta.items() if k.startswith("hocompile.decision")})
        parts = _call(graph, aten.unbind.int, (batched,), list(wide_outs))
        for i, (node, spec) in enumerate(zip(chunk, specs)):
            part = _call(graph, operator.getitem, (parts, i), wide_outs[i])
            if spec.transpose:
                part = _call(graph, aten.permute.default, (part, [1, 0]), out_vals[i])
            node.replace_all_uses_with(part)
    for node in chunk:
        graph.erase_node(node)


def _t(val: Any) -> Any:
    return val.permute(1, 0)


def _call(graph: fx.Graph, target: Any, args: tuple[Any, ...], val: Any) -> fx.Node:
    node = graph.call_function(target, args)
    node.meta["val"] = val
    return node
