"""Newton–Schulz with one compute format per iteration, every GEMM emulated exactly.

The algorithms and their operation order are those of
``hocompile.ops.newton_schulz_math`` (standard and Gram NS, restarts, cubic variant);
only the rounding model differs:

- **normalisation** is always fp32 (accumulate in fp32, divide, no further
  rounding): the normalised X reaches the first iteration in fp32, and only
  that iteration's operand quantisation rounds it;
- **products** of iteration k run as ``emulated_matmul(..., schedule[k])``;
- **iterates** (X, and in Gram NS R, P, Q) are stored in the format's storage
  dtype (``FORMATS[f].storage``: fp32 for fp32/tf32, the dtype itself for
  bf16/fp16, bf16 for FP8/MXFP8 — FP8 is only a GEMM operand format);
- **linear combinations** (``a X + B X``, ``b A + c A²``) accumulate in fp32
  and round once to the storage dtype, as a fused GEMM epilogue.

Which format a Gram-NS product uses: the initial ``R = X₀X₀ᵀ`` uses
``schedule[0]``; everything issued while executing iteration k — ``R²`` for
P_k, ``Q ← P_k Q``, the R update ``P(P R)``, and a restart after k
(``X₀ ← Q X₀``, ``R ← X₀X₀ᵀ``) — uses ``schedule[k]``; the final ``Q X₀``
uses ``schedule[-1]``.

Against ``newton_schulz(..., compute_dtype=bf16, matmul="emulate")`` an
all-"bf16" schedule differs only in the normalisation (that one rounds the
norm, the divisor and X to bf16, and its first epilogue reads the bf16 X):
on inputs whose normalisation is exact in bf16 the two agree bit for bit;
on gaussian inputs they differ by about as much as either differs from
fp64 (tests/test_precision_emulation.py). Where the polynomial is steep at
σ = 1 (rank-one inputs, whose only σ is exactly 1 after normalisation) the
bf16-rounded norm alone moves the result: calibration.json's baseline vs
its bf16 schedule, e.g. 0.19 vs 0.03 for Keller Jordan's coefficients at
64×64. An all-"fp32" schedule equals the fp32 path bit for bit.

The run is split into :func:`start`, :func:`advance` and :func:`finish` so
that schedules sharing a prefix can share its iterations (the calibration
evaluates "first j iterations in F, the rest in G" for every j from one run
in F); resuming a state gives exactly the bits of one uninterrupted run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from ..ops.newton_schulz_math import ALGORITHMS, EPS_MODES, Coefficients, normalize
from .emulate import FORMATS, emulated_matmul


def _mm(
    a: torch.Tensor, b: torch.Tensor, fmt: str, *, c: torch.Tensor | None = None, alpha: float = 1.0,
    beta: float = 1.0,
) -> torch.Tensor:
    """One emulated GEMM whose result is stored in ``fmt``'s storage dtype (kept as fp32 values)."""
    storage = FORMATS[fmt].storage
    return emulated_matmul(a, b, fmt, storage, c=c, alpha=alpha, beta=beta).to(torch.float32)


def _store(t: torch.Tensor, fmt: str) -> torch.Tensor:
    """Round an fp32 value to ``fmt``'s storage dtype, keep computing in fp32."""
    return t.to(FORMATS[fmt].storage).to(torch.float32)


