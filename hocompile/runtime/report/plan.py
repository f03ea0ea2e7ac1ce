"""hocompile.plan(opt, target=...): what the passes would decide, without compiling or running.

It captures the step and runs the pass pipeline for a target that need not
be this machine (``target="sm100"`` on a laptop), then prints each
Newton–Schulz op's plan: algorithm, symmetric products, and the
per-iteration precision schedule with its predicted error and time; then
each registered op family's cost (FLOPs, bytes, predicted time). Nothing
is lowered and the optimizer is not stepped.

A step stamped per parameter class (classes/stamp.py) is planned on one
representative per class, so params on the ``meta`` device at a frontier
model's true shapes plan in seconds: the report then shows each class, its
members and its plan, the step's cost as the members' sum, a peak-memory
estimate and, given ``world=``, the owner plan ``distributed="replicated"``
would make across that many ranks (planned here, no process group needed).
"""

from __future__ import annotations

from typing import Any

import torch

from ...capture.fused_kernels import runs_as_is
from ...distributed.plan import Item, assign_buckets, assign_by_numel, assign_owners
from ...ir import dtypes
from ...ir.decisions import format_seconds
from ...ir.graph import decisions
from ...ir.registry import registered_calls
from ...lowering.class_programs import CHUNK_BYTES, temporaries_bytes
from ...passes.batch_by_shape import BatchByShape, stack_bytes_of
from ...passes.dist_ownership import BUCKET_BYTES, ITEM_COST, MIN_ITEMS_PER_RANK
from ...settings import Settings
from ...targets import Target
from ..compile_step import compile_step
from ..lower_step import CompiledStep
from ..validate import validate
from .explain import format_amount, predicted_seconds, registered_op_costs
from .reports import PlanReport


def plan(optimizer: torch.optim.Optimizer, world: int | None = None, **settings: Any) -> PlanReport:
    """The plan report (its text, and its facts as fields: reports.py); ``settings`` are
    compile_optimizer's (target, precision, error_budget, schedule, backend).

    ``world``: also plan which of that many data-parallel ranks would orthogonalise each matrix
    (``distributed="replicated"``'s longest-processing-time plan), for a stamped step.
    """
    resolved = Settings.resolve(**settings)
    name = type(optimizer).__name__
    if why := runs_as_is(optimizer):
        return PlanReport.make(f"plan for {name}.step: run as is: {why}\n", optimizer=name, as_is=why)
    validate(optimizer)
    # The compile driver CompiledOptimizer uses, stopped before lowering.
    step = compile_step(optimizer, resolved, lower=False)
    target, records, gm = step.target, step.records, step.gm
    assert target is not None  # compile_step resolved it: no pipeline was given
    lines = [f"plan for {name}.step on {target.describe()}:"]
    facts: dict[str, Any] = {"optimizer": name, "target": target.describe(), "passes": tuple(records)}
    if step.stamp is None:
        if step.stamp_note:
            lines.append(f"  traced whole: {step.stamp_note}")
        lines += [f"  {r.name}: {r.summary}" for r in records]
        plans = decisions(gm)
        lines += [f"  {line}" for line in plans]
        lines += [f"  {line}" for line in registered_op_costs(gm, target)]
        return PlanReport.make("\n".join(lines) + "\n", traced_whole=step.stamp_note, plans=tuple(plans), **facts)
    lines += [f"  {line}" for line in step.stamp.describe()[:1]]
    lines.append(f"  passes (on the representatives, {step.pass_seconds:.2f} s):")
    lines += [f"    {r.name}: {r.summary}" for r in records]
    lines += _classes(optimizer, step, target, resolved)
    lines += _memory(optimizer, step)
    if world:
        lines += _ownership(step, world)
    classes = tuple(cls.describe() for cls in step.stamp.classes)
    return PlanReport.make("\n".join(lines) + "\n", stamped=True, classes=classes, **facts)


