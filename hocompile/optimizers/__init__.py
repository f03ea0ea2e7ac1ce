"""Optimizers that hocompile ships, written so that their steps compile.

``Shampoo`` is also the eager reference its compiled step is tested against
(tests/test_shampoo.py checks it in turn against an independent float64 loop).
"""

from __future__ import annotations

from .matrix_roots import inverse_root_eigh, inverse_root_newton, matrix_inverse_root, newton_residual
from .shampoo import Shampoo, block_ranges

__all__ = [
    "Shampoo",
    "block_ranges",
    "inverse_root_eigh",
    "inverse_root_newton",
    "matrix_inverse_root",
    "newton_residual",
]
