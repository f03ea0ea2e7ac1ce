"""Triton generator for FP8 (e4m3, per-matrix scale) and MXFP8 (e4m3, 32-wide K blocks) NS products.

One family, ``fp8_gemm``: ``round_out(alpha · deq(Q(L)) @ deq(Q(R)) + beta · C)``
for the three products of a Newton–Schulz iteration (``X Xᵀ``, ``c A·A + b A``,
``B X + a X``). It follows ``precision.emulate.emulated_matmul`` operation by
operation, so under the interpreter the two agree bit for bit:

1. **prologue quantisation**: operands stay bf16/fp32 in memory and are
   quantised as their tiles are loaded — no pass over memory writes fp8 copies.
   ``fp8_e4m3``: ``q = sat(x / s)`` with ``s = amax / 448`` per matrix (1 when
   amax is 0). ``mxfp8_e4m3``: each 32-element block along K gets
   ``s = 2^clamp(floor(log2 amax_block) - 8, -127, 127)`` from the block's own
   amax, computed in the K loop (hence BLOCK_K is a multiple of 32);
2. **K chunks of 32** (emulate.CHUNK_K, one wgmma k-step): each chunk's dot is
   exact, is rounded once to fp32, multiplied by the two MX block scales
   (``(part · s_row) · s_col``) and added to the fp32 accumulator in K order.
   Under the interpreter (``UPCAST``) the chunk dot runs in fp64 on fp32 copies
   of the e4m3 values (32 products of e4m3 values need 41 bits, exact in fp64)
   and the e4m3 rounding is emulated on fp32 bits, because the interpreter's
   fp8 casts and dots are not the hardware's. On GPU the tiles are cast to
   ``tl.float8e4nv`` (RNE, saturating; clamped first) and dotted natively,
   one promoted-to-fp32 partial per chunk (DeepSeek-V3 §3.3.2);
3. **epilogue**: per-matrix scales as ``acc · (s_L · s_R)``, then ``· alpha``,
   then ``+ C · beta``, each rounded to fp32, then once to ``out_dtype``.

Data flow of the per-matrix amax (the scale needs the whole operand's amax, but
computing it would be an extra pass): every launch takes ``l_amax``/``r_amax``
as ``[batch, P]`` fp32 *partials* and reduces them itself (max is exact and
order-free; ``P = 1`` is a precomputed amax). With ``amax_out=True`` a kernel
writes the amax of its own rounded output, one partial per output tile, into
``[batch, amax_tiles(spec)]`` — the next product's ``*_amax`` input. In a
standard NS iteration::

    A  = fp8_gemm(X, Xᵀ;  l_amax=r_amax=amax(X))             -> amax(A) partials
    B  = fp8_gemm(A, A;   C=A, alpha=c, beta=b, amax(A))       -> amax(B) partials
    X' = fp8_gemm(B, X;   C=X, beta=a, amax(B), amax(X))       -> amax(X') partials

so only the first iteration's ``amax(X)`` comes from elsewhere (normalised X
has Frobenius norm 1, but its amax is data-dependent). MXFP8 needs none of this.

MXFP8 on GPU uses the same per-chunk fp8 dot, with the block scales applied to
the fp32 partial (any sm89+ fp8 tensor core; on sm100 it compiles to
``tcgen05.mma``), not Blackwell's ``tl.dot_scaled``, which would apply the
e8m0 scales inside the MMA. Feeding it the in-kernel scales (as uint8
``exp + 127``) looks possible but was not tried: a later, separate speed-up.

Not matched on GPU: the hardware's summation inside one 32-chunk (the exact
sum is rounded to fp32 only if the MMA keeps enough bits). FMA contraction of
the epilogue is prevented (launchers pass ``enable_fp_fusion=False``; Triton
3.9 contracts by default). NaN inputs are not modelled (clamping may drop them).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ...ir import dtypes
from .code import CodeWriter, KernelSource, emit_round
from .tile_code import cast, cdiv, header, lower_grid, lower_tile, store, store_symmetric, wrapped
from .tiles import TileConfig, matmul_tile

FP8_FORMATS = ("fp8_e4m3", "mxfp8_e4m3")
FP8_ARCHS = ("interpret", "sm89", "sm90", "sm100", "sm103")  # arches with e4m3 tensor cores
OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
CHUNK = 32  # emulate.CHUNK_K == emulate.MX_BLOCK
E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
E4M3_EMAX = 8  # exponent of the largest power of two <= 448 (OCP MX v1.0 Table 1)
BLOCK_AMAX = 16  # amax partials reduced per step


@dataclass(frozen=True)
class Fp8GemmSpec:
    """``round_out(alpha deq(Q(L)) @ deq(Q(R)) + beta C)``: L ``[batch, m, k]``, R ``[batch, k, n]`` (any strides).

    ``symmetric``: the product is known symmetric (X Xᵀ, polynomials in A):
    lower-triangle tiles only, each stored twice. ``amax_out``: also write
    per-tile amax partials of the rounded output (module docstring).
    """

    batch: int
    m: int
    n: int
    k: int
    fmt: str
    arch: str
    out_dtype: torch.dtype = torch.bfloat16
    accumulate: bool = False
    symmetric: bool = False
    amax_out: bool = False
    family = "fp8_gemm"

    def __post_init__(self) -> None:
        if self.fmt not in FP8_FORMATS:
            raise ValueError(f"fmt must be one of {FP8_FORMATS}, got {self.fmt!r}")
        if self.arch not in FP8_ARCHS:
            raise ValueError(f"fp8 tensor cores need one of {FP8_ARCHS}, got {self.arch!r}")
        if self.out_dtype not in OUT_DTYPES:
            raise ValueError(f"out_dtype must be one of {OUT_DTYPES}, got {self.out_dtype}")
        if self.symmetric and self.m != self.n:
            raise ValueError(f"a symmetric product must be square, got {self.m}x{self.n}")

    @property
    def per_tensor(self) -> bool:
        return self.fmt == "fp8_e4m3"

    @property
    def name(self) -> str:
        fmt = "fp8e4m3" if self.per_tensor else "mxfp8e4m3"
        flags = ("_acc" if self.accumulate else "") + ("_sym" if self.symmetric else "")
        flags += "_amax" if self.amax_out else ""
        shape = f"b{self.batch}_{self.m}x{self.n}x{self.k}"
        return f"ns_gemm_{fmt}_{shape}{flags}_out_{dtypes.name(self.out_dtype)}"


def fp8_tile(spec: Fp8GemmSpec) -> TileConfig:
    """The matmul table's tile with BLOCK_K rounded up to a multiple of the 32-wide chunk."""
    tile = matmul_tile(spec.arch, torch.bfloat16, spec.name)
    return replace(tile, BLOCK_K=cdiv(tile.BLOCK_K, CHUNK) * CHUNK)


