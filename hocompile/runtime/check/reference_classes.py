"""verify=N for a stamped step: the fp64 references of reference_step.py, one member at a time.

A stamped step's graphs are one program per parameter class (lowering/class_programs.py),
so its references are too: eager's program (the representatives' step re-captured, before
any pass, and split the same way) and the compiled programs, each run in fp64 for every
member of its class with that member's tensors and host scalars. The error model is
reference_step.py's, unchanged.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ...capture.host_state import HostSlot
from ...capture.trace import capture, slot_tensor
from ...classes.separable import split_foreach
from ...classes.stamp import trace_view
from ...ir.declined import Declined
from ...ir.graph import InputSlot
from ...lowering.class_programs import Program, split_programs
from ..stamped import StampedRun, member_scalars
from .reference_step import Float64Run, References, copied_outputs, plan_downstream, widened_copy

if TYPE_CHECKING:
    from ..entries import CompiledEntry, StepRunner


def member_slot(slot: InputSlot, index: int) -> InputSlot:
    """The representative's slot as member ``index`` has it."""
    return slot.of_member(index)


def stamped_planned(run: StampedRun) -> frozenset[InputSlot]:
    """Every member's slots whose value depends on a ``hocompile::`` op of its class's program."""
    out: set[InputSlot] = set()
    for cls, program in zip(run.stamp.classes, run.programs):
        for slot in _program_planned(program):
            out |= {member_slot(slot, i) for i in cls.members}
    return frozenset(out)


def _program_planned(program: Program) -> set[InputSlot]:
    downstream = plan_downstream(program.gm)
    return {slot for slot, value, _ in _outputs(program) if value in downstream}


def _outputs(program: Program) -> list[tuple[InputSlot, Any, int | None]]:
    """(the representative's slot, value node, position among returned values or None: copied in place)."""
    gm = program.gm
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    values = list(output.args[0])
    lowered = program.lowered
    kept = lowered.kept if lowered is not None else list(range(len(values)))
    found: list[tuple[InputSlot, Any, int | None]] = [
        (program.outputs[j - program.exports].slot, value, position)
        for position, (j, value) in enumerate(zip(kept, values))
        if j >= program.exports
    ]
    return found + copied_outputs(gm)


def expand_host_slots(run: StampedRun, slots: list[HostSlot]) -> list[HostSlot]:
    return [s for slot in slots for s in run.stamp.member_slots(slot)]


# Members per class whose plan-dependent tensors a verified step compares with fp64 references:
# they all run the class's one program, so a wrong program (a stale warm-start record, a pass bug)
# shows on any of them; the rest is compared where the plan keeps eager's arithmetic (bitwise).
SAMPLE = 4


def sample(members: tuple[int, ...]) -> list[int]:
    """The first, the last and evenly spaced members in between."""
    if len(members) <= SAMPLE:
        return list(members)
    picks = {round(k * (len(members) - 1) / (SAMPLE - 1)) for k in range(SAMPLE)}
    return [members[k] for k in sorted(picks)]


def stamped_references(
    runner: StepRunner, entry: CompiledEntry, planned: frozenset[InputSlot]
) -> References:
    run = entry.stamped
    assert run is not None and entry.captured is not None
    inner = runner.optimizer
    env = runner.host_env(entry.captured)
    reference = capture(inner, runner.settings.structural_keys, trace_view(inner, list(run.stamp.classes), 1))
    split_foreach(reference.gm)
    found = split_programs(reference, reference.gm, run.stamp)
    if isinstance(found, Declined):
        raise RuntimeError(f"eager's program is not one per class: {found.reason}")
    refs = References()
    for into, programs, nominal in (
        (refs.exact, found, False),
        (refs.plan, (run.global_program, run.programs), False),
        (refs.nominal, (run.global_program, run.programs), True),
    ):
        shared, per_class = programs
        exports = _run_float64(inner, shared, env, None, nominal, {})
        for cls, program, host in zip(run.stamp.classes, per_class, run.hosts):
            for i in sample(cls.members):
                scalars = member_scalars(inner, host, cls.group, i, env)
                _run_float64(inner, program, env, (cls.group, i, scalars, exports), nominal, into, planned)
    sampled = {(c.group, i) for c in run.stamp.classes for i in sample(c.members)}
    refs.unsampled = {slot for slot in planned if (slot.group, slot.index) not in sampled}
    for slot in planned - refs.unsampled:
        try:
            refs.before[slot] = widened_copy(slot_tensor(inner, slot).detach())
        except (KeyError, IndexError):  # state the step creates
            pass
    return refs


def _run_float64(
    opt: torch.optim.Optimizer,
    program: Program,
    env: dict[str, Any],
    member: tuple[int, int, tuple[Any, ...], list[Any]] | None,
    nominal: bool,
    into: dict[InputSlot, torch.Tensor],
    planned: frozenset[InputSlot] = frozenset(),
) -> list[Any]:
    """``program`` in fp64 for one member (None: the shared part); the planned results go ``into``."""
    inputs: list[Any] = []
    by_slot: dict[InputSlot, torch.Tensor] = {}
    scalars = iter(member[2]) if member is not None else None
    for src in program.inputs:
        if src.kind == "scalar":
            assert src.expr is not None
            inputs.append(next(scalars) if scalars is not None else src.expr.evaluate(env))
        elif src.kind == "global":
            assert member is not None
            inputs.append(member[3][src.index])
        else:
            assert src.slot is not None
            slot = member_slot(src.slot, member[1]) if member is not None and src.kind == "member" else src.slot
            tensor = widened_copy(slot_tensor(opt, slot))
            by_slot[src.slot] = tensor
            inputs.append(tensor)
    values = list(Float64Run(program.gm, nominal).run(*inputs))
    if member is None:
        return values[: program.exports]
    for slot, _, position in _outputs(program):
        mine = member_slot(slot, member[1])
        if mine in planned:
            into[mine] = by_slot[slot] if position is None else values[position]
    return []
