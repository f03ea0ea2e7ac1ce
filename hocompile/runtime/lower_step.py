"""What compile_step produces (:class:`CompiledStep`) and its lowering: aten or Triton, whole or per class.

The cache key covers the pipeline's identity, the backend and every pass's status (the statuses are
printed in the generated module's header). A stamped step lowers one program for the part shared by
all params and one per class (lowering/class_programs.py); a whole one, one module.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.fx as fx

from ..capture.trace import CapturedStep
from ..classes.stamp import Stamp
from ..diskcache import DiskCache
from ..lowering import LoweredStep, cache_key, lower_to_aten
from ..lowering.aten import fast_program
from ..lowering.class_programs import Program, lower_programs
from ..lowering.triton import lower_to_triton
from ..lowering.writeback import write_fence
from ..passes import Pass, PassRecord
from ..settings import Settings
from ..targets import Target
from .stamped import StampedRun, build_run
from .step_graph import GraphedStep


@dataclass
class CompiledStep:
    """What one run of the driver produced: the captured step, the graph after passes, and its lowering."""

    captured: CapturedStep
    gm: fx.GraphModule  # after the passes (and, once lowered, with the lowering's write-backs)
    records: list[PassRecord]
    target: Target | None  # None when the caller supplied the pipeline (its passes hold their target)
    final_graph: str  # printed before lowering rewrites the graph
    decisions: list[str]
    final_stats: dict[str, int]
    pass_seconds: float
    lowered: LoweredStep | None = None
    lower_seconds: float = 0.0
    seconds: float = 0.0  # the whole call, capture included
    key: str = ""  # cache key of the lowered module; "" when not lowered
    # The lowered step writes nothing back before its last fallible op (eigh, SVD):
    # a LinAlgError it raises leaves params and state as they were (writeback.py).
    fenced: bool = False
    # Set when the step was traced on one representative per parameter class (classes/stamp.py):
    # ``captured`` and ``gm`` are the representatives' step; else why it was traced whole.
    stamp: Stamp | None = None
    stamp_note: str = ""
    programs: tuple[Program, list[Program]] | None = None  # the shared part's program and one per class
    stamped: StampedRun | None = None  # once lowered: the programs the runtime runs per member
    warm: str = ""  # loaded from this warm-start record instead of traced (warm.py)


def lower_step(
    step: CompiledStep,
    opt: torch.optim.Optimizer,
    settings: Settings,
    pipeline: tuple[Pass, ...],
    backend: str,
    device: torch.device,
    dump_dir: Path | None,
) -> None:
    start = time.perf_counter()
    identity = ";".join(p.identity() for p in pipeline if p.name not in settings.disabled_passes)
    # The statuses are printed in the module's header: the key must cover them.
    statuses = ",".join(f"{r.name}:{r.status}" for r in step.records)
    step.key = cache_key(step.gm, f"{identity};backend={backend};{statuses}")
    header = _header(opt, step.key, step.records)
    captured = step.captured
    index_of = {slot: i for i, slot in enumerate(captured.inputs)}
    copy_into = [index_of[a.slot] if a.mode == "copy" else None for a in captured.outputs]
    if step.stamp is not None:  # one program per class and one for the shared part (class_programs.py)
        _lower_stamped(step, f"{identity};backend={backend};{statuses}", header, settings)
        step.lower_seconds = time.perf_counter() - start
        _dump_lowered(step, dump_dir)
        return
    # The aten lowering writes nothing back before the graph's last fallible op (writeback.py); the
    # Triton wrapper nothing before its last launch (lowering/triton/fence.py).
    step.fenced = backend == "triton" or write_fence(step.gm) is not None
    for read in captured.reads:  # the programs run before the step, on the host's device
        read.fast = fast_program(read.gm)
    if backend == "triton":
        step.lowered = lower_triton_step(step.gm, step.key, header, copy_into, settings, device)
    else:
        cache = DiskCache(settings.cache_dir)
        step.lowered = lower_to_aten(step.gm, step.key, cache, header, copy_into, settings.fused_updates)
    step.lower_seconds = time.perf_counter() - start
    _dump_lowered(step, dump_dir)


def _dump_lowered(step: CompiledStep, dump_dir: Path | None) -> None:
    if dump_dir is None or step.lowered is None:
        return
    dump_dir.mkdir(parents=True, exist_ok=True)
    (dump_dir / "lowered.py").write_text(step.lowered.source)
    for kernel in step.lowered.kernels:
        (dump_dir / "kernels").mkdir(exist_ok=True)
        (dump_dir / "kernels" / f"{kernel.name}.py").write_text(kernel.source)


def _lower_stamped(step: CompiledStep, identity: str, header: str, settings: Settings) -> None:
    assert step.stamp is not None
    assert step.programs is not None
    shared, programs = step.programs
    has_work = shared.outputs or shared.exports
    lowered = ([shared] if has_work else []) + programs
    lower_programs(lowered, identity, DiskCache(settings.cache_dir), header, settings.fused_updates)
    step.stamped = build_run(step.captured, step.stamp, shared, programs)
    parts = [p.lowered for p in lowered if p.lowered is not None]

    def run(args: list[object]) -> tuple[torch.Tensor, ...]:
        raise AssertionError("a stamped step runs its programs per member (runtime/stamped.py)")

    source = "\n\n".join(part.source for part in parts)
    step.lowered = LoweredStep(run, parts[0].path, step.key, all(p.from_disk for p in parts), source, [])
    step.lowered.reinplaced = [r for part in parts for r in part.reinplaced]
    step.lowered.fused = [f for part in parts for f in part.fused]


def lower_triton_step(
    gm: fx.GraphModule, key: str, header: str, copy_into: list[int | None], settings: Settings, device: torch.device
) -> LoweredStep:
    # The lowering returns a plain runnable; replaying it from a CUDA graph is the runtime's business.
    module = lower_to_triton(gm, settings.cache_dir, header, copy_into, device, autotune=settings.autotune)
    graphed = settings.cuda_graphs and module.graph_safe
    run = GraphedStep(module.module, gm, device) if graphed else module.run
    return LoweredStep(
        run,
        module.path,
        key,
        module.from_disk,
        module.source,
        module.kept,
        "triton",
        module.kernels,
        module.launches,
        module.units,
        graphed,
    )


def _header(opt: torch.optim.Optimizer, key: str, records: list[PassRecord]) -> str:
    passes = ", ".join(f"{r.name} ({r.status})" for r in records) or "none"
    return "\n".join(
        [
            f"# Generated by hocompile for {type(opt).__module__}.{type(opt).__name__}.step",
            f"# cache key {key[:16]}; passes: {passes}",
            "# forward(self, <tensor inputs>, <host scalars>) -> outputs written back by the runtime",
        ]
    )


__all__ = ["CompiledStep", "lower_step", "lower_triton_step"]
