# ruff: noqa: E501
"""choose-precision: the schedules planned for each target, and that they keep their budget.

The plans are expect tests of ``hocompile.plan()`` (no GPU needed: a target
is a table row). The budget test re-measures every schedule the planner
emits, by exact emulation, on every calibration spectrum.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.fx as fx
from expecttest import TestCase

import hocompile
from hocompile.capture.group_hypers import STRUCTURAL_KEYS
from hocompile.capture.trace import capture
from hocompile.ir.decisions import Decision, decided, decision_of
from hocompile.ir.graph import describe_value
from hocompile.ops.newton_schulz_math import newton_schulz, reference_fp64
from hocompile.ops.newton_schulz_spec import NewtonSchulzSpec
from hocompile.passes import default_pipeline, run_pipeline
from hocompile.passes.choose_precision import PER_CASE_TOLERANCE, plan_schedule
from hocompile.precision.calibrate import CALIBRATED, EPS, calibration_inputs, restarts_for, schedule_key
from hocompile.precision.coefficients import coefficients
from hocompile.precision.schedule_ns import newton_schulz_scheduled
from hocompile.targets import resolve_target

TARGETS = ["cpu-avx2", "cpu-amx", "sm80", "sm89", "sm90", "sm100", "sm103"]
GPT2 = [(768, 2304), (768, 768), (768, 3072), (3072, 768)]  # one GPT-2-small layer: every shape
KIMI_K2 = [(7168, 2048), (2048, 7168), (7168, 18432)]


def _muon(shapes: list[tuple[int, int]]) -> torch.optim.Optimizer:
    params = [torch.nn.Parameter(torch.empty(shape)) for shape in shapes]  # never touched: planning only
    opt = torch.optim.Muon(params, lr=0.02, weight_decay=0.1)
    for p in params:
        p.grad = torch.empty_like(p)
        opt.state[p]["momentum_buffer"] = torch.empty_like(p)
    return opt


def _ascii(text: str) -> str:
    # expecttest writes printable ASCII only
    for char, plain in {"\u2013": "-", "\u00d7": "x", "\u2192": "->", "\u1d40": "^T"}.items():
        text = text.replace(char, plain)
    return text


def _schedules(shapes: list[tuple[int, int]]) -> str:
    """One line per target and shape: the schedule and its predicted error (the rest is in plan())."""
    opt = _muon(shapes)
    lines = []
    for target in TARGETS:
        for node, decision in _precision_decisions(opt, target):
            shape = describe_value(NewtonSchulzSpec.from_node(node).x_node.meta["val"])
            error = f"error {decision.predicted_error:.3g}" if decision.predicted_error is not None else "-"
            lines.append(f"{target:8} {shape:18} {decision.label}: {error} {decision.why}")
    return "\n".join(lines) + "\n"


def _precision_decisions(opt: torch.optim.Optimizer, target: str, **options: Any) -> list[tuple[fx.Node, Decision]]:
    """choose-precision's decision per Newton–Schulz op, as plan() would make it (CPU: the aten pipeline)."""
    with torch.no_grad():
        captured = capture(opt, STRUCTURAL_KEYS)
    gm, _ = run_pipeline(captured.gm, default_pipeline(resolve_target(target, None), **options))
    found = [(node, decision_of(node, "choose-precision")) for node, _ in decided(gm.graph)]
    return [(node, d) for node, d in found if d is not None]


