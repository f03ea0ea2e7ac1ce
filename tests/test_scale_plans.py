"""hocompile.plan on frontier structures at their true shapes (meta tensors): per-class plans, expected text.

The step of Qwen3-30B-A3B's and Kimi K2's Muon params (18,624 and 69,608 matrices) is stamped
per parameter class and planned for sm90 (a static rate table: the same plan on any machine),
with the replicated owner plan at world 64. Timings of the capture and the passes are replaced
by ``<t>``; everything else is compared with tests/goldens/ (``EXPECTTEST_ACCEPT=1`` rewrites them).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

import hocompile
from benchmarks.structures import build

GOLDENS = Path(__file__).parent / "goldens"


def _planned(structure: str, experts: str) -> tuple[hocompile.PlanReport, str]:
    """The plan report, and its text with timings masked (for the golden)."""
    muon, _ = build(structure, scale=1, experts=experts, device="meta")
    for p in muon:
        p.grad = torch.empty_like(p)
    optimizer = torch.optim.Muon(muon, lr=0.02, weight_decay=0.1) if experts == "separate" else None
    if optimizer is None:
        from benchmarks.batched_muon import BatchedMuon

        optimizer = BatchedMuon(muon, lr=0.02, weight_decay=0.1)
    report = hocompile.plan(optimizer, target="sm90", world=64)
    return report, re.sub(r"\d+\.\d+ s\b", "<t> s", report)


@pytest.mark.parametrize("structure,experts", [("qwen3", "separate"), ("kimi-k2", "separate"), ("kimi-k2", "stacked")])
def test_frontier_structure_plans_per_class(structure: str, experts: str, tmp_path: Path) -> None:
    report, text = _planned(structure, experts)
    assert report.stamped and report.classes and not report.traced_whole
    golden = GOLDENS / f"plan_{structure}_{experts}_sm90_w64.txt"
    if os.environ.get("EXPECTTEST_ACCEPT"):
        golden.write_text(text)
    assert text == golden.read_text()
