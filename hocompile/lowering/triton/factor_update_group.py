"""The Triton emitter of ``hocompile::factor_update``: one launch per call (a stack: the whole group).

The kernel computes ``out[b] = lerp(F[b], A[b] A[b]ᵀ, w)`` or
``beta·F[b] + w·A[b] A[b]ᵀ`` with A = G (left) or Gᵀ (right, read through
swapped strides: no transpose copy). The Gram is symmetric, so only
lower-triangle tiles are computed (n(n+1)k instead of 2n²k FLOPs for
tiles of 1) and each is stored twice, as itself and mirrored: the result
is exactly symmetric, where eager's dense ``mm`` may not be. Products
accumulate in fp32 (true fp32 dots, no TF32); the epilogue is fp32 and
rounds once to the factor's dtype. ``lerp`` follows ATen's two-sided
formula (``F + w(P − F)`` for w < 0.5, else ``P − (P − F)(1 − w)``).

Against the CPU op it differs by the dot's summation order (and on the
diagonal tiles, where it mirrors its lower half): within a few fp32 ulps
of the Gram's magnitude (tests/test_factor_triton.py checks that, and the
fp64 reference).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from ...ir import dtypes
from ...ir.registry import register_lowering
from ...ops.factor_update import FACTOR_UPDATE, FactorUpdateSpec
from .call_group import CallNames
from .code import CodeWriter, KernelSource
from .code import emit_round as _round
from .op_groups import BACKEND, GroupCode
from .tile_code import dot, header, launcher, lower_grid, lower_tile, signature, store_symmetric, tile_consts, upcast
from .tiles import matmul_tile

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class FactorUpdateKernelSpec:
    """One factor-update kernel: ``batch`` n×n factors, Grams of rank k, in ``dtype``."""

    batch: int
    n: int
    k: int
    form: str
    dtype: torch.dtype
    arch: str
    family = "factor_update"

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"factor_update kernels take {DTYPES}, got {self.dtype}")
        if self.form not in ("lerp", "addmm"):
            raise ValueError(f"unknown factor_update form {self.form!r}")

    @property
    def name(self) -> str:
        return f"factor_update_{self.form}_{dtypes.name(self.dtype)}_b{self.batch}_{self.n}x{self.k}"


def generate_factor_update(spec: FactorUpdateKernelSpec, origin: str) -> KernelSource:
    tile = matmul_tile(spec.arch, spec.dtype, spec.name)
    name = spec.name
    w = CodeWriter()
    header(w, name, spec.family, spec, origin, tile)
    args = ["f_ptr", "g_ptr", "out_ptr", "w_ptr", "beta_ptr", "sf_b", "sf_r", "sf_c", "sg_b", "sg_r", "sg_c"]
    signature(w, name, args, ["N", "K", "BLOCK_M", "BLOCK_K"])
    with w.indent():
        lower_tile(w)
        w.line("g_base = g_ptr + batch * sg_b")
        w.line("acc = tl.zeros((BLOCK_M, BLOCK_M), dtype=tl.float32)")
        w.line("for k0 in range(0, K, BLOCK_K):")
        with w.indent():
            w.line("ks = k0 + tl.arange(0, BLOCK_K)")
            for var, rows in (("a", "rows_i"), ("b", "rows_j")):
                w.line(f"{var}_mask = ({rows}[:, None] < N) & (ks[None, :] < K)")
                w.line(
                    f"{var} = tl.load(g_base + {rows}[:, None] * sg_r + ks[None, :] * sg_c, mask={var}_mask, other=0.0)"
                )
            upcast(w, ["a", "b"], spec.dtype)
            dot(w, "a", "tl.trans(b)", spec.dtype)
        w.line("# the epilogue reads F's (i, j) tile; the mirrored store makes F's upper half irrelevant")
        w.line("f_mask = (rows_i[:, None] < N) & (rows_j[None, :] < N)")
        w.line("f_offs = batch * sf_b + rows_i[:, None] * sf_r + rows_j[None, :] * sf_c")
        w.line("f = tl.load(f_ptr + f_offs, mask=f_mask, other=0.0).to(tl.float32)")
        w.line("wt = tl.load(w_ptr).to(tl.float32)")
        if spec.form == "lerp":
            w.line("# ATen's lerp: from the nearer end, so w = 1 gives exactly the Gram")
            w.line("res = tl.where(wt < 0.5, f + wt * (acc - f), acc - (acc - f) * (1.0 - wt))")
        else:
            w.line("res = tl.load(beta_ptr).to(tl.float32) * f + wt * acc")
        _round(w, "res", spec.dtype)
        store_symmetric(w, "out_ptr + batch * (N * N)", "N", "res", spec.dtype)
    w.line()
    w.line()
    grid, note = lower_grid(spec.n, spec.batch, tile)
    consts = [f"N={spec.n}", f"K={spec.k}"] + tile_consts(tile, square=True)
    kernel_args = ["F", "A", "out", "weight", "beta", "*sf", "*sa"]
    launcher(
        w,
        name,
        "F, A, out, weight, beta, *, upcast",
        grid,
        note,
        kernel_args,
        consts,
        guard="sf, sa = ((0, *t.stride()) if t.dim() == 2 else t.stride() for t in (F, A))",
    )
    return KernelSource(name, spec.family, spec, origin, w.text(), tile.as_dict(), tuple(sorted(w.helpers)))


class FactorUpdateEmitter:
    """:class:`~.call_group.CallEmitter` for ``factor_update``: one lower-triangle Gram kernel, one launch."""

    def scalars(self, node: fx.Node) -> list[Any]:
        spec: FactorUpdateSpec = FACTOR_UPDATE.spec_of(node)
        return [spec.weight, spec.beta]

    def emit(self, node: fx.Node, names: CallNames) -> GroupCode:
        spec: FactorUpdateSpec = FACTOR_UPDATE.spec_of(node)
        batch, n, k = spec.shape()
        dtype = node.meta["val"].dtype
        kernel = generate_factor_update(
            FactorUpdateKernelSpec(batch, n, k, spec.form, dtype, names.arch), f"fuse-factor-update node {node.name}"
        )
        g = names.inputs["g"]
        # A = G (left) or Gᵀ (right): the transpose is a view, the launcher passes its strides.
        a = g if spec.side == "left" else f"{g}.mT"
        line = (
            f"{kernel.launcher}({names.inputs['factor']}, {a}, {names.out}, {names.scalar(spec.weight)}, "
            f"{names.scalar(spec.beta)}, upcast={names.upcast})"
        )
        summary = f"factor_update {spec.side} {spec.form}: {batch} x {n}x{n} from rank {k}, lower tiles, 1 launch"
        return GroupCode([kernel], [], [line], 1, summary)


register_lowering(FACTOR_UPDATE.op, BACKEND, FactorUpdateEmitter())

__all__ = ["FactorUpdateEmitter", "FactorUpdateKernelSpec", "generate_factor_update"]
