"""Newton–Schulz orthogonalisation: the maths behind ``hocompile::newton_schulz``.

X is normalised to Frobenius norm ≤ 1, then each iteration k applies the odd
polynomial ``X ← a_k X + (b_k A + c_k A²) X`` with ``A = X Xᵀ`` (c_k = 0 is
the cubic variant). Two algorithms compute the same polynomial:

- **standard**: three products per iteration on the m×n iterate;
- **gram**: iterate on the m×m Gram matrix ``R = X Xᵀ``, accumulate
  ``Q = P_k … P_1`` (each ``P = a I + b R + c R²`` is a polynomial in R, so all
  of them commute and stay symmetric) and apply ``X = Q X₀`` once at the end;
  ``restarts`` lists iterations after which ``X`` is rebuilt from ``Q X₀``
  and ``R`` recomputed, which bounds the error growth of long Q products.
  It saves FLOPs when the aspect ratio n/m is large (see :func:`flops`).

Rounding model (``compute_dtype``): every product and every linear
combination is accumulated in fp32 (fp64 for fp64) and rounded once to the
compute dtype, as a tensor-core GEMM with a fused epilogue would. With
``matmul="emulate"`` a bf16/fp16 program runs its GEMMs on fp32 units with
exactly those roundings (for CPUs without fast half-precision GEMMs);
``"native"`` calls the half-precision GEMM itself. The normalisation
accumulates in fp32 (fp64 for fp64 inputs) and rounds where eager does.

Symmetric products (``blocks`` > 1): every product known to be symmetric
(``X Xᵀ``, ``A²``, and in Gram NS all products of polynomials in R) is
computed as ``blocks`` row blocks of its lower triangle (row block i against
the columns of blocks 0..i: one GEMM per block row, (k+1)/2k of the dense
FLOPs), each written into one preallocated result, and the upper triangle is
filled by one mirroring ``where`` at the end. Each element is the same fp32
dot product rounded once, so the rounding model is unchanged. The earlier
k×k-block version paid two copies per block (16 ``copy_`` calls per product
at k = 4: 644 ms of a 3.2 s bf16 step on an AMX CPU, issue 13); block rows
pay k writes and one mirror. Whether it is faster depends on the CPU and the
dtype: choose-algorithm measures it (precision/measure_ns.py). Measured here
(AVX-512-bf16, bf16 ``X Xᵀ``): 768×3072 1.3–1.5× faster with 3–4 row blocks.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch

Coefficients = Sequence[tuple[float, float, float]]

ALGORITHMS = ("standard", "gram")
MATMUL_MODES = ("native", "emulate")
EPS_MODES = ("clamp", "add")  # x / max(‖x‖, eps) (torch, F.normalize) or x / (‖x‖ + eps) (Keller Jordan)


def flops(
    m: int, n: int, coefficients: Coefficients, algorithm: str, restarts: Sequence[int] = (), blocks: int = 0
) -> int:
    """FLOPs of one NS on a wide m×n matrix (m ≤ n), products only; ``blocks``: see symmetric products."""
    m, n = min(m, n), max(m, n)
    if blocks > 1 and m >= 2 * blocks:
        dense = flops(m, n, coefficients, algorithm, restarts)
        general = _general_flops(m, n, coefficients, algorithm, restarts)
        return general + (dense - general) * (blocks + 1) // (2 * blocks)
    steps = len(coefficients)
    cubic = [c == 0.0 for _, _, c in coefficients]
    if algorithm == "standard":
        return sum(2 * m * m * n + (0 if cub else 2 * m**3) + 2 * m * m * n for cub in cubic)
    total = 2 * m * m * n  # R = X0 X0ᵀ
    fresh = True
    for k in range(steps):
        last = k == steps - 1
        restart_after = (k + 1) in restarts and not last
        total += 0 if cubic[k] else 2 * m**3  # R²
        total += 0 if fresh else 2 * m**3  # Q = P Q
        fresh = False
        if not last and not restart_after:
            total += 4 * m**3  # R ← P² R (as P (P R))
        if restart_after:
            total += 4 * m * m * n  # X = Q X0, R = X Xᵀ
            fresh = True
    return total + 2 * m * m * n  # X = Q X0


def _general_flops(m: int, n: int, coefficients: Coefficients, algorithm: str, restarts: Sequence[int]) -> int:
    """FLOPs of the products whose result is not symmetric (B X; Q X0)."""
    if algorithm == "standard":
        return len(coefficients) * 2 * m * m * n
    rebuilds = sum(1 for r in restarts if 0 < r < len(coefficients))
    return (rebuilds + 1) * 2 * m * m * n


@functools.lru_cache(maxsize=64)
def _above_blocks(m: int, blocks: int, device: torch.device) -> torch.Tensor:
    """[m, m] bool: True where row block i meets a column of a later block (not computed)."""
    edges = torch.tensor([m * i // blocks for i in range(1, blocks)], device=device)
    block = torch.bucketize(torch.arange(m, device=device), edges, right=True)
    return block[None, :] > block[:, None]


def _round(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Round an fp32 accumulator to ``dtype`` but keep computing in fp32."""
    if dtype in (torch.float32, torch.float64) or t.dtype == dtype:
        return t
    return t.to(dtype).to(t.dtype)


