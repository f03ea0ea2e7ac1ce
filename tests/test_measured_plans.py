"""Newton–Schulz plans chosen by measurement (hocompile/passes/measure_ns.py, choose-algorithm on a measured target).

Nothing here assumes this machine's GEMM rates: the timers are fakes
(seconds per unit from a table, nothing run), the targets are built here
with either kind of CPU's rates, and the numerics run emulated bf16 (fp32
GEMMs), which is fast on CPUs with and without bf16 units.
"""

from __future__ import annotations

import json
import random
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from hocompile.capture import capture
from hocompile.decisions import decision_of
from hocompile.diskcache import CacheWarning
from hocompile.newton_schulz import newton_schulz, reference_fp64
from hocompile.passes import Canonicalize, ChooseAlgorithm, FuseNewtonSchulz, run_pipeline
from hocompile.passes.choose_algorithm import Plan, measured_candidates, measured_plan
from hocompile.passes.measure_ns import (
    SPREAD_LIMIT,
    UNITS,
    MeasureSession,
    Program,
    cache_path,
    model_unit_seconds,
    unit_counts,
)
from hocompile.precision.coefficients import coefficients
from hocompile.precision.gram_half import half_gram_verdict
from hocompile.precision.spectra import SPECTRA, spectrum
from hocompile.settings import STRUCTURAL_KEYS
from hocompile.targets import Target

KJ = [(3.4445, -4.775, 2.0315)] * 5
# Both kinds of this project's CPUs, as rate tables (only the cap reads them).
FAST_BF16 = {"fp32": 180.0, "bf16": 420.0, "fp16": 1.8}
NO_BF16 = {"fp32": 85.0, "bf16": 1.3, "fp16": 1.4}

FakeTimer = Callable[[Program, str, Callable[[], object]], float]


@pytest.fixture(autouse=True)
def _one_intra_op_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """As on a 1-thread torch: no "on 1 thread" twins, so the candidate lists here do not depend
    on this machine's cores (tests/test_thread_plans.py covers the twins)."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)


def _target(rates: dict[str, float], cache_dir: Path | None) -> Target:
    return Target("cpu", dict(rates), measured=True, cache_dir=cache_dir)


def _table_timer(seconds: dict[str, float], calls: list[str] | None = None) -> FakeTimer:
    """Each unit of program ``label`` takes ``seconds[label]`` (nothing is run)."""

    def timer(program: Program, unit: str, run: Callable[[], object]) -> float:
        if calls is not None:
            calls.append(program.label())
        return seconds[program.label()] / len(UNITS)

    return timer


def _plan(target: Target, timer: FakeTimer, m: int = 768, n: int = 3072, budget: float = 2.0) -> Plan:
    plan = measured_plan(m, n, 1, KJ, torch.bfloat16, "auto", MeasureSession(target, timer, budget))
    assert plan is not None
    return plan


def _eager_time(plan: Plan) -> float | None:
    """Eager's program's measured time: the plan's own when it is the choice; None if not timed."""
    if "eager's own program" in plan.why:
        return plan.predicted_s
    eager = [a for a in plan.alternatives if "(eager's program)" in a.name]
    return eager[0].predicted_s if eager else None


@pytest.mark.parametrize("rates", [FAST_BF16, NO_BF16], ids=["fast-bf16", "no-bf16"])
def test_a_plan_measured_slower_than_eager_is_never_chosen(rates: dict[str, float]) -> None:
    """Each program in turn is the slow one (and, in a second pass, the fast one): the chosen plan is
    never measured slower than eager's program, and never the slow one."""
    candidates, _ = measured_candidates(768, 3072, KJ, torch.bfloat16, "auto")
    labels = list(dict.fromkeys(c.program.label() for c in candidates))
    assert labels == ["bf16", "bf16 sym4", "fp32", "fp32 sym4"]  # eager's program, blocked, fp32
    for slow in labels:
        for others in (0.010, 0.030):
            table = {label: others for label in labels}
            table[slow] = 0.050
            plan = _plan(_target(rates, None), _table_timer(table))
            chosen = plan.decision().label
            eager_s = _eager_time(plan)
            if eager_s is None:  # not timed to the end: capped or dropped as slower than the best
                (eager,) = [a for a in plan.alternatives if a.name == "bf16"]
                assert eager.why_not.startswith(("not run", "dropped")), eager
            else:
                assert plan.predicted_s <= eager_s, chosen
            assert not (plan.compute_dtype == torch.bfloat16 and plan.blocks == 0 and slow == "bf16"), chosen
            chosen_label = Program(plan.compute_dtype, plan.matmul, plan.blocks).label()
            assert chosen_label != slow, (slow, chosen)
    rng = random.Random(0)
    for _ in range(20):  # random timings: the property holds whatever the machine measures
        table = {label: rng.uniform(0.005, 0.05) for label in labels}
        plan = _plan(_target(rates, None), _table_timer(table))
        eager_s = _eager_time(plan)
        assert eager_s is None or plan.predicted_s <= eager_s


