"""Precision planner numerics: emulated formats bit for bit, scheduled NS, spectra, the shipped calibration."""

from __future__ import annotations

import bisect
import json
import math
from typing import Any

import numpy as np
import pytest
import torch

from hocompile.ops.newton_schulz_math import newton_schulz, reference_fp64
from hocompile.precision import FORMATS, emulated_matmul, load_calibration, newton_schulz_scheduled, quantize, spectrum
from hocompile.precision import calibrate as cal
from hocompile.precision.coefficients import TABLES, coefficients
from hocompile.precision.emulate import round_tf32
from hocompile.precision.schedule_ns import advance, finish, start
from hocompile.precision.spectra import LOW_RANK, POWER_LAW_ALPHA, SPECTRA, TINY_NORM

from .helpers import emerging_coefficients

KJ = coefficients("keller_jordan")
FP8 = ["fp8_e4m3", "fp8_e5m2", "mxfp8_e4m3", "mxfp8_e5m2"]

# ------------------------------------------------ independent fp8 reference
# Written from the OCP 8-bit floating point spec (OFP8, 2023) and the OCP MX
# v1.0 spec, without torch's fp8 casts: representable values enumerated from
# the bit fields, round-to-nearest-even by search, saturation at the largest
# finite value, MX scale 2^(floor(log2 amax) - emax).

_OFP8 = {  # element format: exponent bits, mantissa bits, largest finite value, emax (MX Table 1)
    "e4m3": (4, 3, 448.0, 8),
    "e5m2": (5, 2, 57344.0, 15),
}


def _grid(elem: str) -> tuple[list[float], list[int]]:
    ebits, mbits, finite_max, _ = _OFP8[elem]
    bias = 2 ** (ebits - 1) - 1
    values, codes = [], []
    for e in range(2**ebits):
        for m in range(2**mbits):
            v = (m / 2**mbits) * 2.0 ** (1 - bias) if e == 0 else (1 + m / 2**mbits) * 2.0 ** (e - bias)
            if v <= finite_max:
                values.append(v)
                codes.append(e * 2**mbits + m)
    return values, codes


def _round_fp8(v: float, elem: str) -> float:
    values, codes = _grid(elem)
    mag = min(abs(v), values[-1])  # saturate
    i = bisect.bisect_left(values, mag)
    if values[i] == mag:
        r = values[i]
    else:
        lo, hi = i - 1, i
        dlo, dhi = mag - values[lo], values[hi] - mag
        r = values[lo] if dlo < dhi or (dlo == dhi and codes[lo] % 2 == 0) else values[hi]
    return math.copysign(r, v)


def _ref_quantize(x: np.ndarray, fmt: str) -> tuple[list[list[float]], list[list[float]] | float]:
    """x: float32 [rows, K], quantised along K. Returns q (python floats) and the scale(s)."""
    elem = fmt.rsplit("_", 1)[1]
    _, _, finite_max, emax = _OFP8[elem]
    if fmt.startswith("fp8"):
        amax = np.float32(np.abs(x).max())
        scale = np.float32(amax / np.float32(finite_max)) if amax > 0 else np.float32(1.0)
        return [[_round_fp8(float(v / scale), elem) for v in row] for row in x], float(scale)
    q, scales = [], []
    for row in x:
        qrow, srow = [], []
        for start_k in range(0, len(row), 32):
            block = [float(v) for v in row[start_k:start_k + 32]]
            block_amax = max(abs(v) for v in block)
            e = max(-127, min(127, math.frexp(block_amax)[1] - 1 - emax)) if block_amax > 0 else -127
            srow.append(2.0**e)
            qrow += [_round_fp8(v / 2.0**e, elem) for v in block]
        q.append(qrow)
        scales.append(srow)
    return q, scales


def _f32(v: Any) -> np.float32:
    return np.float32(v)


def _ref_matmul(a: np.ndarray, b: np.ndarray, fmt: str, alpha: float = 1.0, beta: float = 1.0,
                c: np.ndarray | None = None) -> np.ndarray:
    """2-D reference: exact 32-chunk dot products (math.fsum), fp32 accumulation in K order."""
    qa, sa = _ref_quantize(a, fmt)
    qb, sb = _ref_quantize(b.T.copy(), fmt)  # B quantised along its K axis = rows of Bᵀ
    m, k, n = a.shape[0], a.shape[1], b.shape[1]
    out = np.zeros((m, n), dtype=np.float32)
    for i in range(m):
        for j in range(n):
            acc: Any = None
            for blk, s in enumerate(range(0, k, 32)):
                term = _f32(math.fsum(qa[i][t] * qb[j][t] for t in range(s, min(s + 32, k))))
                if fmt.startswith("mx"):
                    term = _f32(_f32(term * _f32(sa[i][blk])) * _f32(sb[j][blk]))  # type: ignore[index]
                acc = term if acc is None else _f32(acc + term)
            if fmt.startswith("fp8"):
                acc = _f32(acc * _f32(_f32(sa) * _f32(sb)))  # type: ignore[arg-type]
            if alpha != 1.0:
                acc = _f32(acc * _f32(alpha))
            if c is not None:
                acc = _f32(acc + _f32(_f32(c[i, j]) * _f32(beta)))
            out[i, j] = acc
    return out