def amax_tiles(spec: Fp8GemmSpec) -> int:
    """How many amax partials per matrix an ``amax_out`` kernel writes (its tiles per matrix)."""
    tile = fp8_tile(spec)
    if spec.symmetric:
        tiles = cdiv(spec.m, tile.BLOCK_M)
        return tiles * (tiles + 1) // 2
    return cdiv(spec.m, tile.BLOCK_M) * cdiv(spec.n, tile.BLOCK_N)


# ---------------------------------------------------------------- line emitters


def emit_round_e4m3(w: CodeWriter, var: str) -> None:
    """Round the fp32 ``var`` to e4m3fn values in place (kept fp32): saturate to ±448, nearest-even.

    Normals (|v| >= 2^-6) keep 3 mantissa bits: add ``0x7FFFF + lsb`` to the
    bits and clear the 20 low ones; the clamp keeps carries at or below 448.
    Subnormals are multiples of 2^-9: adding and subtracting 2^14 (whose fp32
    ulp is 2^-9) rounds to one, nearest-even, exactly as fp32 addition rounds.
    """
    w.line(f"{var} = tl.minimum(tl.maximum({var}, -{E4M3_MAX}), {E4M3_MAX})")
    w.line(f"{var}_sign = {var}.to(tl.uint32, bitcast=True) & 0x80000000")
    w.line(f"{var}_abs = tl.abs({var})")
    w.line(f"{var}_bits = {var}_abs.to(tl.uint32, bitcast=True)")
    w.line(f"{var}_bits = ({var}_bits + 0x7FFFF + (({var}_bits >> 20) & 1)) & 0xFFF00000")
    w.line(f"{var}_sub = ({var}_abs + 16384.0) - 16384.0")
    w.line(f"{var}_abs = tl.where({var}_abs < 0.015625, {var}_sub, {var}_bits.to(tl.float32, bitcast=True))")
    w.line(f"{var} = ({var}_abs.to(tl.uint32, bitcast=True) | {var}_sign).to(tl.float32, bitcast=True)")