def test_within_noise_of_eager_keeps_eager_program() -> None:
    table = {"bf16": 0.0100, "bf16 sym4": 0.0099, "fp32": 0.1, "fp32 sym4": 0.1}
    plan = _plan(_target(FAST_BF16, None), _table_timer(table))
    assert (plan.algorithm, plan.compute_dtype, plan.blocks) == ("standard", torch.bfloat16, 0)
    assert "eager's own program" in plan.why


def test_hopeless_program_is_never_run() -> None:
    """Without bf16 units eager's bf16 program would take seconds per GEMM: the calibrated rate
    caps it before it runs, and compiling stays fast."""
    target = _target(NO_BF16, None)
    calls: list[str] = []

    def timer(program: Program, unit: str, run: Callable[[], object]) -> float:
        calls.append(program.label())
        return model_unit_seconds(program, 768, 3072, 1, target)[unit]

    session = MeasureSession(target, timer)
    plan = measured_plan(768, 3072, 1, KJ, torch.bfloat16, "auto", session)
    assert plan is not None and plan.compute_dtype == torch.float32
    assert not any(label.startswith("bf16") for label in calls)
    eager = [a for a in plan.alternatives if a.name == "bf16"]
    assert eager and eager[0].why_not.startswith("not run"), plan.alternatives
    assert session.spent_s < 2.0


def test_budget_stops_after_one_timed_run() -> None:
    table = {label: 1.0 for label in ("bf16", "bf16 sym4", "fp32", "fp32 sym4")}
    session = MeasureSession(_target(FAST_BF16, None), _table_timer(table), budget_s=0.1)
    candidates, _ = measured_candidates(768, 3072, KJ, torch.bfloat16, "auto")
    counts = {c: unit_counts(768, 3072, KJ, c.algorithm, c.restarts) for c in candidates}
    measured = session.measure(candidates, counts, (1, 768, 3072), KJ)
    assert measured.runs() == 1


def test_unit_counts_match_flops() -> None:
    from hocompile.newton_schulz import flops

    m, n = 256, 1024
    for algorithm, restarts in (("standard", ()), ("gram", (2,))):
        counts = unit_counts(m, n, KJ, algorithm, restarts)
        total = (counts["xxt"] + counts["apply"]) * 2 * m * m * n + counts["square"] * 2 * m**3
        assert total == flops(m, n, KJ, algorithm, restarts)


def test_cache_is_used_by_a_new_session(tmp_path: Path) -> None:
    table = {"bf16": 0.01, "bf16 sym4": 0.008, "fp32": 0.03, "fp32 sym4": 0.03}
    calls: list[str] = []
    first = _plan(_target(FAST_BF16, tmp_path), _table_timer(table, calls))
    assert calls and list(tmp_path.glob("ns-timing-*.json"))
    calls.clear()
    session = MeasureSession(_target(FAST_BF16, tmp_path), _table_timer(table, calls))
    second = measured_plan(768, 3072, 1, KJ, torch.bfloat16, "auto", session)
    assert not calls, "a warm cache must not measure again"
    assert second is not None and second.decision().chose == first.decision().chose
    assert "cached" in second.why and session.describe().endswith("1 from cache")