def _stacks(node: Any, family: Any, count: int, target: Target, settings: Settings) -> str:
    """How batch-by-shape would stack a class's ``count`` calls on a target that stacks (its caps:
    max_batch, max_stack_bytes or the target's bytes); empty where it would not."""
    rule = family.batch
    if not target.prefers_batched or rule is None or count < 2 or node.meta["val"].dim() != 2:
        return ""
    limit = settings.max_stack_bytes if settings.max_stack_bytes is not None else target.stack_bytes
    per_call = stack_bytes_of(rule, node, family.spec_of(node))
    cap = max(1, min(settings.max_batch or BatchByShape.max_batch, count, limit // max(1, per_call)))
    return f", in {-(-count // cap):,} stack(s) of {cap:,} at most"


def _classes(opt: torch.optim.Optimizer, step: CompiledStep, target: Target, settings: Settings) -> list[str]:
    assert step.stamp is not None and step.programs is not None
    lines = ["  classes:"]
    total_flops = total_s = 0.0
    timed = True
    for k, (cls, program) in enumerate(zip(step.stamp.classes, step.programs[1])):
        count = len(cls.members)
        lines.append(f"    c{k}: {cls.describe()}")
        for line in decisions(program.gm):
            lines.append(f"      {line}")
        for node, family in registered_calls(program.gm.graph):
            cost = family.cost(family.spec_of(node))
            seconds = predicted_seconds(node, cost.matmul_flops, target)
            total_flops += cost.flops * count
            if seconds is None:
                timed = False
            else:
                total_s += seconds * count
            each = format_amount(cost.flops, "FLOP") + (f", {format_seconds(seconds)}" if seconds is not None else "")
            lines.append(
                f"      {family.title}: {each} per member; x{count:,} = {format_amount(cost.flops * count, 'FLOP')}"
                + (f", {format_seconds(seconds * count)} predicted" if seconds is not None else "")
                + _stacks(node, family, count, target, settings)
            )
    step_line = f"  the step: {format_amount(total_flops, 'FLOP')} in registered ops"
    if timed and total_flops:
        step_line += f", {format_seconds(total_s)} predicted on {target.name} one call at a time"
        if target.prefers_batched:
            step_line += " (this target stacks the members of a class per call)"
    return lines + [step_line]


def _bytes(t: Any) -> int:
    return int(t.numel() * t.element_size()) if isinstance(t, torch.Tensor) else 0


def _memory(opt: torch.optim.Optimizer, step: CompiledStep) -> list[str]:
    """Params, grads and state (as they are now, and the state the step creates), and the largest
    temporaries of one call: a list-mode call holds CHUNK_BYTES' worth of members at most."""
    assert step.stamp is not None and step.programs is not None
    persistent = created = 0
    worst = 0
    for cls, program in zip(step.stamp.classes, step.programs[1]):
        p = opt.param_groups[cls.group]["params"][cls.rep]
        own = _bytes(p) + _bytes(p.grad) + sum(_bytes(v) for v in opt.state.get(p, {}).values())
        output = next(n for n in reversed(program.gm.graph.nodes) if n.op == "output")
        values = list(output.args[0])[program.exports :]
        new = sum(_bytes(v.meta.get("val")) for a, v in zip(program.outputs, values) if a.mode == "assign")
        persistent += own * len(cls.members)
        created += new * len(cls.members)
        per_member = temporaries_bytes(program.gm)
        chunk = min(len(cls.members), max(1, CHUNK_BYTES // max(1, per_member)))
        worst = max(worst, per_member * chunk)
    total = persistent + created + worst
    return [
        f"  peak memory (estimate): {format_amount(total, 'B')} = params, grads and state "
        f"{format_amount(persistent, 'B')}"
        + (f" + state the step creates {format_amount(created, 'B')}" if created else "")
        + f" + the largest call's temporaries {format_amount(worst, 'B')}"
    ]


def _ownership(step: CompiledStep, world: int) -> list[str]:
    """distributed="replicated"'s owner plan over every member's orthogonalisation (dist_ownership.py's
    costs, buckets and LPT), planned here for ``world`` ranks."""
    assert step.stamp is not None and step.programs is not None
    items: list[Item] = []
    sizes: list[tuple[str, int]] = []
    for k, (cls, program) in enumerate(zip(step.stamp.classes, step.programs[1])):
        for node, family in registered_calls(program.gm.graph):
            if family.name not in ITEM_COST:
                continue
            cost = ITEM_COST[family.name](family.spec_of(node))
            val = node.meta["val"]
            for i in cls.members:
                items.append(Item(f"c{k}.p{i}.{node.name}", tuple(val.shape), dtypes.name(val.dtype), cost))
                sizes.append((dtypes.name(val.dtype), _bytes(val)))
    if not items:
        return [f"  distributed='replicated' at world {world}: no orthogonalisation to share"]
    buckets = assign_buckets(sizes, BUCKET_BYTES * world, MIN_ITEMS_PER_RANK * world)
    items = [Item(i.key, i.shape, i.dtype, i.cost, b) for i, b in zip(items, buckets)]
    owners = assign_owners(items, world)
    by_numel = assign_by_numel(items, world)
    return [f"  distributed='replicated' at world {world}:"] + [f"    {line}" for line in owners.summary()] + [
        f"  Megatron 0.19's layer-wise rule at world {world} (matrices by element count, largest first, to the "
        f"rank holding fewest): its slowest rank {by_numel.imbalance():.3f}x the ideal, hocompile's plan "
        f"(by NS cost, max·min²) {owners.imbalance():.3f}x: {max(by_numel.loads) / max(owners.loads):.2f}x "
        "the time to the last rank's orthogonalisation"
    ]


__all__ = ["plan"]
