"""``hocompile::inverse_root``: Shampoo's matrix inverse p-th root ``(A + εI)^(-1/p)`` of a symmetric PSD A.

The arithmetic is :mod:`hocompile.optimizers.matrix_roots`'s, called as is,
so a fused call is bitwise the eager Shampoo's:

- ``method="eigh"``: ``Q diag((max(λ, 0) + ε)^(-1/p)) Qᵀ`` from ``eigh(A)``;
- ``method="newton"``: ``iterations`` steps of the coupled Newton iteration
  (matmul-only; fixed count, no host-read tolerance).

What stays outside the op: Shampoo's bias correction (``A`` is already
``factor / (1 − β₂ᵗ)``), its keep-the-previous-root-when-not-finite
``where`` (an elementwise select the step graph keeps), and the fp64 retry of
a failed eigh (a Python ``except`` that a trace cannot see: the compiled step
raises instead, as documented in matrix_roots).

A stacked eigh call runs one matrix per thread (LAPACK per matrix, as
ATen's batched CPU eigh does anyway), and so does a stacked Newton call
(matrix_roots scales by one matrix's norm). Batched results agree with
eager to rounding (other thread counts), not necessarily bitwise.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ..ir.registry import BatchRule, Cost, Input, OpFamily, OpSpec, Scalar, register
from ..optimizers.matrix_roots import ROOT_METHODS, inverse_root_eigh, inverse_root_newton
from .per_matrix import per_matrix


def _check(a: torch.Tensor, root: int, method: str) -> None:
    if a.dim() not in (2, 3) or a.shape[-1] != a.shape[-2]:
        raise ValueError(f"inverse_root takes [n, n] or [B, n, n], got {tuple(a.shape)}")
    if root < 1:
        raise ValueError(f"inverse_root root must be a positive int, got {root}")
    if method not in ROOT_METHODS:
        raise ValueError(f"inverse_root method must be one of {ROOT_METHODS}, got {method!r}")


def inverse_root_eager(a: torch.Tensor, root: int, epsilon: float, method: str, iterations: int) -> torch.Tensor:
    def one(m: torch.Tensor) -> torch.Tensor:
        if method == "newton":
            return inverse_root_newton(m, root, epsilon, iterations)
        return inverse_root_eigh(m, root, epsilon)

    def each(m: torch.Tensor) -> torch.Tensor:
        # per_matrix hands a whole stack over when it has one thread (OMP_NUM_THREADS=1), and
        # matrix_roots' Newton scales by one matrix norm: a stack runs per matrix here too.
        return torch.stack([one(x) for x in m]) if m.dim() == 3 else one(m)

    return per_matrix(each, a) if a.dim() == 3 else one(a)


@torch.library.custom_op("hocompile::inverse_root", mutates_args=())
def inverse_root(a: torch.Tensor, root: int, epsilon: float, method: str = "eigh", iterations: int = 0) -> torch.Tensor:
    """``(a + εI)^(-1/root)`` by ``method`` (Shampoo's matrix_roots arithmetic)."""
    _check(a, root, method)
    return inverse_root_eager(a, root, epsilon, method, iterations)


@inverse_root.register_fake
def _inverse_root_fake(
    a: torch.Tensor, root: int, epsilon: float, method: str = "eigh", iterations: int = 0
) -> torch.Tensor:
    _check(a, root, method)
    return torch.empty_like(a, memory_format=torch.contiguous_format)


@dataclass(frozen=True)
class InverseRootSpec(OpSpec):
    """``hocompile::inverse_root(a, root, epsilon, method="eigh", iterations=0)``, by name."""

    qualname: ClassVar[str] = "hocompile::inverse_root"

    a: Input
    root: int
    epsilon: Scalar
    method: str = "eigh"
    iterations: int = 0

    def shape(self) -> tuple[int, int]:
        a = self.node_of("a").meta["val"]
        return (int(a.shape[0]) if a.dim() == 3 else 1), int(a.shape[-1])


def matrix_power_products(root: int) -> int:
    """Matrix products ``torch.linalg.matrix_power(t, root)`` makes (binary powering)."""
    return max(0, root.bit_length() - 1 + bin(root).count("1") - 1)


def inverse_root_flops(n: int, root: int, method: str, iterations: int) -> tuple[float, float]:
    """(total, in GEMMs) FLOPs of one n×n inverse root, textbook counts.

    eigh with vectors ≈ 9n³ (tridiagonalisation and QR iteration; LAPACK, not
    GEMM rate), then (Q·s) Qᵀ 2n³. Newton: per iteration X T, the power T^p
    and T^p M, each 2n³.
    """
    if method == "eigh":
        return 9.0 * n**3 + 2.0 * n**3, 2.0 * n**3
    gemm = iterations * (2 + matrix_power_products(root)) * 2.0 * n**3
    return gemm, gemm


def _cost(spec: InverseRootSpec) -> Cost:
    batch, n = spec.shape()
    total, gemm = inverse_root_flops(n, spec.root, spec.method, spec.iterations)
    size = spec.node_of("a").meta["val"].element_size()
    return Cost(flops=batch * total, bytes=float(batch * 2 * n * n * size), matmul_flops=batch * gemm)


def _reference(spec: InverseRootSpec) -> torch.Tensor:
    """The exact root of ``A + εI`` by fp64 eigh, whatever the method (Newton converges to it)."""
    assert isinstance(spec.a, torch.Tensor)
    return inverse_root_eigh(spec.a.double(), spec.root, float(spec.epsilon))  # type: ignore[arg-type]


def _describe(spec: InverseRootSpec, fmt: Callable[[Any], str]) -> list[str]:
    method = f"newton x{spec.iterations}" if spec.method == "newton" else spec.method
    return [fmt(spec.a), f"-1/{spec.root}", f"eps={fmt(spec.epsilon)}", method]


def _batch_key(spec: InverseRootSpec) -> Hashable | None:
    a = spec.node_of("a").meta["val"]
    if a.dim() != 2:
        return None  # already batched
    return (int(a.shape[-1]), a.dtype, spec.root, spec.epsilon, spec.method, spec.iterations)


INVERSE_ROOT = register(
    OpFamily(
        spec=InverseRootSpec,
        title="matrix inverse p-th root (A + εI)^(-1/p)",
        fallible=True,  # eigh/SVD may not converge: the write fence waits for it
        reference=_reference,
        describe=_describe,
        cost=_cost,
        batch=BatchRule(key=_batch_key, batched=lambda spec, stacked: spec.replace(a=stacked["a"])),
    )
)

__all__ = ["INVERSE_ROOT", "InverseRootSpec", "inverse_root", "inverse_root_eager", "inverse_root_flops"]
