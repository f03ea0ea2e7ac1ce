"""``hocompile::polar``: the orthogonal polar factor of a matrix, optionally scaled by its nuclear norm.

For X = U S Vᵀ (thin SVD), ``polar(X) = U Vᵀ``, the nearest semi-orthogonal
matrix to X. MOP (emerging-optimizers) spells it ``U, S, Vh = svd(G);
(U @ Vh) * S.sum()``; fuse-polar makes that one op, ``scale="nuclear"``
carrying the ``S.sum()`` factor (‖X‖_*) so the op keeps one output, as
batch-by-shape's :class:`~hocompile.ir.registry.BatchRule` needs.

Methods:

- ``"svd"`` (default): exactly eager's arithmetic, ``torch.linalg.svd(x,
  full_matrices=False)`` then ``U @ Vh`` (then ``* S.sum()``), so an
  unbatched call is bitwise eager.
- ``"gram_eigh"`` (opt-in only): with k = min(m, n) and X wide, ``X Xᵀ =
  Q Λ Qᵀ`` (a k×k eigh instead of an m×n SVD; 3-5x faster here) and
  ``polar(X) = (Q Λ^{-1/2} Qᵀ) X``. Forming the Gram squares the condition
  number κ: eigenvalue errors are ~eps·λ_max, so a singular direction σ_i
  is off by ~eps·(σ_max/σ_i)². Error bound (fp32, max-abs against the fp64
  SVD factor, :func:`gram_eigh_error_bound`): ``eps · (4 + κ²/4)``; measured
  at most 2.4·eps + 0.09·eps·κ² for κ ≤ 1000 on 64×128, 256×1024 and 512×512
  (tests/test_polar_family.py), against ≤ 3.5·eps·κ for ``"svd"``. Past
  κ ≈ 1/√eps (~2900 in fp32) eigenvalues below eps·λ_max are pure rounding
  and their directions are dropped (the factor is a partial isometry there):
  the error saturates near 0.1-0.2 instead of Λ^{-1/2} amplifying noise.
  Never a default.

Inputs are [m, n] or [B, m, n]. A batched input runs one matrix per thread
with one LAPACK thread each (:func:`~hocompile.ops.per_matrix.per_matrix`): ATen's batched CPU
SVD/eigh is a loop over matrices anyway. Measured on this project's 2-core
machine under load (benchmarks/results/polar_step.md): 165 vs 932 ms for
the SVD polar of 3×1024×256, 70 vs 77 ms for gram_eigh of 3×256×1024
(on an idle machine the gain for eigh/QR is smaller, 1.0-1.6×).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ..ir.registry import BatchRule, Cost, Input, OpFamily, OpSpec, register
from .per_matrix import per_matrix

METHODS = ("svd", "gram_eigh")
SCALES = ("none", "nuclear")


def gram_eigh_error_bound(kappa: float, dtype: torch.dtype = torch.float32) -> float:
    """Max-abs error bound of ``gram_eigh`` against the exact factor for condition number κ (see module doc).

    Meaningful while eps·κ² ≪ 1; the constants carry ~2-3x margin over the measured 2.4 and 0.09.
    """
    eps = torch.finfo(dtype).eps
    return eps * (4.0 + kappa * kappa / 4.0)


def _check(x: torch.Tensor, method: str, scale: str) -> None:
    if x.dim() not in (2, 3):
        raise ValueError(f"polar takes [m, n] or [B, m, n], got {tuple(x.shape)}")
    if method not in METHODS:
        raise ValueError(f"polar method must be one of {METHODS}, got {method!r}")
    if scale not in SCALES:
        raise ValueError(f"polar scale must be one of {SCALES}, got {scale!r}")


def _nuclear(s: torch.Tensor) -> torch.Tensor:
    """‖X‖_* as [..., 1, 1] for a batch: a 2-D call sums exactly as eager's ``S.sum()`` (0-d)."""
    return s.sum() if s.dim() == 1 else s.sum(-1)[..., None, None]


def polar_svd(x: torch.Tensor, scale: str) -> torch.Tensor:
    """Eager MOP's own arithmetic (``polar_via_svd``), call for call."""
    u, s, vh = torch.linalg.svd(x, full_matrices=False)
    out = u @ vh
    return out * _nuclear(s) if scale == "nuclear" else out


def polar_gram_eigh(x: torch.Tensor, scale: str) -> torch.Tensor:
    """(Q Λ^{-1/2} Qᵀ) X from the eigh of the k×k Gram, k = min(m, n); see the module docstring's bound."""
    tall = x.shape[-2] > x.shape[-1]
    w = x.mT if tall else x  # wide: the Gram is the small side
    lam, q = torch.linalg.eigh(w @ w.mT)
    # Eigenvalues below rounding level (eps·λ_max) carry no direction: drop them instead of
    # amplifying noise by λ^{-1/2}. (k·eps dropped real directions from κ ≈ 200 at k = 256.)
    floor = lam[..., -1:].clamp_min(0) * torch.finfo(lam.dtype).eps
    kept = lam > floor
    inv_sqrt = torch.where(kept, lam.clamp_min(torch.finfo(lam.dtype).tiny).rsqrt(), torch.zeros_like(lam))
    m = (q * inv_sqrt.unsqueeze(-2)) @ q.mT  # symmetric k×k: (X Xᵀ)^{-1/2}
    out = (m @ w).mT if tall else m @ w
    if scale == "nuclear":
        out = out * _nuclear(torch.where(kept, lam, torch.zeros_like(lam)).sqrt())
    return out


