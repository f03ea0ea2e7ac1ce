"""hocompile.explain(opt): what was compiled, how, and what it cost.

Besides the passes and their decisions (:mod:`hocompile.ir.decisions`), it
shows per registered op family (:mod:`hocompile.ir.registry`) what the step's
calls of it cost: the family's own ``cost(spec)`` and, where the target has a
rate for it, the predicted time; a family added outside hocompile shows up
with no edit here. ``measure=True`` also runs each compiled step on copies
of the optimizer's tensors and shows each family's measured time next to its
prediction (:mod:`hocompile.runtime.report.measure_step`).
"""

from __future__ import annotations

from typing import Any

import torch.fx as fx

from ...capture.scalars import Expr
from ...distributed.replicated import DIST_PLAN, OwnershipPlan
from ...ir import dtypes
from ...ir.decisions import decisions_of, format_seconds
from ...ir.graph import ROLE
from ...ir.registry import OpFamily, registered_calls
from ...passes.pipeline import pipeline_target
from ...targets import Target
from ..compiled_optimizer import CompiledEntry, CompiledOptimizer
from ..wrappers import compiled_inside
from .measure_step import StepMeasurement, measure_entry
from .reports import Explanation, ProgramReport


def explain(opt: object, measure: bool = False) -> Explanation:
    """The compiled steps, their passes, plans and costs: a report whose text is printed and whose
    fields (reports.py) say the same as data. ``measure=True``: time each compiled step's registered
    ops on copies of the current params, grads and state (call it after ``backward()``, while the
    grads are set); the optimizer itself is left as it was."""
    if not isinstance(opt, CompiledOptimizer):
        inside = compiled_inside(opt)
        if not inside:
            raise TypeError(f"explain() takes the result of compile_optimizer(), got {type(opt).__name__}")
        # A training stack's wrapper (runtime/wrappers.py): each optimizer compiled inside it, in step order.
        head = f"{type(opt).__name__}: {len(inside)} optimizer(s) compiled inside, stepped by its own step()\n"
        parts = tuple(explain(one, measure) for one in inside)
        text = head + "".join(f"\n[{k}] " + part for k, part in enumerate(parts))
        return Explanation.make(text, optimizer=f"{type(opt).__module__}.{type(opt).__name__}", inside=parts)
    inner = opt.optimizer
    facts: dict[str, Any] = {
        "optimizer": f"{type(inner).__module__}.{type(inner).__name__}", "steps": opt.steps,
        "counters": opt.counters.as_dict(), "runs_eagerly": opt.passthrough, "as_is": opt.as_is,
    }
    if opt.passthrough:
        text = f"hocompile: {type(inner).__name__}: every step runs eagerly ({opt.passthrough}); {opt.steps} steps\n"
        return Explanation.make(text, **facts)
    n_params = sum(len(g["params"]) for g in inner.param_groups)
    c = opt.counters
    lines = [
        f"hocompile: {type(inner).__module__}.{type(inner).__name__}, "
        f"{len(inner.param_groups)} param group(s), {n_params} params, {opt.steps} steps",
        f"counters: compiles {c.compiles}, recompiles {len(c.recompiles)}, cache hits {c.cache_hits}, "
        f"disk hits {c.disk_hits}, eager fallbacks {c.eager_fallbacks}"
        + (f", branch variants {len(c.variants)}" if c.variants else "")
        + (f", run as is {c.as_is}" if c.as_is else ""),
    ]
    if opt.as_is:
        lines.append(f"run as is: {opt.as_is}")
    elif not opt.history:
        lines.append("nothing compiled yet: the first step() compiles")
    target = pipeline_target(opt.pipeline) if opt.history else None
    programs = []
    for number, entry in enumerate(opt.history, start=1):
        measured = measure_entry(opt.optimizer, entry) if measure else None
        program = program_report(number, entry)
        lines += [""] + _entry(program, entry, target, measured)
        programs.append(program)
    if c.recompiles:
        lines += ["", "recompiles:"] + [f"  - {r}" for r in c.recompiles]
    if c.variants:
        lines += ["", "branch variants (one program per outcome of a host-number branch):"]
        lines += [f"  - {r}" for r in c.variants]
    return Explanation.make("\n".join(lines) + "\n", programs=tuple(programs), **facts)


def program_report(number: int, entry: CompiledEntry) -> ProgramReport:
    """``entry``'s facts, as the text of :func:`_entry` states them."""
    lowered, run, checked = entry.lowered, entry.stamped, entry.self_check
    compiled = entry.captured is not None and lowered is not None
    return ProgramReport(
        number=number,
        reason=entry.reason,
        compile_seconds=entry.compile_seconds,
        eager=entry.fallback,
        stamped=run is not None,
        traced_whole=entry.stamp_note if run is None else "",
        classes=tuple(cls.describe() for cls in run.stamp.classes) if run is not None else (),
        verification=entry.verification.describe() if entry.verification.steps else "",
        self_check=checked.describe() if checked.runs and (checked.checks or checked.skipped) else "",
        passes=tuple(entry.passes) if compiled else (),
        plans=tuple(entry.decisions) if compiled else (),
        backend=lowered.backend if lowered is not None and compiled else "",
        launches=lowered.launches if lowered is not None and lowered.backend == "triton" else 0,
        cache_key=lowered.key[:16] if lowered is not None else "",
    )


