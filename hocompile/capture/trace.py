"""Optimizer step -> functional aten FX graph plus a binding plan.

How: ``make_fx(functionalize(...), tracing_mode="fake")`` over a function that
temporarily rebinds ``param_groups[i]["params"]``, each param's ``.grad`` and
``opt.state`` to the traced tensors, then runs the optimizer's own ``step``.
Dispatch-level tracing goes straight through Python (logging, registries,
dataclasses), so real optimizer libraries come out as one graph (Dynamo splits
emerging-optimizers' Muon into 14).

Hyperparameters become host scalar inputs (see :mod:`hocompile.capture.scalars`). The
step is traced twice with different sentinel payloads: a constant that differs
between the traces depends on a hyperparameter, and must have been tracked;
one that was not (say ``math.sqrt(lr)`` turned it into a plain float) is an
error, never a silently baked-in number.

Nothing here touches real data: tracing runs on fake tensors, and everything
rebound on the optimizer is put back even when the step raises.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

from . import matmul_precision, stand_ins
from .container_trace import ContainerTrace, TreeWrite, container_attributes, leaf_aliases
from .slots import TraceView, container_value, group_containers, host_env, input_slots, slot_tensor, step_tensors

__all__ = [
    "CapturedStep", "TraceView", "capture", "container_value", "host_env", "input_slots", "slot_tensor", "step_tensors",
]
from ..distributed.sharded import global_fakes, is_dtensor, mark_sharded
from ..ir.graph import InputSlot, graph_stats
from .collectives import refuse_several_groups, refuse_untraced_collectives, traced_collectives
from .compiled_helpers import holds_compiled_calls, name_compiled_calls, opaque_compiled_helpers, opaque_names
from .containers import holds_tensors
from .executed_files import ExecutedFiles, compiled_helpers_note
from .finish import OutputAction, finish_placeholders, functional_outputs, lift_scalars
from .host_reads import HostRead, TraceReads, split_at_reads
from .host_scalars import CaptureError, HostScalarMode, counter_name, restore_groups, swap_in_hyperparams
from .host_state import MISSING, Change, HostSlot, HostUpdate, host_updates, needs_lifting
from .scalars import Guard, HyperParam, ScalarProgram, ScalarTracker, build_scalar_program, input_expr, sentinel
from .snapshot import Snapshot
from .tracing_errors import check_state_substitutable, tracing_error

log = logging.getLogger("hocompile.capture")

# make_fx keeps process-wide state (its patcher), and the trace patches `math`
# and torch.distributed: one trace at a time, whoever asks (compile, plan, verify).
_TRACE_LOCK = threading.RLock()


def _dynamo_config_patch(**changes: Any) -> Any:
    import torch._dynamo

    return torch._dynamo.config.patch(**changes)


@dataclass(frozen=True)
class CounterRead:
    """A 0-d state tensor whose value the step reads on the host."""

    name: str
    slot: InputSlot


@dataclass
class CapturedStep:
    gm: fx.GraphModule
    inputs: tuple[InputSlot, ...]
    outputs: tuple[OutputAction, ...]
    scalars: ScalarProgram
    guards: tuple[Guard, ...]
    counters: tuple[CounterRead, ...]
    clears_grads: tuple[tuple[int, int], ...]
    lifted: tuple[HostSlot, ...]  # Python numbers the step rewrites: host inputs, masked from guards
    host_updates: tuple[HostUpdate, ...]  # replayed on the host after every step
    trace_seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    stats: dict[str, int] = field(default_factory=dict)  # of the graph as captured (passes mutate gm)
    # Inputs that are FSDP2 DTensors: traced at their global shape, run on their local
    # shards (distributed/sharded.py; passes/route_sharded.py routes their NS).
    sharded: tuple[InputSlot, ...] = ()
    # The source files whose code the first trace ran, besides torch's and hocompile's own:
    # the optimizer's, its helpers', a monkeypatch's (the warm start keys on their contents).
    code_files: tuple[str, ...] = ()
    files_seen: bool = True  # False: a C-level profiler of the user's ran, so code_files is not known
    # Containers of tensors the step creates or reshapes: rebuilt after it (capture_containers.py).
    trees: tuple[TreeWrite, ...] = ()
    # Data-dependent host reads, run before the step (host_reads.py): their values are host inputs.
    reads: tuple[HostRead, ...] = ()
    # Container leaves that are another input's tensor (leaf, input): checked before every step.
    leaf_aliases: tuple[tuple[InputSlot, InputSlot], ...] = ()
    holds_containers: bool = False


@dataclass
class _TraceResult:
    gm: fx.GraphModule
    tracker: ScalarTracker
    assigns: list[InputSlot]
    clears: list[tuple[int, int]]
    changes: list[Change]
    counters: list[CounterRead]
    matmul_precisions: list[str]
    fused_kernels: list[str] = field(default_factory=list)
    trees: list[TreeWrite] = field(default_factory=list)
    reads: TraceReads | None = None


def unwrapped_step(opt: torch.optim.Optimizer) -> Any:
    # Optimizer patches `step` with a hook-running wrapper; the runtime runs the
    # hooks itself around the compiled step, so the trace must not run them.
    step = type(opt).step
    return getattr(step, "__wrapped__", step) if getattr(step, "hooked", False) else step


def _trace(
    opt: torch.optim.Optimizer,
    slots: list[InputSlot],
    structural: frozenset[str],
    salt: int,
    lifted: frozenset[HostSlot] = frozenset(),
    view: TraceView | None = None,
    opaque: bool = False,
    traced_helpers: dict[str, str] | None = None,
) -> _TraceResult:
    tracker = ScalarTracker(real={}, salt=salt)
    mode = HostScalarMode(tracker, salt)
    result: dict[str, Any] = {}
    real_inputs = [slot_tensor(opt, s) for s in slots]
    reads = TraceReads(real_inputs)
    if any(is_dtensor(t) for t in real_inputs):
        real_inputs = global_fakes(real_inputs)  # DTensors: the step eager runs sees global shapes
    else:
        mode.reader = reads  # data-dependent host reads split the step (host_reads.py); not DTensors'
    step = unwrapped_step(opt)

    def lift(slot: HostSlot, real: Any, index: int) -> HyperParam:
        if isinstance(real, HyperParam):  # a group value swap_in_hyperparams already tracks: its real value
            real = tracker.real_value(real.expr)
        tracker.real[slot.name()] = real
        return tracker.make(sentinel(float(real), 500 + index, salt), input_expr(slot.name()))

    def traced(*flat: torch.Tensor) -> list[torch.Tensor]:
        by_slot = dict(zip(slots, flat))
        groups = opt.param_groups
        reachable = Snapshot(opt, skip=set())
        saved_state = opt.state
        saved_attrs = dict(vars(opt))
        saved_groups = swap_in_hyperparams(groups, structural, tracker, salt)
        host_inputs = {slot: lift(slot, slot.read(opt), k) for k, slot in enumerate(sorted(lifted, key=repr))}
        for host_slot, value in host_inputs.items():
            if host_slot.kind != "state" and not isinstance(host_slot.read(opt), HyperParam):
                host_slot.write(opt, value)
        for input_slot, tensor in by_slot.items():
            if input_slot.kind not in ("attr", "group") or input_slot.leaf >= 0:
                continue
            real = slot_tensor(opt, input_slot)
            if input_slot.kind == "attr":
                setattr(opt, input_slot.key, tensor)
            else:
                groups[input_slot.group][input_slot.key] = tensor
            if tensor.dim() == 0:  # read with .item() (torch.optim's _get_value(lr)): a host counter
                name = f"opt.{input_slot.key}" if input_slot.kind == "attr" else f"g{input_slot.group}.{input_slot.key}"
                mode.track(tensor, name, real.item(), 1000 + len(mode.mirrors))
                result.setdefault("counters", []).append(CounterRead(name, input_slot))
        fake_of = {id(real): by_slot[s] for s, real in zip(slots, real_inputs)}  # aliases in containers
        for key, value in list(saved_attrs.items()):  # a tensor attribute that is a param's (w_q): its fake
            if key != "state" and isinstance(value, torch.Tensor) and InputSlot("attr", -1, -1, key) not in by_slot:
                if id(value) in fake_of:
                    setattr(opt, key, fake_of[id(value)])
        boxes = ContainerTrace(by_slot, fake_of)
        for key in container_attributes(opt):  # copies holding fakes: the real ones stay as they are
            setattr(opt, key, boxes.install(InputSlot("attr", -1, -1, key), vars(opt)[key]))
        boxed_groups = [(g, key) for g, group in enumerate(groups) for key in group_containers(group)]
        for g, key in boxed_groups:
            groups[g][key] = boxes.install(InputSlot("group", g, -1, key), groups[g][key])
        installed = [dict(group) for group in groups]
        installed_attrs = dict(vars(opt))
        fake_state: defaultdict[Any, dict[str, Any]] = defaultdict(dict)
        installed_state: dict[tuple[int, int], dict[str, Any]] = {}
        fakes: dict[tuple[int, int], torch.Tensor] = {}
        changes: list[Change] = []
        attr_assigns: list[InputSlot] = []
        attr_values: list[torch.Tensor] = []
        param_attrs: dict[tuple[int, int], tuple[torch.Tensor, dict[str, Any]]] = {}
        try:
            for g, group in enumerate(groups):
                original = group["params"]
                present = range(len(original)) if view is None else view.get(g, [])
                params = [original[i] for i in present]
                for k, i in enumerate(present):
                    p = original[i]
                    if (slot := InputSlot("param", g, i)) not in by_slot:
                        fake_state[p] = dict(saved_state.get(p, {}))
                        continue
                    fp = by_slot[slot]
                    fp.grad = by_slot[InputSlot("grad", g, i)]
                    mode.stand_ins[id(fp)] = p  # requires_grad, is_leaf: the real param's (stand_ins.py)
                    where = f"param_groups[{g}]['params'][{i}]"
                    param_attrs[(g, i)] = (fp, stand_ins.install(fp, p, where, lambda t: fake_of.get(id(t))))
                    params[k] = fp
                    fakes[(g, i)] = fp
                    entry = _fake_entry(saved_state.get(p, {}), by_slot, g, i, mode, result, boxes)
                    for key in entry:
                        if (hs := HostSlot("state", key, g, i)) in host_inputs:
                            entry[key] = host_inputs[hs]
                    fake_state[fp] = entry
                    installed_state[(g, i)] = dict(entry)
                group["params"] = params
            opt.state = fake_state
            # torch.compile'd helpers as opaque ops; with NS fusion on, not those that multiply matrices
            helpers = opaque_compiled_helpers(opt, step, not opaque, {} if traced_helpers is None else traced_helpers)
            with mode, helpers:
                step(opt)
            for (g, i), (fp, attrs) in param_attrs.items():
                stand_ins.check_unchanged(fp, attrs, f"param_groups[{g}]['params'][{i}]")
        finally:
            opt.state = saved_state
            boxed = {
                (g, key) for g, key in boxed_groups
                if boxes.finish(InputSlot("group", g, -1, key), groups[g].get(key, MISSING), attr_assigns, attr_values)
            }
            for g, key, after in restore_groups(groups, saved_groups, installed):
                if (g, key) in boxed:
                    continue
                base = InputSlot("group", g, -1, key)
                if boxes.assign_tensor(base, after, attr_assigns, attr_values) or boxes.finish(
                    base, after, attr_assigns, attr_values
                ):
                    continue  # a tensor, or a container of tensors, the step put in the group
                changes.append(Change(HostSlot("group", key, g), saved_groups[g].get(key, MISSING), after))
            for key in sorted((set(vars(opt)) | set(installed_attrs)) - {"state"}):
                after = vars(opt).get(key, MISSING)
                if boxes.finish(InputSlot("attr", -1, -1, key), after, attr_assigns, attr_values):
                    pass  # a container of tensors: its writes are outputs
                elif after is not installed_attrs.get(key, MISSING) and not boxes.assign_tensor(
                    InputSlot("attr", -1, -1, key), after, attr_assigns, attr_values
                ):
                    changes.append(Change(HostSlot("attr", key), saved_attrs.get(key, MISSING), after))
                if key not in saved_attrs:
                    delattr(opt, key)
                elif after is not saved_attrs[key]:
                    setattr(opt, key, saved_attrs[key])
            result["elsewhere"] = reachable.changed()
            reachable.restore()
        if result["elsewhere"]:
            raise CaptureError(
                f"the step changes {', '.join(result['elsewhere'][:4])}, which hocompile does not substitute "
                "(only the object's own param_groups, grads, state and attributes): a compiled step would "
                "not carry that state from one step to the next. Compile each sub-optimizer on its own, "
                "or keep such state in `state`"
            )
        assigns: list[InputSlot] = []
        values: list[torch.Tensor] = []
        clears: list[tuple[int, int]] = []
        for (g, i), fp in fakes.items():
            if fp.grad is None:
                clears.append((g, i))
            before = saved_state.get(opt.param_groups[g]["params"][i], {})
            ours = installed_state[(g, i)]
            # in the step's own insertion order: the graph's outputs must not depend on hashing
            for key in list(fake_state[fp]) + [k for k in ours if k not in fake_state[fp]]:
                value = fake_state[fp].get(key, MISSING)
                st = InputSlot("state", g, i, key)
                if boxes.finish(st, value, assigns, values):
                    continue
                if isinstance(value, torch.Tensor):
                    if by_slot.get(st) is not value:
                        assigns.append(st)
                        values.append(value)
                elif value is not ours.get(key, MISSING):
                    changes.append(Change(HostSlot("state", key, g, i), before.get(key, MISSING), value))
        assigns += attr_assigns
        values += attr_values
        result.update(assigns=assigns, clears=clears, changes=changes, trees=boxes.trees)
        return values

    try:
        # A helper wrapped in torch.compile (an NS function, an Adam update)
        # runs as plain Python inside our trace instead of refusing it.
        with _dynamo_config_patch(error_on_nested_fx_trace=False), traced_collectives():
            gm = make_fx(torch.func.functionalize(traced), tracing_mode="fake")(*real_inputs)
    except CaptureError:
        raise
    except Exception as exc:
        raise tracing_error(opt, exc, lifted) from exc
    return _TraceResult(
        gm, tracker, result["assigns"], result["clears"], result["changes"],
        result.get("counters", []), sorted(mode.matmul_precisions), sorted(mode.fused_kernels),
        result["trees"], reads,
    )


def _refuse_attribute_overlaps(opt: torch.optim.Optimizer, slots: list[InputSlot], gm: fx.GraphModule) -> None:
    """A tensor hung on a param that the step reads or writes must not share memory with another of
    its inputs. One it never touches may (FSDP1's flat params carry views of themselves, ``_local_shard``):
    its input stays unused."""
    if not any(s.kind == "pattr" for s in slots):
        return
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    used = {s for s, node in zip(slots, placeholders) if node.users}
    stand_ins.refuse_attribute_overlaps(
        [(s.describe(), slot_tensor(opt, s), s.kind == "pattr") for s in slots if s.kind != "pattr" or s in used]
    )


def _fake_entry(
    real_entry: dict[str, Any],
    by_slot: dict[InputSlot, torch.Tensor],
    g: int,
    i: int,
    mode: HostScalarMode,
    result: dict[str, Any],
    boxes: ContainerTrace,
) -> dict[str, Any]:
    """One param's state with traced tensors; 0-d tensors become host counters."""
    entry = dict(real_entry)
    for key in entry:
        slot = InputSlot("state", g, i, key)
        if not isinstance(entry[key], torch.Tensor) and holds_tensors(entry[key]):
            entry[key] = boxes.install(slot, entry[key])
            continue
        if slot not in by_slot:
            continue
        entry[key] = by_slot[slot]
        if entry[key].dim() == 0:
            name = counter_name(g, i, key)
            mode.track(entry[key], name, real_entry[key].item(), 1000 + len(mode.mirrors))
            result.setdefault("counters", []).append(CounterRead(name, slot))
    return entry


def capture(
    opt: torch.optim.Optimizer,
    structural: frozenset[str],
    view: TraceView | None = None,
    opaque_helpers: bool = False,
) -> CapturedStep:
    """Trace ``opt.step()`` as it would run now into a :class:`CapturedStep`.

    ``view``: trace only these params of each group (the others are absent
    from the group's list while the step runs).
    Every failure is a :class:`CaptureError` (a bug of ours too: it names
    itself), so ``fallback="eager"`` covers all of them.
    """
    try:
        with _TRACE_LOCK:
            return _capture(opt, structural, view, opaque_helpers)
    except CaptureError:
        raise
    except Exception as exc:
        what = f"{type(opt).__name__}.step: {type(exc).__name__}: {exc}"
        raise CaptureError(f"internal error while capturing {what}") from exc


def _capture(
    opt: torch.optim.Optimizer, structural: frozenset[str], view: TraceView | None, opaque: bool = False
) -> CapturedStep:
    start = time.perf_counter()
    check_state_substitutable(opt)
    stand_ins.refuse_identity_maps(opt, {id(p) for g in opt.param_groups for p in g["params"]})
    slots = input_slots(opt, view)
    if not slots:
        raise CaptureError("no parameter has a gradient: there is no step to compile")
    aliases = leaf_aliases(opt, slots, lambda s: slot_tensor(opt, s))
    # Python numbers the step rewrites (``group["step"] += 1``) become host
    # inputs; each trace can reveal more of them, so trace until none is new.
    lifted: frozenset[HostSlot] = frozenset()
    files = ExecutedFiles()
    traced: dict[str, str] = {}  # torch.compile'd helpers traced through, and why (compiled_helpers.py)
    for attempt in range(4):
        with files if attempt == 0 else contextlib.nullcontext():
            first = _trace(opt, slots, structural, 0, lifted, view, opaque, traced)
        more = needs_lifting(first.changes, lifted)
        if not more:
            break
        lifted |= more
    else:
        raise CaptureError("the step keeps rewriting new Python values on every trace; cannot compile it")
    refuse_untraced_collectives(first.gm, opt)
    refuse_several_groups(first.gm, opt)
    _refuse_attribute_overlaps(opt, slots, first.gm)
    second = _trace(opt, slots, structural, 1, lifted, view, opaque)
    updates = host_updates(first.changes, second.changes)
    gm = first.gm
    exprs = lift_scalars(gm, second.gm, first.tracker, second.tracker)
    tensor_slots = slots
    reads: tuple[HostRead, ...] = ()
    if first.reads is not None and first.reads.nodes:  # (never with DTensors: they trace no reads)
        reads, slots = split_at_reads(gm, slots, first.reads)
    outputs = functional_outputs(gm, slots, first.assigns)
    finish_placeholders(gm, slots, exprs)
    sharded = mark_sharded(gm, [slot_tensor(opt, s) for s in tensor_slots], tensor_slots, outputs)
    gm.recompile()
    notes = []
    compiled = [f"{name} ({why})" for name, why in traced.items()]
    opaque_calls = opaque_names(gm)  # and those the trace ran through without passing our swap (a net)
    compiled += [
        n for n in files.compiled
        if n.split(" (")[0] not in set(traced) | opaque_calls and not n.startswith("_opaque.<locals>")
    ]
    if compiled:
        notes.append(compiled_helpers_note(type(opt).__name__, compiled))
    if holds_compiled_calls(gm):
        name_compiled_calls(gm)
        notes.append(
            "torch.compile'd helpers run as the user compiled them (hocompile_torch::compiled_call: eager's "
            "kernels, bitwise; nothing inside them is replanned)"
        )
    if first.fused_kernels:
        notes.append(
            f"fused=True: torch's {', '.join(first.fused_kernels)} kernel runs inside the step as an opaque op "
            "(hocompile_torch::, bitwise eager's fused step; it copies the lists it updates once per step)"
        )
    precision_note = matmul_precision.tag(gm, first.matmul_precisions, f"{type(opt).__name__}.step")
    if precision_note:
        notes.append(precision_note)
    return CapturedStep(
        gm=gm,
        inputs=tuple(slots),
        outputs=tuple(outputs),
        scalars=build_scalar_program(exprs),
        guards=tuple(dict.fromkeys(first.tracker.guards)),
        counters=tuple(first.counters),
        clears_grads=tuple(first.clears),
        lifted=tuple(sorted(lifted, key=repr)),
        host_updates=updates,
        trace_seconds=time.perf_counter() - start,
        notes=notes,
        stats=graph_stats(gm),
        sharded=sharded,
        code_files=files.files(),
        files_seen=files.seeing,
        trees=tuple(first.trees),
        reads=reads,
        leaf_aliases=aliases,
        holds_containers=bool(first.trees) or aliases != () or any(s.leaf >= 0 for s in slots),
    )
