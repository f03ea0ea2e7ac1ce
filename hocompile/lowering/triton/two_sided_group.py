"""The Triton emitter of ``hocompile::two_sided``: two batched GEMM launches per call (a stack: the group).

``A X B`` runs as ``T = A X`` then ``out = T B``, each a strided batched
GEMM (A = leftᵀ or Bᵀ = rightᵀ are read through swapped strides: no
transpose copies), fp32 accumulation with true fp32 dots (no TF32). T is
rounded to X's dtype between the launches, as eager's first ``mm`` rounds
it. Eager's association (``tensordot`` computes ``(Xᵀ Aᵀ)ᵀ``) is the same
product; the kernel's summation order differs from BLAS, so results agree
with the CPU op to fp32 rounding, not bitwise (tests/test_factor_triton.py).
Fusing both products into one kernel (a row block of T kept on chip while
it meets all of B) is the next step where m·n tiles fit in shared memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from ...ir import dtypes
from ...ir.registry import register_lowering
from ...ops.two_sided import TWO_SIDED, TwoSidedSpec
from .call_group import CallNames
from .code import CodeWriter, KernelSource
from .code import emit_round as _round
from .op_groups import BACKEND, Buffer, GroupCode
from .tile_code import cast, cdiv, dot, header, launcher, signature, store, tile_consts, upcast
from .tiles import matmul_tile

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class StridedGemmSpec:
    """``out[b] = round(L[b] @ R[b])``: L ``[batch, m, k]``, R ``[batch, k, n]`` with any strides."""

    batch: int
    m: int
    n: int
    k: int
    dtype: torch.dtype
    arch: str
    family = "two_sided"

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"two_sided kernels take {DTYPES}, got {self.dtype}")

    @property
    def name(self) -> str:
        return f"two_sided_gemm_{dtypes.name(self.dtype)}_b{self.batch}_{self.m}x{self.n}x{self.k}"


def _strided_load(
    w: CodeWriter, var: str, base: str, rows: str, cols: str, strides: tuple[str, str], limits: tuple[str, str]
) -> None:
    w.line(f"{var}_mask = ({rows}[:, None] < {limits[0]}) & ({cols}[None, :] < {limits[1]})")
    offsets = f"{rows}[:, None] * {strides[0]} + {cols}[None, :] * {strides[1]}"
    w.line(f"{var} = tl.load({base} + {offsets}, mask={var}_mask, other=0.0)")


def generate_strided_gemm(spec: StridedGemmSpec, origin: str) -> KernelSource:
    tile = matmul_tile(spec.arch, spec.dtype, spec.name)
    name = spec.name
    w = CodeWriter()
    header(w, name, spec.family, spec, origin, tile)
    args = ["l_ptr", "r_ptr", "out_ptr", "sl_b", "sl_r", "sl_c", "sr_b", "sr_r", "sr_c"]
    signature(w, name, args, ["M", "N", "K", "BLOCK_M", "BLOCK_N", "BLOCK_K"])
    with w.indent():
        w.line("pid = tl.program_id(0)")
        w.line("batch = tl.program_id(1).to(tl.int64)")
        w.line("rows = (pid // tl.cdiv(N, BLOCK_N)) * BLOCK_M + tl.arange(0, BLOCK_M)")
        w.line("cols = (pid % tl.cdiv(N, BLOCK_N)) * BLOCK_N + tl.arange(0, BLOCK_N)")
        w.line("acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)")
        w.line("for k0 in range(0, K, BLOCK_K):")
        with w.indent():
            w.line("ks = k0 + tl.arange(0, BLOCK_K)")
            _strided_load(w, "left", "l_ptr + batch * sl_b", "rows", "ks", ("sl_r", "sl_c"), ("M", "K"))
            _strided_load(w, "right", "r_ptr + batch * sr_b", "ks", "cols", ("sr_r", "sr_c"), ("K", "N"))
            upcast(w, ["left", "right"], spec.dtype)
            dot(w, "left", "right", spec.dtype)
        w.line("res = acc")
        _round(w, "res", spec.dtype)
        w.line("out_mask = (rows[:, None] < M) & (cols[None, :] < N)")
        store(w, "out_ptr + batch * (M * N)", "rows", "cols", "N", cast("res", spec.dtype), "out_mask")
    w.line()
    w.line()
    tiles_m, tiles_n = cdiv(spec.m, tile.BLOCK_M), cdiv(spec.n, tile.BLOCK_N)
    grid = (tiles_m * tiles_n, spec.batch)
    note = f"{tiles_m}x{tiles_n} tiles of {tile.BLOCK_M}x{tile.BLOCK_N}, batch {spec.batch}"
    consts = [f"M={spec.m}", f"N={spec.n}", f"K={spec.k}"] + tile_consts(tile, square=False)
    launcher(
        w,
        name,
        "L, R, out, *, upcast",
        grid,
        note,
        ["L", "R", "out", "*sl", "*sr"],
        consts,
        guard="sl, sr = ((0, *t.stride()) if t.dim() == 2 else t.stride() for t in (L, R))",
    )
    return KernelSource(name, spec.family, spec, origin, w.text(), tile.as_dict(), tuple(sorted(w.helpers)))


class TwoSidedEmitter:
    """:class:`~.call_group.CallEmitter` for ``two_sided``: T = A X, then out = T B; two launches."""

    def scalars(self, node: fx.Node) -> list[Any]:
        return []

    def emit(self, node: fx.Node, names: CallNames) -> GroupCode:
        spec: TwoSidedSpec = TWO_SIDED.spec_of(node)
        batch, m, n = spec.shape()
        dtype = node.meta["val"].dtype
        origin = f"fuse-two-sided node {node.name}"
        first = generate_strided_gemm(StridedGemmSpec(batch, m, n, m, dtype, names.arch), origin)
        second = generate_strided_gemm(StridedGemmSpec(batch, m, n, n, dtype, names.arch), origin)
        left, right = names.inputs["left"], names.inputs["right"]
        a = f"{left}.mT" if spec.left_transposed else left
        b = f"{right}.mT" if spec.right_transposed else right
        tmp = Buffer(f"{names.prefix}ax", tuple(node.meta["val"].shape), dtype)  # A X, rounded as eager's mm
        lines = [
            f"{first.launcher}({a}, {names.inputs['x']}, {tmp.name}, upcast={names.upcast})",
            f"{second.launcher}({tmp.name}, {b}, {names.out}, upcast={names.upcast})",
        ]
        summary = f"two_sided ({spec.association} in eager): {batch} x {m}x{n}, 2 launches"
        return GroupCode([first, second], [tmp], lines, 2, summary)


register_lowering(TWO_SIDED.op, BACKEND, TwoSidedEmitter())

__all__ = ["StridedGemmSpec", "TwoSidedEmitter", "generate_strided_gemm"]
