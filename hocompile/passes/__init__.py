"""The pass pipeline, in the order it runs.

``default_pipeline(target, precision)`` is the explicit tuple the runtime
runs; see README.md for the invariants every pass keeps. The family
recognisers (fuse-*) run before batch-by-shape so their ops batch like NS.
Still to come: distribute.
"""

from __future__ import annotations

from ..targets import Target
from .base import Pass, PassResult
from .batch_by_shape import BatchByShape
from .canonicalize import Canonicalize
from .choose_algorithm import ChooseAlgorithm
from .choose_precision import ChoosePrecision
from .fuse_eigenbasis import FuseEigenbasis
from .fuse_factor_update import FuseFactorUpdate
from .fuse_inverse_root import FuseInverseRoot
from .fuse_newton_schulz import FuseNewtonSchulz
from .fuse_polar import FusePolar
from .fuse_two_sided import FuseTwoSided
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
) -> tuple[Pass, ...]:
    """``force_batch``: the Triton backend launches per shape group. ``kernel_formats``: the
    formats the lowering has NS kernels for (None: all, the aten path emulates any); a schedule
    using others is planned and explained, not applied. ``apply_schedules=False`` applies none.
    ``max_batch``/``max_stack_bytes`` cap batch-by-shape's stacks (default 64 and the target's bytes)."""
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
    "FuseEigenbasis",
    "FuseFactorUpdate",
    "FuseInverseRoot",
    "FuseNewtonSchulz",
    "FusePolar",
    "FuseTwoSided",
    "Pass",
    "PassRecord",
    "PassResult",
    "default_pipeline",
    "run_pipeline",
]
