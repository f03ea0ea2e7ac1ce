"""Inverse p-th roots of symmetric positive semi-definite matrices, for Shampoo.

Two methods, both written so that hocompile can capture them into one graph
(no data-dependent host reads: no ``.item()``, no ``while error > tol``):

- ``inverse_root_eigh``: ``Q diag((max(λ, 0) + ε)^(-1/p)) Qᵀ`` from
  ``torch.linalg.eigh``. The default, as in Meta's Distributed Shampoo.
  Clamping at 0 before adding ε is ``eig(A + εI)`` for a PSD ``A`` and stays
  finite when rounding makes a null-space eigenvalue slightly negative.
- ``inverse_root_newton``: the coupled Newton iteration (Guo & Higham 2006,
  the form Distributed Shampoo uses). Matmul-only, so it can run in the
  Newton–Schulz-style kernels and in lower precision. The iteration count is
  fixed instead of "until ||M − I||∞ < tol": a tolerance loop would read the
  error on the host every iteration (a sync, and not capturable). Once M has
  converged to I the iteration is a no-op up to rounding, so extra iterations
  cost time, not accuracy; ``newton_residual`` reports the convergence.

``matrix_inverse_root`` adds the field's failure handling: an eigh that raises
is retried in float64, and if that fails too (or the result is not finite),
the previous root is kept.
"""

from __future__ import annotations

import logging
import math

import torch

__all__ = [
    "inverse_root_eigh",
    "inverse_root_newton",
    "matrix_inverse_root",
    "newton_iterations_needed",
    "newton_residual",
]

log = logging.getLogger("hocompile.optimizers")

ROOT_METHODS = ("eigh", "newton")


def inverse_root_eigh(a: torch.Tensor, root: int, epsilon: float) -> torch.Tensor:
    """``(A + εI)^(-1/root)`` of a symmetric PSD ``A`` (its lower triangle is read), in ``A``'s dtype."""
    eigenvalues, eigenvectors = torch.linalg.eigh(a)
    # Rounding leaves null-space eigenvalues at ±u·||A||; a negative one would
    # give NaN under a fractional power.
    scales = eigenvalues.clamp_min(0.0).add(epsilon).pow(-1.0 / root)
    return (eigenvectors * scales.unsqueeze(-2)) @ eigenvectors.transpose(-2, -1)


def inverse_root_newton(a: torch.Tensor, root: int, epsilon: float, iterations: int) -> torch.Tensor:
    """``(A + εI)^(-1/root)`` by ``iterations`` steps of the coupled Newton iteration.

    With ``z = (root + 1) / (2 ||A + εI||_F)``, ``X₀ = z^(1/root) I`` and
    ``M₀ = z (A + εI)`` (eigenvalues in (0, (root+1)/2], where it converges):
    ``T = ((root + 1) I − M) / root``, ``X ← X T``, ``M ← T^root M``.
    ``X M^(-1/root)`` is invariant, so ``X → (A + εI)^(-1/root)`` as ``M → I``.
    An eigenvalue μ far below 1 grows by ~((root+1)/root)^root per step (×2.44
    for root 4), so ~log(1/μ)/log(2.44) + 5 iterations are needed
    (``newton_iterations_needed``): ε sets the count.
    """
    n = a.shape[-1]
    identity = torch.eye(n, dtype=a.dtype, device=a.device)
    ridge = a + epsilon * identity
    z = (root + 1.0) / (2.0 * torch.linalg.matrix_norm(ridge))
    x = z.pow(1.0 / root) * identity
    m = z * ridge
    for _ in range(iterations):
        t = (m * (-1.0 / root)).add(identity, alpha=(root + 1.0) / root)
        x = x @ t
        m = torch.linalg.matrix_power(t, root) @ m
    # X is symmetric in exact arithmetic; rounding breaks that slowly.
    return (x + x.transpose(-2, -1)) * 0.5


def newton_residual(a: torch.Tensor, x: torch.Tensor, root: int, epsilon: float) -> float:
    """``max |X^root (A + εI) − I|``: how far a computed inverse root is from converged (host read: eager only)."""
    identity = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)
    product = torch.linalg.matrix_power(x, root) @ (a + epsilon * identity)
    return float((product - identity).abs().max())


def newton_iterations_needed(condition: float, root: int) -> int:
    """Iterations for the coupled Newton iteration to converge from eigenvalue ratio ``condition``.

    The smallest eigenvalue of M₀ is about ``(root+1)/(2·sqrt(n)·condition)``
    or more; the linear phase multiplies it by ((root+1)/root)^root per step,
    then ~5 quadratic steps finish.
    """
    growth = root * math.log1p(1.0 / root)
    return int(math.ceil(math.log(max(condition, 1.0)) / growth)) + 6


def matrix_inverse_root(
    a: torch.Tensor,
    root: int,
    epsilon: float,
    method: str,
    previous: torch.Tensor,
    newton_iterations: int = 30,
    compute_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``(A + εI)^(-1/root)`` in ``previous``'s dtype, or ``previous`` where it cannot be computed.

    Failure handling as in the field: an eigh that raises (LAPACK/cuSOLVER did
    not converge) is retried in float64; if that raises too, the previous root
    is kept. A result that is not finite (NaN/inf in the factor, a diverged
    Newton iteration) also keeps the previous root. That last check is a
    ``torch.where`` on the device, so it is part of a compiled step; the
    retry is a Python ``except`` that a trace cannot see: a compiled step whose
    eigh raises has written nothing back, and the runtime runs that step eagerly,
    retry included (tests/test_linalg_fallback.py).
    """
    if method not in ROOT_METHODS:
        raise ValueError(f"root method {method!r}: expected one of {ROOT_METHODS}")
    work = a.to(compute_dtype)
    if method == "newton":
        result = inverse_root_newton(work, root, epsilon, newton_iterations)
    else:
        try:
            result = inverse_root_eigh(work, root, epsilon)
        except torch.linalg.LinAlgError as first:
            log.warning("Shampoo: eigh failed in %s (%s); retrying in float64", compute_dtype, first)
            try:
                result = inverse_root_eigh(a.to(torch.float64), root, epsilon)
            except torch.linalg.LinAlgError as second:
                log.warning("Shampoo: eigh failed in float64 too (%s); keeping the previous root", second)
                return previous
    result = result.to(previous.dtype)
    return torch.where(torch.isfinite(result).all(), result, previous)
