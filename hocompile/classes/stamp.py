"""Trace a representative of each parameter class, prove the step separable, stamp it out.

Tracing costs per traced op, so a step over N matrices costs N times one
matrix's trace. Here the step is traced on a *view* of the optimizer (the
other params are absent from the groups' lists while it runs) twice:

1. one member per class (its first): the program that will run for every member;
2. two members per class (its first and last; singletons once): the proof.

The step is *separable* when, in both traces, every node belongs to one
member or to the step as a whole (separable.py), and every member's program,
in names that do not depend on which member runs it, is the same in the
second trace as its class's representative's in the first, and so are the
global part, the guards, the host counters and the Python-state updates. A
program that depends on how many params there are (``lr / len(params)``)
differs between the two traces; one that reads another member (a global
grad norm, a foreach over a combined value) has a node owned by no single
member. Either way the step is traced whole, as before, and the reason is
kept for explain().

What cannot be stamped, and is traced whole: DTensor params, tensors shared
between params, random ops (the order of draws), collectives (their order
across ranks), linear algebra that can fail on the data (the write fence
spans the whole step), and steps where every class has one member.
"""

from __future__ import annotations

import time
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from ..capture.container_trace import containers_held
from ..capture.host_state import HostSlot
from ..capture.scalars import Guard
from ..capture.trace import CapturedStep, TraceView, capture, host_env
from ..distributed.sharded import is_dtensor
from ..ir.declined import Declined
from ..ir.graph import is_fallible
from .classify import ParamClass, classify, shared_storage
from .separable import (
    GLOBAL,
    MemberId,
    Partition,
    generic_expr,
    generic_name,
    member_of_name,
    member_program,
    partition,
    split_foreach,
)


@dataclass(frozen=True)
class Stamp:
    """The classes of a stamped step: the traced program of each ``classes[k].rep`` runs for all its members."""

    classes: tuple[ParamClass, ...]
    traced: int  # params traced in the two reduced traces together
    seconds: float  # both reduced traces and the proof

    @property
    def members(self) -> int:
        return sum(len(c.members) for c in self.classes)

    def member_slots(self, slot: HostSlot) -> list[HostSlot]:
        """A representative's Python-state slot, for every member of its class (itself first)."""
        if slot.kind != "state":
            return [slot]
        cls = next((c for c in self.classes if c.group == slot.group and c.rep == slot.index), None)
        members = cls.members if cls is not None else (slot.index,)
        return [HostSlot("state", slot.key, slot.group, i) for i in members]

    def describe(self) -> list[str]:
        head = (
            f"{len(self.classes)} parameter class(es), {self.members:,} params: traced {self.traced} "
            f"(one and two per class) in {self.seconds:.2f} s, proved one program per class"
        )
        return [head] + [f"  c{k}: {c.describe()}" for k, c in enumerate(self.classes)]


def trace_view(opt: torch.optim.Optimizer, classes: list[ParamClass], per_class: int) -> TraceView:
    """Per group: the first (and last) members of each class, and every param without a grad
    (the full trace sees those too: a step that touched one would fail alike)."""
    keep: dict[int, set[int]] = {g: set() for g in range(len(opt.param_groups))}
    for cls in classes:
        keep[cls.group].add(cls.members[0])
        if per_class > 1:
            keep[cls.group].add(cls.members[-1])
    for g, group in enumerate(opt.param_groups):
        keep[g] |= {i for i, p in enumerate(group["params"]) if p.grad is None}
    return {g: sorted(indices) for g, indices in keep.items()}