class TestPlannedSchedules(TestCase):
    def test_gpt2_small(self) -> None:
        self.assertExpectedInline(_schedules(GPT2), """\
cpu-avx2 fp32[768, 2304]    fp32*5: error 7.65e-06 within budget (no worse than eager bf16 per case)
cpu-avx2 fp32[768, 768]     fp32*5: error 1.06e-05 within budget (no worse than eager bf16 per case)
cpu-avx2 fp32[768, 3072]    fp32*5: error 7.65e-06 within budget (no worse than eager bf16 per case)
cpu-avx2 fp32[3072, 768]    fp32*5: error 7.65e-06 within budget (no worse than eager bf16 per case)
cpu-amx  fp32[768, 2304]    bf16*5: error 0.0596 within budget (no worse than eager bf16 per case)
cpu-amx  fp32[768, 768]     bf16*5: error 0.0596 within budget (no worse than eager bf16 per case)
cpu-amx  fp32[768, 3072]    bf16*5: error 0.0596 within budget (no worse than eager bf16 per case)
cpu-amx  fp32[3072, 768]    bf16*5: error 0.0596 within budget (no worse than eager bf16 per case)
sm80     fp32[768, 2304]    fp16*5: error 0.00537 within budget (no worse than eager bf16 per case)
sm80     fp32[768, 768]     fp16*5: error 0.00537 within budget (no worse than eager bf16 per case)
sm80     fp32[2, 768, 3072] fp16*5: error 0.00537 within budget (no worse than eager bf16 per case)
sm89     fp32[768, 2304]    fp8_e4m3*1+fp16*4: error 0.0421 within budget (no worse than eager bf16 per case)
sm89     fp32[768, 768]     fp8_e4m3*1+fp16*4: error 0.0421 within budget (no worse than eager bf16 per case)
sm89     fp32[2, 768, 3072] fp8_e4m3*1+fp16*4: error 0.0421 within budget (no worse than eager bf16 per case)
sm90     fp32[768, 2304]    fp8_e4m3*1+fp16*4: error 0.0421 within budget (no worse than eager bf16 per case)
sm90     fp32[768, 768]     fp8_e4m3*1+fp16*4: error 0.0421 within budget (no worse than eager bf16 per case)
sm90     fp32[2, 768, 3072] fp8_e4m3*1+fp16*4: error 0.0421 within budget (no worse than eager bf16 per case)
sm100    fp32[768, 2304]    fp8_e4m3*1+fp16*4: error 0.0421 within budget (no worse than eager bf16 per case)
sm100    fp32[768, 768]     fp8_e4m3*1+fp16*4: error 0.0421 within budget (no worse than eager bf16 per case)
sm100    fp32[2, 768, 3072] fp8_e4m3*1+fp16*4: error 0.0421 within budget (no worse than eager bf16 per case)
sm103    fp32[768, 2304]    fp8_e4m3*1+fp16*4: error 0.0421 within budget (no worse than eager bf16 per case)
sm103    fp32[768, 768]     fp8_e4m3*1+fp16*4: error 0.0421 within budget (no worse than eager bf16 per case)
sm103    fp32[2, 768, 3072] fp8_e4m3*1+fp16*4: error 0.0421 within budget (no worse than eager bf16 per case)
""")

    def test_kimi_k2_like(self) -> None:
        self.assertExpectedInline(_schedules(KIMI_K2), """\
cpu-avx2 fp32[7168, 2048]   fp32*5: error 7.65e-06 within budget (no worse than eager bf16 per case)
cpu-avx2 fp32[2048, 7168]   fp32*5: error 7.65e-06 within budget (no worse than eager bf16 per case)
cpu-avx2 fp32[7168, 18432]  fp32*5: error 7.65e-06 within budget (no worse than eager bf16 per case)
cpu-amx  fp32[7168, 2048]   bf16*5: error 0.0596 within budget (no worse than eager bf16 per case)
cpu-amx  fp32[2048, 7168]   bf16*5: error 0.0596 within budget (no worse than eager bf16 per case)
cpu-amx  fp32[7168, 18432]  bf16*5: error 0.0596 within budget (no worse than eager bf16 per case)
sm80     fp32[2, 2048, 7168] fp16*5: error 0.00537 within budget (no worse than eager bf16 per case)
sm80     fp32[7168, 18432]  fp16*5: error 0.00537 within budget (no worse than eager bf16 per case)
sm89     fp32[2, 2048, 7168] fp8_e4m3*1+fp16*4: error 0.0421 within budget (no worse than eager bf16 per case)
sm89     fp32[7168, 18432]  fp8_e4m3*1+fp16*4: error 0.0421 within budget (no worse than eager bf16 per case)
sm90     fp32[2, 2048, 7168] fp8_e4m3*1+fp16*4: error 0.0421 within budget (no worse than eager bf16 per case)
sm90     fp32[7168, 18432]  fp8_e4m3*1+fp16*4: error 0.0421 within budget (no worse than eager bf16 per case)
sm100    fp32[2, 2048, 7168] fp8_e4m3*1+fp16*4: error 0.0421 within budget (no worse than eager bf16 per case)
sm100    fp32[7168, 18432]  fp8_e4m3*1+fp16*4: error 0.0421 within budget (no worse than eager bf16 per case)
sm103    fp32[2, 2048, 7168] fp8_e4m3*1+fp16*4: error 0.0421 within budget (no worse than eager bf16 per case)
sm103    fp32[7168, 18432]  fp8_e4m3*1+fp16*4: error 0.0421 within budget (no worse than eager bf16 per case)
""")

    def test_full_plan_report_for_blackwell(self) -> None:
        self.assertExpectedInline(
            _ascii(hocompile.plan(_muon(GPT2), target="sm100")),
            """\
plan for Muon.step on sm100 (GEMM TFLOP/s: bf16 2250, fp16 2250, fp32 80, fp8 4500, mxfp8 4500, tf32 1100; stacks run as bmm):
  traced whole: 4 classes for 4 params: tracing one and two per class would cost as much
  canonicalize: removed 2 identity/copy ops and 1 dead nodes
  fuse-newton-schulz: fused 4 Newton-Schulz chain(s)
  fuse-polar: no svd -> U @ Vh found
  fuse-eigenbasis: no sort-by-diag(Q^TLQ) -> qr(L Q) found
  fuse-factor-update: no Gram lerp/addmm of a Kronecker factor found
  fuse-inverse-root: no eigh or coupled-Newton inverse root found
  fuse-two-sided: no A X B chain of two products found
  batch-by-shape: 2 ops in 1 batched op(s)
  choose-algorithm: standard/bf16 x3 on sm100 (GEMM TFLOP/s: bf16 2250, fp16 2250, fp32 80, fp8 4500, mxfp8 4500, tf32 1100; stacks run as bmm)
  choose-precision: fp8_e4m3*1+fp16*4 x3 on sm100
  hocompile.newton_schulz fp32[768, 2304]: choose-algorithm: standard bf16, 14.1 us predicted (vs gram 10.5 us, not in half precision), eager's precision; choose-precision: fp8_e4m3*1+fp16*4, 12.7 us predicted, error 0.0421 (vs bf16*5 14.1 us, error 0.19, eager's precision), within budget (no worse than eager bf16 per case)
  hocompile.newton_schulz fp32[768, 768]: choose-algorithm: standard bf16, 6.04 us predicted (vs gram 7.25 us, not in half precision), eager's precision; choose-precision: fp8_e4m3*1+fp16*4, 5.44 us predicted, error 0.0421 (vs bf16*5 6.04 us, error 0.19, eager's precision), within budget (no worse than eager bf16 per case)
  hocompile.newton_schulz fp32[2, 768, 3072]: choose-algorithm: standard bf16, 36.2 us predicted (vs gram 24.2 us, not in half precision), eager's precision; choose-precision: fp8_e4m3*1+fp16*4, 32.6 us predicted, error 0.0421 (vs bf16*5 36.2 us, error 0.19, eager's precision), within budget (no worse than eager bf16 per case)
  Newton-Schulz orthogonalisation (hocompile.newton_schulz) x3: 127 GFLOP (all in GEMMs), 42.5 MB read and written, 50.7 us predicted on sm100
""",
        )


