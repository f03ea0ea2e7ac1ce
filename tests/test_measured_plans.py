"""Newton–Schulz plans on the CPU running the step: decided by rule, timing only among bitwise twins
(hocompile/passes/choose_algorithm.py, measure_ns.py, targets.declared_ratios).

Nothing here assumes this machine's GEMM rates: the timers are fakes (seconds per unit from a
table, nothing run), the targets are built here with either kind of CPU's declared ratios, and
the numerics run emulated bf16 (fp32 GEMMs), which is fast on CPUs with and without bf16 units.
"""

from __future__ import annotations

import json
import random
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from hocompile import targets
from hocompile.capture.trace import capture
from hocompile.diskcache import CacheWarning
from hocompile.ir.decisions import decision_of
from hocompile.ops.newton_schulz_math import newton_schulz, reference_fp64
from hocompile.passes import Canonicalize, ChooseAlgorithm, FuseNewtonSchulz, choose_algorithm, run_pipeline
from hocompile.passes.choose_algorithm import Plan, decide, measured_plan, thread_twins
from hocompile.passes.choose_precision import plan_schedule
from hocompile.precision.coefficients import coefficients
from hocompile.precision.gram_half import half_gram_verdict
from hocompile.precision.measure_ns import SPREAD_LIMIT, UNITS, Program, unit_counts
from hocompile.precision.measure_session import MeasureSession, cache_path
from hocompile.precision.spectra import SPECTRA, spectrum
from hocompile.settings import STRUCTURAL_KEYS
from hocompile.targets import Target

KJ = [(3.4445, -4.775, 2.0315)] * 5
# Both kinds of this project's CPUs, as declared by their ISA flags (targets.declared_ratios).
AMX = targets.declared_ratios(frozenset({"amx_bf16", "avx512_bf16"}), "")
NO_BF16 = targets.declared_ratios(frozenset({"avx2"}), "")

FakeTimer = Callable[[Program, str, Callable[[], object]], float]


@pytest.fixture
def two_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Planning as on a 2-thread torch, and thread twins that compute the same bits (the real
    check is tested on its own below): the same decisions on any machine."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.setattr(choose_algorithm, "same_bits", lambda *args: "")


def _target(ratios: dict[str, float], cache_dir: Path | None = None, fp32: float = 100.0) -> Target:
    """This CPU as calibrated: a measured fp32 rate (and half rates that only explain() shows)."""
    gflops = {"fp32": fp32, "bf16": 3.0 * fp32, "fp16": 1.0}
    return Target("cpu", gflops, measured=True, cache_dir=cache_dir, ratios=dict(ratios))


def _table_timer(seconds: dict[str, float], calls: list[str] | None = None) -> FakeTimer:
    """Each unit of program ``label`` takes ``seconds[label]`` (nothing is run)."""

    def timer(program: Program, unit: str, run: Callable[[], object]) -> float:
        if calls is not None:
            calls.append(program.label())
        return seconds[program.label()] / len(UNITS)

    return timer


def _numerics(plan: Plan) -> tuple[object, ...]:
    """What a plan computes (everything but the thread count it runs on)."""
    return (plan.algorithm, plan.restarts, plan.compute_dtype, plan.matmul, plan.blocks)


def _measured(target: Target, timer: FakeTimer, m: int = 64, n: int = 256, dtype: torch.dtype = torch.bfloat16,
              precision: str = "auto", budget: float = 2.0) -> tuple[Plan, Plan]:
    rule = decide(m, n, 1, KJ, dtype, precision, target)
    return rule, measured_plan(rule, m, n, 1, KJ, MeasureSession(target, timer, budget))


@pytest.mark.parametrize("ratios", [AMX, NO_BF16], ids=["amx", "no-bf16"])
def test_timing_never_changes_what_a_plan_computes(two_threads: None, ratios: dict[str, float]) -> None:
    """Whatever the timings (each program in turn the fast or the slow one, then random tables),
    the plan computes the rule's numbers; only its thread count follows the clock."""
    rng = random.Random(0)
    for dtype in (torch.bfloat16, torch.float32):
        for precision in ("auto", "fp32", "bf16"):
            for m, n in ((64, 256), (8, 256), (256, 1024)):
                rule = decide(m, n, 1, KJ, dtype, precision, _target(ratios))
                labels = [p.label() for p in thread_twins(rule, m, n)]
                tables = [{label: 0.01 if label == fast else 0.05 for label in labels} for fast in labels]
                tables += [{label: rng.uniform(0.001, 0.05) for label in labels} for _ in range(5)]
                for table in tables:
                    _, plan = _measured(_target(ratios), _table_timer(table), m, n, dtype, precision)
                    assert _numerics(plan) == _numerics(rule), (dtype, precision, m, n, table)