@torch.library.custom_op("hocompile::polar", mutates_args=())
def polar(x: torch.Tensor, method: str = "svd", scale: str = "none") -> torch.Tensor:
    """polar(x) = U Vᵀ of x's thin SVD (times ‖x‖_* if ``scale="nuclear"``), by ``method``."""
    _check(x, method, scale)
    fn = polar_svd if method == "svd" else polar_gram_eigh
    if x.dim() == 3:
        return per_matrix(lambda m: fn(m, scale), x)
    return fn(x, scale)


@polar.register_fake
def _polar_fake(x: torch.Tensor, method: str = "svd", scale: str = "none") -> torch.Tensor:
    _check(x, method, scale)
    return torch.empty_like(x)


@dataclass(frozen=True)
class PolarSpec(OpSpec):
    """The arguments of one ``hocompile::polar`` call, by name."""

    qualname: ClassVar[str] = "hocompile::polar"

    x: Input
    method: str = "svd"
    scale: str = "none"

    def shape(self) -> tuple[int, int, int]:
        """(batch, k, n) with k = min(rows, cols) ≤ n = max(rows, cols), from the input's meta."""
        x = self.node_of("x").meta["val"]
        rows, cols = int(x.shape[-2]), int(x.shape[-1])
        return (int(x.shape[0]) if x.dim() == 3 else 1), min(rows, cols), max(rows, cols)


def polar_flops(k: int, n: int, method: str) -> tuple[float, float]:
    """(total, in GEMMs) FLOPs of one k×n polar factor (k ≤ n), textbook operation counts.

    svd: thin R-SVD with vectors ≈ 4k²n + 22k³ (Golub & Van Loan), then U Vh (2k²n).
    gram_eigh: Gram 2k²n, eigh with vectors ≈ 9k³, (Q Λ^{-1/2}) Qᵀ 2k³, times X 2k²n.
    """
    if method == "svd":
        gemm = 2.0 * k * k * n
        return 4.0 * k * k * n + 22.0 * k**3 + gemm, gemm
    gemm = 4.0 * k * k * n + 2.0 * k**3
    return gemm + 9.0 * k**3, gemm


def _cost(spec: PolarSpec) -> Cost:
    batch, k, n = spec.shape()
    total, gemm = polar_flops(k, n, spec.method)
    x = spec.node_of("x").meta["val"]
    return Cost(flops=batch * total, bytes=float(2 * x.numel() * x.element_size()), matmul_flops=batch * gemm)


def _reference(spec: PolarSpec) -> torch.Tensor:
    """The exact polar factor (and nuclear norm) by fp64 SVD, whatever the method."""
    assert isinstance(spec.x, torch.Tensor)
    return polar_svd(spec.x.double(), spec.scale)


def _describe(spec: PolarSpec, fmt: Callable[[Any], str]) -> list[str]:
    return [fmt(spec.x), spec.method] + (["scale=nuclear"] if spec.scale == "nuclear" else [])


def _batch_key(spec: PolarSpec) -> Hashable | None:
    """m×n and n×m calls share a key (one joins transposed, :func:`_joins_transposed`): polar(Xᵀ) = polar(X)ᵀ."""
    x = spec.node_of("x").meta["val"]
    if x.dim() != 2:
        return None  # already batched
    _, k, n = spec.shape()
    return ((k, n), x.dtype, spec.method, spec.scale)


def _joins_transposed(spec: PolarSpec) -> bool:
    """Which orientation a stack takes: tall for svd, wide for gram_eigh.

    LAPACK's SVD of a (row-major) tall matrix measured 20-30 % cheaper than of
    its wide transpose here (19 vs 27 ms at 1024×256, one thread), so an svd
    stack is tall and wide members join transposed; gram_eigh costs the same
    either way and stacks wide. A stack is not bitwise eager anyway (another
    orientation, other LAPACK thread counts); an unbatched call keeps eager's.
    """
    x = spec.node_of("x").meta["val"]
    rows, cols = int(x.shape[-2]), int(x.shape[-1])
    return rows < cols if spec.method == "svd" else rows > cols


POLAR = register(
    OpFamily(
        spec=PolarSpec,
        title="polar factor (U Vᵀ of the SVD)",
        fallible=True,  # eigh/SVD may not converge: the write fence waits for it
        reference=_reference,
        describe=_describe,
        cost=_cost,
        batch=BatchRule(
            key=_batch_key,
            batched=lambda spec, stacked: spec.replace(x=stacked["x"]),
            transposed=_joins_transposed,
        ),
    )
)

__all__ = ["METHODS", "POLAR", "SCALES", "PolarSpec", "gram_eigh_error_bound", "polar", "polar_flops"]
