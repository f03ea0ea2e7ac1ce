"""Which passes run for a step: the one place that decides it.

A step's pipeline is decided in three stages, each from the facts known by then:

1. :func:`step_pipeline`, from the settings, the target and the backend. The default tuple
   (:func:`default_pipeline`) in the order it runs: canonicalize; the family recognisers
   (fuse-*), before batch-by-shape so their ops batch like NS; dist-ownership when
   ``distributed="replicated"`` (it sees every orthogonalisation one by one, so each rank then
   batches and plans only its share); batch-by-shape; choose-algorithm; choose-precision.
   Then stack-calls, last, where this CPU was measured, the lowering is aten and each rank
   computes everything (a stack is one rank's timing).
2. :func:`stamped_pipeline` (or :func:`why_not_stamped`), once the step is known to be stamped
   (one representative per parameter class): stack-calls gives way to stack-members, which
   stacks each class's members; ``hocompile.plan()`` leaves out the passes that combine calls
   across params (batch-by-shape, dist-ownership) and reports stacking per class instead.
3. :func:`traced_whole_pipeline`, once a step traced whole is captured: DTensor params insert
   route-sharded before batch-by-shape and tp-newton-schulz last (after choose-algorithm and
   choose-precision planned the calls it inlines), and stack-calls leaves.

``settings.disabled_passes`` is not applied here: the runner skips those passes (and logs
that), so a pipeline's printed identity still names them.
"""

from __future__ import annotations

import torch.fx as fx

from ..distributed.sharded import step_layout
from ..errors import CaptureError
from ..ir.declined import Declined
from ..settings import Backend, Distributed, Settings
from ..targets import Target
from .base import Pass
from .batch_by_shape import BatchByShape
from .canonicalize import Canonicalize
from .choose_algorithm import ChooseAlgorithm
from .choose_precision import ChoosePrecision
from .dist_ownership import DistOwnership
from .fuse_eigenbasis import FuseEigenbasis
from .fuse_factor_update import FuseFactorUpdate
from .fuse_inverse_root import FuseInverseRoot
from .fuse_newton_schulz import FuseNewtonSchulz
from .fuse_polar import FusePolar
from .fuse_two_sided import FuseTwoSided
from .route_sharded import RouteSharded
from .stack_calls import StackCalls
from .stack_members import StackMembers
from .tp_newton_schulz import TensorParallelNS


def default_pipeline(
    target: Target,
    precision: str = "auto",
    force_batch: bool = False,
    error_budget: float | None = None,
    schedule: tuple[str, ...] = (),
    apply_schedules: bool = True,
    kernel_formats: frozenset[str] | None = None,
    max_batch: int | None = None,
    max_stack_bytes: int | None = None,
    dist_ownership: DistOwnership | None = None,
) -> tuple[Pass, ...]:
    """``force_batch``: the Triton backend launches per shape group. ``kernel_formats``: the
    formats the lowering has NS kernels for (None: all, the aten path emulates any); a schedule
    using others is planned and explained, not applied. ``apply_schedules=False`` applies none.
    ``max_batch``/``max_stack_bytes`` cap batch-by-shape's stacks (default 64 and the target's bytes).
    ``dist_ownership``: the configured pass for replicated params across ranks (distributed/replicated.py)."""
    distribute: tuple[Pass, ...] = (dist_ownership,) if dist_ownership is not None else ()
    return (
        Canonicalize(),
        FuseNewtonSchulz(),
        FusePolar(),
        FuseEigenbasis(),
        # after fuse-eigenbasis, which proves L symmetric from the lerp-of-a-Gram this one replaces;
        # the inverse root before the two-sided chains, which its Newton products would look like
        FuseFactorUpdate(),
        FuseInverseRoot(),
        FuseTwoSided(),
        *distribute,
        BatchByShape(
            target=target,
            force=force_batch,
            max_batch=max_batch or BatchByShape.max_batch,
            max_stack_bytes=max_stack_bytes,
        ),
        ChooseAlgorithm(target=target, precision=precision),
        ChoosePrecision(
            target=target,
            precision=precision,
            error_budget=error_budget,
            schedule=schedule,
            apply=apply_schedules,
            formats=kernel_formats,
        ),
    )