def test_a_calibration_taken_under_load_plans_the_same_numbers() -> None:
    """Measured under load, fp32 read 4.4 GFLOP/s beside bf16's 837 (an unloaded run: 380 and 880).
    The declared ratios rank the dtypes: every shape, dtype and precision plans alike either way,
    choose-algorithm's rule and choose-precision's schedule."""
    loaded = Target("cpu", {"fp32": 4.4, "bf16": 837.0, "fp16": 6.1}, measured=True, ratios=dict(AMX))
    idle = Target("cpu", {"fp32": 380.0, "bf16": 880.0, "fp16": 310.0}, measured=True, ratios=dict(AMX))
    for dtype in (torch.bfloat16, torch.float32, torch.float16):
        for precision in ("auto", "fp32", "bf16", "fp16"):
            for m, n in ((8, 256), (64, 256), (256, 1024), (768, 3072)):
                plans = [decide(m, n, 1, KJ, dtype, precision, t) for t in (loaded, idle)]
                assert _numerics(plans[0]) == _numerics(plans[1]), (dtype, precision, m, n)
                if min(m, n) >= 64:
                    schedules = [
                        plan_schedule(m, n, 1, KJ, p.algorithm, dtype, t).schedule
                        for p, t in zip(plans, (loaded, idle))
                    ]
                    assert schedules[0] == schedules[1], (dtype, m, n)


