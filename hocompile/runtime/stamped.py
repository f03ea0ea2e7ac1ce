"""Running a stamped step: the global program once, each class's program once per member.

What is per member besides its tensors: the host scalars computed from its
own counters (``g0.p*.state.step``), the guards on them, the Python state
numbers the step rewrites, and whether the step clears its grad. All of it
is evaluated for every member before any program runs, so a guard that
fails, or a host expression that raises, leaves params and state as they
were (as on a step traced whole). Members at the same counter values share
one evaluation: a step's members usually are.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any

import torch

from ..capture.finish import OutputAction
from ..capture.host_state import MISSING, HostSlot, HostUpdate
from ..capture.scalars import Expr, Guard, ScalarProgram, build_scalar_program
from ..capture.slots import member_tensor
from ..capture.trace import CapturedStep, slot_tensor
from ..classes.separable import GLOBAL, expr_members, generic_name, member_of_name
from ..classes.stamp import Stamp
from ..lowering.class_programs import Program


@dataclass
class ClassHost:
    """A class's per-member host work, in names generic over its members."""

    names: tuple[str, ...]  # generic member inputs, e.g. ("g0.p*.state.step",)
    reads: tuple[tuple[str, bool], ...]  # per name: (state key, read with .item())
    scalars: ScalarProgram  # the class program's scalar inputs, in order
    guards: tuple[Guard, ...]
    updates: tuple[HostUpdate, ...]  # slots in the representative's index
    clears_grad: bool
    per_member: tuple[bool, ...]  # per scalar input of the program: computed from the member's own counters


@dataclass
class StampedRun:
    """Everything a stamped entry runs, built once per compile."""

    stamp: Stamp
    global_program: Program
    programs: list[Program]
    hosts: list[ClassHost]
    shared_guards: tuple[Guard, ...]
    shared_updates: tuple[HostUpdate, ...]
    _memo: dict[Any, Any] = field(default_factory=dict, repr=False)


def _generic(names: set[str]) -> dict[str, str]:
    return {n: generic_name(n) for n in names if member_of_name(n) is not None}


def build_run(captured: CapturedStep, stamp: Stamp, global_program: Program, programs: list[Program]) -> StampedRun:
    counters = {c.name: c.slot.key for c in captured.counters}
    member_guards: dict[tuple[int, int], list[Guard]] = {}
    shared_guards: list[Guard] = []
    for guard in captured.guards:
        names = guard.lhs.inputs() | guard.rhs.inputs()
        members = {m for m in map(member_of_name, names) if m is not None}
        if members:
            (member,) = members  # stamp.py proved a guard reads one member at most
            mapping = _generic(names)
            member_guards.setdefault(member, []).append(
                Guard(guard.lhs.renamed(mapping), guard.op, guard.rhs.renamed(mapping), guard.outcome)
            )
        else:
            shared_guards.append(guard)
    member_updates: dict[tuple[int, int], list[HostUpdate]] = {}
    shared_updates: list[HostUpdate] = []
    for update in captured.host_updates:
        slot = update.slot
        if slot.kind == "state":
            expr = update.expr.renamed(_generic(update.expr.inputs())) if update.expr is not None else None
            member_updates.setdefault((slot.group, slot.index), []).append(HostUpdate(slot, expr, update.constant))
        else:
            shared_updates.append(update)
    clears = set(captured.clears_grads)
    hosts = []
    for program in programs:
        exprs = [src.expr for src in program.inputs if src.kind == "scalar" and src.expr is not None]
        mapping = _generic(set().union(*(e.inputs() for e in exprs)) if exprs else set())
        guards = tuple(member_guards.get(program.member, ()))
        updates = tuple(member_updates.get(program.member, ()))
        generic = [e.renamed(mapping) for e in exprs]
        used: set[str] = set()
        for e in generic + [g.lhs for g in guards] + [g.rhs for g in guards]:
            used |= e.inputs()
        for u in updates:
            used |= u.expr.inputs() if u.expr is not None else set()
        member_names = tuple(sorted(n for n in used if n.startswith(f"g{program.member[0]}.p*.state.")))
        reads = []
        for name in member_names:
            key = name.split(".state.", 1)[1]
            rep_name = name.replace(".p*.", f".p{program.member[1]}.", 1)
            reads.append((key, rep_name in counters))
        per_member = tuple(bool(expr_members(e)) for e in exprs)
        scalars = build_scalar_program(generic)
        clears_grad = program.member in clears
        hosts.append(ClassHost(member_names, tuple(reads), scalars, guards, updates, clears_grad, per_member))
    return StampedRun(stamp, global_program, programs, hosts, tuple(shared_guards), tuple(shared_updates))


