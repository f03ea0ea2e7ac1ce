"""explain() and plan() return reports: their text as before, their facts as fields (runtime/report/reports.py)."""

from __future__ import annotations

import pytest
import torch

import hocompile
from hocompile.passes import PassRecord

from .helpers import Pair


def _muon(ps: list[torch.Tensor]) -> torch.optim.Optimizer:
    return torch.optim.Muon(ps, lr=0.02, weight_decay=0.1)


def test_explanation_fields_say_what_the_text_says(cache_dir) -> None:
    pair = Pair(_muon, [(8, 4), (4, 4)], cache_dir)
    empty = hocompile.explain(pair.compiled)
    assert isinstance(empty, str) and empty.programs == () and empty.steps == 0
    for _ in range(3):
        pair.step()
    report = hocompile.explain(pair.compiled)
    assert isinstance(report, hocompile.Explanation) and str(report).startswith("hocompile: torch.optim")
    assert report.optimizer == "torch.optim.Muon" and report.steps == 3 and not report.runs_eagerly
    assert report.counters["compiles"] == len(report.programs) == 2 and report.counters["cache_hits"] == 1
    first, steady = report.programs
    assert (first.number, steady.number) == (1, 2) and first.reason == "first step"
    assert all(isinstance(r, PassRecord) for r in first.passes) and first.passes[0].name == "canonicalize"
    # every field is in the text too: the text is the report, the fields its facts
    for program in report.programs:
        assert f"compiled step #{program.number} ({program.reason})" in report
        assert program.backend == "aten" and f"cache key: {program.cache_key}" in report and not program.eager
        assert "fuse-newton-schulz" in program.fired() and all(f"    {p}" in report for p in program.plans)
        assert all(name in report for name in program.fired())
    assert steady.self_check and steady.self_check in report


def test_explanation_of_a_step_that_runs_eagerly(cache_dir) -> None:
    class NoState:  # no state dict: nothing the capture could rebind
        def __init__(self, params: list[torch.Tensor]) -> None:
            self.param_groups = [{"params": params}]

        def step(self) -> None:
            for p in self.param_groups[0]["params"]:
                p.data.add_(1.0)

    opt = hocompile.compile_optimizer(NoState([torch.zeros(3)]), cache_dir=cache_dir, fallback="eager")
    opt.step()
    report = hocompile.explain(opt)
    assert "lacks state" in report.runs_eagerly and report.runs_eagerly in report and report.programs == ()


def test_plan_report_fields(cache_dir) -> None:
    params = [torch.nn.Parameter(torch.randn(16, 8)) for _ in range(8)]
    for p in params:
        p.grad = torch.randn_like(p)
    report = hocompile.plan(_muon(params), target="sm90", cache_dir=cache_dir)
    assert isinstance(report, hocompile.PlanReport) and report.optimizer == "Muon" and report.target in report
    assert report.stamped and not report.traced_whole
    assert report.classes == ("group 0, 8 params fp32[16, 8], no state yet",)
    few = hocompile.plan(_muon(params[:3]), target="sm90", cache_dir=cache_dir)
    assert not few.stamped and "cost as much" in few.traced_whole and few.plans and few.plans[0] in few
    assert [r.name for r in report.passes][:2] == ["canonicalize", "fuse-newton-schulz"]


def test_a_report_refuses_fields_it_does_not_declare() -> None:
    with pytest.raises(TypeError, match="no field"):
        hocompile.PlanReport.make("text", optimiser="Muon")