class _Arith:
    """Products and linear combinations under one rounding model."""

    def __init__(self, compute: torch.dtype, matmul: str, acc: torch.dtype, blocks: int = 0) -> None:
        self.compute, self.matmul, self.acc, self.blocks = compute, matmul, acc, blocks
        self.native = matmul == "native" and compute not in (torch.float32, torch.float64)

    def cast_in(self, x: torch.Tensor) -> torch.Tensor:
        if self.native:
            return x.to(self.compute)
        return _round(x.to(self.acc), self.compute)

    def mm(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        if self.native:
            return a @ b
        return _round(a @ b, self.compute)

    def sym(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """``a @ b`` for a product known to be symmetric (blocked when ``blocks`` > 1)."""
        if not self._blocked(a):
            return self.mm(a, b)
        return self._lower_blocks(a, lambda rows, cols: self.mm(a[..., rows, :], b[..., :, cols]))

    def sym_addmm(
        self, c: torch.Tensor, a: torch.Tensor, b: torch.Tensor, beta: float, alpha: float
    ) -> torch.Tensor:
        """beta*c + alpha*(a@b) for a symmetric result, one rounding per block."""
        if not self._blocked(a):
            return self.addmm(c, a, b, beta, alpha)
        return self._lower_blocks(
            a, lambda rows, cols: self.addmm(c[..., rows, cols], a[..., rows, :], b[..., :, cols], beta, alpha)
        )

    def _blocked(self, a: torch.Tensor) -> bool:
        return self.blocks > 1 and a.shape[-2] >= 2 * self.blocks

    def _lower_blocks(self, a: torch.Tensor, block: Callable[[slice, slice], torch.Tensor]) -> torch.Tensor:
        """Row block i against columns 0..edge(i+1), written into one buffer; the rest mirrored once."""
        m = a.shape[-2]
        edges = [m * i // self.blocks for i in range(self.blocks + 1)]
        out = torch.empty(*a.shape[:-2], m, m, dtype=a.dtype, device=a.device)
        for i in range(self.blocks):
            rows, cols = slice(edges[i], edges[i + 1]), slice(0, edges[i + 1])
            out[..., rows, cols] = block(rows, cols)
        # Above the block diagonal nothing was written: take it from the transpose.
        return torch.where(_above_blocks(m, self.blocks, a.device), out.mT, out)

    def addmm(self, c: torch.Tensor, a: torch.Tensor, b: torch.Tensor, beta: float, alpha: float) -> torch.Tensor:
        """beta*c + alpha*(a@b), one rounding (a GEMM epilogue)."""
        if self.native:
            return torch.baddbmm(c, a, b, beta=beta, alpha=alpha) if a.dim() == 3 else torch.addmm(
                c, a, b, beta=beta, alpha=alpha
            )
        return _round(torch.baddbmm(c, a, b, beta=beta, alpha=alpha) if a.dim() == 3 else torch.addmm(
            c, a, b, beta=beta, alpha=alpha
        ), self.compute)


Arith = _Arith  # public name for callers outside the NS code (targets times its blocked symmetric product)


def normalize(x: torch.Tensor, eps: float, eps_mode: str, compute: torch.dtype) -> torch.Tensor:
    """Frobenius-normalise each matrix: accumulate in fp32 (or fp64), round like eager.

    In half precision the norm and the quotient are rounded to the compute
    dtype, exactly where eager's bf16 reduction and division round. Keeping
    them in fp32 instead measured *worse* on some inputs (a 1×5 row with AOL
    coefficients: 5× eager's error), because the polynomial is sensitive to
    where σ lands after the division, not to how precisely it was computed.
    """
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    xa = x.to(acc)
    norm = _round(torch.linalg.vector_norm(xa, dim=(-2, -1), keepdim=True), compute)
    denom = _round(norm.clamp(min=eps) if eps_mode == "clamp" else norm + eps, compute)
    return _round(xa / denom, compute)


def _normalize_native(xh: torch.Tensor, eps: float, eps_mode: str) -> torch.Tensor:
    """:func:`normalize` of a half-precision ``xh`` without an fp32 copy of it: the norm
    accumulates in fp32 and is rounded like eager's, and a half-precision division computes
    in fp32 and rounds once, so the roundings are normalize()'s (one m×n fp32 temporary and
    four elementwise passes fewer: memory and time on the native bf16 path)."""
    norm = torch.linalg.vector_norm(xh, dim=(-2, -1), keepdim=True, dtype=torch.float32).to(xh.dtype)
    denom = norm.clamp(min=eps) if eps_mode == "clamp" else norm + eps
    return xh / denom


def newton_schulz(
    x: torch.Tensor,
    coefficients: Coefficients,
    eps: float,
    *,
    eps_mode: str = "clamp",
    transpose: bool = False,
    compute_dtype: torch.dtype = torch.bfloat16,
    out_dtype: torch.dtype | None = None,
    algorithm: str = "standard",
    restarts: Sequence[int] = (),
    matmul: str = "emulate",
    blocks: int = 0,
) -> torch.Tensor:
    """Orthogonalise ``x`` ([m, n] or [B, m, n]); see the module docstring."""
    if algorithm not in ALGORITHMS or matmul not in MATMUL_MODES or eps_mode not in EPS_MODES:
        raise ValueError(f"bad newton_schulz options: {algorithm=}, {matmul=}, {eps_mode=}")
    out_dtype = out_dtype or x.dtype
    acc = torch.float64 if compute_dtype == torch.float64 else torch.float32
    arith = _Arith(compute_dtype, matmul, acc, blocks)
    xt = x.mT if transpose else x
    # Cast first (as eager does), then normalise (see normalize()).
    if arith.native:
        X = _normalize_native(arith.cast_in(xt), eps, eps_mode)
    else:
        X = arith.cast_in(normalize(arith.cast_in(xt).to(acc), eps, eps_mode, compute_dtype))
    if algorithm == "standard":
        X = _standard(X, coefficients, arith)
    else:
        X = _gram(X, coefficients, restarts, arith)
    out = X.mT if transpose else X
    return out.to(out_dtype)


def _standard(X: torch.Tensor, coefficients: Coefficients, arith: _Arith) -> torch.Tensor:
    for a, b, c in coefficients:
        A = arith.sym(X, X.mT)
        B = arith.sym_addmm(A, A, A, beta=b, alpha=c) if c != 0.0 else _scale(A, b, arith)
        X = arith.addmm(X, B, X, beta=a, alpha=1.0)
    return X


def _scale(A: torch.Tensor, b: float, arith: _Arith) -> torch.Tensor:
    return _round(A * b, arith.compute) if not arith.native else A * b


def _gram(X0: torch.Tensor, coefficients: Coefficients, restarts: Sequence[int], arith: _Arith) -> torch.Tensor:
    m = X0.shape[-2]
    eye = torch.eye(m, dtype=X0.dtype, device=X0.device).expand(*X0.shape[:-2], m, m)
    R = arith.sym(X0, X0.mT)
    Q: torch.Tensor | None = None
    steps = len(coefficients)
    for k, (a, b, c) in enumerate(coefficients):
        # P = a I + b R + c R²
        bR_plus_aI = b * R + a * eye
        P = arith.sym_addmm(bR_plus_aI, R, R, beta=1.0, alpha=c) if c != 0.0 else _round(bR_plus_aI, arith.compute)
        # Polynomials in R commute, so their products are symmetric too.
        Q = P if Q is None else arith.sym(P, Q)
        last = k == steps - 1
        if not last and (k + 1) in restarts:
            X0 = arith.mm(Q, X0)
            R = arith.sym(X0, X0.mT)
            Q = None
        elif not last:
            R = arith.sym(P, arith.sym(P, R))
    assert Q is not None
    return arith.mm(Q, X0)


def reference_fp64(
    x: torch.Tensor, coefficients: Coefficients, eps: float, *, eps_mode: str = "clamp", transpose: bool = False
) -> torch.Tensor:
    """The same polynomial, evaluated in fp64 with no intermediate rounding."""
    return newton_schulz(
        x.to(torch.float64), coefficients, eps, eps_mode=eps_mode, transpose=transpose,
        compute_dtype=torch.float64, out_dtype=torch.float64, algorithm="standard",
    )