def _entry(
    program: ProgramReport, entry: CompiledEntry, target: Target | None, measured: StepMeasurement | None
) -> list[str]:
    """The text of one compiled step; what ``program`` holds as fields is printed from it."""
    head = f"compiled step #{program.number} ({program.reason}): {program.compile_seconds:.2f} s"
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
    lines += _stamping(entry)
    if program.verification:  # verify=N (runtime/check/verify.py)
        lines.append(f"  {program.verification}" + ("; runs eagerly from then on" if program.eager else ""))
    if program.self_check:  # runtime/check/self_check.py
        lines.append(f"  {program.self_check}" + ("; runs eagerly from then on" if entry.self_check.failed else ""))
    final = entry.final_stats
    if final:
        lines.append(
            f"  after passes: {final['ops']} ops ({final['matmuls']} matmuls, {final['newton-schulz']} newton_schulz)"
        )
    if cap.reads:
        lines.append(
            f"  split at {len(cap.reads)} host read{'s' if len(cap.reads) != 1 else ''} (each computed first, "
            "then read on the host: one sync, as eager reads it):"
        )
        lines += [f"    {read.describe()}" for read in cap.reads]
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
    ownership = cap.gm.meta.get(DIST_PLAN)  # the passes rewrite the captured graph in place
    if isinstance(ownership, OwnershipPlan):
        lines.append("  distributed:")
        lines += [f"    {line}" for line in ownership.describe()]
    if entry.decisions:
        lines.append("  plans:")
        lines += [f"    {d}" for d in entry.decisions]
    costs = registered_op_costs(cap.gm, target, measured)
    if costs:
        lines.append("  registered ops (cost per step):")
        lines += [f"    {line}" for line in costs]
    if measured is not None:
        if measured.skipped:
            lines.append(f"  measured: not measured, {measured.skipped}")
        else:
            in_ops = sum(measured.per_op_s.values())
            lines.append(
                f"  measured: {format_seconds(measured.step_s)} per step on copies of the current tensors "
                f"(registered ops {format_seconds(in_ops)}, everything else {format_seconds(measured.step_s - in_ops)})"
            )
    lowered = entry.lowered
    origin = "from disk cache" if lowered.from_disk else "generated"
    lines.append(f"  lowering: {lowered.backend}, {origin}: {lowered.path}")
    if lowered.backend == "triton":
        graph = "; replayed from a CUDA graph" if lowered.graphed else ""
        lines.append(f"  launches per step: {lowered.launches}{graph}")
        lines += [f"    {unit}" for unit in lowered.units]
        lines.append(f"  kernels ({len(lowered.kernels)}; sources: opt.kernels()):")
        lines += [f"    {k.name}  [{k.family}]  {k.origin}" for k in lowered.kernels]
    lines.append(f"  cache key: {program.cache_key}")
    return lines


def _stamping(entry: CompiledEntry) -> list[str]:
    """How the step was traced: per parameter class (classes/stamp.py), or whole and why."""
    run = entry.stamped
    if run is None:
        return [f"  traced whole: {entry.stamp_note}"] if entry.stamp_note else []
    lines = ["  stamped: " + run.stamp.describe()[0]]
    for (k, cls), program in zip(enumerate(run.stamp.classes), run.programs):
        how = "one call over lists of members" if program.list_mode else "one call per member"
        if program.list_mode_note:
            how += f" ({program.list_mode_note})"
        lines.append(f"    c{k}: {cls.describe()}; {how}")
    return lines


def registered_op_costs(
    gm: fx.GraphModule, target: Target | None, measured: StepMeasurement | None = None
) -> list[str]:
    """One line per registered op family in ``gm``: title, calls, FLOPs, bytes, predicted
    (and, given ``measured``, measured) time.

    A call's time is the prediction of its last applied decision (choose-
    precision refines choose-algorithm) where a pass planned it, else its
    GEMM FLOPs at the target's rate for the call's output dtype; a family's
    time is shown only when every call has one.
    """
    groups: dict[str, tuple[OpFamily, list[fx.Node]]] = {}
    for node, family in registered_calls(gm.graph):
        groups.setdefault(family.name, (family, []))[1].append(node)
    lines = []
    for family, nodes in groups.values():
        costs = [family.cost(family.spec_of(node)) for node in nodes]
        flops = sum(c.flops for c in costs)
        matmul = sum(c.matmul_flops for c in costs)
        moved = sum(c.bytes for c in costs)
        text = f"{family.title} (hocompile.{family.name}) x{len(nodes)}: {format_amount(flops, 'FLOP')}"
        if matmul:
            text += " (all in GEMMs)" if matmul == flops else f" ({format_amount(matmul, 'FLOP')} in GEMMs)"
        text += f", {format_amount(moved, 'B')} read and written"
        times = [predicted_seconds(node, cost.matmul_flops, target) for node, cost in zip(nodes, costs)]
        if target is not None and times and all(t is not None for t in times):
            text += f", {format_seconds(sum(t for t in times if t is not None))} predicted on {target.name}"
        if measured is not None and family.name in measured.per_op_s:
            text += f", {format_seconds(measured.per_op_s[family.name])} measured"
        lines.append(text)
    return lines


def predicted_seconds(node: fx.Node, matmul_flops: float, target: Target | None) -> float | None:
    applied = [d for d in decisions_of(node) if d.applied]
    if applied:  # the op runs as the last applied plan says (None: that plan predicted no time)
        return applied[-1].predicted_s
    val: Any = node.meta.get("val")
    name = dtypes.name(val.dtype) if hasattr(val, "dtype") else ""
    if target is None or not matmul_flops or name not in target.gflops:
        return None  # no rate known: a bandwidth model is not part of Target
    return matmul_flops / (target.gflops[name] * 1e9)


def format_amount(value: float, unit: str) -> str:
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= scale:
            return f"{value / scale:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"