def _round_bf16_bits(x: np.ndarray) -> np.ndarray:
    bits = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).astype(np.uint32)
    return rounded.view(np.float32)


def _operands(seed: int, m: int = 5, k: int = 70, n: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=g) * torch.logspace(-3, 2, k)  # spread magnitudes along K
    b = torch.randn(k, n, generator=g)
    a[1, :32] = 0.0  # an all-zero MX block
    a[2, 40] = 1.9 * 2.0**6  # block amax 1.9·2^e: scaled to 1.9·2^emax > max, saturates
    b[3, :] = -1e4
    return a, b


# ------------------------------------------------ bit-exact matmul checks


@pytest.mark.parametrize("fmt", FP8)
def test_emulated_matmul_bit_exact(fmt: str) -> None:
    a, b = _operands(0)
    got = emulated_matmul(a, b, fmt)
    want = _ref_matmul(a.numpy(), b.numpy(), fmt)
    assert torch.equal(got, torch.from_numpy(want))


@pytest.mark.parametrize("fmt", FP8)
def test_emulated_matmul_epilogue_and_batch_bit_exact(fmt: str) -> None:
    pairs = [_operands(s) for s in (1, 2)]
    a = torch.stack([p[0] for p in pairs])
    b = torch.stack([p[1] for p in pairs])
    c = torch.randn(2, 5, 6, generator=torch.Generator().manual_seed(3))
    got = emulated_matmul(a, b, fmt, torch.bfloat16, c=c, alpha=2.0315, beta=-4.775)
    for i in range(2):
        want = _ref_matmul(a[i].numpy(), b[i].numpy(), fmt, 2.0315, -4.775, c[i].numpy())
        assert torch.equal(got[i].float(), torch.from_numpy(_round_bf16_bits(want)))


@pytest.mark.parametrize("fmt", FP8)
def test_gram_and_square_products_bit_exact(fmt: str) -> None:
    """X Xᵀ and A A reuse one quantisation internally: still the reference's bits."""
    x = torch.randn(6, 45, generator=torch.Generator().manual_seed(4))
    assert torch.equal(emulated_matmul(x, x.mT, fmt), torch.from_numpy(_ref_matmul(x.numpy(), x.T.numpy(), fmt)))
    s = torch.randn(40, 40, generator=torch.Generator().manual_seed(5))
    assert torch.equal(emulated_matmul(s, s, fmt), torch.from_numpy(_ref_matmul(s.numpy(), s.numpy(), fmt)))


def test_float_formats_match_rounded_fp32_gemm() -> None:
    a, b = _operands(6)
    assert torch.equal(emulated_matmul(a, b, "fp32"), a @ b)
    assert torch.equal(emulated_matmul(a, b, "bf16", torch.bfloat16), (a.bfloat16().float() @ b.bfloat16().float())
                       .bfloat16())
    assert torch.equal(emulated_matmul(a, b, "tf32"), round_tf32(a) @ round_tf32(b))


# ------------------------------------------------ quantisation units


def test_tf32_rounding_bit_patterns() -> None:
    one = 0x3F800000
    cases = {  # input bits -> expected bits (10 mantissa bits kept, ties to even)
        one + 0x1000: one,  # 1 + 2^-11: tie, even stays
        one + 0x3000: one + 0x4000,  # 1 + 3·2^-11: tie, odd rounds up
        one + 0x1001: one + 0x2000,  # just above the tie
        one + 0x0FFF: one,  # just below the tie
        0x80000000 | (one + 0x3000): 0x80000000 | (one + 0x4000),  # sign unaffected
        0x7F7FFFFF: 0x7F800000,  # fp32 max rounds to inf
        0x00000001: 0x00000000,  # smallest subnormal rounds to zero
        0x7F800000: 0x7F800000,  # inf
    }
    x = torch.tensor(list(cases), dtype=torch.int64).to(torch.int32).view(torch.float32)
    got = round_tf32(x).view(torch.int32).tolist()
    assert [g & 0xFFFFFFFF for g in got] == list(cases.values())
    nan_low_payload = torch.tensor([0x7F800001], dtype=torch.int32).view(torch.float32)
    assert torch.isnan(round_tf32(nan_low_payload)).all()  # the bit trick alone would make it inf