def _emit_block_scale(w: CodeWriter, var: str, tile: str, axis: int) -> None:
    """``var`` = e8m0 scale of each 32-block of ``tile`` along ``axis`` (emulate.quantize), and ``var_inv`` = 1/var."""
    w.line(f"{var}_amax = tl.max(tl.abs({tile}), axis={axis})")
    w.line("# floor(log2 amax) from the exponent bits; subnormal (and zero) amax clamp to 2^-127 below anyway")
    w.line(f"{var}_exp = (({var}_amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127 - {E4M3_EMAX}")
    w.line(f"{var}_exp = tl.where({var}_amax > 0, tl.minimum(tl.maximum({var}_exp, -127), 127), -127)")
    w.line(f"{var}_bits = tl.where({var}_exp >= -126, ({var}_exp + 127) << 23, 1 << 22)  # 2^-127 is subnormal")
    w.line(f"{var} = {var}_bits.to(tl.float32, bitcast=True)")
    w.line("# 1 / scale, exact (2^-exp is representable): x * inv rounds as x / scale, without a GPU division")
    w.line(f"{var}_inv_bits = tl.where({var}_exp <= 126, (127 - {var}_exp) << 23, 1 << 22)")
    w.line(f"{var}_inv = {var}_inv_bits.to(tl.float32, bitcast=True)")


def _emit_tensor_scale(w: CodeWriter, var: str, ptr: str, parts: str) -> None:
    """``var`` = per-matrix scale amax / 448 (1 for a zero matrix) from ``[batch, parts]`` amax partials."""
    w.line(f"{var}_amax = tl.zeros((BLOCK_AMAX,), dtype=tl.float32)")
    w.line(f"for p0 in range(0, {parts}, BLOCK_AMAX):")
    with w.indent():
        w.line("offs_p = p0 + tl.arange(0, BLOCK_AMAX)")
        w.line(f"part = tl.load({ptr} + batch * {parts} + offs_p, mask=offs_p < {parts}, other=0.0)")
        w.line(f"{var}_amax = tl.maximum({var}_amax, part)")
    w.line(f"{var}_amax = tl.max({var}_amax, axis=0)")
    w.line(f"{var} = tl.where({var}_amax > 0, tl.math.div_rn({var}_amax, {E4M3_MAX}), 1.0)")


def _load_chunk(
    w: CodeWriter, var: str, base: str, rows: str, cols: str, strides: tuple[str, str], limits: tuple[str, str]
) -> None:
    w.line(f"{var}_mask = ({rows}[:, None] < {limits[0]}) & ({cols}[None, :] < {limits[1]})")
    offs = f"{rows}[:, None] * {strides[0]} + {cols}[None, :] * {strides[1]}"
    w.line(f"{var} = tl.load({base} + {offs}, mask={var}_mask, other=0.0).to(tl.float32)")


def _quantize_chunk(w: CodeWriter, spec: Fp8GemmSpec, var: str, scale: str, axis: int) -> None:
    """Divide the fp32 tile ``var`` by its scale and make it e4m3 (emulated, or a native fp8 tile)."""
    if spec.per_tensor:
        w.line(f"{var} = tl.math.div_rn({var}, {scale})  # true division, as emulate.quantize divides")
    else:
        _emit_block_scale(w, scale, var, axis)
        bcast = f"{scale}_inv[:, None]" if axis == 1 else f"{scale}_inv[None, :]"
        w.line(f"{var} = {var} * {bcast}  # the quotient stays below 2^9 (no overflow)")
    w.line("if UPCAST:")
    with w.indent():
        emit_round_e4m3(w, var)
        w.line(f"{var} = {var}.to(tl.float64)")
    w.line("else:")
    with w.indent():
        w.line(f"{var} = tl.minimum(tl.maximum({var}, -{E4M3_MAX}), {E4M3_MAX}).to(tl.float8e4nv)")


def _chunk_dot(w: CodeWriter, spec: Fp8GemmSpec, block_n: str) -> None:
    w.line("if UPCAST:  # 32 products of e4m3 values sum exactly in fp64; rounded once to fp32, as emulated")
    with w.indent():
        w.line(f"part = tl.dot(left, right, tl.zeros((BLOCK_M, {block_n}), dtype=tl.float64), out_dtype=tl.float64)")
        w.line("part = part.to(tl.float32)")
    w.line("else:  # a fresh fp32 partial per chunk: the promotion of DeepSeek-V3 §3.3.2")
    with w.indent():
        w.line("part = tl.dot(left, right, out_dtype=tl.float32)")
    if not spec.per_tensor:
        w.line("part = part * l_scale[:, None] * r_scale[None, :]")
    w.line("acc = acc + part")