def step_pipeline(
    settings: Settings,
    target: Target,
    backend: str,
    kernel_formats: frozenset[str] | None = None,
    dist_ownership: DistOwnership | None = None,
    stack_calls: bool = True,
) -> tuple[Pass, ...]:
    """Stage 1: the passes for any step under ``settings`` on ``target``, lowered by ``backend``.
    ``kernel_formats``: the NS formats the Triton lowering has kernels for on the device (None: all).
    ``dist_ownership``: the configured pass when ``distributed="replicated"`` (the runtime resolves
    the process group). ``stack_calls=False`` for graphs Inductor lowers (it has no lowering for
    aten.stack post-grad)."""
    triton = backend == Backend.TRITON
    pipeline = default_pipeline(
        target,
        str(settings.precision),
        force_batch=triton,
        error_budget=settings.error_budget,
        schedule=settings.schedule,
        kernel_formats=kernel_formats,
        max_batch=settings.max_batch,
        max_stack_bytes=settings.max_stack_bytes,
        dist_ownership=dist_ownership,
    )
    cpu_here = target.measured and target.name == "cpu"  # timed on this CPU: another target has nothing to time
    if stack_calls and cpu_here and not triton and settings.distributed != Distributed.REPLICATED:
        # A step traced whole stacks its same-shaped NS calls where this CPU measures that faster
        # and bitwise (a stamped step stacks its classes' members instead: stamped_pipeline).
        pipeline = (*pipeline, StackCalls(target=target, max_batch=settings.max_batch or StackCalls.max_batch,
                                          max_stack_bytes=settings.max_stack_bytes or StackCalls.max_stack_bytes,
                                          cache_dir=settings.cache_dir))
    return pipeline


def pipeline_target(pipeline: tuple[Pass, ...]) -> Target | None:
    """The target the passes plan for (the first pass that has one; None for a pipeline without)."""
    return next((t for t in (getattr(p, "target", None) for p in pipeline) if isinstance(t, Target)), None)


def why_not_stamped(pipeline: tuple[Pass, ...], backend: str, planning: bool) -> Declined | None:
    """Why a step must be traced whole whatever its classes, or None when stamping may go on."""
    if planning:
        return None
    if backend != Backend.ATEN:
        return Declined(f"the {backend} backend compiles a step traced whole (class programs run on the aten lowering)")
    if any(p.name == DistOwnership.name for p in pipeline):
        return Declined("distributed='replicated' plans owners across all matrices: traced whole")
    return None


def stamped_pipeline(
    pipeline: tuple[Pass, ...], members: tuple[tuple[tuple[int, int], int], ...], settings: Settings, planning: bool
) -> tuple[Pass, ...]:
    """Stage 2: ``pipeline`` for a stamped step whose classes are ``members`` (each class's
    ``(group, representative)`` and member count). One call per class: nothing side by side for
    stack-calls; each class's calls may run on stacks of its members (stack-members, last).
    ``planning`` (``hocompile.plan``: nothing runs): no pass that combines calls across params."""
    pipeline = tuple(p for p in pipeline if not isinstance(p, StackCalls))
    if planning:
        return tuple(p for p in pipeline if not isinstance(p, (BatchByShape, DistOwnership)))
    target = pipeline_target(pipeline)
    if target is None:
        return pipeline
    stack = StackMembers(target=target, members=members, max_batch=settings.max_batch or StackMembers.max_batch,
                         max_stack_bytes=settings.max_stack_bytes or StackMembers.max_stack_bytes,
                         cache_dir=settings.cache_dir)
    return (*pipeline, stack)


def traced_whole_pipeline(
    pipeline: tuple[Pass, ...], sharded: bool, gm: fx.GraphModule, settings: Settings, shared: Target | None
) -> tuple[Pass, ...]:
    """Stage 3: ``pipeline`` for a step traced whole. DTensor params (``sharded``): each NS routed
    to an owner or run tensor-parallel (route_sharded.py), the mode chosen on ``shared`` (rank 0's
    target, so every rank chooses alike); no stack-calls, whose timing is one rank's."""
    if not sharded:
        return pipeline
    pipeline = tuple(p for p in pipeline if not isinstance(p, StackCalls))
    return with_route_sharded(pipeline, gm, settings.tp_mode, shared)


def with_route_sharded(
    pipeline: tuple[Pass, ...], gm: fx.GraphModule, tp_mode: str = "auto", target: Target | None = None
) -> tuple[Pass, ...]:
    """``pipeline`` with route-sharded for the ranks of ``gm``'s DTensor inputs, right before
    batch-by-shape (so an owner's matrices batch as on one rank), or last if there is none, and
    tp-newton-schulz last (after choose-algorithm/-precision have planned the calls it inlines).
    ``tp_mode``: the ``tp_mode`` setting ("auto": the cost model on ``target``, by default
    batch-by-shape's; compile_step passes rank 0's, so every rank chooses alike)."""
    layout = step_layout(gm)
    if layout is None:
        return pipeline
    if any(p.name == "dist-ownership" for p in pipeline):
        raise CaptureError(
            "distributed='replicated' was asked for, but the step's params are Shard(0) DTensors: they are "
            "sharded, not replicated (leave distributed at 'auto'; route-sharded plans them)"
        )
    if target is None:
        target = pipeline_target(pipeline)
    group = {"world": layout.world, "rank": layout.rank, "group_name": layout.group_name}
    route = RouteSharded(**group, tp_mode=tp_mode, target=target)  # type: ignore[arg-type]
    names = [p.name for p in pipeline]
    at = names.index("batch-by-shape") if "batch-by-shape" in names else len(pipeline)
    return pipeline[:at] + (route,) + pipeline[at:] + (TensorParallelNS(**group),)  # type: ignore[arg-type]