@pytest.mark.parametrize("fmt,fp8_max", [("fp8_e4m3", 448.0), ("fp8_e5m2", 57344.0)])
def test_fp8_per_matrix_scale_and_saturation(fmt: str, fp8_max: float) -> None:
    x = torch.tensor([[3.0, -7.5], [0.25, 1e-9]])
    q, scale = quantize(x, fmt)
    assert scale is not None and scale.shape == (1, 1)
    assert q.to(torch.float32).abs().max().item() == fp8_max  # amax maps onto the largest finite value
    assert scale.item() == pytest.approx(7.5 / fp8_max, rel=1e-7)
    zq, zs = quantize(torch.zeros(3, 4), fmt)
    assert zs is not None and zs.item() == 1.0 and not zq.to(torch.float32).any()


@pytest.mark.parametrize("fmt,emax,fp8_max", [("mxfp8_e4m3", 8, 448.0), ("mxfp8_e5m2", 15, 57344.0)])
def test_mx_scales_layout_saturation_and_zero_blocks(fmt: str, emax: int, fp8_max: float) -> None:
    x = torch.randn(3, 70, generator=torch.Generator().manual_seed(7))
    x[0, 32:64] = 0.0  # zero block
    x[1, 64] = 1.9 * 2.0**20  # amax of the padded last block
    q, scale = quantize(x, fmt)
    assert scale is not None and scale.shape == (3, 3) and q.shape == x.shape
    exps = torch.log2(scale)
    assert torch.equal(exps, exps.round())  # powers of two
    assert scale[0, 1].item() == 2.0**-127 and not q[0, 32:64].to(torch.float32).any()
    assert scale[1, 2].item() == 2.0 ** (20 - emax)
    assert q[1, 64].to(torch.float32).item() == fp8_max  # 1.9·2^emax > max: saturated, not inf/NaN
    assert not torch.isnan(q.to(torch.float32)).any()
    # Blocks are 32 consecutive elements along the axis: touching element 40 changes block 1 only.
    y = x.clone()
    y[2, 40] = 1e6
    _, scale_y = quantize(y, fmt)
    assert scale_y is not None and torch.equal(scale_y[:, [0, 2]], scale[:, [0, 2]]) and scale_y[2, 1] > scale[2, 1]
    # Along axis -2 is the same as transposing.
    qt, st = quantize(x.mT.contiguous(), fmt, axis=-2)
    assert st is not None and torch.equal(st, scale.mT) and torch.equal(qt.view(torch.uint8), q.mT.view(torch.uint8))


def test_float_formats_are_casts() -> None:
    x = torch.randn(4, 5)
    assert torch.equal(quantize(x, "bf16")[0], x.bfloat16())
    assert torch.equal(quantize(x, "fp16")[0], x.half())
    assert quantize(x, "fp32")[1] is None
    assert {f: FORMATS[f].storage for f in ("tf32", "fp8_e4m3", "fp16")} == {
        "tf32": torch.float32, "fp8_e4m3": torch.bfloat16, "fp16": torch.float16}
    with pytest.raises(ValueError, match="unknown compute format"):
        quantize(x, "fp4")


# ------------------------------------------------ scheduled Newton–Schulz


