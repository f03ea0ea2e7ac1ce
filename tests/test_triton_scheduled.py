"""Scheduled Newton–Schulz kernels (per-iteration formats) against ``newton_schulz_scheduled``.

Under the interpreter, FP8/MXFP8 products are bit-exact against the
emulation (tests/test_triton_fp8.py) but fp32/bf16/fp16 products sum in
Triton's tile order, not BLAS's, and the norm sums the pre-kernel's partials
in another order than ``vector_norm``: the last bits of the first iterate
differ, and NS amplifies such differences in its early (steep) iterations.
So a whole NS is compared the way the numerics contract compares backends:
its error against fp64 within 1.25x the reference's own, plus a floor.
"""

from __future__ import annotations

import ast
import os
from pathlib import Path
from types import ModuleType

import pytest
import torch

from hocompile.lowering.triton import module
from hocompile.lowering.triton.code import CodeWriter, KernelSource
from hocompile.lowering.triton.ns_kernels import NSCall
from hocompile.lowering.triton.ns_scheduled import check_schedule, emit_newton_schulz_scheduled, schedule_formats
from hocompile.lowering.triton.op_groups import allocations
from hocompile.ops.newton_schulz_math import reference_fp64
from hocompile.precision.calibrate import parse_schedule_key
from hocompile.precision.schedule_ns import newton_schulz_scheduled

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

interpreted = pytest.mark.skipif(torch.cuda.is_available(), reason="runs CPU tensors in the interpreter")
KJ = [(3.4445, -4.7750, 2.0315)] * 5
SCHEDULES = ["fp8_e4m3*1+fp16*4", "fp8_e4m3*2+bf16*3", "mxfp8_e4m3*2+bf16*3", "bf16*2+fp32*3"]
# Floor: what one storage ulp of the last iteration's format contributes to an element of size ~1/sqrt(m)
# (bf16: 2^-8 relative; the reference's own error is itself of that order), so a last-bit difference
# in the normalisation that NS propagates cannot fail a case whose reference error happens to be small.
FLOOR = {"fp16": 2.0**-11, "bf16": 2.0**-8, "fp32": 1e-5}


def _load(kernels: list[KernelSource], body: str, tmp_path: Path) -> ModuleType:
    for kernel in kernels:
        ast.parse(kernel.source)
    loaded, _ = module.load(module.assemble(kernels, body), tmp_path)
    return loaded


def _run(x: torch.Tensor, schedule: str, out_dtype: torch.dtype, tmp_path: Path, eps: float = 1e-7) -> tuple:
    batch, m, n = x.shape
    body = CodeWriter()
    call = NSCall(x="x", partials="partials", P="3", eps="eps", out="out", upcast="upcast", prefix="ns0_",
                  batch=batch, m=m, n=n, coefficients=KJ, out_dtype=out_dtype, eps_mode="clamp",
                  algorithm="standard", arch="interpret", origin="test")
    emitted = emit_newton_schulz_scheduled(body, call, parse_schedule_key(schedule))
    # The emitter's launch count is what its lines launch; its temporaries are the caller's to allocate.
    assert body.text().count("launch_") + body.text().count(".copy_(") == emitted.launches
    assert "torch.empty" not in body.text()
    w = CodeWriter()
    w.line("def run(x, eps, out, upcast):")
    with w.indent():
        w.line("partials = torch.stack([c.sum(1) for c in x.float().square().flatten(1).tensor_split(3, dim=1)], 1)")
        w.lines(allocations(emitted.buffers, "x.device"))
        w.extend(body)
        w.line("return out")
    out = torch.empty(batch, m, n, dtype=out_dtype)
    _load(emitted.kernels, w.text(), tmp_path).run(x, torch.tensor(eps), out, True)
    return out, w.text()


def _err(y: torch.Tensor, ref64: torch.Tensor) -> float:
    return float((y.double() - ref64).abs().amax())


CASES = [
    # schedule, batch, m, n, out_dtype
    ("fp8_e4m3*1+fp16*4", 1, 20, 40, torch.float32),
    ("fp8_e4m3*1+fp16*4", 3, 16, 16, torch.bfloat16),
    ("fp8_e4m3*2+bf16*3", 3, 16, 36, torch.float32),
    ("fp8_e4m3*2+bf16*3", 1, 24, 24, torch.float32),
    ("mxfp8_e4m3*2+bf16*3", 1, 20, 40, torch.bfloat16),
    ("mxfp8_e4m3*2+bf16*3", 3, 16, 16, torch.float32),
    ("bf16*2+fp32*3", 3, 16, 36, torch.float32),
    ("bf16*2+fp32*3", 1, 24, 24, torch.float32),
]


@interpreted
@pytest.mark.parametrize("schedule, batch, m, n, out_dtype", CASES)
def test_scheduled_ns_matches_reference(
    schedule: str, batch: int, m: int, n: int, out_dtype: torch.dtype, tmp_path: Path
) -> None:
    x = torch.randn(batch, m, n, generator=torch.Generator().manual_seed(m * n + batch))
    got, body = _run(x, schedule, out_dtype, tmp_path)
    fmts = parse_schedule_key(schedule)
    ref = newton_schulz_scheduled(x, KJ, 1e-7, fmts, out_dtype=out_dtype)
    ref64 = reference_fp64(x, KJ, 1e-7)
    assert got.dtype == out_dtype and got.shape == x.shape and torch.isfinite(got).all()
    own, err = _err(ref, ref64), _err(got, ref64)
    assert err <= 1.25 * own + FLOOR[fmts[-1]], (schedule, err, own, _err(got, ref))
    # 1 normalisation + 3 launches per iteration (FP8 amaxes are chained, the first from the normalisation)
    assert body.count("launch_") == 1 + 3 * len(KJ)


