"""Cores as a resource: an NS measured faster on one intra-op thread runs on one (issue 13, item 4).

The timers are fakes (nothing is timed) and torch's thread count is pinned to 2 for the
planning, so these tests decide the same on any machine; the lowered step then runs for
real and must equal eager.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from hocompile.capture import capture
from hocompile.lowering.aten import _on_threads, call_kernels_directly, planned_threads
from hocompile.passes import Canonicalize, ChooseAlgorithm, FuseNewtonSchulz, run_pipeline
from hocompile.passes.choose_algorithm import MAX_ONE_THREAD_WORK, measured_candidates, measured_plan
from hocompile.passes.measure_ns import MAX_REPS, UNITS, MeasureSession, Program, intra_op_threads
from hocompile.settings import STRUCTURAL_KEYS
from hocompile.targets import Target

KJ = [(3.4445, -4.775, 2.0315)] * 5
FAST_BF16 = {"fp32": 180.0, "bf16": 420.0, "fp16": 1.8}


def _target(cache_dir: Path | None = None) -> Target:
    return Target("cpu", dict(FAST_BF16), measured=True, cache_dir=cache_dir)


def _timer(seconds: dict[str, float]) -> Callable[[Program, str, Callable[[], object]], float]:
    def timer(program: Program, unit: str, run: Callable[[], object]) -> float:
        return seconds[program.label()] / len(UNITS)

    return timer


@pytest.fixture
def two_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)


def test_one_thread_twins_only_for_dense_programs(two_threads: None) -> None:
    candidates, _ = measured_candidates(256, 1024, KJ, torch.bfloat16, "auto")
    labels = list(dict.fromkeys(c.program.label() for c in candidates))
    assert labels == ["bf16", "bf16 1 thread", "bf16 sym2", "fp32", "fp32 1 thread", "fp32 sym2"]
    # eager's own program is the all-threads one: the twin is a candidate like any other
    assert [c.program.label() for c in candidates if c.eager] == ["bf16"]


def test_no_twins_for_large_matrices(two_threads: None) -> None:
    """768×3072 ran 2x slower on one thread: not worth compile time to time it."""
    assert 768 * 768 * 3072 > MAX_ONE_THREAD_WORK >= 256 * 256 * 1024
    candidates, _ = measured_candidates(768, 3072, KJ, torch.bfloat16, "auto")
    assert not any(c.program.threads for c in candidates)


def test_no_twins_on_one_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    candidates, _ = measured_candidates(64, 256, KJ, torch.bfloat16, "auto")
    assert not any(c.program.threads for c in candidates)


@pytest.mark.parametrize("fast", ["bf16 1 thread", "bf16"])
def test_the_faster_thread_count_is_chosen(two_threads: None, fast: str) -> None:
    table = {"bf16": 0.010, "bf16 1 thread": 0.010, "fp32": 0.1, "fp32 1 thread": 0.1}
    table[fast] = 0.005
    session = MeasureSession(_target(), _timer(table))
    plan = measured_plan(64, 256, 1, KJ, torch.bfloat16, "auto", session)
    assert plan is not None and plan.compute_dtype == torch.bfloat16
    assert plan.threads == (1 if fast == "bf16 1 thread" else 0)
    assert ("on 1 thread" in plan.label()) == (plan.threads == 1)
    assert ("threads" in plan.decision().chose) == (plan.threads == 1)


def test_within_noise_of_eager_keeps_all_threads(two_threads: None) -> None:
    table = {"bf16": 0.0100, "bf16 1 thread": 0.0099, "fp32": 0.1, "fp32 1 thread": 0.1}
    plan = measured_plan(64, 256, 1, KJ, torch.bfloat16, "auto", MeasureSession(_target(), _timer(table)))
    assert plan is not None and plan.threads == 0 and "eager's own program" in plan.why


def test_small_units_are_timed_over_several_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    """A unit that takes 10 us per call is repeated MAX_REPS times per sample (one call is at the
    mercy of a scheduler tick), and the sample is the time per call."""
    import hocompile.passes.measure_ns as measure_ns

    calls = {"n": 0}

    def counting_units(program: Program, *args: object) -> dict[str, Callable[[], object]]:
        def unit() -> None:
            calls["n"] += 1

        return {u: unit for u in UNITS}

    monkeypatch.setattr(measure_ns, "_unit_programs", counting_units)
    per_run: list[int] = []

    def timer(program: Program, unit: str, run: Callable[[], object]) -> float:
        before = calls["n"]
        run()
        per_run.append(calls["n"] - before)
        return 1e-5 * per_run[-1]  # 10 us per call

    candidates, _ = measured_candidates(16, 32, KJ, torch.float32, "fp32")
    counts = {c: measure_ns.unit_counts(16, 32, KJ, c.algorithm, c.restarts) for c in candidates}
    measured = MeasureSession(_target(), timer).measure(candidates, counts, (1, 16, 32), KJ)
    warm_ups = len(measured.timings) * len(UNITS)  # each unit of each program: one call
    assert per_run[:warm_ups] == [1] * warm_ups, per_run
    assert per_run[warm_ups:] and set(per_run[warm_ups:]) == {MAX_REPS}, per_run  # then repeated
    samples = [s for t in measured.timings.values() for u in UNITS for s in t.samples[u]]
    assert samples and all(abs(s - 1e-5) < 1e-12 for s in samples)


def test_intra_op_threads_restores_the_count() -> None:
    before = torch.get_num_threads()
    with intra_op_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
    with pytest.raises(RuntimeError), intra_op_threads(1):
        raise RuntimeError("boom")
    assert torch.get_num_threads() == before


def test_lowering_runs_a_one_thread_plan_on_one_thread(two_threads: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The plan reaches the generated call, which runs on 1 thread and equals the all-threads call."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(32, 64)) for _ in range(2)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.Muon(params, lr=0.02)
    table = {"bf16": 0.010, "bf16 1 thread": 0.004, "fp32": 0.1, "fp32 1 thread": 0.1}
    passes = (Canonicalize(), FuseNewtonSchulz(), ChooseAlgorithm(target=_target(), timer=_timer(table)))
    with torch.no_grad():
        gm, _ = run_pipeline(capture(opt, STRUCTURAL_KEYS).gm, passes)
    ns = [n for n in gm.graph.nodes if n.target is torch.ops.hocompile.newton_schulz.default]
    assert ns and all(planned_threads(n) == 1 for n in ns)
    graph = gm.graph
    call_kernels_directly(graph)
    assert all(getattr(n.target, "__name__", "").endswith("_on_1_thread") for n in ns)
    monkeypatch.undo()  # real thread counts from here
    seen: list[int] = []

    def probe(x: torch.Tensor) -> torch.Tensor:
        seen.append(torch.get_num_threads())
        return x * 2

    x = torch.randn(8, 8)
    assert torch.equal(_on_threads(probe, 1)(x), x * 2) and seen == [1]
