"""FP8 / MXFP8 NS product kernels against ``precision.emulate`` on the same inputs.

Under Triton's interpreter the kernels follow ``emulated_matmul`` operation by
operation — e4m3 rounding on fp32 bits, each 32-chunk dot exact (fp64) and
rounded once to fp32, chunks added in K order, the same epilogue order — so
every comparison here is bit-exact (``torch.equal``). Shapes are never tile
multiples (interpreter tiles are 16x16 with BLOCK_K 32) and K is never a
multiple of 32, so masks and the zero padding of the last block are exercised.
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

import pytest
import torch

from hocompile.lowering.triton import module
from hocompile.lowering.triton.code import CodeWriter, KernelSource
from hocompile.lowering.triton.fp8_kernels import (
    BLOCK_AMAX,
    E4M3_MAX,
    Fp8GemmSpec,
    amax_tiles,
    emit_round_e4m3,
    generate_fp8_gemm,
)
from hocompile.precision.emulate import _chunked_dot, emulated_matmul
from hocompile.precision.schedule_ns import _standard_iteration

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

interpreted = pytest.mark.skipif(torch.cuda.is_available(), reason="runs CPU tensors in the interpreter")
FORMATS = ["fp8_e4m3", "mxfp8_e4m3"]


def _load(kernels: list[KernelSource], tmp_path: Path, body: str = "") -> ModuleType:
    for kernel in kernels:
        ast.parse(kernel.source)
    loaded, _ = module.load(module.assemble(kernels, body), tmp_path)
    return loaded


def _run(spec: Fp8GemmSpec, tmp_path: Path, L: torch.Tensor, R: torch.Tensor, **kw: object) -> torch.Tensor:
    kernel = generate_fp8_gemm(spec, "test")
    out = torch.empty(spec.batch, spec.m, spec.n, dtype=spec.out_dtype)
    getattr(_load([kernel], tmp_path), kernel.launcher)(L, R, out, kw.pop("alpha", 1.0), upcast=True, **kw)
    return out


def _amax(x: torch.Tensor) -> torch.Tensor:
    return x.float().abs().amax(dim=(-2, -1))


def _randn(*shape: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@interpreted
@pytest.mark.parametrize("fmt", FORMATS)
def test_gemm_with_epilogue_matches_emulation(fmt: str, tmp_path: Path) -> None:
    b, m, n, k = 2, 20, 36, 70
    L, R, C = _randn(b, m, k, seed=0), _randn(b, k, n, seed=1), _randn(b, m, n, seed=2)
    L[1] *= 1e-3  # a per-matrix scale differs between the matrices of a batch
    spec = Fp8GemmSpec(b, m, n, k, fmt, "interpret", torch.float32, accumulate=True, amax_out=True)
    amax_out = torch.full((b, amax_tiles(spec)), float("nan"))
    kw: dict[str, object] = {"C": C, "alpha": 1.7, "beta": -0.6, "amax_out": amax_out}
    if spec.per_tensor:
        # amax as partials ([batch, P], max over P), the way amax_out writes them
        parts = _amax(L)[:, None] * torch.tensor([[0.25, 1.0, 0.5]])
        kw |= {"l_amax": parts, "r_amax": _amax(R)}
    got = _run(spec, tmp_path, L, R, **kw)
    ref = emulated_matmul(L, R, fmt, torch.float32, c=C, alpha=1.7, beta=-0.6)
    assert torch.equal(got, ref), (got - ref).abs().max()
    assert torch.equal(amax_out.amax(dim=1), _amax(got))


@interpreted
@pytest.mark.parametrize("fmt", FORMATS)
def test_one_ns_iteration_chains_amax_partials(fmt: str, tmp_path: Path) -> None:
    """X Xᵀ, c A² + b A, B X + a X with each kernel's amax partials feeding the next: schedule_ns's iteration."""
    b, m, n = 2, 18, 40
    a_, b_, c_ = 3.4445, -4.7750, 2.0315
    x = _randn(b, m, n, seed=3)
    x = x / x.norm(dim=(-2, -1), keepdim=True)  # fp32, as the scheduled NS's first iteration sees it
    per_tensor = fmt == "fp8_e4m3"
    gram = Fp8GemmSpec(b, m, m, n, fmt, "interpret", symmetric=True, amax_out=per_tensor)
    poly = Fp8GemmSpec(b, m, m, m, fmt, "interpret", accumulate=True, symmetric=True, amax_out=per_tensor)
    update = Fp8GemmSpec(b, m, n, m, fmt, "interpret", accumulate=True, amax_out=per_tensor)
    kernels = [generate_fp8_gemm(s, "test") for s in (gram, poly, update)]
    mod = _load(kernels, tmp_path)
    launch = [getattr(mod, kernel.launcher) for kernel in kernels]
    A, B = torch.empty(b, m, m, dtype=torch.bfloat16), torch.empty(b, m, m, dtype=torch.bfloat16)
    X1 = torch.empty(b, m, n, dtype=torch.bfloat16)
    amax = {s: torch.empty(b, amax_tiles(s)) if per_tensor else None for s in (gram, poly, update)}
    x_amax = _amax(x) if per_tensor else None
    launch[0](x, x.mT, A, 1.0, upcast=True, l_amax=x_amax, r_amax=x_amax, amax_out=amax[gram])
    launch[1](A, A, B, c_, upcast=True, C=A, beta=b_, l_amax=amax[gram], r_amax=amax[gram], amax_out=amax[poly])
    launch[2](B, x, X1, 1.0, upcast=True, C=x, beta=a_, l_amax=amax[poly], r_amax=x_amax, amax_out=amax[update])
    assert torch.equal(A.float(), emulated_matmul(x, x.mT, fmt, torch.bfloat16).float())
    assert torch.equal(A.float(), A.float().mT)  # stored symmetric
    assert torch.equal(B.float(), emulated_matmul(A, A, fmt, torch.bfloat16, c=A, alpha=c_, beta=b_).float())
    assert torch.equal(X1.float(), _standard_iteration(x, (a_, b_, c_), fmt))
    if per_tensor:
        for spec, result in ((gram, A), (poly, B), (update, X1)):
            partials = amax[spec]
            assert partials is not None and torch.equal(partials.amax(dim=1), _amax(result))


def _hard_operand(b: int, rows: int, k: int, seed: int) -> torch.Tensor:
    """Blocks that saturate, blocks spanning e4m3's subnormals, all-zero rows and blocks, extreme magnitudes."""
    x = _randn(b, rows, k, seed=seed)
    x[:, 0] = 0.0  # an all-zero row
    x[:, :, 32:64] = 0.0  # an all-zero 32-block in every row
    x[:, 1, 0] = 1.99 * 2.0**5  # amax mantissa near 2: x / s ~ 509 > 448 saturates
    x[:, 2, :32] *= 2.0 ** torch.arange(-14, 18, dtype=torch.float32)  # one block over 2^32 of range
    x[:, 3] *= 1e15  # products near 1e30, still finite
    x[:, 4] *= 1e-30  # below the smallest e8m0 scale times e4m3's subnormals
    x[:, 5, 64:] = 2.0**-130  # an fp32-subnormal block amax
    return x