# ---------------------------------------------------------------- generator


def generate_fp8_gemm(spec: Fp8GemmSpec, origin: str) -> KernelSource:
    tile = fp8_tile(spec)
    name, out = spec.name, spec.out_dtype
    w = CodeWriter()
    header(w, name, spec.family, spec, origin, tile)
    args = ["l_ptr", "r_ptr", "out_ptr", "alpha"] + (["c_ptr", "beta"] if spec.accumulate else [])
    args += ["l_amax_ptr", "r_amax_ptr", "L_PARTS", "R_PARTS"] if spec.per_tensor else []
    args += ["amax_out_ptr"] if spec.amax_out else []
    args += ["stride_lb", "stride_lm", "stride_lk", "stride_rb", "stride_rk", "stride_rn"]
    blocks = ["BLOCK_M", "BLOCK_K"] if spec.symmetric else ["BLOCK_M", "BLOCK_N", "BLOCK_K"]
    consts = ["M", "N", "K", *blocks] + (["BLOCK_AMAX"] if spec.per_tensor else [])
    consts += ["AMAX_TILES"] if spec.amax_out else []
    w.line("@triton.jit")
    w.line(f"def {name}(")
    with w.indent():
        wrapped(w, args)
        wrapped(w, [f"{c}: tl.constexpr" for c in consts])
        w.line("UPCAST: tl.constexpr,  # interpreter: e4m3 rounding emulated on fp32 bits, chunk dots in fp64")
    w.line("):")
    with w.indent():
        if spec.symmetric:
            lower_tile(w)
            rows, cols, block_n = "rows_i", "rows_j", "BLOCK_M"
        else:
            w.line("pid = tl.program_id(0)")
            w.line("batch = tl.program_id(1).to(tl.int64)")
            w.line("rows = (pid // tl.cdiv(N, BLOCK_N)) * BLOCK_M + tl.arange(0, BLOCK_M)")
            w.line("cols = (pid % tl.cdiv(N, BLOCK_N)) * BLOCK_N + tl.arange(0, BLOCK_N)")
            rows, cols, block_n = "rows", "cols", "BLOCK_N"
        w.line("l_base = l_ptr + batch * stride_lb")
        w.line("r_base = r_ptr + batch * stride_rb")
        if spec.per_tensor:
            _emit_tensor_scale(w, "l_scale", "l_amax_ptr", "L_PARTS")
            _emit_tensor_scale(w, "r_scale", "r_amax_ptr", "R_PARTS")
        w.line(f"acc = tl.zeros((BLOCK_M, {block_n}), dtype=tl.float32)")
        w.line("for k0 in range(0, K, BLOCK_K):")
        with w.indent():
            w.line(f"for kc in tl.static_range(BLOCK_K // {CHUNK}):  # one emulate.CHUNK_K chunk each")
            with w.indent():
                w.line(f"ks = k0 + kc * {CHUNK} + tl.arange(0, {CHUNK})")
                w.line("# zero padding past K quantises to zero, as emulate pads")
                _load_chunk(w, "left", "l_base", rows, "ks", ("stride_lm", "stride_lk"), ("M", "K"))
                _load_chunk(w, "right", "r_base", "ks", cols, ("stride_rk", "stride_rn"), ("K", "N"))
                _quantize_chunk(w, spec, "left", "l_scale", axis=1)
                _quantize_chunk(w, spec, "right", "r_scale", axis=0)
                _chunk_dot(w, spec, block_n)
        w.line("# epilogue in emulate.emulated_matmul's order, each step rounded to fp32")
        w.line("res = acc * (l_scale * r_scale)" if spec.per_tensor else "res = acc")
        w.line("res = res * alpha")
        w.line("out_offs = batch * (M * N)")
        if spec.accumulate:
            w.line(f"c_mask = ({rows}[:, None] < M) & ({cols}[None, :] < N)")
            w.line(f"c = tl.load(c_ptr + out_offs + {rows}[:, None] * N + {cols}[None, :], mask=c_mask, other=0.0)")
            w.line("res = res + c.to(tl.float32) * beta")
        emit_round(w, "res", out)
        if spec.symmetric:
            store_symmetric(w, "out_ptr + out_offs", "M", "res", out)
            valid = "lower"  # a diagonal tile's upper half is not stored (its mirror is)
        else:
            w.line(f"out_mask = ({rows}[:, None] < M) & ({cols}[None, :] < N)")
            store(w, "out_ptr + out_offs", rows, cols, "N", cast("res", out), "out_mask")
            valid = "out_mask"
        if spec.amax_out:
            w.line("# the next fp8 product's scale: amax of the stored values, one partial per tile")
            w.line(f"tile_amax = tl.max(tl.max(tl.where({valid}, tl.abs(res), 0.0), axis=1), axis=0)")
            w.line("tl.store(amax_out_ptr + batch * AMAX_TILES + pid, tile_amax)")
    w.line()
    w.line()
    _emit_launcher(w, spec, tile)
    return KernelSource(name, spec.family, spec, origin, w.text(), tile.as_dict(), tuple(sorted(w.helpers)))