def test_high_spread_cache_is_measured_again(tmp_path: Path) -> None:
    table = {"bf16": 0.01, "bf16 sym4": 0.008, "fp32": 0.03, "fp32 sym4": 0.03}
    _plan(_target(FAST_BF16, tmp_path), _table_timer(table))
    (path,) = tmp_path.glob("ns-timing-*.json")
    data = json.loads(path.read_text())
    samples = data["programs"]["bf16 sym4"]["samples"]
    for unit in UNITS:  # as if measured under load: runs 3x apart
        samples[unit] = [samples[unit][0], 3 * samples[unit][0], 3 * samples[unit][0]]
    path.write_text(json.dumps(data))
    calls: list[str] = []
    session = MeasureSession(_target(FAST_BF16, tmp_path), _table_timer(table, calls))
    measured_plan(768, 3072, 1, KJ, torch.bfloat16, "auto", session)
    assert calls and session.remeasured == 1
    assert SPREAD_LIMIT < 2.0  # the spread written above is 200 %


def test_corrupt_cache_is_warned_about_and_measured_again(tmp_path: Path) -> None:
    candidates, _ = measured_candidates(768, 3072, KJ, torch.bfloat16, "auto")
    programs = list(dict.fromkeys(c.program for c in candidates))
    cache_path(tmp_path, (1, 768, 3072), programs).write_text("{not json")
    table = {p.label(): 0.01 for p in programs}
    calls: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _plan(_target(FAST_BF16, tmp_path), _table_timer(table, calls))
    assert calls and any(issubclass(w.category, CacheWarning) for w in caught)


def _steady_muon(shapes: list[tuple[int, int]]) -> torch.optim.Optimizer:
    """torch.optim.Muon with grads and the state its first step leaves (one momentum buffer per
    param), without running that step: eager's bf16 NS of a 768x3072 matrix takes seconds on a
    CPU without bf16 units, and capture reads shapes and dtypes only."""
    params = [torch.zeros(shape) for shape in shapes]
    opt = torch.optim.Muon(params, lr=0.02)
    for p in params:
        p.grad = torch.randn(p.shape) * 1e-3
        opt.state[p]["momentum_buffer"] = torch.zeros_like(p)
    return opt


def test_pass_records_each_candidates_measured_time() -> None:
    """choose-algorithm on a measured target: the decision shows every candidate's time and the choice."""
    opt = _steady_muon([(768, 3072), (768, 768)])
    table = {"bf16": 0.02, "bf16 sym4": 0.015, "fp32": 0.05, "fp32 sym4": 0.05}
    choose = ChooseAlgorithm(target=_target(FAST_BF16, None), timer=_table_timer(table))
    gm, records = run_pipeline(capture(opt, STRUCTURAL_KEYS).gm, (Canonicalize(), FuseNewtonSchulz(), choose))
    ns = [n for n in gm.graph.nodes if n.target is torch.ops.hocompile.newton_schulz.default]
    wide = decision_of(ns[0], "choose-algorithm")
    assert wide is not None and wide.chose["blocks"] == 4 and wide.chose["compute"] == "bf16"
    text = wide.render()
    assert "measured here" in text and "standard bf16 (eager's program) 100 ms" in text, text
    assert "gram bf16, error model" in text  # refused by the calibrated error model, with why
    assert "timed 2 shape(s)" in records[-1].summary


def test_model_target_keeps_flop_model() -> None:
    """A target that is not this machine (target="cpu-avx2", "sm100") is planned by its rates."""
    from hocompile.targets import CPU_DESCRIPTORS

    opt = _steady_muon([(768, 3072)])

    def never(program: Program, unit: str, run: Callable[[], object]) -> float:
        raise AssertionError("a model target must not be timed")

    choose = ChooseAlgorithm(target=CPU_DESCRIPTORS["cpu-avx2"], timer=never)
    gm, _ = run_pipeline(capture(opt, STRUCTURAL_KEYS).gm, (Canonicalize(), FuseNewtonSchulz(), choose))
    (node,) = [n for n in gm.graph.nodes if n.target is torch.ops.hocompile.newton_schulz.default]
    decision = decision_of(node, "choose-algorithm")
    assert decision is not None and decision.chose["compute"] == "fp32" and "measured" not in decision.render()


# ------------------------------------------------------------------ numerics


def _error(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.double() - ref).abs().max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_symmetric_row_blocks_keep_the_error_of_dense_products(dtype: torch.dtype) -> None:
    """Row blocks are the same dot products rounded once: error vs fp64 as dense's (emulated bf16)."""
    for kind in SPECTRA:
        x = spectrum(kind, 256, 1024, 1)
        ref = reference_fp64(x, KJ, 1e-7)
        errors = {}
        for blocks in (0, 2, 4):
            out = newton_schulz(
                x, KJ, 1e-7, compute_dtype=dtype, matmul="emulate", blocks=blocks, out_dtype=torch.float32
            )
            errors[blocks] = _error(out, ref)
        assert max(errors.values()) <= 1.25 * errors[0] + 1e-6, (kind, errors)


