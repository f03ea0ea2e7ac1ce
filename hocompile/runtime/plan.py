"""hocompile.plan(opt, target=...): what the passes would decide, without compiling or running.

It captures the step and runs the pass pipeline for a target that need not
be this machine (``target="sm100"`` on a laptop), then prints each
Newton–Schulz op's plan: algorithm, symmetric products, and the
per-iteration precision schedule with its predicted error and time. Nothing
is lowered and the optimizer is not stepped.
"""

from __future__ import annotations

from typing import Any

import torch

from ..capture import capture
from ..graph import decisions
from ..passes import default_pipeline, run_pipeline
from ..settings import Settings
from ..targets import resolve_target
from .compiled_optimizer import _kernel_formats
from .validate import validate


def plan(optimizer: torch.optim.Optimizer, **settings: Any) -> str:
    """The plan report; ``settings`` are compile_optimizer's (target, precision, error_budget, schedule, backend)."""
    resolved = Settings.resolve(**settings)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    device = params[0].device if params else torch.device("cpu")
    target = resolve_target(resolved.target, resolved.cache_dir, device)
    triton = resolved.backend == "triton" or (resolved.backend == "auto" and device.type == "cuda")
    validate(optimizer)
    with torch.no_grad():
        captured = capture(optimizer, resolved.structural_keys)
    pipeline = default_pipeline(
        target,
        resolved.precision,
        force_batch=triton,
        error_budget=resolved.error_budget,
        schedule=resolved.schedule,
        kernel_formats=_kernel_formats(triton, device),
        max_batch=resolved.max_batch,
        max_stack_bytes=resolved.max_stack_bytes,
    )
    gm, records = run_pipeline(captured.gm, pipeline, resolved.disabled_passes, None)
    lines = [f"plan for {type(optimizer).__name__}.step on {target.describe()}:"]
    lines += [f"  {r.name}: {r.summary}" for r in records]
    lines += [f"  {line}" for line in decisions(gm)]
    return "\n".join(lines) + "\n"