def _emit_launcher(w: CodeWriter, spec: Fp8GemmSpec, tile: TileConfig) -> None:
    name = spec.name
    b, m, n, k = spec.batch, spec.m, spec.n, spec.k
    if spec.symmetric:
        grid, note = lower_grid(m, b, tile)
    else:
        grid = (cdiv(m, tile.BLOCK_M) * cdiv(n, tile.BLOCK_N), b)
        note = f"{grid[0]} tiles of {tile.BLOCK_M}x{tile.BLOCK_N}, batch {b}"
    params = "L, R, out, alpha, *, upcast, C=None, beta=0.0, l_amax=None, r_amax=None, amax_out=None"
    w.line(f"def launch_{name}({params}):")
    with w.indent():
        w.line(f"assert tuple(L.shape) == ({b}, {m}, {k}) and tuple(R.shape) == ({b}, {k}, {n}), 'operand shapes'")
        w.line(f"assert out.is_contiguous() and tuple(out.shape) == ({b}, {m}, {n}), 'out shape'")
        if spec.accumulate:
            w.line(f"assert C is not None and C.is_contiguous() and tuple(C.shape) == ({b}, {m}, {n}), 'C'")
        else:
            w.line("assert C is None, 'this fp8 gemm kernel does not accumulate'")
        if spec.per_tensor:
            w.line("assert l_amax is not None and r_amax is not None, 'per-tensor fp8 needs amax partials'")
            w.line(f"l_amax, r_amax = l_amax.reshape({b}, -1), r_amax.reshape({b}, -1)  # [batch] or [batch, P]")
        else:
            w.line("assert l_amax is None and r_amax is None, 'mxfp8 scales come from the blocks themselves'")
        if spec.amax_out:
            w.line(f"assert tuple(amax_out.shape) == ({b}, {amax_tiles(spec)}) and amax_out.is_contiguous()")
        else:
            w.line("assert amax_out is None, 'this fp8 gemm kernel writes no amax partials'")
        w.line(f"grid = {grid}  # {note}")
        w.line(f"{name}[grid](")
        with w.indent():
            args = ["L", "R", "out", "alpha"] + (["C", "beta"] if spec.accumulate else [])
            args += ["l_amax", "r_amax", "l_amax.shape[1]", "r_amax.shape[1]"] if spec.per_tensor else []
            args += ["amax_out"] if spec.amax_out else []
            args += ["L.stride(0)", "L.stride(1)", "L.stride(2)", "R.stride(0)", "R.stride(1)", "R.stride(2)"]
            wrapped(w, args)
            consts = [f"M={m}", f"N={n}", f"K={k}", f"BLOCK_M={tile.BLOCK_M}"]
            consts += [] if spec.symmetric else [f"BLOCK_N={tile.BLOCK_N}"]
            consts += [f"BLOCK_K={tile.BLOCK_K}"] + ([f"BLOCK_AMAX={BLOCK_AMAX}"] if spec.per_tensor else [])
            consts += [f"AMAX_TILES={amax_tiles(spec)}"] if spec.amax_out else []
            consts += ["UPCAST=upcast", f"num_warps={tile.num_warps}", f"num_stages={tile.num_stages}"]
            wrapped(w, consts)
            w.line("enable_fp_fusion=False,  # no FMA: the epilogue rounds as emulate does")
        w.line(")")
