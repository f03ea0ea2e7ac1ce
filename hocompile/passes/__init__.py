"""The pass pipeline, in the order it runs.

``default_pipeline(target, precision)`` is the explicit tuple the runtime
runs; see README.md for the invariants every pass keeps. Still to come:
choose-precision (per-iteration schedules) and distribute.
"""

from __future__ import annotations

from ..targets import Target
from .base import Pass, PassResult
from .batch_by_shape import BatchByShape
from .canonicalize import Canonicalize
from .choose_algorithm import ChooseAlgorithm
from .fuse_newton_schulz import FuseNewtonSchulz
from .runner import PassRecord, run_pipeline


def default_pipeline(target: Target, precision: str = "auto", force_batch: bool = False) -> tuple[Pass, ...]:
    """``force_batch``: the Triton backend launches per shape group, whatever the target."""
    return (
        Canonicalize(),
        FuseNewtonSchulz(),
        BatchByShape(target=target, force=force_batch),
        ChooseAlgorithm(target=target, precision=precision),
    )


__all__ = [
    "BatchByShape",
    "Canonicalize",
    "ChooseAlgorithm",
    "FuseNewtonSchulz",
    "Pass",
    "PassRecord",
    "PassResult",
    "default_pipeline",
    "run_pipeline",
]
