"""Newton–Schulz matmul kernels (gram, sym_poly, gemm) against aten with the same rounding points.

On a machine without CUDA the kernels run in Triton's interpreter on CPU
tensors (``TRITON_INTERPRET=1``, set before any kernel is defined) and dot on
fp32 copies of half-precision tiles (``upcast``). Interpreted launches are
slow, so shapes are tiny but never tile multiples (tiles are 16 there).

Tolerances: a kernel and aten sum the same products in different orders. In
fp32 any order is within ``k * 2**-24 * sum|terms|`` of the exact sum (the
classic dot-product bound), so two orders differ by at most twice that;
rounding once to the compute dtype then adds at most one ulp of the result.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from hocompile.lowering.triton import module
from hocompile.lowering.triton.code import CodeWriter, KernelSource
from hocompile.lowering.triton.matmul_kernels import BLOCK_P
from hocompile.lowering.triton.ns_kernels import (
    GemmSpec,
    GramSpec,
    NSCall,
    SymPolySpec,
    emit_newton_schulz,
    generate_gemm,
    generate_gram,
    generate_sym_poly,
)
from hocompile.lowering.triton.op_groups import allocations
from hocompile.lowering.triton.tiles import MATMUL_TILES
from hocompile.ops.newton_schulz_math import _round, newton_schulz, reference_fp64

from .helpers import emerging_coefficients

if not torch.cuda.is_available():
    # Before any kernel is defined: Triton decides then whether it is interpreted.
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ARCH = "interpret" if DEVICE.type == "cpu" else "sm90"
UPCAST = DEVICE.type == "cpu"
ULP = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}  # ulp(x) <= ULP * |x|
KJ = [(3.4445, -4.7750, 2.0315)] * 5
CUBIC = [(1.5, -0.5, 0.0)] * 5
EMERGING_KINDS = ["simple", "quintic", "polar_express", "cans", "aol", "deepseekv4"]
# An fp32 NS is ~1e-6 from fp64, where 1.25x of aten's error is summation-order noise, so this floor
# bounds instead. Measured: fp32 Gram NS with polar_express/cans at 16x20 is ~2x aten's error (4-6e-6)
# because symmetric products keep one triangle and mirror it (pure-torch emulation of the mirroring
# shows the same; at 256x1024 the cost is under 1.15x).
FLOOR = 1e-5


def _load(kernels: list[KernelSource], body: str, tmp_path: Path) -> ModuleType:
    for kernel in kernels:
        ast.parse(kernel.source)
    loaded = module.load(module.assemble(kernels, body), tmp_path)
    return loaded[0] if isinstance(loaded, tuple) else loaded


def _randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(DEVICE)


def _assert_rounded_close(
    got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, magnitude: torch.Tensor, terms: int
) -> float:
    """``got`` and ``ref``: one sum of ``terms`` terms (of total size ``magnitude``), rounded once to dtype.

    Returns the largest error as a fraction of the allowed one.
    """
    got, ref = got.float(), ref.float()
    tol = 2 * terms * 2.0**-24 * magnitude + ULP[dtype] * torch.maximum(got.abs(), ref.abs())
    err = (got - ref).abs()
    worst = (err / tol.clamp_min(1e-30)).max().item()
    assert (err <= tol).all(), f"max error {err.max().item():.3g}, {worst:.3g}x the rounding bound"
    return worst


def _partials(x: torch.Tensor, parts: int) -> torch.Tensor:
    """[batch, parts] fp32 partial sums of squares, as the producer kernel of x leaves them."""
    chunks = x.float().square().flatten(1).tensor_split(parts, dim=1)
    return torch.stack([chunk.sum(1) for chunk in chunks], 1)


# ------------------------------------------------------------- each family alone


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize(
    "normalize, eps_mode, eps",
    [(False, "clamp", 0.0), (True, "clamp", 1e-7), (True, "clamp", 1e3), (True, "add", 0.5)],
    ids=["plain", "clamp", "clamp-hit", "add"],
)
def test_gram(dtype: torch.dtype, normalize: bool, eps_mode: str, eps: float, tmp_path: Path) -> None:
    batch, m, k = 2, 20, 37
    spec = GramSpec(batch, m, k, dtype, ARCH, normalize=normalize, eps_mode=eps_mode)
    mod = _load([generate_gram(spec, "test")], "", tmp_path)
    x = _randn(batch, m, k, dtype=dtype, seed=0)
    out = torch.empty(batch, m, m, dtype=dtype, device=DEVICE)
    launch = getattr(mod, f"launch_{spec.name}")
    if not normalize:
        launch(x, out, upcast=UPCAST)
        x0 = x.float()
    else:
        partials = _partials(x, 3)
        x0_out = torch.full_like(x, float("nan"))
        launch(
            x,
            out,
            upcast=UPCAST,
            x0=x0_out,
            partials=partials,
            eps=torch.tensor(eps, dtype=torch.float32, device=DEVICE),
        )
        # newton_schulz.normalize's rounding points, from the same partial sums
        norm = _round(partials.sum(1).sqrt(), dtype)[:, None, None]
        denom = _round(norm.clamp(min=eps) if eps_mode == "clamp" else norm + eps, dtype)
        x0 = _round(x.float() / denom, dtype)
        _assert_rounded_close(x0_out, x0, dtype, x0.abs(), terms=3 + 2)
    ref = _round(x0 @ x0.mT, dtype)
    _assert_rounded_close(out, ref, dtype, x0.abs() @ x0.abs().mT, terms=k)
    assert torch.equal(out, out.mT)  # the mirrored store


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("cubic", [False, True], ids=["quintic", "cubic"])
def test_sym_poly(dtype: torch.dtype, cubic: bool, tmp_path: Path) -> None:
    batch, m = 2, 20
    a, b, c = 3.4445, -4.775, 0.0 if cubic else 2.0315
    spec = SymPolySpec(batch, m, dtype, ARCH, cubic=cubic)
    mod = _load([generate_sym_poly(spec, "test")], "", tmp_path)
    y = _randn(batch, m, m, dtype=torch.float32, seed=1)
    A = ((y + y.mT) / 4).to(dtype)  # exactly symmetric
    out = torch.empty_like(A)
    getattr(mod, f"launch_{spec.name}")(A, out, a, b, c, upcast=UPCAST)
    Af = A.float()
    eye = torch.eye(m, device=DEVICE)
    ref = _round(b * Af + a * eye + c * (Af @ Af), dtype)  # newton_schulz._gram's P
    magnitude = abs(b) * Af.abs() + abs(a) * eye + abs(c) * (Af.abs() @ Af.abs())
    _assert_rounded_close(out, ref, dtype, magnitude, terms=m + 3)
    assert torch.equal(out, out.mT)


GEMM_CASES = {
    "f32": (torch.float32, None, False, False),
    "bf16-acc": (torch.bfloat16, None, True, False),
    "f16-acc": (torch.float16, None, True, False),
    "bf16-sym": (torch.bfloat16, None, False, True),
    "f32-acc-sym": (torch.float32, None, True, True),
    "f32-to-bf16-acc": (torch.float32, torch.bfloat16, True, False),
    "bf16-to-f32": (torch.bfloat16, torch.float32, False, False),
}


@pytest.mark.parametrize("case", sorted(GEMM_CASES))
def test_gemm(case: str, tmp_path: Path) -> None:
    dtype, out_dtype, accumulate, symmetric = GEMM_CASES[case]
    batch, m, n, k = 2, 20, (20 if symmetric else 37), 20
    spec = GemmSpec(batch, m, n, k, dtype, ARCH, out_dtype=out_dtype, accumulate=accumulate, symmetric=symmetric)
    mod = _load([generate_gemm(spec, "test")], "", tmp_path)
    alpha, beta = 0.75, 3.4445
    if symmetric:  # L = R = A, so L @ R = A² is symmetric exactly
        y = _randn(batch, m, m, dtype=torch.float32, seed=2)
        L = R = ((y + y.mT) / 4).to(dtype)
    else:
        L, R = _randn(batch, m, k, dtype=dtype, seed=3), _randn(batch, k, n, dtype=dtype, seed=4)
    C = L.to(dtype) if symmetric else _randn(batch, m, n, dtype=dtype, seed=5)
    out = torch.empty(batch, m, n, dtype=out_dtype or dtype, device=DEVICE)
    launch = getattr(mod, f"launch_{spec.name}")
    if accumulate:
        launch(L, R, out, alpha, upcast=UPCAST, C=C, beta=beta)
    else:
        launch(L, R, out, alpha, upcast=UPCAST)
    Lf, Rf, Cf = L.float(), R.float(), C.float()
    exact = alpha * (Lf @ Rf) + (beta * Cf if accumulate else 0.0)
    ref = _round(exact, dtype).to(out.dtype)
    magnitude = alpha * (Lf.abs() @ Rf.abs()) + (beta * Cf.abs() if accumulate else 0.0)
    # a second rounding to a different stored dtype: one more ulp of that dtype
    check = out_dtype if out_dtype is not None and ULP[out_dtype] > ULP[dtype] else dtype
    _assert_rounded_close(out, ref, check, magnitude, terms=k + 3)
    if symmetric:
        assert torch.equal(out, out.mT)


# ------------------------------------------------------------- a whole Newton–Schulz


def _ns_body(w: CodeWriter, *, dtype: torch.dtype, restarts: tuple[int, ...], **kw: Any) -> list[KernelSource]:
    body = CodeWriter()
    call = NSCall(x="x", partials="partials", P="3", eps="eps", out="out", upcast="upcast", prefix="ns0_",
                  arch=ARCH, origin="test", **kw)
    emitted = emit_newton_schulz(body, call, dtype, restarts)
    # The emitter's launch count is what its lines launch; its temporaries are the caller's to allocate.
    assert body.text().count("launch_") == emitted.launches
    assert "torch.empty" not in body.text()
    w.line("def run(x, eps, out, upcast):")
    with w.indent():
        w.line("partials = torch.stack([c.sum(1) for c in x.float().square().flatten(1).tensor_split(3, dim=1)], 1)")
        w.lines(allocations(emitted.buffers, "x.device"))
        w.extend(body)
        w.line("return out")
    return emitted.kernels


def _coefficients(kind: str) -> list[tuple[float, float, float]]:
    return {"kj": KJ, "cubic": CUBIC}.get(kind) or emerging_coefficients(kind, 5)


# kind, algorithm, restarts, batch, m, n, dtype, out_dtype, eps_mode
# Batch 3 cases use m = 16 (one row tile) because interpreted time grows with programs launched;
# the batch 1 cases cover row masks and several lower-triangle tiles.
NS_CASES = [
    ("kj", "standard", (), 3, 16, 20, torch.bfloat16, torch.float32, "clamp"),
    ("simple", "standard", (), 1, 20, 24, torch.float32, torch.float32, "clamp"),
    ("quintic", "standard", (), 1, 20, 20, torch.bfloat16, torch.bfloat16, "clamp"),
    ("polar_express", "standard", (), 1, 20, 24, torch.bfloat16, torch.float32, "clamp"),
    ("cans", "standard", (), 1, 20, 20, torch.float32, torch.bfloat16, "clamp"),
    ("aol", "standard", (), 1, 20, 24, torch.bfloat16, torch.float32, "clamp"),
    ("deepseekv4", "standard", (), 1, 20, 24, torch.bfloat16, torch.float32, "add"),
    ("cubic", "standard", (), 1, 20, 24, torch.bfloat16, torch.float32, "clamp"),
    ("kj", "gram", (), 1, 20, 24, torch.float32, torch.float32, "clamp"),
    ("polar_express", "gram", (2,), 3, 16, 20, torch.float32, torch.float32, "add"),
    ("cubic", "gram", (), 1, 20, 20, torch.float32, torch.float32, "clamp"),
]


def test_ns_cases_cover_every_coefficient_set() -> None:
    assert {case[0] for case in NS_CASES} == {"kj", "cubic", *EMERGING_KINDS}
    assert {(case[1], case[6]) for case in NS_CASES if case[1] == "gram"} == {("gram", torch.float32)}
    assert {case[3] for case in NS_CASES} == {1, 3} and any(case[4] == case[5] for case in NS_CASES)


@pytest.mark.parametrize("case", NS_CASES, ids=lambda c: f"{c[0]}-{c[1]}{list(c[2]) or ''}-b{c[3]}-{c[4]}x{c[5]}")
def test_newton_schulz_error_within_aten_budget(case: tuple, tmp_path: Path) -> None:  # type: ignore[type-arg]
    """Against fp64, the kernels' error is within 1.25x of the aten emulation's own (the product's contract).

    Bitwise agreement with aten is not expected: each product sums in another
    order, and NS amplifies those ulp-sized differences over its iterations.
    """
    kind, algorithm, restarts, batch, m, n, dtype, out_dtype, eps_mode = case
    coefficients = _coefficients(kind)
    w = CodeWriter()
    kernels = _ns_body(
        w,
        batch=batch,
        m=m,
        n=n,
        coefficients=coefficients,
        dtype=dtype,
        out_dtype=out_dtype,
        eps_mode=eps_mode,
        algorithm=algorithm,
        restarts=restarts,
    )
    mod = _load(kernels, w.text(), tmp_path)
    x = _randn(batch, m, n, dtype=dtype, seed=6)
    out = torch.full((batch, m, n), float("nan"), dtype=out_dtype, device=DEVICE)
    mod.run(x, torch.tensor(1e-7, device=DEVICE), out, UPCAST)
    aten = newton_schulz(
        x,
        coefficients,
        1e-7,
        eps_mode=eps_mode,
        compute_dtype=dtype,
        out_dtype=out_dtype,
        algorithm=algorithm,
        restarts=restarts,
        matmul="emulate",
    )
    exact = reference_fp64(x.cpu(), coefficients, 1e-7, eps_mode=eps_mode)

    def rel(y: torch.Tensor) -> float:
        return ((y.cpu().double() - exact).norm() / exact.norm()).item()

    assert rel(out) <= 1.25 * rel(aten) + FLOOR, (rel(out), rel(aten))


# ------------------------------------------------------------- generated text


def _all_specs(arch: str) -> list[KernelSource]:
    out = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for normalize, eps_mode in ((False, "clamp"), (True, "clamp"), (True, "add")):
            out.append(generate_gram(GramSpec(3, 40, 70, dtype, arch, normalize, eps_mode), "test"))
        for cubic in (False, True):
            out.append(generate_sym_poly(SymPolySpec(3, 40, dtype, arch, cubic), "test"))
        for accumulate in (False, True):
            for symmetric in (False, True):
                for out_dtype in (None, torch.float32):
                    spec = GemmSpec(3, 40, 40, 40, dtype, arch, out_dtype, accumulate, symmetric)
                    out.append(generate_gemm(spec, "test"))
    return out


@pytest.mark.parametrize("arch", sorted(MATMUL_TILES))
def test_every_generated_source_parses_and_is_deterministic(arch: str) -> None:
    first, again = _all_specs(arch), _all_specs(arch)
    assert [k.source for k in first] == [k.source for k in again]
    assert len({k.name for k in first}) == len({k.spec for k in first})  # names tell every variant apart
    for kernel in first:
        ast.parse(kernel.source)
        assert kernel.source.isascii()  # goldens and any source encoding take it verbatim
        assert kernel.source.startswith(f"# kernel {kernel.name}: family {kernel.family}; from test\n")
        assert f"def {kernel.launcher}(" in kernel.source


def _emitted(algorithm: str, coefficients: list[tuple[float, float, float]], restarts: tuple[int, ...] = ()) -> str:
    w = CodeWriter()
    _ns_body(
        w,
        batch=2,
        m=20,
        n=30,
        coefficients=coefficients,
        dtype=torch.bfloat16,
        out_dtype=torch.float32,
        eps_mode="clamp",
        algorithm=algorithm,
        restarts=restarts,
    )
    ast.parse(w.text())
    assert w.text().isascii()
    return w.text()


def test_standard_is_three_launches_per_iteration() -> None:
    for steps in (1, 2, 5):
        assert _emitted("standard", KJ[:steps]).count("launch_") == 3 * steps
    assert _emitted("standard", CUBIC).count("launch_") == 3 * len(CUBIC)


def test_gram_launch_count_follows_the_algorithm() -> None:
    # gram + per iteration: P, Q = P Q (not the first since a (re)start), R = P (P R) (not last, no restart)
    assert _emitted("gram", KJ).count("launch_") == 1 + 5 + 4 + 2 * 4 + 1
    # a restart after iteration 2 trades "R = P (P R)" for "X0 = Q X0; R = gram(X0)" and one "Q = P Q" less
    assert _emitted("gram", KJ, (2,)).count("launch_") == 1 + 5 + 3 + 2 * 3 + 2 + 1


def test_stable_names_and_spec_checks() -> None:
    assert GramSpec(12, 768, 3072, torch.bfloat16, "sm90").name == "ns_gram_bf16_b12_768x3072"
    gram = GramSpec(1, 4, 8, torch.float32, "sm90", normalize=True, eps_mode="add")
    assert gram.name == "ns_gram_fp32_b1_4x8_norm_add"
    assert SymPolySpec(2, 4, torch.bfloat16, "sm90", cubic=True).name == "ns_sym_poly_bf16_b2_4x4_cubic"
    spec = GemmSpec(2, 4, 8, 4, torch.bfloat16, "sm90", out_dtype=torch.float32, accumulate=True)
    assert spec.name == "ns_gemm_bf16_b2_4x8x4_acc_out_fp32"
    # out_dtype equal to the compute dtype is the default: one spec, one name, one kernel
    assert GemmSpec(2, 4, 8, 4, torch.float32, "sm90", out_dtype=torch.float32) == GemmSpec(
        2, 4, 8, 4, torch.float32, "sm90"
    )
    with pytest.raises(ValueError, match="symmetric gemm must be square"):
        GemmSpec(1, 4, 8, 4, torch.float32, "sm90", symmetric=True)
    with pytest.raises(ValueError, match="dtype must be one of"):
        SymPolySpec(1, 4, torch.float64, "sm90")
    with pytest.raises(ValueError, match="eps_mode"):
        GramSpec(1, 4, 8, torch.float32, "sm90", eps_mode="max")
    with pytest.raises(ValueError, match="m <= n"):
        call = NSCall(x="x", partials="p", P="1", eps="e", out="o", upcast="u", prefix="p_", batch=1, m=8, n=4,
                      coefficients=KJ, out_dtype=torch.float32, eps_mode="clamp", algorithm="standard",
                      arch="sm90", origin="test")
        emit_newton_schulz(CodeWriter(), call, torch.float32, ())


def test_launchers_refuse_arguments_their_kernel_ignores(tmp_path: Path) -> None:
    gram = generate_gram(GramSpec(1, 16, 16, torch.float32, ARCH), "test")
    gemm = generate_gemm(GemmSpec(1, 16, 16, 16, torch.float32, ARCH), "test")
    mod = _load([gram, gemm], "", tmp_path)
    x = torch.zeros(1, 16, 16, device=DEVICE)
    with pytest.raises(AssertionError, match="does not normalise"):
        getattr(mod, gram.launcher)(x, x, upcast=UPCAST, x0=x)
    with pytest.raises(AssertionError, match="does not accumulate"):
        getattr(mod, gemm.launcher)(x, x, x, 1.0, upcast=UPCAST, C=x)


# ------------------------------------------------------------- native GPU code, compiled without a GPU

PTR = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16"}
NATIVE_KERNELS = [
    generate_gram(GramSpec(2, 200, 300, torch.bfloat16, "sm90", normalize=True), "test"),
    generate_sym_poly(SymPolySpec(2, 200, torch.bfloat16, "sm90"), "test"),
    generate_gemm(GemmSpec(2, 200, 300, 200, torch.bfloat16, "sm90", torch.float32, accumulate=True), "test"),
    generate_gemm(GemmSpec(2, 200, 200, 200, torch.float16, "sm90", symmetric=True), "test"),
    # Scheduled NS: an fp16 iteration reading a bf16-stored iterate rounds it as it loads.
    generate_gram(GramSpec(2, 200, 300, torch.float16, "sm90", in_dtype=torch.bfloat16), "test"),
    generate_gemm(
        GemmSpec(2, 200, 300, 200, torch.float16, "sm90", accumulate=True, r_dtype=torch.bfloat16), "test"
    ),
]


def _native_ptx(kernel: KernelSource, capability: int, cache_dir: Path) -> str:
    """PTX of ``kernel`` with ``UPCAST=False``, as a GPU runs it (Triton compiles ahead of time)."""
    from triton.backends.compiler import GPUTarget  # type: ignore[import-untyped]
    from triton.compiler import ASTSource, compile  # type: ignore[import-untyped]

    assert not module.interpreting(), "an interpreted kernel cannot be compiled"
    fn = getattr(_load([kernel], "", cache_dir), kernel.name)
    spec: Any = kernel.spec
    values = {"M": spec.m, "N": getattr(spec, "n", None), "K": getattr(spec, "k", None), "BLOCK_P": BLOCK_P}
    values |= {**kernel.tile, "UPCAST": False}
    constexprs = {p.name: values[p.name] for p in fn.params if p.is_constexpr}
    pointers = {"partials_ptr": "*fp32", "eps_ptr": "*fp32", "out_ptr": PTR[getattr(spec, "stored_dtype", spec.dtype)]}
    signature = {}
    for name in fn.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = pointers.get(name, PTR[spec.dtype])
        else:
            signature[name] = "i32" if name == "P" else "fp32"
    options = {"num_warps": kernel.tile["num_warps"], "num_stages": kernel.tile["num_stages"]}
    compiled = compile(ASTSource(fn, signature, constexprs), target=GPUTarget("cuda", capability, 32), options=options)
    return str(compiled.asm["ptx"])


def native_report() -> None:
    """Run by the test below in a fresh interpreter, where kernels are defined for compilation."""
    with tempfile.TemporaryDirectory() as cache_dir:
        for kernel in NATIVE_KERNELS:
            ptx = _native_ptx(kernel, 90, Path(cache_dir))
            print(json.dumps({"name": kernel.name, "tensor_cores": "wgmma" in ptx}))


def test_native_kernels_compile_for_hopper_with_tensor_cores() -> None:
    """The interpreter never compiles: this catches what only the compiler checks (loop-carried types, layouts).

    A fresh process because this one defined Triton's own helpers (tl.sum, ...) interpreted.
    """
    pytest.importorskip("triton.backends.nvidia")
    run = subprocess.run(
        [sys.executable, "-c", "from tests.test_triton_kernels import native_report; native_report()"],
        cwd=Path(__file__).parent.parent,
        env={**os.environ, "TRITON_INTERPRET": "0"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    report = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert [r["name"] for r in report] == [k.name for k in NATIVE_KERNELS]
    assert all(r["tensor_cores"] for r in report), report  # UPCAST=False: half-precision dots on wgmma
