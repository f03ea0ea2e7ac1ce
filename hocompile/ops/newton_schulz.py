"""Home of hocompile's built-in custom ops (the ``hocompile::`` torch.library namespace).

Passes rewrite recognised subgraphs into these ops (fuse-newton-schulz makes
``hocompile::newton_schulz``). This module only defines each op: its CPU
kernel and its fake (meta) implementation, so graphs stay traceable. All
else hocompile knows about an op (named arguments, printed line, cost,
batching, fp64 reference, backend lowerings) is its
:class:`~hocompile.ir.registry.OpFamily`, registered in
:mod:`hocompile.ops.newton_schulz_spec`; registering checks this schema against the
family's spec (:func:`hocompile.ir.registry.check_schema`), so the two cannot
drift apart. A new family needs no edit here (see tests/toy_family.py).

Conventions:

- schemas are functional (no aliasing, no mutation), like the graphs;
- structural choices (coefficients, steps, flags) are op arguments, so they
  show in printed graphs and enter the cache key through the graph text;
- hyperparameters never are: they stay host scalars.
"""

from __future__ import annotations

import torch

from ..precision.calibrate import parse_schedule_key
from ..precision.schedule_ns import newton_schulz_scheduled
from . import newton_schulz_math as ns

NAMESPACE = "hocompile"


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

    See :mod:`hocompile.ops.newton_schulz_math` for the maths and rounding model.
    ``transpose`` works on xᵀ (tall matrices become wide) and transposes the
    result back; the output has x's shape and ``out_dtype``. ``blocks`` > 1
    computes symmetric products on lower-triangle blocks only. ``schedule``
    (operand formats per iteration in runs, e.g. ``"fp8_e4m3*2+bf16*3"``)
    replaces ``compute_dtype`` with a per-iteration plan.
    """
    coefficients = list(zip(a, b, c))
    if schedule:
        # A per-iteration precision schedule (choose-precision): each GEMM
        # emulated exactly as the planned tensor-core format computes it.
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
    """Output shape and dtype only. Its parameters repeat the op's schema, which
    NewtonSchulzSpec is checked against when hocompile.ops.newton_schulz_spec registers the family."""
    if not (len(a) == len(b) == len(c)) or not a:
        raise ValueError("newton_schulz needs one (a, b, c) per iteration")
    if x.dim() not in (2, 3):
        raise ValueError(f"newton_schulz takes [m, n] or [B, m, n], got {tuple(x.shape)}")
    if transpose:  # the op iterates on xᵀ and returns its result transposed back: eager's layout too
        return x.new_empty((*x.shape[:-2], x.shape[-1], x.shape[-2]), dtype=out_dtype).mT
    return x.new_empty(x.shape, dtype=out_dtype)
