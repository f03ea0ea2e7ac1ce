"""hocompile.explain(opt): what was compiled, how, and what it cost."""

from __future__ import annotations

from ..graph import ROLE
from ..scalars import Expr
from .compiled_optimizer import CompiledEntry, CompiledOptimizer


def explain(opt: CompiledOptimizer) -> str:
    if not isinstance(opt, CompiledOptimizer):
        raise TypeError(f"explain() takes the result of compile_optimizer(), got {type(opt).__name__}")
    inner = opt.optimizer
    if opt._passthrough:
        return f"hocompile: {type(inner).__name__}: every step runs eagerly ({opt._passthrough}); {opt.steps} steps\n"
    n_params = sum(len(g["params"]) for g in inner.param_groups)
    c = opt.counters
    lines = [
        f"hocompile: {type(inner).__module__}.{type(inner).__name__}, "
        f"{len(inner.param_groups)} param group(s), {n_params} params, {opt.steps} steps",
        f"counters: compiles {c.compiles}, recompiles {len(c.recompiles)}, cache hits {c.cache_hits}, "
        f"disk hits {c.disk_hits}, eager fallbacks {c.eager_fallbacks}",
    ]
    if not opt.history:
        lines.append("nothing compiled yet: the first step() compiles")
    for number, entry in enumerate(opt.history, start=1):
        lines += [""] + _entry(number, entry)
    if c.recompiles:
        lines += ["", "recompiles:"] + [f"  - {r}" for r in c.recompiles]
    return "\n".join(lines) + "\n"


def _entry(number: int, entry: CompiledEntry) -> list[str]:
    head = f"compiled step #{number} ({entry.reason}): {entry.compile_seconds:.2f} s"
    if entry.captured is None or entry.lowered is None:
        return [head, f"  runs eagerly: {entry.fallback}"]
    cap = entry.captured
    stats = cap.stats
    lines = [
        head + f" (capture {cap.trace_seconds:.2f} s, passes {entry.pass_seconds * 1e3:.1f} ms, "
        f"lowering {entry.lower_seconds * 1e3:.1f} ms)",
        f"  captured: {stats['tensor inputs']} tensor inputs, {stats['host scalars']} host scalars, "
        f"{stats['ops']} ops ({stats['matmuls']} matmuls), {len(cap.outputs)} outputs written back",
    ]
    if entry.verification.steps:  # verify=N (runtime/verify.py)
        lines.append(f"  {entry.verification.describe()}" + ("; runs eagerly from then on" if entry.fallback else ""))
    final = entry.final_stats
    if final:
        lines.append(
            f"  after passes: {final['ops']} ops ({final['matmuls']} matmuls, "
            f"{final['newton-schulz']} newton_schulz)"
        )
    scalars = [n for n in cap.gm.graph.nodes if n.op == "placeholder" and isinstance(n.meta.get(ROLE), Expr)]
    if scalars:
        lines.append("  host scalars (evaluated before each step, in eager's order):")
        lines += [f"    {n.name} = {n.meta[ROLE].pretty()}" for n in scalars]
    if cap.guards:
        lines.append("  guards on hyperparameter branches:")
        lines += [f"    {g.describe()}" for g in cap.guards]
    for note in cap.notes:
        lines.append(f"  note: {note}")
    if cap.host_updates:
        lines.append("  python state the step updates (replayed on the host after each step):")
        lines += [f"    {u.describe()}" for u in cap.host_updates]
    lines.append("  passes:")
    width = max((len(r.name) for r in entry.passes), default=0)
    for r in entry.passes:
        lines.append(f"    {r.name:<{width}}  {r.status:<9}  {r.seconds * 1e3:6.1f} ms  {r.summary}")
    if entry.decisions:
        lines.append("  plans:")
        lines += [f"    {d}" for d in entry.decisions]
    lowered = entry.lowered
    origin = "from disk cache" if lowered.from_disk else "generated"
    lines.append(f"  lowering: {lowered.backend}, {origin}: {lowered.path}")
    if lowered.backend == "triton":
        graph = "; replayed from a CUDA graph" if lowered.graphed else ""
        lines.append(f"  launches per step: {lowered.launches}{graph}")
        lines += [f"    {unit}" for unit in lowered.units]
        lines.append(f"  kernels ({len(lowered.kernels)}; sources: opt.kernels()):")
        lines += [f"    {k.name}  [{k.family}]  {k.origin}" for k in lowered.kernels]
    lines.append(f"  cache key: {entry.lowered.key[:16]}")
    return lines