def _unstampable(gm: fx.GraphModule) -> str:
    """Ops whose meaning depends on the whole step's order or extent (the module docstring's list)."""
    for node in gm.graph.nodes:
        target = node.target
        if node.op != "call_function":
            continue
        if isinstance(target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in target.tags:
            return f"it draws random numbers (`{node.format_node()}`): their order is the whole step's"
        if "c10d" in str(target) or "wait_tensor" in str(target):
            return "it issues collectives, whose order across ranks is the whole step's"
        if is_fallible(node):
            return f"`{node.format_node()}` can fail on the data, and the write fence spans the whole step"
    return ""


def _host_view(captured: CapturedStep, member_of: dict[MemberId, int]) -> dict[Hashable, Any]:
    """The Python-level parts of a capture, per class (``member_of``: member -> class) and for the whole step."""
    out: dict[Hashable, set[Hashable]] = {}

    def add(owner: Hashable, item: Hashable) -> None:
        out.setdefault(owner, set()).add(item)

    def owner_of_names(names: set[str]) -> Hashable:
        members = {m for m in map(member_of_name, names) if m is not None}
        return ("class", member_of[next(iter(members))]) if len(members) == 1 else ("step", len(members))

    for guard in captured.guards:
        owner = owner_of_names(guard.lhs.inputs() | guard.rhs.inputs())
        add(owner, ("guard", generic_expr(guard.lhs), guard.op, generic_expr(guard.rhs), guard.outcome))
    for counter in captured.counters:
        add(owner_of_names({counter.name}), ("counter", generic_name(counter.name)))
    for g, i in captured.clears_grads:
        add(("class", member_of[(g, i)]), ("clears grad",))
    for slot in captured.lifted:
        add(owner_of_names({slot.name()}), ("lifted", generic_name(slot.name())))
    for update in captured.host_updates:
        value = generic_expr(update.expr) if update.expr is not None else repr(update.constant)
        add(owner_of_names({update.slot.name()}), ("update", generic_name(update.slot.name()), value))
    add(("step", 0), ("notes", tuple(captured.notes)))
    return {k: frozenset(v) for k, v in out.items()}


def _compare(
    one: CapturedStep, two: CapturedStep, classes: list[ParamClass], p1: Partition, p2: Partition
) -> str:
    """'' when the second trace is the first stamped out for two members per class; else the first difference."""
    for k, cls in enumerate(classes):
        want = member_program(one.gm, p1, (cls.group, cls.rep), one.outputs)
        for i in dict.fromkeys((cls.members[0], cls.members[-1])):
            got = member_program(two.gm, p2, (cls.group, i), two.outputs)
            if got != want:
                where = f"param_groups[{cls.group}]['params'][{i}]"
                return (
                    f"{where} does not run the program of its class's first member when traced with "
                    f"another member of class c{k} ({cls.title}): the step depends on how many params there are"
                )
    if member_program(one.gm, p1, GLOBAL, one.outputs) != member_program(two.gm, p2, GLOBAL, two.outputs):
        return "the part of the step shared by all params changes with how many params there are"
    member_of = {(c.group, i): k for k, c in enumerate(classes) for i in c.members}
    h1, h2 = _host_view(one, member_of), _host_view(two, member_of)
    if h1 != h2:
        owner: Any = next(k for k in set(h1) | set(h2) if h1.get(k) != h2.get(k))
        what = f"class c{owner[1]}" if owner[0] == "class" else "the whole step"
        return f"the Python-level part of the step (guards, counters, state updates) of {what} changes with the params"
    return ""


def _member_env(opt: torch.optim.Optimizer, captured: CapturedStep, g: int, i: int) -> dict[str, Any]:
    """The member's own host inputs, by generic name (``g0.p*.state.step``), read from its state."""
    p = opt.param_groups[g]["params"][i]
    state = opt.state.get(p, {})
    env: dict[str, Any] = {}
    for counter in captured.counters:
        if counter.slot.kind == "state":
            env[generic_name(counter.name)] = state[counter.slot.key].item()
    for slot in captured.lifted:
        if slot.kind == "state":
            env[generic_name(slot.name())] = state.get(slot.key)
    return env


def _split_by_guards(
    opt: torch.optim.Optimizer, captured: CapturedStep, classes: list[ParamClass]
) -> list[ParamClass] | None:
    """Classes split by the outcomes, per member, of the guards on the representative's own counters
    (a refresh every k steps where some params are at other counts); None when no class splits."""
    shared = host_env(opt, captured)
    generic = [
        (member, Guard(g.lhs.renamed(names), g.op, g.rhs.renamed(names), g.outcome))
        for g in captured.guards
        for names in [{n: generic_name(n) for n in g.lhs.inputs() | g.rhs.inputs()}]
        for member in {m for m in map(member_of_name, names) if m is not None}
    ]
    out: list[ParamClass] = []
    split = False
    for cls in classes:
        guards = [g for member, g in generic if member == (cls.group, cls.rep)]
        if not guards:
            out.append(cls)
            continue
        by_outcome: dict[tuple[bool, ...], list[int]] = {}
        for i in cls.members:
            env = {**shared, **_member_env(opt, captured, cls.group, i)}
            by_outcome.setdefault(tuple(g.holds(env) for g in guards), []).append(i)
        split |= len(by_outcome) > 1
        out += [ParamClass(cls.group, tuple(m), cls.title, (cls.key, k)) for k, m in enumerate(by_outcome.values())]
    return out if split else None


def stamp_capture(
    opt: torch.optim.Optimizer,
    structural: frozenset[str],
    lifted: frozenset[HostSlot] = frozenset(),
    opaque_helpers: bool = False,
) -> tuple[CapturedStep, Stamp] | Declined:
    """The representatives' capture and its stamp, or why the step must be traced whole.

    ``lifted``: the Python numbers the step is known to rewrite (they do not split classes).
    ``opaque_helpers``: as :func:`~hocompile.capture.trace.capture`'s (NS fusion off).
    A :class:`~hocompile.capture.host_scalars.CaptureError` of a reduced trace propagates: the full
    trace would meet the same code.
    """
    start = time.perf_counter()
    params = [p for group in opt.param_groups for p in group["params"]]
    if any(is_dtensor(p) for p in params):
        return Declined("DTensor params are traced whole (their routing plans across all matrices)")
    classes = classify(opt, lifted)
    total = sum(len(c.members) for c in classes)
    traced = len(classes) + sum(min(2, len(c.members)) for c in classes)
    if traced >= total:
        return Declined(f"{len(classes)} classes for {total} params: tracing one and two per class would cost as much")
    boxed = containers_held(opt)
    if boxed:
        return Declined(f"the step keeps tensors in containers ({boxed}): traced whole")
    aliased = shared_storage(opt, classes)
    if aliased:
        return Declined(f"{aliased}: their updates are not independent")
    for _ in range(4):  # members whose own counters take another branch get a class of their own
        one = capture(opt, structural, trace_view(opt, classes, 1), opaque_helpers)
        split = _split_by_guards(opt, one, classes)
        if split is None:
            break
        classes = split
    else:
        return Declined("the params' own counters take too many different branches")
    if one.trees or one.holds_containers:  # e.g. state["f"] = [L, R] on the first step
        return Declined("the step creates containers of tensors (a list or dict in its state): traced whole")
    if one.reads:  # each member's value is its own read: one program per member, not per class
        return Declined("it reads tensor values on the host, each param its own (the step is split at every read)")
    reason = _unstampable(one.gm)
    if reason:
        return Declined(f"the step is traced whole: {reason}")
    two = capture(opt, structural, trace_view(opt, classes, 2), opaque_helpers)
    split_foreach(one.gm)
    split_foreach(two.gm)
    p1, p2 = partition(one.gm, one.outputs), partition(two.gm, two.outputs)
    problem = p1.problem or p2.problem or _compare(one, two, classes, p1, p2)
    if problem:
        return Declined(f"not one program per param: {problem}")
    return one, Stamp(tuple(classes), traced, time.perf_counter() - start)
