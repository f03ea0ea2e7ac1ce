"""``benchmarks/gpu_check.py --smoke``: the device check's every section, on CPU under Triton's interpreter.

The device check is what a GPU session runs in one go (no GPU has run it yet): this keeps its code
paths working between such sessions. Tiny shapes, one process per section's needs; the report
(JSON and Markdown) goes to a temporary folder, and the estimate for an H200 must fit its budget.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU machine runs the real check")
def test_gpu_check_smoke_runs_every_section_and_passes(tmp_path: Path) -> None:
    out = tmp_path / "gpu-interpret.json"
    env = {**os.environ, "HOCOMPILE_CACHE_DIR": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--smoke", "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    report = json.loads(out.read_text())
    sections = report["sections"]
    assert list(sections) == ["env", "kernels", "step", "fence", "gpt2", "large", "shampoo_family", "distributed"]
    assert report["failures"] == [] and not any("error" in s for s in sections.values())
    assert sections["kernels"]["failed"] == [] and not sections["kernels"]["skipped"]
    assert all(sections["fence"][case]["passed"] for case in ("launch_failure", "eigh_fallback", "layouts"))
    assert sections["shampoo_family"]["SOAP"]["hocompile"]["backend"] == "triton"  # the GPU's path, interpreted
    assert sections["distributed"]["passed"]
    # Its own estimate for one H200, printed before it runs, fits the 6-minute budget.
    estimate = re.search(r"estimate on one H200 .*; total (\d+) s of the (\d+) s budget", run.stdout)
    assert estimate is not None, run.stdout[:2000]
    assert int(estimate.group(1)) <= int(estimate.group(2)) <= 360
    assert report["estimate_h200_total_s"] == int(estimate.group(1))
    markdown = out.with_suffix(".md").read_text()
    assert "**PASS**" in markdown and "| fence | ok |" in markdown