def newton_schulz_scheduled(
    x: torch.Tensor,
    coefficients: Coefficients,
    eps: float,
    schedule: Sequence[str],
    *,
    eps_mode: str = "clamp",
    transpose: bool = False,
    algorithm: str = "standard",
    restarts: Sequence[int] = (),
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Orthogonalise ``x`` ([m, n] or [B, m, n]) running iteration k in format ``schedule[k]``."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"bad newton_schulz_scheduled algorithm {algorithm!r}")
    _check_schedule(coefficients, schedule)
    state = start(x, eps, eps_mode=eps_mode, transpose=transpose)
    state = advance(state, coefficients, schedule, len(coefficients), algorithm=algorithm, restarts=restarts)
    return finish(state, schedule[-1], transpose=transpose, out_dtype=out_dtype or x.dtype)


def _check_schedule(coefficients: Coefficients, schedule: Sequence[str]) -> None:
    if len(schedule) != len(coefficients):
        raise ValueError(f"schedule has {len(schedule)} formats for {len(coefficients)} iterations")
    unknown = [f for f in schedule if f not in FORMATS]
    if unknown:
        raise ValueError(f"unknown compute formats {unknown}; known: {sorted(FORMATS)}")


@dataclass(frozen=True)
class NSState:
    """A scheduled NS after ``done`` iterations (fp32 tensors holding storage-rounded values).

    ``X`` is the iterate (standard NS) or X₀ of the current restart segment
    (Gram NS); ``R`` is the Gram matrix the next Gram iteration starts from
    (None before the first one) and ``Q`` the polynomial accumulated since the
    last restart (None right after one).
    """

    done: int
    X: torch.Tensor
    R: torch.Tensor | None = None
    Q: torch.Tensor | None = None


def start(x: torch.Tensor, eps: float, *, eps_mode: str = "clamp", transpose: bool = False) -> NSState:
    """Normalise in fp32 (accumulate, divide; nothing rounded below fp32)."""
    if eps_mode not in EPS_MODES:
        raise ValueError(f"bad eps_mode {eps_mode!r}")
    xt = x.mT if transpose else x
    return NSState(0, normalize(xt.to(torch.float32), eps, eps_mode, torch.float32))


def advance(
    state: NSState,
    coefficients: Coefficients,
    schedule: Sequence[str],
    until: int,
    *,
    algorithm: str = "standard",
    restarts: Sequence[int] = (),
) -> NSState:
    """Run iterations ``state.done .. until-1``, iteration k in ``schedule[k]``."""
    for k in range(state.done, until):
        if algorithm == "standard":
            state = NSState(k + 1, _standard_iteration(state.X, coefficients[k], schedule[k]))
        else:
            last = k == len(coefficients) - 1
            state = _gram_iteration(state, coefficients[k], schedule[k], last, (k + 1) in restarts)
    return state


def finish(
    state: NSState, fmt: str, *, transpose: bool = False, out_dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The result: the iterate, or for Gram NS ``Q X₀`` computed in ``fmt`` (the last iteration's)."""
    X = state.X if state.Q is None else _mm(state.Q, state.X, fmt)
    return (X.mT if transpose else X).to(out_dtype)


def _standard_iteration(X: torch.Tensor, abc: tuple[float, float, float], fmt: str) -> torch.Tensor:
    a, b, c = abc
    A = _mm(X, X.mT, fmt)
    B = _mm(A, A, fmt, c=A, alpha=c, beta=b) if c != 0.0 else _store(A * b, fmt)
    return _mm(B, X, fmt, c=X, alpha=1.0, beta=a)


def _gram_iteration(
    state: NSState, abc: tuple[float, float, float], fmt: str, last: bool, restart_after: bool
) -> NSState:
    a, b, c = abc
    X0, Q = state.X, state.Q
    R = _mm(X0, X0.mT, fmt) if state.R is None else state.R
    m = X0.shape[-2]
    eye = torch.eye(m, dtype=X0.dtype, device=X0.device).expand(*X0.shape[:-2], m, m)
    # P = a I + b R + c R², the linear part in fp32 and fused into R²'s epilogue.
    bR_plus_aI = b * R + a * eye
    P = _mm(R, R, fmt, c=bR_plus_aI, alpha=c, beta=1.0) if c != 0.0 else _store(bR_plus_aI, fmt)
    Q = P if Q is None else _mm(P, Q, fmt)
    if last:
        return NSState(state.done + 1, X0, R, Q)
    if restart_after:
        X0 = _mm(Q, X0, fmt)
        return NSState(state.done + 1, X0, _mm(X0, X0.mT, fmt), None)
    return replace(state, done=state.done + 1, R=_mm(P, _mm(P, R, fmt), fmt), Q=Q)
