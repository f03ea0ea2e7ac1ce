"""The passes, one per file, and the pipeline that runs them.

Which passes run for a step, in which order, is decided in one place: ``pipeline.py``
(``default_pipeline`` and the three stages that adapt it to a step). ``runner.py`` runs a
pipeline; README.md lists the invariants every pass keeps.
"""

from __future__ import annotations

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
from .pipeline import default_pipeline
from .route_sharded import RouteSharded
from .runner import PassRecord, run_pipeline

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
