"""Triton generators for the three matmul families of Newton–Schulz.

- ``gram``: ``A = round(X Xᵀ)``, optionally normalising X on the fly;
- ``sym_poly``: ``round(a I + b A + c A²)`` for symmetric A;
- ``gemm``: ``round(alpha (L @ R) + beta C)``.

Rounding follows ``newton_schulz._Arith`` with ``matmul="emulate"``: every
product and linear combination accumulates in fp32 and is rounded once to
the spec's ``dtype``. Symmetric results compute lower-triangle tiles only and
store each tile twice (as itself and mirrored), which halves the work.

Matrices are batched, contiguous and row-major (``[batch, rows, cols]``);
shapes are baked into each kernel (its name carries them), so masks handle
sizes that are not tile multiples and the launcher grid is a constant.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...ir import dtypes
from ...ops.newton_schulz_math import EPS_MODES
from .code import TL_DTYPE, CodeWriter, KernelSource
from .code import emit_round as _round
from .tile_code import (
    cast,
    cdiv,
    dot,
    header,
    launcher,
    load,
    lower_grid,
    lower_tile,
    requantize,
    signature,
    store,
    store_symmetric,
    tile_consts,
    upcast,
)
from .tiles import matmul_tile

COMPUTE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BLOCK_P = 32  # partial sums of squares summed per step when normalising


def _check_dtype(dtype: torch.dtype, what: str) -> None:
    if dtype not in COMPUTE_DTYPES:
        raise ValueError(f"{what} must be one of {COMPUTE_DTYPES}, got {dtype}")


@dataclass(frozen=True)
class GramSpec:
    """``A[b] = round(X0[b] X0[b]ᵀ)``; X is ``[batch, m, k]``, A ``[batch, m, m]``."""

    batch: int
    m: int
    k: int
    dtype: torch.dtype
    arch: str
    normalize: bool = False
    eps_mode: str = "clamp"
    # X is stored in another dtype (a scheduled NS's previous iteration): rounded to ``dtype`` as loaded
    in_dtype: torch.dtype | None = None
    family = "gram"

    def __post_init__(self) -> None:
        _check_dtype(self.dtype, "dtype")
        if self.eps_mode not in EPS_MODES:
            raise ValueError(f"eps_mode must be one of {EPS_MODES}, got {self.eps_mode!r}")
        if self.in_dtype is not None:
            _check_dtype(self.in_dtype, "in_dtype")
            if self.normalize:
                raise ValueError("a normalising gram kernel reads X in its own dtype")
        if self.in_dtype == self.dtype:  # one spec (and one name) per kernel
            object.__setattr__(self, "in_dtype", None)

    @property
    def name(self) -> str:
        norm = f"_norm_{self.eps_mode}" if self.normalize else ""
        src = f"_from_{dtypes.name(self.in_dtype)}" if self.in_dtype is not None else ""
        return f"ns_gram_{dtypes.name(self.dtype)}_b{self.batch}_{self.m}x{self.k}{norm}{src}"


@dataclass(frozen=True)
class SymPolySpec:
    """``round(a I + b A + c A²)`` for symmetric ``A`` ``[batch, m, m]``; ``cubic`` drops ``A²``."""

    batch: int
    m: int
    dtype: torch.dtype
    arch: str
    cubic: bool = False
    family = "sym_poly"

    def __post_init__(self) -> None:
        _check_dtype(self.dtype, "dtype")

    @property
    def name(self) -> str:
        cubic = "_cubic" if self.cubic else ""
        return f"ns_sym_poly_{dtypes.name(self.dtype)}_b{self.batch}_{self.m}x{self.m}{cubic}"


@dataclass(frozen=True)
class GemmSpec:
    """``round(alpha (L @ R) + beta C)``: L ``[batch, m, k]``, R ``[batch, k, n]``, C ``[batch, m, n]``."""

    batch: int
    m: int
    n: int
    k: int
    dtype: torch.dtype
    arch: str
    out_dtype: torch.dtype | None = None  # None: the compute dtype
    accumulate: bool = False
    symmetric: bool = False  # the product is known symmetric: lower tiles only
    # R (and C) stored in another dtype (a scheduled NS's previous iterate): R rounded to ``dtype``
    # as loaded, C read as is (an epilogue input is not a tensor-core operand)
    r_dtype: torch.dtype | None = None
    family = "gemm"

    def __post_init__(self) -> None:
        _check_dtype(self.dtype, "dtype")
        _check_dtype(self.stored_dtype, "out_dtype")
        if self.out_dtype == self.dtype:  # one spec (and one name) per kernel
            object.__setattr__(self, "out_dtype", None)
        if self.r_dtype is not None:
            _check_dtype(self.r_dtype, "r_dtype")
        if self.r_dtype == self.dtype:
            object.__setattr__(self, "r_dtype", None)
        if self.symmetric and self.m != self.n:
            raise ValueError(f"a symmetric gemm must be square, got {self.m}x{self.n}")

    @property
    def stored_dtype(self) -> torch.dtype:
        return self.out_dtype or self.dtype

    @property
    def name(self) -> str:
        flags = ("_acc" if self.accumulate else "") + ("_sym" if self.symmetric else "")
        out = f"_out_{dtypes.name(self.stored_dtype)}" if self.stored_dtype != self.dtype else ""
        src = f"_r_{dtypes.name(self.r_dtype)}" if self.r_dtype is not None else ""
        return f"ns_gemm_{dtypes.name(self.dtype)}_b{self.batch}_{self.m}x{self.n}x{self.k}{flags}{src}{out}"


# ---------------------------------------------------------------- line emitters


def generate_gram(spec: GramSpec, origin: str) -> KernelSource:
    tile = matmul_tile(spec.arch, spec.dtype, spec.name)
    name, dtype = spec.name, spec.dtype
    w = CodeWriter()
    header(w, name, spec.family, spec, origin, tile)
    args = ["x_ptr", "out_ptr"] + (["x0_ptr", "partials_ptr", "P", "eps_ptr"] if spec.normalize else [])
    consts = ["M", "K", "BLOCK_M", "BLOCK_K"] + (["BLOCK_P"] if spec.normalize else [])
    signature(w, name, args, consts)
    with w.indent():
        lower_tile(w)
        w.line("x_base = x_ptr + batch * (M * K)")
        if spec.normalize:
            gram_denominator(w, spec)
            w.line("x0_base = x0_ptr + batch * (M * K)")
        w.line("acc = tl.zeros((BLOCK_M, BLOCK_M), dtype=tl.float32)")
        w.line("for k0 in range(0, K, BLOCK_K):")
        with w.indent():
            w.line("ks = k0 + tl.arange(0, BLOCK_K)")
            for side in ("i", "j"):
                load(w, f"x_{side}", "x_base", f"rows_{side}", "ks", "K", ("M", "K"))
                if spec.normalize:
                    _gram_normalize_tile(w, side, dtype)
                else:
                    requantize(w, f"x_{side}", spec.in_dtype, dtype)
                    upcast(w, [f"x_{side}"], dtype)
            dot(w, "x_i", "tl.trans(x_j)", dtype)
        _round(w, "acc", dtype)
        w.line("out_base = out_ptr + batch * (M * M)")
        store_symmetric(w, "out_base", "M", "acc", dtype)
    w.line()
    w.line()
    grid, note = lower_grid(spec.m, spec.batch, tile)
    params = "x, out, *, upcast, x0=None, partials=None, eps=None"
    if spec.normalize:
        args = ["x", "out", "x0", "partials", "partials.shape[1]", "eps"]
        consts = [f"M={spec.m}", f"K={spec.k}"] + tile_consts(tile, square=True, extra=(f"BLOCK_P={BLOCK_P}",))
        launcher(w, name, params, grid, note, args, consts)
    else:
        consts = [f"M={spec.m}", f"K={spec.k}"] + tile_consts(tile, square=True)
        # One launcher signature for both variants, but a caller expecting a
        # normalisation this kernel does not do fails loudly.
        guard = "assert x0 is None and partials is None and eps is None, 'this gram kernel does not normalise'"
        launcher(w, name, params, grid, note, ["x", "out"], consts, guard)
    return KernelSource(name, spec.family, spec, origin, w.text(), tile.as_dict(), tuple(sorted(w.helpers)))


def gram_denominator(w: CodeWriter, spec: GramSpec) -> None:
    """``denom`` as newton_schulz.normalize rounds it: norm and denominator each rounded to dtype."""
    w.line("sumsq = tl.zeros((BLOCK_P,), dtype=tl.float32)")
    w.line("for p0 in range(0, P, BLOCK_P):")
    with w.indent():
        w.line("offs_p = p0 + tl.arange(0, BLOCK_P)")
        w.line("sumsq += tl.load(partials_ptr + batch * P + offs_p, mask=offs_p < P, other=0.0)")
    w.line("norm = tl.sqrt_rn(tl.sum(sumsq, axis=0))")
    _round(w, "norm", spec.dtype)
    w.line("eps = tl.load(eps_ptr)  # a device scalar, so CUDA-graph replay sees its current value")
    if spec.eps_mode == "clamp":
        w.line("denom = tl.where(norm < eps, eps, norm)  # max(norm, eps) that keeps a NaN norm, as clamp does")
    else:
        w.line("denom = norm + eps")
    _round(w, "denom", spec.dtype)


def _gram_normalize_tile(w: CodeWriter, side: str, dtype: torch.dtype) -> None:
    var = f"x_{side}"
    w.line(f"{var} = tl.math.div_rn({var}.to(tl.float32), denom)  # true division, as eager divides")
    _round(w, var, dtype)
    if side == "i":
        w.line("# X0 for the next kernels: each block row has one diagonal tile, whose program writes it")
        w.line("if pid_i == pid_j:")
        with w.indent():
            store(w, "x0_base", "rows_i", "ks", "K", cast(var, dtype), "x_i_mask")
    if dtype != torch.float32:
        w.line("if not UPCAST:")
        with w.indent():
            w.line(f"{var} = {var}.to({TL_DTYPE[dtype]})")


# ---------------------------------------------------------------- sym_poly


def generate_sym_poly(spec: SymPolySpec, origin: str) -> KernelSource:
    tile = matmul_tile(spec.arch, spec.dtype, spec.name)
    name, dtype = spec.name, spec.dtype
    w = CodeWriter()
    header(w, name, spec.family, spec, origin, tile)
    signature(w, name, ["a_ptr", "out_ptr", "a", "b", "c"], ["M", "BLOCK_M", "BLOCK_K"])
    with w.indent():
        w.line("# a, b, c are runtime arguments: one compiled kernel serves every iteration")
        lower_tile(w)
        w.line("a_base = a_ptr + batch * (M * M)")
        if not spec.cubic:
            w.line("acc = tl.zeros((BLOCK_M, BLOCK_M), dtype=tl.float32)")
            w.line("for k0 in range(0, M, BLOCK_K):")
            with w.indent():
                w.line("ks = k0 + tl.arange(0, BLOCK_K)")
                load(w, "left", "a_base", "rows_i", "ks", "M", ("M", "M"))
                load(w, "right", "a_base", "ks", "rows_j", "M", ("M", "M"))
                upcast(w, ["left", "right"], dtype)
                dot(w, "left", "right", dtype)
        load(w, "tile", "a_base", "rows_i", "rows_j", "M", ("M", "M"))
        w.line("# the order of newton_schulz._gram: (b A + a I) + c A^2, one rounding at the end")
        w.line("res = b * tile.to(tl.float32) + tl.where(rows_i[:, None] == rows_j[None, :], a, 0.0)")
        if not spec.cubic:
            w.line("res = res + c * acc")
        _round(w, "res", dtype)
        w.line("out_base = out_ptr + batch * (M * M)")
        store_symmetric(w, "out_base", "M", "res", dtype)
    w.line()
    w.line()
    grid, note = lower_grid(spec.m, spec.batch, tile)
    consts = [f"M={spec.m}"] + tile_consts(tile, square=True)
    launcher(w, name, "A, out, a, b, c, *, upcast", grid, note, ["A", "out", "a", "b", "c"], consts)
    return KernelSource(name, spec.family, spec, origin, w.text(), tile.as_dict(), tuple(sorted(w.helpers)))


# ---------------------------------------------------------------- gemm


def generate_gemm(spec: GemmSpec, origin: str) -> KernelSource:
    tile = matmul_tile(spec.arch, spec.dtype, spec.name)
    name, dtype, stored = spec.name, spec.dtype, spec.stored_dtype
    w = CodeWriter()
    header(w, name, spec.family, spec, origin, tile)
    args = ["l_ptr", "r_ptr", "out_ptr", "alpha"] + (["c_ptr", "beta"] if spec.accumulate else [])
    # symmetric tiles are square: BLOCK_M serves as BLOCK_N
    blocks = ["BLOCK_M", "BLOCK_K"] if spec.symmetric else ["BLOCK_M", "BLOCK_N", "BLOCK_K"]
    signature(w, name, args, ["M", "N", "K"] + blocks)
    with w.indent():
        if spec.symmetric:
            lower_tile(w)
            rows, cols, block_n_name = "rows_i", "rows_j", "BLOCK_M"
        else:
            w.line("pid = tl.program_id(0)")
            w.line("batch = tl.program_id(1).to(tl.int64)")
            w.line("pid_m = pid // tl.cdiv(N, BLOCK_N)")
            w.line("pid_n = pid % tl.cdiv(N, BLOCK_N)")
            w.line("rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)")
            w.line("cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)")
            rows, cols, block_n_name = "rows", "cols", "BLOCK_N"
        w.line("l_base = l_ptr + batch * (M * K)")
        w.line("r_base = r_ptr + batch * (K * N)")
        w.line(f"acc = tl.zeros((BLOCK_M, {block_n_name}), dtype=tl.float32)")
        w.line("for k0 in range(0, K, BLOCK_K):")
        with w.indent():
            w.line("ks = k0 + tl.arange(0, BLOCK_K)")
            load(w, "left", "l_base", rows, "ks", "K", ("M", "K"))
            load(w, "right", "r_base", "ks", cols, "N", ("K", "N"))
            requantize(w, "right", spec.r_dtype, dtype)
            upcast(w, ["left", "right"], dtype)
            dot(w, "left", "right", dtype)
        w.line("res = alpha * acc")
        w.line("out_offs = batch * (M * N)")
        if spec.accumulate:
            load(w, "c", "c_ptr + out_offs", rows, cols, "N", ("M", "N"))
            w.line("res = res + beta * c.to(tl.float32)")
        _round(w, "res", dtype)
        if stored != dtype:
            w.line("# rounded to the compute dtype first, then converted, as eager's final .to(out_dtype)")
            _round(w, "res", stored)
        if spec.symmetric:
            store_symmetric(w, "out_ptr + out_offs", "M", "res", stored)
        else:
            w.line(f"out_mask = ({rows}[:, None] < M) & ({cols}[None, :] < N)")
            store(w, "out_ptr + out_offs", rows, cols, "N", cast("res", stored), "out_mask")
    w.line()
    w.line()
    if spec.symmetric:
        grid, note = lower_grid(spec.m, spec.batch, tile)
    else:
        tiles_m, tiles_n = cdiv(spec.m, tile.BLOCK_M), cdiv(spec.n, tile.BLOCK_N)
        grid = (tiles_m * tiles_n, spec.batch)
        note = f"{tiles_m}x{tiles_n} tiles of {tile.BLOCK_M}x{tile.BLOCK_N}, batch {spec.batch}"
    consts = [f"M={spec.m}", f"N={spec.n}", f"K={spec.k}"] + tile_consts(tile, square=spec.symmetric)
    args = ["L", "R", "out", "alpha"] + (["C", "beta"] if spec.accumulate else [])
    guard = None if spec.accumulate else "assert C is None, 'this gemm kernel does not accumulate'"
    launcher(w, name, "L, R, out, alpha, *, upcast, C=None, beta=0.0", grid, note, args, consts, guard)
    return KernelSource(name, spec.family, spec, origin, w.text(), tile.as_dict(), tuple(sorted(w.helpers)))