@interpreted
@pytest.mark.parametrize("fmt", FORMATS)
def test_saturation_subnormals_and_zero_blocks(fmt: str, tmp_path: Path) -> None:
    b, m, n, k = 2, 18, 20, 90
    L, R = _hard_operand(b, m, k, seed=4), _hard_operand(b, n, k, seed=5).mT
    spec = Fp8GemmSpec(b, m, n, k, fmt, "interpret", torch.float32)
    if spec.per_tensor:
        # a stale (too small) amax, as delayed scaling would pass: values beyond it saturate to ±448
        l_amax, r_amax = _amax(L) * 0.5, _amax(R) * 0.25
        got = _run(spec, tmp_path, L, R, l_amax=l_amax, r_amax=r_amax)
        sl, sr = (l_amax / E4M3_MAX)[:, None, None], (r_amax / E4M3_MAX)[:, None, None]
        ql = (L / sl).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        qr = (R / sr).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        assert (ql.float().abs() == E4M3_MAX).sum() > 1  # saturation did happen
        ref = _chunked_dot(ql, qr, None, None) * (sl * sr)
    else:
        got = _run(spec, tmp_path, L, R)
        ref = emulated_matmul(L, R, fmt, torch.float32)
    assert torch.equal(got, ref), (got - ref).abs().max()
    assert torch.isfinite(got).all()


@interpreted
def test_e4m3_rounding_matches_torch_cast(tmp_path: Path) -> None:
    """emit_round_e4m3 on every e4m3 value, every midpoint, their fp32 neighbours, and beyond ±448."""
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[torch.isfinite(grid)].unique()
    mids = (grid[1:] + grid[:-1]) / 2
    near = torch.cat([torch.nextafter(mids, torch.tensor(float("inf"))), torch.nextafter(mids, -torch.tensor(1e9))])
    edges = torch.tensor([448.0, 463.9, 464.0, 480.0, 1e38, 2.0**-149])
    wide = torch.cat([2.0 ** torch.linspace(-30, 12, 4000), edges])
    x = torch.cat([grid, mids, near, wide, -wide])
    w = CodeWriter()
    w.line("@triton.jit")
    w.line("def round_e4m3(x_ptr, out_ptr, N: tl.constexpr, BLOCK: tl.constexpr):")
    with w.indent():
        w.line("offs = tl.arange(0, BLOCK)")
        w.line("v = tl.load(x_ptr + offs, mask=offs < N, other=0.0)")
        emit_round_e4m3(w, "v")
        w.line("tl.store(out_ptr + offs, v, mask=offs < N)")
    kernel = KernelSource("round_e4m3", "test", None, "test", w.text())
    out = torch.empty_like(x)
    _load([kernel], tmp_path).round_e4m3[(1,)](x, out, N=x.numel(), BLOCK=_next_pow2(x.numel()))
    ref = x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float()
    assert torch.equal(out, ref), x[out != ref][:8]