@interpreted
def test_fp8_iterations_are_bit_exact_given_the_same_x0(tmp_path: Path) -> None:
    """All-FP8 schedules on inputs whose norm is exactly 1 in any summation order (so X0 = x in both): bit for bit."""
    signs = torch.randint(0, 2, (2, 16, 64), generator=torch.Generator().manual_seed(0)) * 2.0 - 1.0
    x = signs / 32  # 1024 squares of 2^-10: exactly 1
    for schedule in ("fp8_e4m3*5", "mxfp8_e4m3*5"):
        fmts = parse_schedule_key(schedule)
        got, _ = _run(x, schedule, torch.bfloat16, tmp_path)
        ref = newton_schulz_scheduled(x, KJ, 1e-7, fmts, out_dtype=torch.bfloat16)
        assert torch.equal(got, ref), (schedule, (got.float() - ref.float()).abs().max())


def test_unsupported_schedules_decline() -> None:
    assert {"fp8_e4m3", "mxfp8_e4m3", "bf16", "fp16", "fp32"} <= schedule_formats("interpret")
    assert "fp8_e4m3" not in schedule_formats("sm80")
    with pytest.raises(NotImplementedError, match="fp8_e5m2"):
        check_schedule(("fp8_e5m2", "bf16"), "sm90")
    with pytest.raises(NotImplementedError, match="tf32"):
        check_schedule(("tf32", "fp32"), "interpret")
    with pytest.raises(NotImplementedError, match="gram"):
        check_schedule(("fp32",), "interpret", "gram")
    w = CodeWriter()
    with pytest.raises(NotImplementedError, match="cubic"):
        call = NSCall(x="x", partials="p", P="1", eps="e", out="o", upcast="u", prefix="p_", batch=1, m=4, n=4,
                      coefficients=[(1.5, -0.5, 0.0)], out_dtype=torch.float32, eps_mode="clamp",
                      algorithm="standard", arch="interpret", origin="t")
        emit_newton_schulz_scheduled(w, call, ("fp8_e4m3",))


# ------------------------------------------------------------- end to end


@interpreted
def test_muon_with_fp8_schedule_through_triton_matches_aten(cache_dir: Path) -> None:
    """torch.optim.Muon with ``schedule="fp8_e4m3*1+fp16*4"``: Triton kernels vs the aten path's emulation.

    Not bit-exact: the norm (partials vs vector_norm) and the fp16 products (tile vs BLAS
    order) differ in last bits, and one flipped FP8 rounding of X0 moves the result by as
    much as the schedule's own error (measured: 16-18 bf16 ulps of the update, i.e. ~0.07
    in NS units, the size of the FP8 error itself). The bound is the numerics contract's:
    both NS results are within 1.25x the reference's error of fp64 (tested per op above),
    so they differ by at most 2.25x the reference's own error ``own`` (max-abs, measured
    here on rank-8 inputs of the model's NS shapes, as a batch of 8 makes the gradients),
    times lr * scale, per step.
    """
    import hocompile
    from hocompile.ops.newton_schulz_math import reference_fp64 as fp64

    from .test_triton_step import TinyMLP, _train

    schedule = "fp8_e4m3*1+fp16*4"
    torch.manual_seed(0)
    model, twin = TinyMLP(), TinyMLP()
    twin.load_state_dict(model.state_dict())

    def mats(m: torch.nn.Module) -> list[torch.nn.Parameter]:
        return [p for p in m.parameters() if p.dim() == 2]

    aten = hocompile.compile_optimizer(
        torch.optim.Muon(mats(model), lr=0.02), backend="aten", schedule=schedule, cache_dir=cache_dir
    )
    tri = hocompile.compile_optimizer(
        torch.optim.Muon(mats(twin), lr=0.02), backend="triton", schedule=schedule, cache_dir=cache_dir
    )
    worst = _train(model, twin, aten, tri, steps=2)
    fmts = parse_schedule_key(schedule)
    own = 0.0
    for seed, (m, n) in enumerate([(24, 40), (24, 24)] * 2):
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn(m, 8, generator=gen) @ torch.randn(8, n, generator=gen)  # batch-8 grads: rank 8
        own = max(own, _err(newton_schulz_scheduled(x, KJ, 1e-7, fmts), fp64(x, KJ, 1e-7)))
    per_step = 0.02 * (40 / 24) ** 0.5 * 2.25 * own
    assert all(w <= (i + 1) * per_step for i, w in enumerate(worst)), (worst, per_step)
    text = hocompile.explain(tri)
    assert f"schedule {schedule}" in text, text
    assert "not applied" not in text, text
    import re

    counts = [int(c) for c in re.findall(r"schedule fp8_e4m3\*1\+fp16\*4, (\d+) launches", text)]
    assert counts and all(c <= 3 * len(KJ) + 2 for c in counts), counts  # 3 per iteration + normalisation
    lowered = tri.history[-1].lowered
    assert lowered is not None and lowered.backend == "triton"
    assert {"fp8_gemm", "ns_scale", "gram", "sym_poly", "gemm"} <= {k.family for k in tri.kernels()}
