"""Home of hocompile's custom ops (the ``hocompile::`` torch.library namespace).

Passes rewrite recognised subgraphs into these ops. Each op registered here
comes with a fake (meta) implementation so graphs stay traceable, an exact
reference implementation that runs in fp64 for tests, and lowerings.

Conventions:

- schemas are functional (no aliasing, no mutation), like the graphs;
- structural choices (coefficients, steps, flags) are op arguments, so they
  show in printed graphs and enter the cache key through the graph text;
- hyperparameters never are: they stay host scalars.

The Newton–Schulz op arrives with the fuse-newton-schulz pass.
"""

from __future__ import annotations

import torch

NAMESPACE = "hocompile"

# One fragment for the namespace; ops are defined on it as passes need them.
LIBRARY = torch.library.Library(NAMESPACE, "FRAGMENT")


def defined_ops() -> list[str]:
    """Names of the ops currently registered under ``hocompile::``."""
    ns = getattr(torch.ops, NAMESPACE)
    return sorted(name for name in dir(ns) if not name.startswith("_") and name not in {"name"})


# --------------------------------------------------------------- newton_schulz


@torch.library.custom_op(f"{NAMESPACE}::newton_schulz", mutates_args=())
def newton_schulz(
    x: torch.Tensor,
    a: list[float],
    b: list[float],
    c: list[float],
    eps: float,
    eps_mode: str,
    transpose: bool,
    compute_dtype: torch.dtype,
    out_dtype: torch.dtype,
    algorithm: str,
    restarts: list[int],
    matmul: str,
    blocks: int = 0,
    schedule: str = "",
) -> torch.Tensor:
    """Orthogonalise x ([m, n] or [B, m, n]) with per-iteration (a, b, c).

    See :mod:`hocompile.newton_schulz` for the maths and rounding model.
    ``transpose`` works on xᵀ (tall matrices become wide) and transposes the
    result back; the output has x's shape and ``out_dtype``. ``blocks`` > 1
    computes symmetric products on lower-triangle blocks only. ``schedule``
    (operand formats per iteration in runs, e.g. ``"fp8_e4m3*2+bf16*3"``)
    replaces ``compute_dtype`` with a per-iteration plan.
    """
    from . import newton_schulz as ns

    coefficients = list(zip(a, b, c))
    if schedule:
        # A per-iteration precision schedule (choose-precision): each GEMM
        # emulated exactly as the planned tensor-core format computes it.
        from .precision.calibrate import parse_schedule_key
        from .precision.schedule_ns import newton_schulz_scheduled

        return newton_schulz_scheduled(
            x, coefficients, eps, parse_schedule_key(schedule), eps_mode=eps_mode, transpose=transpose,
            algorithm=algorithm, restarts=tuple(restarts), out_dtype=out_dtype,
        )
    kwargs = dict(
        eps_mode=eps_mode, transpose=transpose, compute_dtype=compute_dtype, out_dtype=out_dtype,
        algorithm=algorithm, restarts=restarts, matmul=matmul, blocks=blocks,
    )
    # A batched x runs as bmm/baddbmm: batch-by-shape only stacks where the
    # target measured one bmm faster than a loop of mm.
    return ns.newton_schulz(x, coefficients, eps, **kwargs)  # type: ignore[arg-type]


@newton_schulz.register_fake
def _newton_schulz_fake(
    x: torch.Tensor,
    a: list[float],
    b: list[float],
    c: list[float],
    eps: float,
    eps_mode: str,
    transpose: bool,
    compute_dtype: torch.dtype,
    out_dtype: torch.dtype,
    algorithm: str,
    restarts: list[int],
    matmul: str,
    blocks: int = 0,
    schedule: str = "",
) -> torch.Tensor:
    if not (len(a) == len(b) == len(c)) or not a:
        raise ValueError("newton_schulz needs one (a, b, c) per iteration")
    if x.dim() not in (2, 3):
        raise ValueError(f"newton_schulz takes [m, n] or [B, m, n], got {tuple(x.shape)}")
    return x.new_empty(x.shape, dtype=out_dtype)
