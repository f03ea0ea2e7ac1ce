"""The pass pipeline, in the order it runs.

``default_pipeline(target, precision)`` is the explicit tuple the runtime
runs; see README.md for the invariants every pass keeps. The family
recognisers (fuse-*) run before batch-by-shape so their ops batch like NS.
dist-ownership (replicated params across ranks, only when asked for) runs
after them and before batch-by-shape: it sees every orthogonalisation one by
one, and each rank then batches and plans (algorithm, precision) only the
share it computes.
route-sharded (DTensor params, Shard(0) or Shard(1)) is not in the tuple: compile_step
inserts it before batch-by-shape when the captured step has DTensor inputs, and
tp-newton-schulz last (it inlines the tensor-parallel NS modes route-sharded chose,
after choose-algorithm/-precision planned those calls).
"""

from __future__ import annotations

from ..targets import Target
from .base import Pass, PassResult
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
from .runner import PassRecord, run_pipeline


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


__all__ = [
    "BatchByShape",
    "Canonicalize",
    "ChooseAlgorithm",
    "ChoosePrecision",
    "DistOwnership",
    "FuseEigenbasis",
    "FuseFactorUpdate",
    "FuseInverseRoot",
    "FuseNewtonSchulz",
    "FusePolar",
    "FuseTwoSided",
    "Pass",
    "PassRecord",
    "PassResult",
    "RouteSharded",
    "default_pipeline",
    "run_pipeline",
]
