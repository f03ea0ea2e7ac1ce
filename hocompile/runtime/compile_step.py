"""compile_step(opt, settings): the one capture -> passes -> lowering driver.

``CompiledOptimizer`` calls it for every new configuration of its step, and
``hocompile.plan()`` with ``lower=False`` to show what the passes decide
without generating anything; both therefore plan with the same target,
backend, pipeline and settings. The caller validates the optimizer first
(validate.py) and decides what a refusal means: a ``CaptureError`` from the
capture propagates unchanged.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ..capture.collectives import collective_launches
from ..capture.host_state import HostSlot
from ..capture.snapshot import random_state_kept
from ..capture.trace import CapturedStep, capture, host_env
from ..classes.stamp import stamp_capture
from ..distributed.check import check_collectives_agree, check_replicated, planning_basis, rank0_target
from ..distributed.replicated import resolve_group
from ..distributed.sharded import is_dtensor
from ..ir.declined import Declined
from ..ir.graph import decisions, graph_stats, print_graph
from ..lowering.class_programs import split_programs
from ..lowering.triton.ns_scheduled import schedule_formats
from ..passes import BatchByShape, Pass, run_pipeline
from ..passes import pipeline as pipelines
from ..passes.dist_ownership import DistOwnership
from ..passes.pipeline import pipeline_target, stamped_pipeline, traced_whole_pipeline, why_not_stamped
from ..passes.route_sharded import require_routed
from ..settings import Backend, Distributed, Settings
from ..targets import Target, device_arch, resolve_target
from . import warm
from .lower_step import CompiledStep, lower_step
from .stamped import broken_guard

log = logging.getLogger("hocompile")

# Target calibration times the machine (two at once would measure each other)
# and writes its file; tracing has its own lock in capture.py.
COMPILE_LOCK = threading.RLock()


def params_device(opt: torch.optim.Optimizer) -> torch.device:
    """The device of the first param (CPU for an optimizer without params): it picks backend and target."""
    params = [p for g in opt.param_groups for p in g["params"]]
    return params[0].device if params else torch.device("cpu")


def resolve_backend(settings: Settings, device: torch.device) -> str:
    """ "triton" or "aten": the setting, with "auto" resolved by the params' device."""
    if settings.backend != Backend.AUTO:
        return str(settings.backend)
    if device.type != "cuda":
        return "aten"
    try:
        import triton  # noqa: F401  (an optional dependency: probed, not required)
    except ImportError:
        log.warning("hocompile: CUDA params but triton is not installed: lowering to aten")
        return "aten"
    return "triton"


def kernel_formats(triton: bool, device: torch.device) -> frozenset[str] | None:
    """The NS formats the Triton lowering has kernels for on ``device``; None (all) for aten."""
    return schedule_formats(device_arch(device)) if triton else None


def ownership_pass(settings: Settings) -> DistOwnership | None:
    """The configured dist-ownership pass, or None when every rank computes everything."""
    if settings.distributed != Distributed.REPLICATED:
        return None
    group = resolve_group(settings.process_group)
    return DistOwnership(world=dist.get_world_size(group), rank=dist.get_rank(group), group_name=str(group.group_name))


def shared_target(opt: torch.optim.Optimizer, passes: tuple[Pass, ...]) -> Target | None:
    """Rank 0's target (the pipeline's) when the params are DTensors on a mesh, else None."""
    params = [p for g in opt.param_groups for p in g["params"]]
    mesh = next((p.device_mesh for p in params if is_dtensor(p)), None)
    found = pipeline_target(passes)
    if mesh is None or found is None or mesh.ndim != 1:
        return found
    return rank0_target(found, mesh.get_group().group_name)


def step_pipeline(
    settings: Settings, device: torch.device, backend: str, stack_calls: bool = True
) -> tuple[tuple[Pass, ...], Target]:
    """The pass pipeline for ``settings`` on ``device`` (passes/pipeline.py decides it; here the facts
    it needs: the target, calibrated on first use, the Triton kernels' formats, the ranks' group)."""
    with COMPILE_LOCK:
        target = resolve_target(settings.target, settings.cache_dir, device)
    formats = kernel_formats(backend == Backend.TRITON, device)
    passes = pipelines.step_pipeline(settings, target, backend, formats, ownership_pass(settings), stack_calls)
    return passes, target


