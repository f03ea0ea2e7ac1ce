"""Measured NS error of every precision schedule the planner may pick, and its lookup.

For each coefficient set in :data:`CALIBRATED`, each algorithm (standard;
Gram with a restart after iteration 2 when there are more than 3 steps),
each spectrum in :data:`~hocompile.precision.spectra.SPECTRA` and each shape
in :data:`SHAPES`, the table holds the max-abs error against
``reference_fp64`` (the same polynomial in fp64) of every schedule in
:func:`planner_schedules`, plus the baseline: hocompile's bf16 NS (bf16
normalisation, as eager), the precision the planner must not fall below by
default (its budget: no worse than the eager optimizer's own precision).

The table ships as ``calibration.json`` next to this file; regenerate it
with ``.venv/bin/python benchmarks/calibrate_precision.py``. Numbers are
kept to 4 significant digits. They are deterministic on one machine; on
another CPU the fp32/bf16 entries can move in the last digits (BLAS
summation order), the FP8 entries much less (their accumulation order is
fixed, see emulate.py).
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..ops.newton_schulz_math import newton_schulz, reference_fp64
from .coefficients import Table, coefficients
from .emulate import FORMATS
from .schedule_ns import advance, finish, newton_schulz_scheduled, start
from .spectra import SPECTRA, spectrum

CALIBRATION_PATH = Path(__file__).with_name("calibration.json")

# (coefficient set, steps): each table at its own length, plus the 5 steps
# emerging-optimizers' Muon runs by default (num_ns_steps=5) where that is a
# different polynomial. "simple"@5 and "deepseekv4"@5 are keller_jordan@5.
CALIBRATED: tuple[tuple[str, int], ...] = (
    ("keller_jordan", 5),
    ("quintic", 5),
    ("polar_express", 8),
    ("polar_express", 5),
    ("cans", 5),
    ("aol", 4),
    ("aol", 5),
    ("deepseekv4", 10),
    ("cubic", 5),
)
ALGORITHMS = ("standard", "gram")
SHAPES: tuple[tuple[int, int], ...] = ((64, 64), (64, 256), (128, 512))
SEED = 0
# torch.optim.Muon's eps and eps placement (x / max(‖x‖, eps)).
EPS, EPS_MODE = 1e-7, "clamp"
# The "low-precision-early" family: the first j iterations in EARLY, the rest in LATE.
EARLY_FORMATS = ("fp8_e4m3", "mxfp8_e4m3", "fp16", "bf16")
LATE_FORMATS = ("bf16", "fp16", "fp32")
SIGNIFICANT_DIGITS = 4

Schedule = tuple[str, ...]


def restarts_for(algorithm: str, steps: int) -> tuple[int, ...]:
    """Gram NS restarts after iteration 2 when there are more than 3 steps.

    Gram NS needs a restart (``R`` recomputed from ``Q X₀``) in half
    precision; one after iteration 2 kept a 5-step bf16 Gram NS within about
    1.25× of standard NS's error against fp64 (768×3072: 1.3e-2 vs 1.04e-2).
    """
    return (2,) if algorithm == "gram" and steps > 3 else ()


def planner_schedules(steps: int) -> list[Schedule]:
    """Every uniform schedule, then early-F / late-G splits after j = 1 .. steps-1 iterations."""
    out: list[Schedule] = [(f,) * steps for f in FORMATS]
    for early in EARLY_FORMATS:
        for late in LATE_FORMATS:
            for j in range(1, steps):
                s = (early,) * j + (late,) * (steps - j)
                if s not in out:
                    out.append(s)
    return out


def schedule_key(schedule: Sequence[str]) -> str:
    """Run-length name of a schedule: ``("fp8_e4m3",)*2 + ("bf16",)*3`` → ``"fp8_e4m3*2+bf16*3"``."""
    runs: list[list[Any]] = []
    for f in schedule:
        if runs and runs[-1][0] == f:
            runs[-1][1] += 1
        else:
            runs.append([f, 1])
    return "+".join(f"{f}*{n}" for f, n in runs)


def parse_schedule_key(key: str) -> Schedule:
    out: list[str] = []
    for run in key.split("+"):
        f, n = run.rsplit("*", 1)
        out += [f] * int(n)
    return tuple(out)


def calibration_inputs(m: int, n: int, seed: int = SEED) -> torch.Tensor:
    """[len(SPECTRA), m, n] fp32: one matrix per spectrum kind (a batch, so one NS call measures all)."""
    return torch.stack([spectrum(kind, m, n, seed) for kind in SPECTRA])


def _round_sig(x: float) -> float | None:
    """Stored digits; a non-finite error (the run diverged) is stored as null and read back as inf."""
    return float(f"{x:.{SIGNIFICANT_DIGITS - 1}e}") if math.isfinite(x) else None


def max_abs_errors(out: torch.Tensor, reference: torch.Tensor) -> list[float | None]:
    """Per matrix of a batch: max |out - reference|, rounded to the stored digits."""
    err = (out.to(torch.float64) - reference).abs().amax(dim=(-2, -1))
    err = torch.where(torch.isnan(err), math.inf, err)
    return [_round_sig(e) for e in err.tolist()]


def measure(
    coeffs: Table, algorithm: str, schedule: Sequence[str], inputs: torch.Tensor, reference: torch.Tensor
) -> list[float | None]:
    """Errors of one schedule on a batch of inputs (one per spectrum), as stored in the table."""
    out = newton_schulz_scheduled(
        inputs, coeffs, EPS, schedule, eps_mode=EPS_MODE, algorithm=algorithm,
        restarts=restarts_for(algorithm, len(coeffs)), out_dtype=torch.float32,
    )
    return max_abs_errors(out, reference)


def measure_schedules(
    coeffs: Table, algorithm: str, inputs: torch.Tensor, reference: torch.Tensor
) -> dict[str, list[float | None]]:
    """:func:`measure` for every planner schedule, each prefix run once.

    Every schedule is "j iterations in F, then G"; the states after 1 .. T
    iterations of the uniform-F run are resumed in G (schedule_ns.advance),
    which gives the bits of an uninterrupted run at a fraction of the cost.
    """
    steps = len(coeffs)
    restarts = restarts_for(algorithm, steps)
    initial = start(inputs, EPS, eps_mode=EPS_MODE)
    found: dict[str, list[float | None]] = {}
    for early in FORMATS:
        uniform = (early,) * steps
        states = [initial]
        for k in range(steps):
            states.append(advance(states[-1], coeffs, uniform, k + 1, algorithm=algorithm, restarts=restarts))
        found[schedule_key(uniform)] = max_abs_errors(finish(states[-1], early), reference)
        if early not in EARLY_FORMATS:
            continue
        for late in LATE_FORMATS:
            for j in range(1, steps):
                schedule = (early,) * j + (late,) * (steps - j)
                if schedule_key(schedule) not in found:
                    end = advance(states[j], coeffs, schedule, steps, algorithm=algorithm, restarts=restarts)
                    found[schedule_key(schedule)] = max_abs_errors(finish(end, late), reference)
    return {schedule_key(s): found[schedule_key(s)] for s in planner_schedules(steps)}


def measure_baseline(
    coeffs: Table, algorithm: str, inputs: torch.Tensor, reference: torch.Tensor
) -> list[float | None]:
    """Errors of hocompile's bf16 NS (normalisation rounded to bf16, as eager's bf16 NS does)."""
    out = newton_schulz(
        inputs, coeffs, EPS, eps_mode=EPS_MODE, compute_dtype=torch.bfloat16, out_dtype=torch.float32,
        algorithm=algorithm, restarts=restarts_for(algorithm, len(coeffs)), matmul="emulate",
    )
    return max_abs_errors(out, reference)


Grid = list[list[float | None]]  # [shape][spectrum]


def run_calibration(
    sets: Sequence[tuple[str, int]] = CALIBRATED,
    shapes: Sequence[tuple[int, int]] = SHAPES,
    progress: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """Measure the whole table: one JSON record per coefficient set."""
    inputs = {shape: calibration_inputs(*shape) for shape in shapes}
    records: list[dict[str, Any]] = []
    for name, steps in sets:
        coeffs = coefficients(name, steps)
        refs = {s: reference_fp64(x, coeffs, EPS, eps_mode=EPS_MODE) for s, x in inputs.items()}
        errors: dict[str, dict[str, Grid]] = {}
        baseline: dict[str, Grid] = {}
        for algorithm in ALGORITHMS:
            baseline[algorithm] = [measure_baseline(coeffs, algorithm, inputs[s], refs[s]) for s in shapes]
            per_shape = [measure_schedules(coeffs, algorithm, inputs[s], refs[s]) for s in shapes]
            errors[algorithm] = {key: [grid[key] for grid in per_shape] for key in per_shape[0]}
            if progress:
                progress(f"{name}@{steps} {algorithm}: {len(errors[algorithm])} schedules")
        records.append(
            {"name": name, "steps": steps, "coefficients": [list(t) for t in coeffs], "baseline": baseline,
             "errors": errors}
        )
    return records


@dataclass(frozen=True)
class CalibratedSet:
    name: str
    coefficients: Table
    baseline: dict[str, Grid]  # algorithm -> [shape][spectrum]
    errors: dict[str, dict[str, Grid]]  # algorithm -> schedule key -> [shape][spectrum]


@dataclass(frozen=True)
class Calibration:
    """The shipped error table. Coefficient sets are named (``"quintic"``; the
    steps are taken from the schedule's length) or given as the tuples
    themselves, matched by value."""

    metadata: dict[str, Any]
    sets: tuple[CalibratedSet, ...]

    def find(self, coefficient_set: str | Sequence[Sequence[float]], steps: int | None = None) -> CalibratedSet:
        wanted = coefficients(coefficient_set, steps) if isinstance(coefficient_set, str) else coefficient_set
        for s in self.sets:
            if len(s.coefficients) == len(wanted) and all(
                abs(x - y) <= 1e-12 for t, u in zip(s.coefficients, wanted) for x, y in zip(t, u)
            ):
                return s
        raise KeyError(f"no calibration for coefficient set {coefficient_set!r} (steps={steps})")

    def errors(
        self, coefficient_set: str | Sequence[Sequence[float]], algorithm: str, schedule: Sequence[str]
    ) -> dict[tuple[tuple[int, int], str], float]:
        """Error of one schedule per (shape, spectrum)."""
        table = self.find(coefficient_set, len(schedule)).errors[algorithm]
        key = schedule_key(schedule)
        if key not in table:
            raise KeyError(f"schedule {key} not calibrated for {coefficient_set!r} / {algorithm}")
        return self._by_case(table[key])

    def predicted_error(
        self, coefficient_set: str | Sequence[Sequence[float]], algorithm: str, schedule: Sequence[str]
    ) -> float:
        """Worst max-abs error over the calibrated spectra and shapes."""
        return max(self.errors(coefficient_set, algorithm, schedule).values())

    def baseline_error(
        self, coefficient_set: str | Sequence[Sequence[float]], algorithm: str, steps: int | None = None
    ) -> float:
        """Worst error of hocompile's bf16 NS (eager's precision): the planner's default budget."""
        return max(self.baseline_errors(coefficient_set, algorithm, steps).values())

    def baseline_errors(
        self, coefficient_set: str | Sequence[Sequence[float]], algorithm: str, steps: int | None = None
    ) -> dict[tuple[tuple[int, int], str], float]:
        """The baseline's error per (shape, spectrum)."""
        return self._by_case(self.find(coefficient_set, steps).baseline[algorithm])

    def schedules(self, coefficient_set: str | Sequence[Sequence[float]], algorithm: str,
                  steps: int | None = None) -> list[Schedule]:
        return [parse_schedule_key(k) for k in self.find(coefficient_set, steps).errors[algorithm]]

    def _by_case(self, grid: Grid) -> dict[tuple[tuple[int, int], str], float]:
        return {
            ((m, n), kind): math.inf if e is None else e
            for (m, n), row in zip(self.metadata["shapes"], grid)
            for kind, e in zip(self.metadata["spectra"], row)
        }


def parse_calibration(doc: dict[str, Any]) -> Calibration:
    sets = tuple(
        CalibratedSet(s["name"], tuple((a, b, c) for a, b, c in s["coefficients"]), s["baseline"], s["errors"])
        for s in doc["sets"]
    )
    return Calibration(doc["metadata"], sets)


@functools.lru_cache(maxsize=4)
def load_calibration(path: Path | str = CALIBRATION_PATH) -> Calibration:
    """The shipped table (cached: it is read once per process)."""
    return parse_calibration(json.loads(Path(path).read_text()))