def _signs(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """±1/64 entries: 4096 per matrix, so ‖X‖_F = 1 exactly and normalisation is exact in any precision."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 2, shape, generator=g) * 2 - 1).float() / 64


@pytest.mark.parametrize("algorithm,restarts", [("standard", ()), ("gram", (2,))])
@pytest.mark.parametrize("shape,transpose", [((64, 64), False), ((2, 32, 128), False), ((128, 32), True)])
def test_all_bf16_schedule_is_hocompile_bf16(algorithm: str, restarts: tuple[int, ...],
                                             shape: tuple[int, ...], transpose: bool) -> None:
    x = _signs(shape, 0)
    coeffs = coefficients("quintic")
    kw = dict(algorithm=algorithm, restarts=restarts, transpose=transpose, out_dtype=torch.float32)
    got = newton_schulz_scheduled(x, coeffs, 1e-7, ["bf16"] * 5, **kw)  # type: ignore[arg-type]
    want = newton_schulz(x, coeffs, 1e-7, compute_dtype=torch.bfloat16, matmul="emulate", **kw)  # type: ignore[arg-type]
    assert torch.equal(got, want)


@pytest.mark.parametrize("algorithm,restarts", [("standard", ()), ("gram", (2,))])
def test_all_bf16_schedule_close_to_hocompile_bf16_on_gaussian(algorithm: str, restarts: tuple[int, ...]) -> None:
    """Only the normalisation differs (fp32 here, bf16 there): the gap is of the size of either error."""
    x = torch.randn(3, 48, 160, generator=torch.Generator().manual_seed(1))
    kw = dict(algorithm=algorithm, restarts=restarts, out_dtype=torch.float32)
    got = newton_schulz_scheduled(x, KJ, 1e-7, ["bf16"] * 5, **kw)  # type: ignore[arg-type]
    want = newton_schulz(x, KJ, 1e-7, compute_dtype=torch.bfloat16, matmul="emulate", **kw)  # type: ignore[arg-type]
    ref = reference_fp64(x, KJ, 1e-7)
    err_got, err_want = (got - ref).abs().max().item(), (want - ref).abs().max().item()
    assert (got - want).abs().max().item() <= 2 * max(err_got, err_want)
    assert 0.5 < err_got / err_want < 2


@pytest.mark.parametrize("algorithm,restarts", [("standard", ()), ("gram", (2,))])
def test_all_fp32_schedule_is_hocompile_fp32(algorithm: str, restarts: tuple[int, ...]) -> None:
    x = torch.randn(2, 40, 96, generator=torch.Generator().manual_seed(2))
    got = newton_schulz_scheduled(x, KJ, 1e-7, ["fp32"] * 5, algorithm=algorithm, restarts=restarts, eps_mode="add")
    want = newton_schulz(x, KJ, 1e-7, compute_dtype=torch.float32, algorithm=algorithm, restarts=restarts,
                         eps_mode="add")
    assert torch.equal(got, want)


@pytest.mark.parametrize("algorithm,restarts", [("standard", ()), ("gram", (2,))])
def test_resumed_prefix_is_one_run(algorithm: str, restarts: tuple[int, ...]) -> None:
    x = torch.randn(2, 32, 96, generator=torch.Generator().manual_seed(3))
    schedule = ["mxfp8_e4m3"] * 2 + ["bf16"] * 3
    whole = newton_schulz_scheduled(x, KJ, 1e-7, schedule, algorithm=algorithm, restarts=restarts)
    prefix = advance(start(x, 1e-7), KJ, ["mxfp8_e4m3"] * 5, 2, algorithm=algorithm, restarts=restarts)
    resumed = finish(advance(prefix, KJ, schedule, 5, algorithm=algorithm, restarts=restarts), "bf16")
    assert torch.equal(whole, resumed)


def test_fp8_early_schedule_is_self_corrected() -> None:
    """NS is self-correcting: one FP8 iteration then fp32 beats all-bf16."""
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(4))
    ref = reference_fp64(x, KJ, 1e-7)
    err = {s: (newton_schulz_scheduled(x, KJ, 1e-7, list(s)) - ref).abs().max().item()
           for s in [("fp8_e4m3",) + ("fp32",) * 4, ("bf16",) * 5, ("fp8_e4m3",) * 5]}
    assert err[("fp8_e4m3",) + ("fp32",) * 4] < err[("bf16",) * 5] < err[("fp8_e4m3",) * 5]


def test_schedule_validation() -> None:
    x = torch.randn(8, 16)
    with pytest.raises(ValueError, match="formats for 5 iterations"):
        newton_schulz_scheduled(x, KJ, 1e-7, ["bf16"] * 4)
    with pytest.raises(ValueError, match="unknown compute formats"):
        newton_schulz_scheduled(x, KJ, 1e-7, ["bf16"] * 4 + ["int8"])


# ------------------------------------------------ spectra and coefficient tables


def test_spectra_are_deterministic_and_as_intended() -> None:
    m, n = 32, 96
    for kind in SPECTRA:
        x = spectrum(kind, m, n, 0)
        assert x.dtype == torch.float32 and x.shape == (m, n)
        assert torch.equal(x, spectrum(kind, m, n, 0)) and not torch.equal(x, spectrum(kind, m, n, 1))
    sv = {kind: torch.linalg.svdvals(spectrum(kind, m, n, 0).double()) for kind in SPECTRA}
    power_law = torch.arange(1, m + 1, dtype=torch.float64) ** -POWER_LAW_ALPHA
    torch.testing.assert_close(sv["heavy_tailed"], power_law, rtol=1e-5, atol=1e-7)
    low = sv["low_rank_noise"] / sv["low_rank_noise"][0]
    assert low[LOW_RANK - 1] > 1e-2 and low[LOW_RANK] < 1e-2  # rank-4 signal, then the noise floor
    assert sv["rank_one"][1] / sv["rank_one"][0] < 1e-6
    assert spectrum("tiny_norm", m, n, 0).double().norm().item() == pytest.approx(TINY_NORM, rel=1e-6)
    with pytest.raises(ValueError):
        spectrum("uniform", m, n, 0)


def test_coefficient_tables_equal_emerging_optimizers() -> None:
    pytest.importorskip("emerging_optimizers")
    from emerging_optimizers.orthogonalized_optimizers import muon_utils  # needs .helpers' typing patch (imported)

    for kind, table in muon_utils._COEFFICIENT_SETS.items():
        assert TABLES[kind] == tuple(tuple(t) for t in table)
        for steps in (3, 4, 5, 8, 10, 12):
            assert list(coefficients(kind, steps)) == emerging_coefficients(kind, steps)
    assert coefficients("keller_jordan") == ((3.4445, -4.775, 2.0315),) * 5
    assert coefficients("simple") == coefficients("keller_jordan")


# ------------------------------------------------ the shipped calibration


def test_calibration_covers_every_set_algorithm_and_planner_schedule() -> None:
    c = load_calibration()
    assert cal.CALIBRATION_PATH.stat().st_size < 200 * 1024
    assert [tuple(s) for s in c.metadata["shapes"]] == list(cal.SHAPES)
    assert c.metadata["spectra"] == list(SPECTRA) and c.metadata["seed"] == cal.SEED
    for name, steps in cal.CALIBRATED:
        for algorithm in cal.ALGORITHMS:
            assert c.schedules(name, algorithm, steps) == cal.planner_schedules(steps)
            for schedule in cal.planner_schedules(steps):
                errors = c.errors(name, algorithm, schedule)
                assert len(errors) == len(cal.SHAPES) * len(SPECTRA)
                assert c.predicted_error(name, algorithm, schedule) == max(errors.values()) > 0
            assert c.baseline_error(name, algorithm, steps) > 0  # inf where eager's bf16 Gram NS diverges
    # Names resolve through the coefficient tables; tuples are matched by value.
    kj = c.predicted_error("keller_jordan", "standard", ["bf16"] * 5)
    assert c.predicted_error("simple", "standard", ["bf16"] * 5) == kj
    assert c.predicted_error("deepseekv4", "standard", ["bf16"] * 5) == kj
    assert c.predicted_error([list(t) for t in KJ], "standard", ["bf16"] * 5) == kj
    with pytest.raises(KeyError):
        c.predicted_error("quintic", "standard", ["bf16"] * 7)


def test_calibration_entry_reproduces() -> None:
    """Re-measure stored entries: identical twice in a row, and equal to the table.

    On the machine that wrote the table the stored digits come back exactly;
    the 1% tolerance covers another CPU's BLAS summation order.
    """
    c = load_calibration()
    (m, n) = cal.SHAPES[0]
    x = cal.calibration_inputs(m, n)
    for name, algorithm, schedule in [
        ("keller_jordan", "standard", ("fp8_e4m3",) * 2 + ("bf16",) * 3),
        ("quintic", "gram", ("mxfp8_e4m3",) + ("fp32",) * 4),
    ]:
        coeffs = coefficients(name)
        ref = reference_fp64(x, coeffs, cal.EPS, eps_mode=cal.EPS_MODE)
        first = cal.measure(coeffs, algorithm, schedule, x, ref)
        assert first == cal.measure(coeffs, algorithm, schedule, x, ref)
        stored = c.errors(name, algorithm, schedule)
        for kind, e in zip(SPECTRA, first):
            assert (math.inf if e is None else e) == pytest.approx(stored[((m, n), kind)], rel=1e-2)


def test_prefix_sharing_measures_what_measure_measures() -> None:
    x = cal.calibration_inputs(32, 64)
    coeffs = coefficients("aol")
    ref = reference_fp64(x, coeffs, cal.EPS, eps_mode=cal.EPS_MODE)
    shared = cal.measure_schedules(coeffs, "gram", x, ref)
    for schedule in [("fp16",) * 2 + ("fp32",) * 2, ("fp8_e4m3",) * 3 + ("bf16",), ("tf32",) * 4]:
        assert shared[cal.schedule_key(schedule)] == cal.measure(coeffs, "gram", schedule, x, ref)
    assert cal.parse_schedule_key("fp8_e4m3*3+bf16*1") == ("fp8_e4m3",) * 3 + ("bf16",)
    assert json.loads(json.dumps(shared)) == shared