def test_declared_ratios_follow_isa_flags_and_the_onednn_cap() -> None:
    amx = frozenset({"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "avx512_fp16"})
    assert targets.declared_ratios(amx, "")["bf16"] == 2.5
    assert targets.declared_ratios(amx, "AVX512_CORE_BF16")["bf16"] == 1.9  # AMX hidden, AVX-512-BF16 not
    assert targets.declared_ratios(amx, "avx2")["bf16"] < 0.1  # oneDNN's cap hides every bf16 unit
    assert targets.declared_ratios(frozenset({"avx2", "avx512_bf16"}), "")["bf16"] == 1.9
    assert targets.declared_ratios(frozenset({"avx2"}), "") == {"fp32": 1.0, "bf16": 0.01, "fp16": 0.01}
    # The rule the plans read: bf16 is eager's precision kept where it has units, fp32 where not.
    assert decide(8, 256, 1, KJ, torch.bfloat16, "auto", _target(AMX)).compute_dtype == torch.bfloat16
    assert decide(8, 256, 1, KJ, torch.bfloat16, "auto", _target(NO_BF16)).compute_dtype == torch.float32


def test_a_twin_that_rounds_differently_is_never_chosen(monkeypatch: pytest.MonkeyPatch) -> None:
    """One thread timed 10x faster but computing other bits: the plan stays on all threads, and says why."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.setattr(choose_algorithm, "same_bits", lambda *args: "xxt")
    calls: list[str] = []
    rule, plan = _measured(_target(AMX), _table_timer({"bf16": 0.01, "bf16 1 thread": 0.001}, calls))
    assert plan.threads == 0 and _numerics(plan) == _numerics(rule) and not calls
    assert any("rounds differently here (xxt unit)" in a.why_not for a in plan.alternatives), plan.alternatives


def test_the_bitwise_check_is_real() -> None:
    """measure_ns.same_bits runs both programs: equal for a program and itself, and it names the
    first unit where an emulated and a native product differ."""
    from hocompile.precision.measure_ns import same_bits

    shape, abc = (1, 64, 256), KJ[0]
    assert same_bits(Program(torch.float32), Program(torch.float32), shape, abc) == ""
    assert same_bits(Program(torch.float32), Program(torch.float32, blocks=2), shape, abc) in ("", *UNITS)
    assert same_bits(Program(torch.bfloat16, "emulate"), Program(torch.float32), shape, abc) == "xxt"


def test_large_matrices_are_not_timed(two_threads: None) -> None:
    """768×3072: no twin (one thread ran 2x slower), so nothing is timed and nothing spent."""
    def never(program: Program, unit: str, run: Callable[[], object]) -> float:
        raise AssertionError("no twin: nothing to time")

    rule, plan = _measured(_target(AMX), never, 768, 3072)
    assert plan == rule


def test_budget_stops_after_one_timed_run(two_threads: None) -> None:
    target = _target(AMX)
    rule = decide(64, 256, 1, KJ, torch.bfloat16, "auto", target)
    session = MeasureSession(target, _table_timer({"bf16": 1.0, "bf16 1 thread": 1.0}), budget_s=0.1)
    candidates = [choose_algorithm.Candidate(rule.algorithm, rule.restarts, p) for p in thread_twins(rule, 64, 256)]
    counts = {c: unit_counts(64, 256, KJ, c.algorithm, c.restarts) for c in candidates}
    assert session.measure(candidates, counts, (1, 64, 256), KJ).runs() == 1


def test_unit_counts_match_flops() -> None:
    from hocompile.ops.newton_schulz_math import flops

    m, n = 256, 1024
    for algorithm, restarts in (("standard", ()), ("gram", (2,))):
        counts = unit_counts(m, n, KJ, algorithm, restarts)
        total = (counts["xxt"] + counts["apply"]) * 2 * m * m * n + counts["square"] * 2 * m**3
        assert total == flops(m, n, KJ, algorithm, restarts)


TABLE = {"bf16": 0.01, "bf16 1 thread": 0.005}


def test_cache_is_used_by_a_new_session(two_threads: None, tmp_path: Path) -> None:
    calls: list[str] = []
    _, first = _measured(_target(AMX, tmp_path), _table_timer(TABLE, calls))
    assert calls and list(tmp_path.glob("ns-timing-*.json")) and first.threads == 1
    calls.clear()
    session = MeasureSession(_target(AMX, tmp_path), _table_timer(TABLE, calls))
    rule = decide(64, 256, 1, KJ, torch.bfloat16, "auto", _target(AMX, tmp_path))
    second = measured_plan(rule, 64, 256, 1, KJ, session)
    assert not calls, "a warm cache must not measure again"
    assert second.decision().chose == first.decision().chose
    assert "cached" in second.why and session.describe().endswith("1 from cache")


def test_high_spread_cache_is_measured_again(two_threads: None, tmp_path: Path) -> None:
    _measured(_target(AMX, tmp_path), _table_timer(TABLE))
    (path,) = tmp_path.glob("ns-timing-*.json")
    data = json.loads(path.read_text())
    samples = data["programs"]["bf16 1 thread"]["samples"]
    for unit in UNITS:  # as if measured under load: runs 3x apart
        samples[unit] = [samples[unit][0], 3 * samples[unit][0], 3 * samples[unit][0]]
    path.write_text(json.dumps(data))
    calls: list[str] = []
    session = MeasureSession(_target(AMX, tmp_path), _table_timer(TABLE, calls))
    measured_plan(decide(64, 256, 1, KJ, torch.bfloat16, "auto", _target(AMX)), 64, 256, 1, KJ, session)
    assert calls and session.remeasured == 1
    assert SPREAD_LIMIT < 2.0  # the spread written above is 200 %


def test_corrupt_cache_is_warned_about_and_measured_again(two_threads: None, tmp_path: Path) -> None:
    rule = decide(64, 256, 1, KJ, torch.bfloat16, "auto", _target(AMX))
    cache_path(tmp_path, (1, 64, 256), thread_twins(rule, 64, 256)).write_text("{not json")
    calls: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _measured(_target(AMX, tmp_path), _table_timer(TABLE, calls))
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


def test_pass_records_the_rule_and_the_measured_threads(two_threads: None) -> None:
    """choose-algorithm on a measured target: the large NS keeps the rule's plan untimed; the small
    one says its threads were measured, bitwise alike, with the other count's time."""
    opt = _steady_muon([(768, 3072), (64, 256)])
    choose = ChooseAlgorithm(target=_target(AMX), timer=_table_timer(TABLE))
    gm, records = run_pipeline(capture(opt, STRUCTURAL_KEYS).gm, (Canonicalize(), FuseNewtonSchulz(), choose))
    ns = [n for n in gm.graph.nodes if n.target is torch.ops.hocompile.newton_schulz.default]
    wide, small = (decision_of(n, "choose-algorithm") for n in ns)
    assert wide is not None and wide.chose["blocks"] == 0 and wide.chose["compute"] == "bf16"
    assert "eager's precision" in wide.render() and "measured" not in wide.render()
    assert small is not None and small.chose.get("threads") == 1, small.render()
    assert "threads measured here (bitwise alike)" in small.render() and "bf16 all threads" in small.render()
    assert "timed 1 shape(s)" in records[-1].summary


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
    from hocompile.ops.newton_schulz_math import Arith

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
    """End to end on this machine (whichever kind): the first plan times the thread twins of a
    small NS, a second plan of the same model (a new optimizer, as a new process would build)
    reads the cache."""
    import hocompile

    if torch.get_num_threads() < 2:
        pytest.skip("one intra-op thread: no twin to time")

    def muon() -> torch.optim.Optimizer:
        params = [torch.zeros(64, 256)]
        params[0].grad = torch.randn(64, 256) * 1e-3
        return torch.optim.Muon(params, lr=0.02)

    first = hocompile.plan(muon(), cache_dir=tmp_path)
    if "rounds differently here" in first:  # this CPU's BLAS splits the sums by thread: nothing timed
        assert "threads measured here" not in first and "timed 1 shape(s)" not in first, first
        return
    assert "timed 1 shape(s)" in first and "threads measured here" in first, first
    second = hocompile.plan(muon(), cache_dir=tmp_path)
    # From the disk cache, or (spread too high to trust the file) from this process's own
    # measurement: never timed twice in one process. A new process re-checks a high spread
    # (test_high_spread_cache_is_measured_again).
    assert "timed 0 shape(s) in 0.00 s, 1 from cache" in second, (first, second)


def test_a_load_spike_never_drops_a_program_against_its_own_warm_up(two_threads: None) -> None:
    """Seen under load: every program's round ran 10x its warm-up, each was dropped against its
    own warm-up, and no plan was left. The bar is the other programs' best, never a program's own."""
    seen: dict[tuple[str, str], int] = {}

    def spiking(program: Program, unit: str, run: Callable[[], object]) -> float:
        key = (program.label(), unit)
        seen[key] = seen.get(key, 0) + 1
        return 1e-3 if seen[key] == 1 else 1e-2  # the warm-up, then a busy neighbour

    _, plan = _measured(_target(AMX), spiking, dtype=torch.float32, precision="fp32")
    assert "threads measured here" in plan.why