def test_explicit_schedule_and_absolute_budget() -> None:
    opt = _muon([(768, 768)])
    ((_, explicit),) = _precision_decisions(opt, "sm90", schedule=("fp8_e4m3",) * 2 + ("bf16",) * 3)
    assert explicit.chose == {"schedule": "fp8_e4m3*2+bf16*3"} and explicit.why == "explicit schedule"
    ((_, default),) = _precision_decisions(opt, "sm90")
    ((_, loose),) = _precision_decisions(opt, "sm90", error_budget=1.0)
    assert "absolute 1" in loose.why and loose.predicted_error is not None and default.predicted_error is not None
    # a loose budget buys more FP8 iterations: faster, with more error
    assert str(loose.chose["schedule"]).startswith("fp8_e4m3*") and loose.chose != default.chose
    assert loose.predicted_s < default.predicted_s and loose.predicted_error > default.predicted_error  # type: ignore[operator]
    with pytest.raises(ValueError, match="unknown format"):
        hocompile.plan(opt, target="sm90", schedule=["fp7"] * 5)
    with pytest.raises(ValueError, match="schedule has 2 formats"):
        hocompile.plan(opt, target="sm90", schedule=["bf16"] * 2)


def _eager_bf16(x: torch.Tensor, table: list[tuple[float, float, float]]) -> torch.Tensor:
    return newton_schulz(x, table, EPS, compute_dtype=torch.bfloat16, out_dtype=torch.float32, matmul="emulate")


