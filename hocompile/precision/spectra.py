"""Deterministic calibration inputs whose singular values stress NS in different ways.

NS maps every singular value σ of the normalised input through the same odd
polynomial, so what matters about an input is its spectrum (and, for
low-precision formats, the spread of its entries):

- ``gaussian``: Marchenko–Pastur spectrum, the textbook case;
- ``low_rank_noise``: a rank-4 signal plus noise at 1e-3 of its norm — many
  tiny σ that early iterations must lift through the low-precision floor;
- ``heavy_tailed``: ``U diag(s) Vᵀ`` with ``s_i = i^-1`` (power-law spectra,
  as measured for LLM gradients and momenta), random orthonormal U, V;
- ``tiny_norm``: gaussian scaled to Frobenius norm 1e-8, below the eps = 1e-7
  every Muon implementation here uses, so the eps clamp sets the scale;
- ``rank_one``: ``u vᵀ``, one σ, the rest exactly zero.

Every generator is a pure function of ``(kind, m, n, seed)`` (seeded CPU
``torch.Generator``, maths in fp64, rounded once to fp32).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# Rank of the signal in "low_rank_noise" and the noise level relative to it.
LOW_RANK = 4
NOISE_LEVEL = 1e-3
# Power-law exponent of "heavy_tailed" (s_i ∝ i^-alpha).
POWER_LAW_ALPHA = 1.0
# Frobenius norm of "tiny_norm": one tenth of eps = 1e-7 (torch.optim.Muon,
# emerging-optimizers and Keller Jordan's muon.py all default to 1e-7).
TINY_NORM = 1e-8


def _gaussian(m: int, n: int, g: torch.Generator) -> torch.Tensor:
    return torch.randn(m, n, generator=g, dtype=torch.float64)


def _orthonormal(rows: int, cols: int, g: torch.Generator) -> torch.Tensor:
    """rows×cols with orthonormal columns (Haar: QR of a gaussian, signs fixed by diag(R))."""
    q, r = torch.linalg.qr(torch.randn(rows, cols, generator=g, dtype=torch.float64))
    return q * torch.sign(torch.diagonal(r)).where(torch.diagonal(r) != 0, 1.0)


def _low_rank_noise(m: int, n: int, g: torch.Generator) -> torch.Tensor:
    r = min(LOW_RANK, m, n)
    signal = _gaussian(m, r, g) @ _gaussian(r, n, g)
    noise = _gaussian(m, n, g)
    return signal / signal.norm() + NOISE_LEVEL * noise / noise.norm()


def _heavy_tailed(m: int, n: int, g: torch.Generator) -> torch.Tensor:
    k = min(m, n)
    s = torch.arange(1, k + 1, dtype=torch.float64) ** -POWER_LAW_ALPHA
    return (_orthonormal(m, k, g) * s) @ _orthonormal(n, k, g).mT


def _tiny_norm(m: int, n: int, g: torch.Generator) -> torch.Tensor:
    x = _gaussian(m, n, g)
    return x * (TINY_NORM / x.norm())


def _rank_one(m: int, n: int, g: torch.Generator) -> torch.Tensor:
    return _gaussian(m, 1, g) @ _gaussian(1, n, g)


_GENERATORS: dict[str, Callable[[int, int, torch.Generator], torch.Tensor]] = {
    "gaussian": _gaussian,
    "low_rank_noise": _low_rank_noise,
    "heavy_tailed": _heavy_tailed,
    "tiny_norm": _tiny_norm,
    "rank_one": _rank_one,
}
SPECTRA: tuple[str, ...] = tuple(_GENERATORS)


def spectrum(kind: str, m: int, n: int, seed: int) -> torch.Tensor:
    """An fp32 [m, n] calibration input of the given kind (module docstring)."""
    if kind not in _GENERATORS:
        raise ValueError(f"unknown spectrum {kind!r}; known: {SPECTRA}")
    g = torch.Generator().manual_seed(seed)
    return _GENERATORS[kind](m, n, g).to(torch.float32)