def broken_guard(opt: torch.optim.Optimizer, run: StampedRun, env: dict[str, Any]) -> Guard | None:
    """The first guard that no longer holds, for the whole step or for any member; None if all do."""
    broken = next((g for g in run.shared_guards if not g.holds(env)), None)
    if broken is not None:
        return broken
    for cls, host in zip(run.stamp.classes, run.hosts):
        if not host.guards:
            continue
        params = opt.param_groups[cls.group]["params"]
        for i in cls.members:
            member_env = dict(env)
            member_env.update(zip(host.names, _member_values(opt, params[i], host)))
            broken = next((g for g in host.guards if not g.holds(member_env)), None)
            if broken is not None:
                return broken
    return None


def member_scalars(
    opt: torch.optim.Optimizer, host: ClassHost, g: int, i: int, env: dict[str, Any]
) -> tuple[Any, ...]:
    """The host scalar inputs of member ``i`` of group ``g``'s class program."""
    values = _member_values(opt, opt.param_groups[g]["params"][i], host) if host.names else ()
    return host.scalars({**env, **dict(zip(host.names, values))})


def _member_values(opt: torch.optim.Optimizer, p: torch.Tensor, host: ClassHost) -> tuple[Any, ...]:
    state = opt.state[p]
    return tuple(state[key].item() if item else state[key] for key, item in host.reads)


def run_stamped(opt: torch.optim.Optimizer, run: StampedRun, env: dict[str, Any]) -> bool:
    """One stamped step on ``opt``'s params and state; True if it created state."""
    groups = opt.param_groups
    # Everything host-side first: nothing is written until every member's inputs are known.
    shared_values = [(u.slot, u.value(env)) for u in run.shared_updates]
    plans: list[list[tuple[Any, ...]]] = []
    member_writes: list[tuple[HostSlot, Any]] = []
    for cls, host in zip(run.stamp.classes, run.hosts):
        params = groups[cls.group]["params"]
        memo: dict[tuple[Any, ...], tuple[tuple[Any, ...], list[Any]]] = {}
        scalars_of = []
        for i in cls.members:
            values = _member_values(opt, params[i], host) if host.names else ()
            known = memo.get(values)
            if known is None:
                member_env = dict(env)
                member_env.update(zip(host.names, values))
                known = (host.scalars(member_env), [u.value(member_env) for u in host.updates])
                memo[values] = known
            scalars_of.append(known[0])
            for update, value in zip(host.updates, known[1]):
                member_writes.append((HostSlot("state", update.slot.key, cls.group, i), value))
        plans.append(scalars_of)
    created = False
    exports = _run_global(opt, run.global_program, env)
    for cls, program, host, scalars_of in zip(run.stamp.classes, run.programs, run.hosts, plans):
        params = [groups[cls.group]["params"][i] for i in cls.members]
        if program.list_mode:
            created |= _run_lists(opt, program, host, params, scalars_of, exports)
        else:
            created |= _run_members(opt, program, params, scalars_of, exports)
        if host.clears_grad:
            for p in params:
                p.grad = None
    for slot, value in member_writes + shared_values:
        created = created or slot.read(opt) is MISSING
        slot.write(opt, value)
    return created


def _install(opt: torch.optim.Optimizer, action: OutputAction, p: torch.Tensor, value: torch.Tensor) -> bool:
    """A kept output of a member's program put in place; True if it created state."""
    if action.mode == "copy":
        member_tensor(opt, action.slot, p).copy_(value)
        return False
    opt.state[p][action.slot.key] = value
    return True


def _run_members(
    opt: torch.optim.Optimizer, program: Program, params: list[torch.Tensor], scalars_of: list[Any], exports: list[Any]
) -> bool:
    lowered = program.lowered
    assert lowered is not None
    fetch = _fetchers(opt, program, exports)
    kept = [program.outputs[j - program.exports] for j in lowered.kept]
    created = False
    for p, scalars in zip(params, scalars_of):
        outputs = lowered.run([f(p) for f in fetch] + list(scalars))
        for action, value in zip(kept, outputs):
            created |= _install(opt, action, p, value)
    return created