def _next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


@interpreted
def test_specs_names_and_launch_guards(tmp_path: Path) -> None:
    spec = Fp8GemmSpec(3, 64, 64, 96, "mxfp8_e4m3", "sm90", accumulate=True, symmetric=True)
    assert spec.name == "ns_gemm_mxfp8e4m3_b3_64x64x96_acc_sym_out_bf16"
    assert Fp8GemmSpec(1, 8, 9, 10, "fp8_e4m3", "sm100", torch.float32, amax_out=True).name == (
        "ns_gemm_fp8e4m3_b1_8x9x10_amax_out_fp32"
    )
    for bad in ({"fmt": "fp8_e5m2"}, {"arch": "sm80"}, {"n": 65, "symmetric": True}, {"out_dtype": torch.int8}):
        with pytest.raises(ValueError):
            Fp8GemmSpec(**{"batch": 1, "m": 64, "n": 64, "k": 64, "fmt": "fp8_e4m3", "arch": "sm90", **bad})  # type: ignore[arg-type]
    per_tensor = Fp8GemmSpec(1, 8, 8, 8, "fp8_e4m3", "interpret")
    x = torch.zeros(1, 8, 8)
    with pytest.raises(AssertionError, match="amax"):
        _run(per_tensor, tmp_path, x, x)
    zero = _run(per_tensor, tmp_path, x, x, l_amax=torch.zeros(1), r_amax=torch.zeros(1))
    assert torch.equal(zero.float(), x)  # an all-zero matrix has scale 1, not 0/0


# ------------------------------------------------------------- native GPU code, compiled without a GPU

NATIVE_KERNELS = [
    generate_fp8_gemm(Fp8GemmSpec(2, 200, 300, 200, "fp8_e4m3", "sm90", accumulate=True, amax_out=True), "test"),
    generate_fp8_gemm(Fp8GemmSpec(2, 200, 200, 300, "mxfp8_e4m3", "sm90", symmetric=True), "test"),
    generate_fp8_gemm(Fp8GemmSpec(2, 200, 200, 300, "mxfp8_e4m3", "sm100", accumulate=True), "test"),
]
# the fp8 tensor-core instruction per target (PTX ISA: wgmma .e4m3 types; tcgen05.mma kind::f8f6f4)
MMA = {"sm90": ("wgmma.mma_async", "f32.e4m3.e4m3"), "sm100": ("tcgen05.mma", "kind::f8f6f4")}


def native_report() -> None:
    """Run by the test below in a fresh interpreter (TRITON_INTERPRET=0), where kernels compile for their arch."""
    from triton.backends.compiler import GPUTarget  # type: ignore[import-untyped]
    from triton.compiler import ASTSource, compile  # type: ignore[import-untyped]

    with tempfile.TemporaryDirectory() as cache_dir:
        for kernel in NATIVE_KERNELS:
            spec = kernel.spec
            assert isinstance(spec, Fp8GemmSpec)
            fn = getattr(_load([kernel], Path(cache_dir)), kernel.name)
            values = {"M": spec.m, "N": spec.n, "K": spec.k, "BLOCK_AMAX": BLOCK_AMAX, "UPCAST": False}
            values |= {"AMAX_TILES": amax_tiles(spec), **kernel.tile}
            constexprs = {p.name: values[p.name] for p in fn.params if p.is_constexpr}
            signature = {}
            for name in fn.arg_names:
                if name in constexprs:
                    signature[name] = "constexpr"
                elif name.endswith("_ptr"):
                    signature[name] = "*fp32" if "amax" in name else "*bf16"
                else:
                    signature[name] = "i32" if name.startswith("stride") or name.endswith("PARTS") else "fp32"
            options = {"num_warps": kernel.tile["num_warps"], "num_stages": kernel.tile["num_stages"]}
            target = GPUTarget("cuda", int(spec.arch[2:]), 32)
            ptx = str(compile(ASTSource(fn, signature, constexprs), target=target, options=options).asm["ptx"])
            fp8_mma = all(needle in ptx for needle in MMA[spec.arch])
            print(json.dumps({"name": kernel.name, "fp8_wgmma": fp8_mma, "cvt": "satfinite.e4m3x2" in ptx}))


def test_native_fp8_kernels_compile_for_hopper_and_blackwell_fp8_tensor_cores() -> None:
    pytest.importorskip("triton.backends.nvidia")
    run = subprocess.run(
        [sys.executable, "-c", "from tests.test_triton_fp8 import native_report; native_report()"],
        cwd=Path(__file__).parent.parent,
        env={**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "0"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    report = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert [r["name"] for r in report] == [k.name for k in NATIVE_KERNELS]
    assert all(r["fp8_wgmma"] and r["cvt"] for r in report), report
