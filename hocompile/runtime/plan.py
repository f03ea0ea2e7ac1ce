"""hocompile.plan(opt, target=...): what the passes would decide, without compiling or running.

It captures the step and runs the pass pipeline for a target that need not
be this machine (``target="sm100"`` on a laptop), then prints each
Newton–Schulz op's plan: algorithm, symmetric products, and the
per-iteration precision schedule with its predicted error and time; then
each registered op family's cost (FLOPs, bytes, predicted time). Nothing
is lowered and the optimizer is not stepped.
"""

from __future__ import annotations

from typing import Any

import torch

from ..graph import decisions
from ..settings import Settings
from .compile_step import compile_step
from .explain import registered_op_costs
from .validate import validate


def plan(optimizer: torch.optim.Optimizer, **settings: Any) -> str:
    """The plan report; ``settings`` are compile_optimizer's (target, precision, error_budget, schedule, backend)."""
    resolved = Settings.resolve(**settings)
    validate(optimizer)
    # The compile driver CompiledOptimizer uses, stopped before lowering.
    step = compile_step(optimizer, resolved, lower=False)
    target, records, gm = step.target, step.records, step.gm
    assert target is not None  # compile_step resolved it: no pipeline was given
    lines = [f"plan for {type(optimizer).__name__}.step on {target.describe()}:"]
    lines += [f"  {r.name}: {r.summary}" for r in records]
    lines += [f"  {line}" for line in decisions(gm)]
    lines += [f"  {line}" for line in registered_op_costs(gm, target)]
    return "\n".join(lines) + "\n"