def compile_step(
    opt: torch.optim.Optimizer,
    settings: Settings,
    *,
    pipeline: tuple[Pass, ...] | None = None,
    lower: bool = True,
    dump_dir: Path | None = None,
    lifted: frozenset[HostSlot] = frozenset(),
    warm_start: bool = False,
) -> CompiledStep:
    """Capture ``opt``'s step, run the passes and (``lower``) generate and load the step module.

    ``pipeline``: the passes to run (default: :func:`step_pipeline`'s);
    ``dump_dir``: where the graphs before/after each pass, the lowered
    module and its kernels are written; ``lifted``: Python numbers the step
    is known to rewrite (host inputs: they do not split parameter classes);
    ``warm_start``: load the step from the cache directory's warm-start
    records where one fits (warm.py), and keep a record of what is compiled.
    """
    # The capture evaluates a host read's program on the real inputs, running the step's own random
    # ops: the stream is put back, so the step's draws stay eager's. (Timings draw from generators
    # of their own: targets._measure, stack_members, triton autotune.)
    with random_state_kept():
        return _compile_step(opt, settings, pipeline, lower, dump_dir, lifted, warm_start)


def _compile_step(
    opt: torch.optim.Optimizer,
    settings: Settings,
    pipeline: tuple[Pass, ...] | None,
    lower: bool,
    dump_dir: Path | None,
    lifted: frozenset[HostSlot],
    warm_start: bool,
) -> CompiledStep:
    device = params_device(opt)
    backend = resolve_backend(settings, device)
    target = None
    with COMPILE_LOCK:  # the target is calibrated once per process
        planning = time.perf_counter()
        if pipeline is None:
            pipeline, target = step_pipeline(settings, device, backend)
        planning = time.perf_counter() - planning
    # Sharded params: the tensor-parallel modes decide which collectives each rank issues, so every
    # rank chooses them from rank 0's rates (a broadcast, outside the lock: in tests, ranks are
    # threads of one process and would otherwise wait for each other's lock).
    shared = shared_target(opt, pipeline)
    with COMPILE_LOCK:  # one compile at a time per process (see COMPILE_LOCK)
        start = time.perf_counter() - planning  # waiting for another compile is not this one's time
        key = _warm_key(opt, settings, pipeline, lifted, lower and warm_start)
        loaded = _warm_step(opt, settings, key, pipeline, backend, device, dump_dir) if key else None
        if loaded is not None:
            loaded.target, loaded.seconds = target, time.perf_counter() - start
            return loaded
        stamped = _stamped(opt, settings, backend, pipeline, lifted, dump_dir, planning=not lower)
        if isinstance(stamped, CompiledStep):
            step = stamped
        else:
            with torch.no_grad():
                captured = capture(opt, settings.structural_keys, opaque_helpers=opaque_helpers(settings))
            pipeline = traced_whole_pipeline(pipeline, bool(captured.sharded), captured.gm, settings, shared)
            step = _run_passes(captured, pipeline, settings, dump_dir)
            step.stamp_note = stamped.reason
        step.target = target
        if settings.debug >= 2:
            log.debug("hocompile final graph:\n%s", step.final_graph)
        # Before lowering rewrites the graphs. Not for a step issuing collectives: its ranks compile together
        # (check_collectives_agree below), and a rank loading a record would skip that while another compiles.
        record = warm.encode_step(step, key) if key and not collective_launches(step.gm) else None
        if lower:
            lower_step(step, opt, settings, pipeline, backend, device, dump_dir)
            if record is not None:
                warm.write(settings, key, record)
    step.seconds = time.perf_counter() - start
    if lower:  # outside COMPILE_LOCK: it waits for the other ranks (threads, in tests) to compile too
        # distributed/check.py: a no-op unless dist-ownership planned the step
        planned_for = pipeline_target(pipeline)
        basis = planning_basis(planned_for, settings, backend) if planned_for is not None else ""
        check_replicated(opt, step.gm, basis)
        check_collectives_agree(step.gm, device)  # every rank issues the same collectives (a no-op without)
    return step


def _warm_key(
    opt: torch.optim.Optimizer, settings: Settings, pipeline: tuple[Pass, ...], lifted: frozenset[HostSlot], ok: bool
) -> str:
    """The warm-start key, or '' where no record is read or kept (planning only, DTensors, several ranks)."""
    if not (ok and settings.warm_start) or settings.distributed == Distributed.REPLICATED:
        return ""
    if any(is_dtensor(p) for g in opt.param_groups for p in g["params"]):
        return ""
    return warm.warm_key(opt, settings, pipeline, lifted)


