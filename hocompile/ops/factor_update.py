"""``hocompile::factor_update``: the symmetric rank-k update of a Kronecker factor.

Shampoo-family optimizers keep, per 2-D gradient G (m×n), a left factor
L (m×m) and a right factor R (n×n) and fold each step's Gram into them.
The captured graphs spell it two ways:

- ``form="lerp"`` (emerging-optimizers SOAP): ``L.lerp_(G @ G.T, w)`` →
  ``aten.lerp.Scalar(L, aten.mm(G, Gᵀ), w)``. REKLS and SOAP with
  ``use_kl_shampoo`` lerp towards ``G C Gᵀ`` (a KL correction C from the old
  basis) instead: a three-factor product, not this op; fuse-factor-update
  declines it and says so;
- ``form="addmm"`` (hocompile's Shampoo): ``L.addmm_(G, G.T, beta=β, alpha=w)``
  → ``aten.addmm(L, G, Gᵀ, beta=β, alpha=w)``.

``side="left"`` is ``G Gᵀ`` (factor size m, rank k = n), ``side="right"`` is
``Gᵀ G`` (size n, rank m). The CPU kernel makes exactly eager's calls (the
same ``mm`` on the same transposed view, then the same ``lerp``/``addmm``),
so an unbatched call is bitwise eager.

Batching: a right update of G is a left update of Gᵀ (``Gᵀ G = (Gᵀ)(Gᵀ)ᵀ``),
so every update with factor size n and rank k shares one stack whatever the
side or the param (the right members join transposed, their factors too:
a lerp commutes with the transpose, and the Gram is symmetric). A stacked
call computes the Gram with ``bmm`` and the transposed operand, which need
not round like eager's ``mm`` (and is not bitwise symmetric on every BLAS):
batched results agree with eager to fp32 rounding, not bitwise.

A lower-triangle-only CPU variant (torch exposes no SYRK: b row blocks of
``mm`` into one preallocated output, b(b+1)/2 of b² blocks, then the upper
blocks copied from their mirrors) did not measure faster here (fp32, 2
shared cores, min of 7; dense ``mm`` vs 2 / 4 blocks): 256×1024 0.87 vs
0.83 / 0.86 ms, 1024×256 3.13 vs 3.13 / 11.6 ms, 512×512 1.31 vs 1.13 /
1.16 ms: within this machine's noise but for one shape, and it would give
up bitwise parity. So there is none; the Triton kernel
(lowering/triton/factor_update_group.py) computes lower tiles only and
mirrors them, where the halved FLOPs do pay.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ..ir.registry import BatchRule, Cost, Input, OpFamily, OpSpec, Scalar, register

SIDES = ("left", "right")
FORMS = ("lerp", "addmm")


def _check(factor: torch.Tensor, g: torch.Tensor, side: str, form: str) -> None:
    if side not in SIDES:
        raise ValueError(f"factor_update side must be one of {SIDES}, got {side!r}")
    if form not in FORMS:
        raise ValueError(f"factor_update form must be one of {FORMS}, got {form!r}")
    if g.dim() not in (2, 3) or factor.dim() != g.dim():
        raise ValueError(
            f"factor_update takes [n, n] and [n, k] (or [B, ...]), got {tuple(factor.shape)}, {tuple(g.shape)}"
        )
    n = g.shape[-2] if side == "left" else g.shape[-1]
    if factor.shape[-2:] != (n, n):
        raise ValueError(f"factor {tuple(factor.shape)} does not match the {side} Gram of {tuple(g.shape)}")


def factor_update_eager(
    factor: torch.Tensor, g: torch.Tensor, side: str, form: str, weight: float, beta: float = 1.0
) -> torch.Tensor:
    """Eager's own arithmetic: the Gram on G's transposed view, then ``lerp``/``addmm``."""
    a, b = (g, g.mT) if side == "left" else (g.mT, g)
    if g.dim() == 3:
        if form == "lerp":
            return torch.lerp(factor, torch.bmm(a, b), weight)
        return torch.baddbmm(factor, a, b, beta=beta, alpha=weight)
    if form == "lerp":
        return torch.lerp(factor, torch.mm(a, b), weight)
    return torch.addmm(factor, a, b, beta=beta, alpha=weight)


@torch.library.custom_op("hocompile::factor_update", mutates_args=())
def factor_update(
    factor: torch.Tensor, g: torch.Tensor, side: str, form: str, weight: float, beta: float = 1.0
) -> torch.Tensor:
    """``lerp(factor, G Gᵀ, weight)`` or ``beta·factor + weight·G Gᵀ`` (``Gᵀ G`` for ``side="right"``)."""
    _check(factor, g, side, form)
    return factor_update_eager(factor, g, side, form, weight, beta)


# The in-place form, for the aten lowering's re-inplacing (lowering/reinplace.py): eager's own
# ``L.lerp_(G Gᵀ, w)`` / ``L.addmm_(G, Gᵀ, β, α)``, so the write-back copy of the factor goes
# away and the values stay eager's bits. Defined with an aliasing schema (``Tensor(a!)`` in
# and out, as aten's in-place ops), which ``torch.library.custom_op`` cannot express.
_LIB = torch.library.Library("hocompile", "FRAGMENT")
_LIB.define(
    "factor_update_(Tensor(a!) factor, Tensor g, str side, str form, float weight, float beta=1.) -> Tensor(a!)"
)


def _factor_update_inplace(
    factor: torch.Tensor, g: torch.Tensor, side: str, form: str, weight: float, beta: float = 1.0
) -> torch.Tensor:
    _check(factor, g, side, form)
    a, b = (g, g.mT) if side == "left" else (g.mT, g)
    if form == "lerp":
        return factor.lerp_(torch.bmm(a, b) if g.dim() == 3 else torch.mm(a, b), weight)
    if g.dim() == 3:
        return factor.baddbmm_(a, b, beta=beta, alpha=weight)
    return factor.addmm_(a, b, beta=beta, alpha=weight)


_LIB.impl("factor_update_", _factor_update_inplace, "CompositeExplicitAutograd")


@factor_update.register_fake
def _factor_update_fake(
    factor: torch.Tensor, g: torch.Tensor, side: str, form: str, weight: float, beta: float = 1.0
) -> torch.Tensor:
    _check(factor, g, side, form)
    return torch.empty_like(factor, memory_format=torch.contiguous_format)


@dataclass(frozen=True)
class FactorUpdateSpec(OpSpec):
    """``hocompile::factor_update(factor, g, side, form, weight, beta=1.0)``, by name."""

    qualname: ClassVar[str] = "hocompile::factor_update"

    factor: Input
    g: Input
    side: str
    form: str
    weight: Scalar
    beta: Scalar = 1.0

    def shape(self) -> tuple[int, int, int]:
        """(batch, n, k): factor size n, Gram rank k, from G's meta."""
        g = self.node_of("g").meta["val"]
        rows, cols = int(g.shape[-2]), int(g.shape[-1])
        n, k = (rows, cols) if self.side == "left" else (cols, rows)
        return (int(g.shape[0]) if g.dim() == 3 else 1), n, k


