"""The pass pipeline, in the order it runs.

Later passes (fuse-newton-schulz, batch-by-shape, choose-algorithm,
choose-precision, distribute) slot in here; see README.md for the invariants
every pass keeps.
"""

from __future__ import annotations

from .base import Pass, PassResult
from .canonicalize import Canonicalize
from .runner import PassRecord, run_pipeline

PIPELINE: tuple[Pass, ...] = (Canonicalize(),)

__all__ = ["PIPELINE", "Canonicalize", "Pass", "PassRecord", "PassResult", "run_pipeline"]