def _executed(x: torch.Tensor, table, schedule, algorithm: str, restarts) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """What the compiled step runs: eager's own bf16 (or fp32) is the op's compute_dtype, anything else a schedule."""
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    if len(set(schedule)) == 1 and schedule[0] in dtypes:
        return newton_schulz(
            x,
            table,
            EPS,
            compute_dtype=dtypes[schedule[0]],
            out_dtype=torch.float32,
            algorithm=algorithm,
            restarts=restarts,
            matmul="emulate",
        )
    return newton_schulz_scheduled(x, table, EPS, schedule, algorithm=algorithm, restarts=restarts)


@pytest.mark.parametrize("name, steps", CALIBRATED)
def test_every_emitted_schedule_keeps_its_budget_on_every_spectrum(name: str, steps: int) -> None:
    # Re-measured here by emulation (not read back from the table), on a
    # shape of the calibration grid and on one it does not contain.
    table = coefficients(name, steps)
    for algorithm in ("standard", "gram"):
        emitted = set()
        for target in TARGETS:
            plan = plan_schedule(
                768,
                3072,
                1,
                table,
                algorithm,
                torch.bfloat16,
                resolve_target(target, None),
                restarts=restarts_for(algorithm, steps),
            )
            emitted.add(plan.schedule)
        for schedule in emitted:
            for m, n in [(64, 256), (96, 160)]:
                x = calibration_inputs(m, n, seed=1)
                exact = reference_fp64(x, table, EPS)
                eager = (_eager_bf16(x, table).double() - exact).abs().amax(dim=(-2, -1))
                out = _executed(x, table, schedule, algorithm, restarts_for(algorithm, steps))
                error = (out.double() - exact).abs().amax(dim=(-2, -1))
                worst = (error / eager).max().item()
                assert (error <= PER_CASE_TOLERANCE * eager).all(), (name, algorithm, schedule_key(schedule), worst)


def test_explicit_low_precision_schedule_switches_gram_to_standard(cache_dir) -> None:
    # On this CPU choose-algorithm picks Gram NS (fp32) for wide matrices; an
    # explicit FP8 schedule must not run inside Gram NS (measured: NaN).
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(64, 256))
    opt = hocompile.compile_optimizer(
        torch.optim.Muon([param], lr=0.02), target="cpu-avx2", schedule="fp8_e4m3*1+fp16*4", cache_dir=cache_dir
    )
    for _ in range(3):
        param.grad = torch.randn_like(param)
        opt.step()
    assert torch.isfinite(param).all()
    gm = opt.history[-1].captured.gm  # type: ignore[union-attr]
    ((node, decisions),) = decided(gm.graph)
    algorithm, precision = decisions
    assert algorithm.chose["algorithm"] == "gram"  # planned first, then switched for the schedule
    assert dict(precision.chose) == {"schedule": "fp8_e4m3*1+fp16*4", "algorithm": "standard"}
    assert "Gram NS is unsafe below fp32/tf32" in precision.why
    assert NewtonSchulzSpec.from_node(node).algorithm == "standard"
    assert "schedule fp8_e4m3*1+fp16*4" in opt.history[-1].final_graph


def test_no_schedule_planned_outside_the_calibrated_shapes() -> None:
    """Found by verify=: fp8_e4m3*1+fp16*4 on 16-row matrices was 3.3x eager's error; the
    calibration measures short sides >= 64, so smaller ops keep their uniform precision."""
    (_, small), (_, large) = _precision_decisions(_muon([(16, 64), (768, 768)]), "sm90")
    assert small.chose == {} and not small.applied and "outside the calibrated shapes" in small.why
    assert str(large.chose["schedule"]).startswith("fp8_e4m3*") and large.applied