def factor_update_flops(n: int, k: int, symmetric: bool = False) -> float:
    """FLOPs of one update: the n×n Gram of an n×k matrix (2n²k; half that on the lower
    triangle, n(n+1)k, when only it is computed), plus the lerp/addmm epilogue (3n²)."""
    gram = n * (n + 1) * k if symmetric else 2.0 * n * n * k
    return float(gram + 3 * n * n)


def _cost(spec: FactorUpdateSpec) -> Cost:
    batch, n, k = spec.shape()
    g = spec.node_of("g").meta["val"]
    gemm = 2.0 * n * n * k  # dense GEMM, as aten's mm computes it (a symmetric kernel does half)
    moved = (2 * n * n + n * k) * g.element_size()  # factor in and out, G in
    return Cost(flops=batch * factor_update_flops(n, k), bytes=float(batch * moved), matmul_flops=batch * gemm)


def _reference(spec: FactorUpdateSpec) -> torch.Tensor:
    """The update in fp64 from the same inputs (exact but for fp64 rounding)."""
    assert isinstance(spec.factor, torch.Tensor) and isinstance(spec.g, torch.Tensor)
    weight, beta = float(spec.weight), float(spec.beta)  # type: ignore[arg-type]
    g = spec.g.double()
    gram = g @ g.mT if spec.side == "left" else g.mT @ g
    factor = spec.factor.double()
    if spec.form == "lerp":
        return factor + weight * (gram - factor)
    return beta * factor + weight * gram


def _describe(spec: FactorUpdateSpec, fmt: Callable[[Any], str]) -> list[str]:
    gram = f"{fmt(spec.g)} @ {fmt(spec.g)}^T" if spec.side == "left" else f"{fmt(spec.g)}^T @ {fmt(spec.g)}"
    parts = [fmt(spec.factor), gram, spec.form, f"weight={fmt(spec.weight)}"]
    return parts + ([f"beta={fmt(spec.beta)}"] if spec.form == "addmm" else [])


def _batch_key(spec: FactorUpdateSpec) -> Hashable | None:
    """(n, k, dtype, form, weight, beta): left and right updates of any params share it.

    The scalars are part of the key because a stack runs with one weight:
    updates with their own host scalars (per-param step counts) stay apart.
    """
    g = spec.node_of("g").meta["val"]
    if g.dim() != 2:
        return None  # already batched
    _, n, k = spec.shape()
    beta = spec.beta if spec.form == "addmm" else None
    return (n, k, g.dtype, spec.form, spec.weight, beta)


def _stack_bytes(spec: FactorUpdateSpec) -> int:
    _, n, k = spec.shape()
    return int((2 * n * n + n * k) * spec.node_of("g").meta["val"].element_size())


FACTOR_UPDATE = register(
    OpFamily(
        spec=FactorUpdateSpec,
        title="Kronecker factor update (symmetric rank-k lerp/addmm of G Gᵀ)",
        reference=_reference,
        describe=_describe,
        cost=_cost,
        batch=BatchRule(
            key=_batch_key,
            batched=lambda spec, stacked: spec.replace(factor=stacked["factor"], g=stacked["g"], side="left"),
            transposed=lambda spec: spec.side == "right",
            stack_bytes=_stack_bytes,
        ),
    )
)

__all__ = [
    "FACTOR_UPDATE",
    "FORMS",
    "SIDES",
    "FactorUpdateSpec",
    "factor_update",
    "factor_update_eager",
    "factor_update_flops",
]