def test_symmetric_row_blocks_are_symmetric_and_batched() -> None:
    from hocompile.newton_schulz import Arith

    x = torch.randn(3, 200, 300)
    for blocks in (2, 3, 4):
        out = Arith(torch.float32, "native", torch.float32, blocks).sym(x, x.mT)
        assert torch.equal(out, out.mT)
        torch.testing.assert_close(out, x @ x.mT, rtol=1e-5, atol=1e-4)


def test_bf16_gram_refusal_is_confirmed_by_fp64() -> None:
    """The error model refuses bf16 Gram NS for Keller Jordan's coefficients at GPT-2's aspect
    ratio; an fp64 evaluation on fresh inputs finds a spectrum where it is outside eager's error."""
    verdict = half_gram_verdict(KJ, 768, 3072, torch.bfloat16)
    assert not verdict.allowed and verdict.ratio is not None and verdict.ratio > 1.0
    ratios = []
    for kind in SPECTRA:
        x = spectrum(kind, 96, 384, 1)
        ref = reference_fp64(x, KJ, 1e-7)
        run = {
            algorithm: newton_schulz(
                x, KJ, 1e-7, compute_dtype=torch.bfloat16, matmul="emulate", algorithm=algorithm,
                restarts=verdict.restarts if algorithm == "gram" else (), out_dtype=torch.float32,
            )
            for algorithm in ("standard", "gram")
        }
        ratios.append(_error(run["gram"], ref) / _error(run["standard"], ref))
    assert max(ratios) > 1.25, ratios


def test_gram_half_verdict_refuses_square_fp16_and_uncalibrated() -> None:
    assert not half_gram_verdict(KJ, 512, 512, torch.bfloat16).allowed  # 64x64 calibrated: 6x
    assert not half_gram_verdict(KJ, 256, 1024, torch.float16).allowed
    assert not half_gram_verdict([(3.0, -3.2, 1.2)] * 5, 256, 1024, torch.bfloat16).allowed
    # Admitted where the calibration is within the factor: AOL's 4 steps at n/m = 4 (1.08x).
    assert half_gram_verdict(coefficients("aol", 4), 256, 1024, torch.bfloat16, factor=1.1).allowed


def test_warm_cache_plan_does_not_measure_again(tmp_path: Path) -> None:
    """End to end on this machine (whichever kind): the first plan times the group, a second
    plan of the same model (a new optimizer, as a new process would build) reads the cache."""
    import hocompile

    def muon() -> torch.optim.Optimizer:
        params = [torch.zeros(256, 1024)]
        params[0].grad = torch.randn(256, 1024) * 1e-3
        return torch.optim.Muon(params, lr=0.02)

    first = hocompile.plan(muon(), cache_dir=tmp_path)
    assert "timed 1 shape(s)" in first and "measured here" in first, first
    second = hocompile.plan(muon(), cache_dir=tmp_path)
    # From the disk cache, or (spread too high to trust the file) from this process's own
    # measurement: never timed twice in one process. A new process re-checks a high spread
    # (test_high_spread_cache_is_measured_again).
    assert "timed 0 shape(s) in 0.00 s, 1 from cache" in second, (first, second)


def test_a_load_spike_never_drops_a_program_against_its_own_warm_up() -> None:
    """Seen under load: every program's round ran 10x its warm-up, each was dropped against its
    own warm-up, and no plan was left. The bar is the other programs' best, never a program's own."""
    seen: dict[tuple[str, str], int] = {}

    def spiking(program: Program, unit: str, run: Callable[[], object]) -> float:
        key = (program.label(), unit)
        seen[key] = seen.get(key, 0) + 1
        return 1e-3 if seen[key] == 1 else 1e-2  # the warm-up, then a busy neighbour

    plan = measured_plan(64, 256, 1, KJ, torch.float32, "fp32", MeasureSession(_target(FAST_BF16, None), spiking))
    assert plan is not None and "measured here" in plan.why
