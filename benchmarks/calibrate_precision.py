"""Regenerate hocompile/precision/calibration.json: NS error of every precision schedule.

    .venv/bin/python benchmarks/calibrate_precision.py             # the shipped table (~3 min on 2 cores)
    .venv/bin/python benchmarks/calibrate_precision.py --quick     # 2 sets, smallest shape: a smoke run
    .venv/bin/python benchmarks/calibrate_precision.py --out /tmp/c.json

What is measured (per coefficient set × algorithm × spectrum × shape, the
max-abs error against reference_fp64) is described in
hocompile/precision/calibrate.py; this script runs it, stamps the metadata
(torch version, date, shapes, seed, the command) and prints a summary: the
worst-case error of the uniform schedules and of the low-precision-early
schedules the planner is most interested in.
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from hocompile.precision import calibrate, spectra
from hocompile.precision.emulate import FORMATS


def metadata(shapes: list[tuple[int, int]], seconds: float) -> dict[str, Any]:
    return {
        "description": "max |NS(x) - reference_fp64(x)| per [shape][spectrum]; null = diverged (inf/nan)",
        "command": " ".join(shlex.quote(a) for a in [".venv/bin/python", *sys.argv]),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
        "seconds": round(seconds, 1),
        "shapes": [list(s) for s in shapes],
        "spectra": list(spectra.SPECTRA),
        "seed": calibrate.SEED,
        "eps": calibrate.EPS,
        "eps_mode": calibrate.EPS_MODE,
        "formats": list(FORMATS),
        "early_formats": list(calibrate.EARLY_FORMATS),
        "late_formats": list(calibrate.LATE_FORMATS),
        "gram_restarts": "after iteration 2 when steps > 3",
        "baseline": "hocompile.newton_schulz bf16 (matmul='emulate'), eager's precision",
        "significant_digits": calibrate.SIGNIFICANT_DIGITS,
    }


def summary(doc: dict[str, Any]) -> str:
    cal = calibrate.parse_calibration(doc)
    lines = []
    for s in cal.sets:
        steps = len(s.coefficients)
        for algorithm in calibrate.ALGORITHMS:
            picks = {
                "eager bf16": cal.baseline_error(s.coefficients, algorithm),
                "bf16": cal.predicted_error(s.coefficients, algorithm, ("bf16",) * steps),
                "fp16": cal.predicted_error(s.coefficients, algorithm, ("fp16",) * steps),
                "fp8*2+bf16": cal.predicted_error(
                    s.coefficients, algorithm, ("fp8_e4m3",) * 2 + ("bf16",) * (steps - 2)
                ),
                "mx*2+bf16": cal.predicted_error(
                    s.coefficients, algorithm, ("mxfp8_e4m3",) * 2 + ("bf16",) * (steps - 2)
                ),
                "fp8*2+fp32": cal.predicted_error(
                    s.coefficients, algorithm, ("fp8_e4m3",) * 2 + ("fp32",) * (steps - 2)
                ),
            }
            cells = "  ".join(f"{k} {v:9.3g}" for k, v in picks.items())
            lines.append(f"{s.name + '@' + str(steps):18s} {algorithm:8s} {cells}")
    return "\n".join(lines)


def dumps(value: Any, indent: int = 0) -> str:
    """JSON with one line per schedule (reviewable diffs), lists of numbers kept on one line."""
    pad = " " * (indent + 1)
    if isinstance(value, dict) and not all(isinstance(v, (int, float, str)) for v in value.values()):
        items = [f"{pad}{json.dumps(k)}: {dumps(v, indent + 1)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + "\n" + " " * indent + "}"
    if isinstance(value, list) and value and isinstance(value[0], dict):
        return "[\n" + ",\n".join(pad + dumps(v, indent + 1) for v in value) + "\n" + " " * indent + "]"
    return json.dumps(value, separators=(",", ":"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=calibrate.CALIBRATION_PATH)
    parser.add_argument("--quick", action="store_true", help="2 coefficient sets, the smallest shape")
    args = parser.parse_args()
    if args.quick and args.out == calibrate.CALIBRATION_PATH:
        args.out = Path(tempfile.gettempdir()) / "calibration-quick.json"  # never ship a smoke run
    sets = list(calibrate.CALIBRATED[:2] if args.quick else calibrate.CALIBRATED)
    shapes = list(calibrate.SHAPES[:1] if args.quick else calibrate.SHAPES)
    t0 = time.perf_counter()
    records = calibrate.run_calibration(
        sets, shapes, progress=lambda msg: print(f"[{time.perf_counter() - t0:6.1f}s] {msg}", flush=True)
    )
    doc = {"metadata": metadata(shapes, time.perf_counter() - t0), "sets": records}
    text = dumps(doc)
    args.out.write_text(text + "\n")
    print(f"wrote {args.out} ({len(text) / 1024:.0f} KB) in {time.perf_counter() - t0:.0f}s")
    print(summary(doc))


if __name__ == "__main__":
    main()
