"""Measured cost of a compiled step, per registered op family: what ``explain(opt, measure=True)`` shows.

The family lines of explain() predict each group's time from the target's
GEMM rates; a solver (LAPACK QR, SVD, eigh) has no such rate, and a
prediction is only a model. Measuring runs the compiled step's generated
module on *copies* of the optimizer's current params, grads and state (the
optimizer itself is not touched) under ``torch.profiler`` and sums, per
``hocompile::`` op, the wall time of its calls (the per-matrix thread pool's
work included, since the call waits for it); the rest of the step is
reported as one line. Best of ``repeats`` runs.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch.profiler import ProfilerActivity, profile

from ...capture.trace import step_tensors
from ..entries import CompiledEntry, host_env


@dataclass
class StepMeasurement:
    """Seconds per run of the whole step and per registered op (``"power_qr"``: 0.012)."""

    step_s: float = float("inf")
    per_op_s: dict[str, float] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)
    skipped: str = ""  # why it was not measured ("" when it was)


def measure_entry(opt: torch.optim.Optimizer, entry: CompiledEntry, repeats: int = 3) -> StepMeasurement:
    """Run ``entry``'s lowered step ``repeats`` times on copies of ``opt``'s tensors; best of each."""
    captured, lowered = entry.captured, entry.lowered
    if captured is None or lowered is None:
        return StepMeasurement(skipped="runs eagerly")
    if entry.stamped is not None:
        return StepMeasurement(skipped="a stamped step (one program per parameter class) is not measured per op yet")
    try:
        env = host_env(opt, captured)
        originals = step_tensors(opt, captured.inputs, env)
        scalars = list(captured.scalars(env))
    except (KeyError, IndexError, AttributeError, TypeError) as exc:
        # Typically grads set to None after the step (zero_grad) or state this entry predates.
        return StepMeasurement(skipped=f"its inputs are not all present now ({type(exc).__name__}: {exc})")
    if any(t is None for t in originals):
        return StepMeasurement(skipped="a grad is None now: call explain(measure=True) after backward()")
    result = StepMeasurement()
    for _ in range(max(1, repeats)):
        copies = [t.detach().clone() for t in originals]
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            with torch.profiler.record_function("hocompile.step"):
                lowered.run(copies + scalars)
        per_op: dict[str, float] = defaultdict(float)
        calls: dict[str, int] = defaultdict(int)
        step_us = 0.0
        for event in prof.events():
            if event.name == "hocompile.step":
                step_us = max(step_us, event.cpu_time_total)
            elif event.name.startswith("hocompile::"):
                name = event.name.split("::", 1)[1]
                per_op[name] += event.cpu_time_total
                calls[name] += 1
        if step_us * 1e-6 < result.step_s:
            result.step_s = step_us * 1e-6
            result.per_op_s = {k: v * 1e-6 for k, v in per_op.items()}
            result.calls = dict(calls)
    return result


__all__ = ["StepMeasurement", "measure_entry"]