def _warm_step(
    opt: torch.optim.Optimizer,
    settings: Settings,
    key: str,
    pipeline: tuple[Pass, ...],
    backend: str,
    device: torch.device,
    dump_dir: Path | None,
) -> CompiledStep | None:
    """A step loaded from a warm-start record whose guards hold now, lowered; None if there is none.
    ``dump_dir`` gets its lowered module and the record it came from (no capture or pass ran)."""
    for path, record in warm.load(opt, settings, key):
        try:
            step = warm.rebuild(record, CompiledStep)
            if dump_dir is not None:
                dump_dir.mkdir(parents=True, exist_ok=True)
                (dump_dir / "warm-start.txt").write_text(
                    f"loaded from the warm-start record {path}\n(no capture or pass ran in this process: the "
                    "record holds the final graph; lowered.py is what runs)\n"
                )
            lower_step(step, opt, settings, pipeline, backend, device, dump_dir)
        except Exception as exc:  # a record this build cannot use: compile afresh
            log.info("hocompile: warm-start record %s not usable (%s: %s)", path.name, type(exc).__name__, exc)
            warm.discard(path)
            continue
        env = host_env(opt, step.captured)
        if step.stamped is not None:
            broken = broken_guard(opt, step.stamped, env)
        else:
            broken = next((g for g in step.captured.guards if not g.holds(env)), None)
        if broken is None:
            step.warm = str(path)
            return step
    return None


def _run_passes(
    captured: CapturedStep, pipeline: tuple[Pass, ...], settings: Settings, dump_dir: Path | None
) -> CompiledStep:
    pass_start = time.perf_counter()
    gm, records = run_pipeline(captured.gm, pipeline, settings.disabled_passes, dump_dir)
    if captured.sharded:
        require_routed(gm)
    pass_seconds = time.perf_counter() - pass_start
    return CompiledStep(captured, gm, records, None, print_graph(gm), decisions(gm), graph_stats(gm), pass_seconds)


def _stamped(
    opt: torch.optim.Optimizer,
    settings: Settings,
    backend: str,
    pipeline: tuple[Pass, ...],
    lifted: frozenset[HostSlot],
    dump_dir: Path | None,
    planning: bool = False,
) -> CompiledStep | Declined:
    """The step compiled on one representative per parameter class (classes/stamp.py), or why it is
    traced whole. The passes run on the representatives' graph; the result must still be one
    program per member (a pass that combines calls of several params, batch-by-shape on a GPU
    target, makes it a whole trace). ``planning`` (hocompile.plan: nothing runs): the passes that
    combine calls across params are left out, and plan.py reports stacking and owners per class."""
    if not settings.stamp:
        return Declined("stamping is off (stamp=False / HOCOMPILE_STAMP=0)")
    declined = why_not_stamped(pipeline, backend, planning)
    if declined is not None:
        return declined
    with torch.no_grad():
        found = stamp_capture(opt, settings.structural_keys, lifted, opaque_helpers(settings))
    if isinstance(found, Declined):
        return found
    captured, stamp = found
    members = tuple(((c.group, c.rep), len(c.members)) for c in stamp.classes)
    pipeline = stamped_pipeline(pipeline, members, settings, planning)
    step = _run_passes(captured, pipeline, settings, dump_dir)
    enabled = [p for p in pipeline if p.name not in settings.disabled_passes]
    if any(isinstance(p, BatchByShape) and p.stacks_anything(step.gm) for p in enabled):
        return Declined("batch-by-shape stacks this target's calls across params: traced whole")
    programs = split_programs(captured, step.gm, stamp)
    if isinstance(programs, Declined):
        why = programs.reason
        return Declined(f"after the passes the step is no longer one program per param ({why}): traced whole")
    step.stamp, step.programs = stamp, programs
    return step


def opaque_helpers(settings: Settings) -> bool:
    """torch.compile'd helpers run as opaque ops (compiled_helpers.py) where no pass would replan
    what they compute: with Newton–Schulz fusion off, the plan keeps eager's arithmetic."""
    return "fuse-newton-schulz" in settings.disabled_passes
