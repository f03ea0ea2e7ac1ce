"""May Gram NS run in half precision for this coefficient set and shape? The calibrated answer.

Gram NS iterates on the m×m Gram matrix and applies the accumulated
polynomial once, so its rounding errors are not corrected by later
iterations the way standard NS's are; a restart (``restarts_for``) bounds
them. Whether that is enough depends on the coefficients and the shape, so
the answer comes from the shipped calibration (calibration.json): its
baseline holds, per coefficient set, shape and spectrum, the max-abs error
against fp64 of hocompile's bf16 NS — standard (eager's own program) and
Gram with the calibrated restarts. Gram in bf16 is admitted where its error
is within ``factor`` × standard's on **every** spectrum at the calibrated
shapes of the op's aspect ratio (the error grows with n/m: at 64×64 bf16
Gram is 6× standard's for Keller Jordan's coefficients, at 128×512 0.8–1.3×).

Only bf16 is calibrated for Gram: fp16 Gram NS (and any set without
calibration data) is refused, with the reason. Measured on this CPU's native
bf16 GEMM (768×3072 Gaussian, Keller Jordan): Gram with one restart after
iteration 2 is 2.2× standard's error, and no placement of one to three
restarts brought it under 2×; the calibration refuses it too (1.29× on
heavy-tailed 128×512), so on GPT-2's shapes the planner keeps standard NS.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .calibrate import load_calibration, restarts_for


@dataclass(frozen=True)
class GramVerdict:
    allowed: bool
    why: str
    ratio: float | None = None  # worst Gram/standard error ratio over the cases looked at
    restarts: tuple[int, ...] = ()


def half_gram_verdict(
    coefficients: Sequence[tuple[float, float, float]],
    m: int,
    n: int,
    dtype: torch.dtype,
    factor: float = 1.0,
) -> GramVerdict:
    """Is bf16 Gram NS (with the calibrated restarts) within ``factor`` × eager's bf16 error here?"""
    restarts = restarts_for("gram", len(coefficients))
    if dtype != torch.bfloat16:
        return GramVerdict(False, f"Gram NS not calibrated in {dtype}", restarts=restarts)
    calibration = load_calibration()
    try:
        found = calibration.find(coefficients)
    except KeyError:
        return GramVerdict(False, "coefficients not calibrated", restarts=restarts)
    shapes = [tuple(s) for s in calibration.metadata["shapes"]]
    aspect = max(m, n) / max(1, min(m, n))
    # The calibrated shapes nearest in aspect ratio (log scale): the error follows n/m.
    distance = {s: abs(math.log((s[1] / s[0]) / aspect)) for s in shapes}
    nearest = min(distance.values())
    cases = [s for s in shapes if distance[s] == nearest]
    standard = calibration.baseline_errors(found.coefficients, "standard", len(coefficients))
    gram = calibration.baseline_errors(found.coefficients, "gram", len(coefficients))
    worst, where = 0.0, ""
    for (shape, kind), eager in standard.items():
        if shape not in cases or not math.isfinite(eager) or eager == 0.0:
            continue
        ratio = gram[(shape, kind)] / eager
        if ratio > worst:
            worst, where = ratio, f"{kind} {shape[0]}x{shape[1]}"
    if worst > factor:
        return GramVerdict(False, f"bf16 Gram {worst:.2f}x eager's error on {where}", worst, restarts)
    return GramVerdict(True, f"bf16 Gram within {worst:.2f}x eager's error", worst, restarts)


__all__ = ["GramVerdict", "half_gram_verdict"]
