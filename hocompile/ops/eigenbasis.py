"""SOAP's eigenbasis refresh as two ops: ``hocompile::rayleigh_order`` and ``hocompile::power_qr``.

emerging-optimizers 0.3.0 refreshes each Kronecker factor's basis Q (n×n,
L symmetric n×n) in two steps (``soap_utils.sort_eigenbasis_by_approx_eigvals``
then ``get_eigenbasis_qr`` with ``power_iter_steps=1``)::

    d     = ((Qᵀ @ L) * Qᵀ).sum(dim=1)          # diag(QᵀLQ): approximate eigenvalues
    order = argsort(d, descending=True)          # traced as aten.sort(d, -1, True)[1]
    Qs    = Q[:, order]                           # (exp_avg_sq.index_select(side, order) too)
    Q_new = qr(L @ Qs).Q

Both matrix products are n³. Since L is symmetric, ``Qᵀ L = (L Q)ᵀ``, and
``L @ Q[:, order] = (L @ Q)[:, order]``: one product P = L Q serves both.
fuse-eigenbasis rewrites the pattern to::

    P     = aten.mm(L, Q)
    order = hocompile.rayleigh_order(P, Q)       # argsort(−diag(PᵀQ)), eager's reduction layout
    Q_new = hocompile.power_qr(P, order)         # qr(P[:, order]).Q

Two single-output ops rather than one two-output op: batch-by-shape's
:class:`~hocompile.ir.registry.BatchRule` stacks one output per call, and the
expensive half (QR, 8/3 n³ in LAPACK) is the one worth batching; the
order is O(n²) and stays per matrix.

Numerics: ``rayleigh_order`` reduces ``Pᵀ ∘ Qᵀ`` in the same layout as
eager's ``(QᵀL) ∘ Qᵀ``, and ``P[:, order]`` gathers the columns eager's
``L @ Q[:, order]`` computes, so with a bitwise-symmetric L (SOAP's
``lerp`` of ``G Gᵀ`` is) an unbatched refresh is bitwise eager wherever
the GEMM computes a column independently of its position (checked in
tests/test_eigenbasis_family.py). A batched ``power_qr`` runs one
single-threaded LAPACK QR per matrix (:func:`~hocompile.ops.per_matrix.per_matrix`), which rounds
differently from eager's multi-threaded call: Q agrees to ~1e-5 (columns
up to sign; SOAP's update is invariant to column signs).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..ir.registry import BatchRule, Cost, Input, OpFamily, OpSpec, register
from .per_matrix import per_matrix


def _check_square(name: str, x: torch.Tensor) -> None:
    if x.dim() not in (2, 3) or x.shape[-1] != x.shape[-2]:
        raise ValueError(f"{name} takes [n, n] or [B, n, n], got {tuple(x.shape)}")


# ------------------------------------------------------------------ the kernels


def rayleigh_order_eager(lq: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Column order of Q by descending diag(QᵀLQ), from P = L Q (L symmetric).

    ``P.mT.contiguous()`` is eager's ``Qᵀ @ L`` (same values for symmetric
    L, same row-major layout), so the product with the ``Qᵀ`` view and the
    row sum reduce in eager's order: equal inputs give bitwise-equal keys,
    and ``sort(…, -1, True)`` is the very call ``argsort(descending=True)``
    traces to, so ties break the same way.
    """
    d = (lq.mT.contiguous() * q.mT).sum(dim=-1)
    return torch.sort(d, -1, True)[1]


