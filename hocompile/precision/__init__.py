"""Numerics of the precision planner: emulated compute formats, scheduled NS, calibration.

Everything runs on CPU: each tensor-core format is emulated exactly
(quantise → exact products → fp32 accumulation → rounded epilogue), so the
planner's error model is measured and tested without a GPU.
"""

from .calibrate import Calibration, load_calibration
from .emulate import FORMATS, Format, emulated_matmul, quantize
from .schedule_ns import newton_schulz_scheduled
from .spectra import SPECTRA, spectrum

__all__ = [
    "FORMATS",
    "SPECTRA",
    "Calibration",
    "Format",
    "emulated_matmul",
    "load_calibration",
    "newton_schulz_scheduled",
    "quantize",
    "spectrum",
]
