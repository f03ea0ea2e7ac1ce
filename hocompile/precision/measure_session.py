"""One compile's Newton–Schulz timings (:class:`MeasureSession`) and their cache on disk.

A session shares the measurement budget among the shapes one compile times, measures each shape
once, and keeps the unit timings per CPU (``targets.cpu_id``) and shape in the cache directory with
their spread: a cached entry whose contenders spread more than ``SPREAD_LIMIT`` (timed under load)
is measured again. What is timed, and how, is measure_ns.py.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..diskcache import read_json, write_json
from ..targets import Target, cpu_id
from .measure_ns import (
    BUDGET_S,
    MEASURE_VERSION,
    SPREAD_LIMIT,
    UNITS,
    Candidate,
    GroupMeasurement,
    Program,
    ProgramTiming,
    Timer,
    measure_programs,
)


@dataclass
class MeasureSession:
    """One compile's measurements: a shared budget, each shape measured once, the disk cache."""

    target: Target
    timer: Timer
    budget_s: float = BUDGET_S
    groups: dict[tuple[Any, ...], GroupMeasurement] = field(default_factory=dict)
    spent_s: float = 0.0
    remeasured: int = 0  # cached entries not trusted (spread too high)
    expected_groups: int = 1  # shapes this compile will measure: each gets its share of the budget

    def measure(
        self,
        candidates: Sequence[Candidate],
        counts: dict[Candidate, dict[str, int]],
        shape: tuple[int, int, int],
        coefficients: Sequence[tuple[float, float, float]],
    ) -> GroupMeasurement:
        programs = list(dict.fromkeys(c.program for c in candidates))
        key = (shape, tuple(p.label() for p in programs))
        if key in self.groups:
            return self.groups[key]
        cache_dir = self.target.cache_dir
        path = cache_path(cache_dir, shape, programs) if cache_dir is not None else None
        mine = _MEASURED_HERE.get(_file_key(path)) if path is not None else None
        if mine is not None:
            # Measured by this process (an earlier compile, e.g. before the optimizer state
            # existed) and not rewritten since: re-checking it seconds later would only cost time.
            self.groups[key] = GroupMeasurement(mine.timings, 0.0, cached=True)
            return self.groups[key]
        found = load_measurement(path, programs) if path is not None else None
        if found is not None and found.contenders_spread(candidates, counts) <= SPREAD_LIMIT:
            self.groups[key] = found
            return found
        self.remeasured += found is not None
        # Timing shapes: the first coefficient triple that has a c (the square unit is timed
        # even for a cubic set: its count is then 0).
        a, b, c = next((t for t in coefficients if t[2] != 0.0), (*coefficients[0][:2], 1.0))
        left = max(1, self.expected_groups - len(self.groups))
        remaining = max(0.0, self.budget_s - self.spent_s) / left
        measured = measure_programs(candidates, counts, shape, (a, b, c), self.target, remaining, self.timer)
        self.spent_s += measured.spent_s
        if path is not None:
            save_measurement(path, measured)  # unwritable: warned once inside, measured again next time
            _MEASURED_HERE[_file_key(path)] = measured
        self.groups[key] = measured
        return measured

    def describe(self) -> str:
        cached = sum(1 for g in self.groups.values() if g.cached)
        text = f"timed {len(self.groups) - cached} shape(s) in {self.spent_s:.2f} s, {cached} from cache"
        return text + (f", {self.remeasured} re-measured (spread > {SPREAD_LIMIT:.0%})" if self.remeasured else "")


# ------------------------------------------------------------------ cache

# Measurements this process made, by (cache file, its mtime): trusted for the process's life
# whatever their spread; another process (or a rewritten file) re-checks them.
_MEASURED_HERE: dict[tuple[str, int], GroupMeasurement] = {}


def _file_key(path: Path) -> tuple[str, int]:
    try:
        return str(path), path.stat().st_mtime_ns
    except OSError:
        return str(path), -1  # not written (unwritable directory): this process's own result


def cache_path(cache_dir: Path, shape: tuple[int, int, int], programs: Sequence[Program]) -> Path:
    text = f"{MEASURE_VERSION}|{shape}|" + ",".join(p.label() for p in programs)
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    return cache_dir / f"ns-timing-{cpu_id()}-{digest}.json"


def load_measurement(path: Path, programs: Sequence[Program]) -> GroupMeasurement | None:
    def parse(data: Any) -> GroupMeasurement:
        if not isinstance(data, dict) or data.get("version") != MEASURE_VERSION:
            raise ValueError("not a measurement of this version")
        timings: dict[Program, ProgramTiming] = {}
        for p in programs:
            entry = data["programs"][p.label()]
            samples = {u: [float(s) for s in entry["samples"][u]] for u in UNITS}
            if any(s <= 0 for v in samples.values() for s in v):
                raise ValueError("non-positive timing")
            timings[p] = ProgramTiming(samples, str(entry["dropped"]))
        return GroupMeasurement(timings, 0.0, cached=True)

    return read_json(path, parse)


def save_measurement(path: Path, measurement: GroupMeasurement) -> None:
    programs = {p.label(): t.to_json() for p, t in measurement.timings.items()}
    write_json(path, {"version": MEASURE_VERSION, "programs": programs})


__all__ = ["MeasureSession", "cache_path", "load_measurement", "save_measurement"]