def power_qr_eager(lq: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Q of ``qr(P[:, order])``: one orthogonal-iteration step from the sorted basis."""
    if lq.dim() == 2:
        return torch.linalg.qr(lq[:, order]).Q
    index = order.unsqueeze(-2).expand(lq.shape)
    return torch.linalg.qr(torch.gather(lq, -1, index)).Q


@torch.library.custom_op("hocompile::rayleigh_order", mutates_args=())
def rayleigh_order(lq: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """argsort(diag(Qᵀ L Q), descending) per matrix, given ``lq`` = L Q with L symmetric."""
    _check_square("rayleigh_order", lq)
    return rayleigh_order_eager(lq, q)


@rayleigh_order.register_fake
def _rayleigh_order_fake(lq: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    _check_square("rayleigh_order", lq)
    return lq.new_empty(lq.shape[:-1], dtype=torch.int64)


@torch.library.custom_op("hocompile::power_qr", mutates_args=())
def power_qr(lq: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Q of ``qr(lq[:, order])`` per matrix; a [B, n, n] stack runs one matrix per thread."""
    _check_square("power_qr", lq)
    if lq.dim() == 3:
        return per_matrix(power_qr_eager, lq, order)
    return power_qr_eager(lq, order)


@power_qr.register_fake
def _power_qr_fake(lq: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    _check_square("power_qr", lq)
    return torch.empty_like(lq, memory_format=torch.contiguous_format)


# ------------------------------------------------------------------ the specs


def _batch_and_n(spec: OpSpec) -> tuple[int, int]:
    x = spec.node_of("lq").meta["val"]
    return (int(x.shape[0]) if x.dim() == 3 else 1), int(x.shape[-1])


@dataclass(frozen=True)
class RayleighOrderSpec(OpSpec):
    """``hocompile::rayleigh_order(lq, q)``: lq = L Q (L symmetric), q the current basis."""

    qualname: ClassVar[str] = "hocompile::rayleigh_order"

    lq: Input
    q: Input


@dataclass(frozen=True)
class PowerQRSpec(OpSpec):
    """``hocompile::power_qr(lq, order)``: lq = L Q, order the new column order."""

    qualname: ClassVar[str] = "hocompile::power_qr"

    lq: Input
    order: Input


def qr_flops(n: int) -> float:
    """Householder QR of an n×n matrix with Q formed: geqrf 4/3 n³ + orgqr 4/3 n³ (Golub & Van Loan)."""
    return 8.0 / 3.0 * n**3


def _rayleigh_cost(spec: RayleighOrderSpec) -> Cost:
    batch, n = _batch_and_n(spec)
    # A multiply-add per element of P ∘ Q, then an n·log n sort (not counted as FLOPs).
    return Cost(flops=2.0 * batch * n * n, bytes=float(batch * (2 * n * n * 4 + n * 8)))


def _power_qr_cost(spec: PowerQRSpec) -> Cost:
    batch, n = _batch_and_n(spec)
    x = spec.node_of("lq").meta["val"]
    # LAPACK's blocked QR runs far below GEMM rate, so none of it counts as matmul FLOPs.
    return Cost(flops=batch * qr_flops(n), bytes=float(2 * x.numel() * x.element_size()))


def _rayleigh_reference(spec: RayleighOrderSpec) -> torch.Tensor:
    """The order by exact fp64 keys diag(Pᵀ Q) (ties may order differently from fp32)."""
    assert isinstance(spec.lq, torch.Tensor) and isinstance(spec.q, torch.Tensor)
    d = (spec.lq.double() * spec.q.double()).sum(dim=-2)
    return torch.sort(d, -1, True)[1]


def _power_qr_reference(spec: PowerQRSpec) -> torch.Tensor:
    assert isinstance(spec.lq, torch.Tensor) and isinstance(spec.order, torch.Tensor)
    return power_qr_eager(spec.lq.double(), spec.order)


def _power_qr_key(spec: PowerQRSpec) -> Hashable | None:
    """Keyed by factor size only: left and right factors of any params with equal n share a stack."""
    x = spec.node_of("lq").meta["val"]
    if x.dim() != 2:
        return None  # already batched
    return (int(x.shape[-1]), x.dtype)


def _power_qr_stack_bytes(spec: PowerQRSpec) -> int:
    x = spec.node_of("lq").meta["val"]
    return int(2 * x.numel() * x.element_size() + x.shape[-1] * 8)  # stacked P and Q_new, plus the order


# One thread per matrix beats eager's loop of two-thread QRs from n = 256 on this
# project's 2-core CPU (2.4x at 3×256², 1.5x at 2×512², 1.05x at 3×1024²); at
# n ≤ 192 the hand-off to the pool costs more than it saves (0.4x at 16, 1.0x at 192).
# benchmarks/soap_step.py prints the table.
PER_MATRIX_MIN_N = 256


def _threads_pay(spec: PowerQRSpec) -> bool:
    return int(spec.node_of("lq").meta["val"].shape[-1]) >= PER_MATRIX_MIN_N


RAYLEIGH_ORDER = register(
    OpFamily(
        spec=RayleighOrderSpec,
        title="eigenbasis order by descending Rayleigh quotients diag(QᵀLQ)",
        reference=_rayleigh_reference,
        describe=lambda spec, fmt: [fmt(spec.lq), fmt(spec.q), "descending"],
        cost=_rayleigh_cost,
    )
)

POWER_QR = register(
    OpFamily(
        spec=PowerQRSpec,
        title="orthogonal-iteration step Q of qr(LQ[:, order])",
        reference=_power_qr_reference,
        describe=lambda spec, fmt: [fmt(spec.lq), f"columns={fmt(spec.order)}", "householder"],
        cost=_power_qr_cost,
        batch=BatchRule(
            key=_power_qr_key,
            batched=lambda spec, stacked: spec.replace(lq=stacked["lq"], order=stacked["order"]),
            stack_bytes=_power_qr_stack_bytes,
            per_matrix_threads=_threads_pay,
        ),
    )
)

__all__ = [
    "POWER_QR",
    "RAYLEIGH_ORDER",
    "PowerQRSpec",
    "RayleighOrderSpec",
    "power_qr",
    "power_qr_eager",
    "qr_flops",
    "rayleigh_order",
    "rayleigh_order_eager",
]