def _run_lists(
    opt: torch.optim.Optimizer,
    program: Program,
    host: ClassHost,
    params: list[torch.Tensor],
    scalars_of: list[Any],
    exports: list[Any],
) -> bool:
    """Calls over lists of the class's members (lowering/list_mode.py), ``program.chunk`` members each:
    a list-mode call holds every temporary of its members at once, so a chunk bounds the step's peak."""
    created = False
    for start in range(0, len(params), program.chunk):
        end = start + program.chunk
        created |= _run_chunk(opt, program, host, params[start:end], scalars_of[start:end], exports)
    return created


def _run_chunk(
    opt: torch.optim.Optimizer,
    program: Program,
    host: ClassHost,
    params: list[torch.Tensor],
    scalars_of: list[Any],
    exports: list[Any],
) -> bool:
    lowered = program.lowered
    assert lowered is not None
    state = opt.state
    args: list[Any] = []
    for src in program.inputs:
        if src.kind == "global":
            args.append(exports[src.index])
        elif src.kind == "shared":
            assert src.slot is not None
            args.append(slot_tensor(opt, src.slot))
        elif src.kind == "member":
            assert src.slot is not None
            kind, key = src.slot.kind, src.slot.key
            if kind == "param":
                args.append(params)
            elif kind == "grad":
                args.append([p.grad for p in params])
            elif kind == "pattr":
                args.append(list(map(_attribute(key), params)))
            else:
                args.append([state[p][key] for p in params])
    for j, per_member in enumerate(host.per_member):
        args.append([s[j] for s in scalars_of] if per_member else scalars_of[0][j])
    args.append(len(params))
    outputs = lowered.run(args)
    created = False
    for j, values in zip(lowered.kept, outputs):
        action = program.outputs[j - program.exports]
        for p, value in zip(params, values):
            created |= _install(opt, action, p, value)
    return created


def _attribute(key: str) -> Callable[[Any], Any]:
    return lambda p: getattr(p, key)  # (not attrgetter: a name may hold a dot)


def _fetchers(opt: torch.optim.Optimizer, program: Program, exports: list[Any]) -> list[Callable[[Any], Any]]:
    """Per tensor input of ``program``: how to get it for a member param."""
    state = opt.state

    def constant(value: Any) -> Callable[[Any], Any]:
        return lambda p: value

    def state_entry(key: str) -> Callable[[Any], Any]:
        return lambda p: state[p][key]

    fetch: list[Callable[[Any], Any]] = []
    for src in program.inputs:
        if src.kind == "scalar":
            continue
        if src.kind == "global":
            fetch.append(constant(exports[src.index]))
        elif src.kind == "shared":
            assert src.slot is not None
            fetch.append(constant(slot_tensor(opt, src.slot)))
        else:
            assert src.slot is not None
            if src.slot.kind == "param":
                fetch.append(_itself)
            elif src.slot.kind == "grad":
                fetch.append(attrgetter("grad"))
            elif src.slot.kind == "pattr":
                fetch.append(_attribute(src.slot.key))
            else:
                fetch.append(state_entry(src.slot.key))
    return fetch


def _itself(p: Any) -> Any:
    return p


def _run_global(opt: torch.optim.Optimizer, program: Program, env: dict[str, Any]) -> list[Any]:
    """The shared part's outputs the classes read (its own write-backs done)."""
    lowered = program.lowered
    if lowered is None:
        return []
    tensors = [slot_tensor(opt, src.slot) for src in program.inputs if src.kind == "shared" and src.slot]
    exprs: list[Expr] = [src.expr for src in program.inputs if src.kind == "scalar" and src.expr is not None]
    scalars = [e.evaluate(env) for e in exprs]
    outputs = lowered.run(tensors + scalars)
    exports: list[Any] = []
    for j, value in zip(lowered.kept, outputs):
        if j < program.exports:
            exports.append(value)
            continue
        action = program.outputs[j - program.exports]
        if action.mode == "copy":
            slot_tensor(opt, action.slot).copy_(value)
        else:
            raise AssertionError(f"the shared part of a stamped step assigns {action.slot.describe()}")
    assert len(exports) == program.exports, "a value the classes read was written back instead"
    return exports


__all__ = ["GLOBAL", "StampedRun", "broken_guard", "build_run", "member_scalars", "run_stamped"]
