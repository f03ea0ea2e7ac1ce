"""Optimizer step -> functional aten FX graph plus a binding plan.

How: ``make_fx(functionalize(...), tracing_mode="fake")`` over a function that
temporarily rebinds ``param_groups[i]["params"]``, each param's ``.grad`` and
``opt.state`` to the traced tensors, then runs the optimizer's own ``step``
(one such trace, in named steps: ``one_trace.py``).
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
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from ..distributed.sharded import mark_sharded
from ..errors import CaptureError
from ..ir.graph import InputSlot, graph_stats
from . import matmul_precision, stand_ins
from .collectives import refuse_several_groups, refuse_untraced_collectives
from .compiled_helpers import holds_compiled_calls, name_compiled_calls, opaque_names
from .container_trace import TreeWrite, leaf_aliases
from .executed_files import ExecutedFiles, compiled_helpers_note
from .finish import OutputAction, finish_placeholders, functional_outputs, lift_scalars
from .host_reads import HostRead, split_at_reads
from .host_state import HostSlot, HostUpdate, host_updates, needs_lifting
from .one_trace import CounterRead, trace_once, unwrapped_step
from .scalars import Guard, ScalarProgram, build_scalar_program
from .slots import TraceView, container_value, host_env, input_slots, slot_tensor, step_tensors
from .tracing_errors import check_state_substitutable

__all__ = [
    "CapturedStep", "TraceView", "capture", "container_value", "host_env", "input_slots", "slot_tensor", "step_tensors",
    "unwrapped_step",
]

log = logging.getLogger("hocompile.capture")

# make_fx keeps process-wide state (its patcher), and the trace patches `math`
# and torch.distributed: one trace at a time, whoever asks (compile, plan, verify).
_TRACE_LOCK = threading.RLock()


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
            first = trace_once(opt, slots, structural, 0, lifted, view, opaque, traced)
        more = needs_lifting(first.changes, lifted)
        if not more:
            break
        lifted |= more
    else:
        raise CaptureError("the step keeps rewriting new Python values on every trace; cannot compile it")
    refuse_untraced_collectives(first.gm, opt)
    refuse_several_groups(first.gm, opt)
    _refuse_attribute_overlaps(opt, slots, first.gm)
    second = trace_once(opt, slots, structural, 1, lifted, view, opaque)
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
