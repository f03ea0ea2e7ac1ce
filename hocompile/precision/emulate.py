"""Exact CPU emulation of the compute formats a GPU tensor core offers.

One GEMM ``C = alpha * (A @ B) + beta * C0`` in format ``fmt`` runs as:

1. **operands** are quantised the way the hardware sees them (:func:`quantize`):
   tf32 keeps 10 mantissa bits, bf16/fp16 are casts, FP8 divides by a per-matrix
   scale, MXFP8 by a power-of-two scale per block of 32 elements along K;
2. **products are exact**: quantised values have at most 11 significant bits
   (tf32), so every product fits fp32 (and fp64) without rounding;
3. **accumulation is fp32**, in one of two orders:

   - fp32 / tf32 / bf16 / fp16: torch's fp32 GEMM (BLAS order) on the
     dequantised operands — the same call ``hocompile.ops.newton_schulz_math._Arith``
     makes for ``matmul="emulate"``, so results agree with it bit for bit;
   - FP8 and MXFP8: K is split into chunks of 32 (:data:`CHUNK_K`); each
     chunk's dot product is summed exactly and rounded once to fp32, MX chunks
     are multiplied by their two block scales, and chunks are added to an fp32
     accumulator in K order. This fixes the rounding order independently of
     BLAS and thread count, which is what makes bit-exact tests possible.
     Exactness of a chunk sum (computed in fp64): e4m3 values are multiples of
     2^-9 below 2^9, so 32 products are multiples of 2^-18 below 2^23 — 41
     bits, always exact. e5m2 values span 2^-16..2^16; a chunk mixing
     subnormals with near-maximal values can exceed fp64's 53 bits, and then
     one fp64 rounding precedes the fp32 one (the tests' operands, which mix
     subnormals with the maximum, still match an exactly rounded reference);

4. **scales**: per-tensor FP8 scales multiply the fp32 accumulator in the
   epilogue (``acc * (sa * sb)``, as cuBLASLt's scaleA/scaleB); MX block
   scales are applied per chunk inside the K loop (step 3);
5. **epilogue**: ``alpha * acc + beta * C0`` in fp32, rounded once to
   ``out_dtype``.

Caveat: Hopper's FP8 tensor cores accumulate with about 14 bits inside an
MMA sequence unless the kernel promotes partial sums to fp32 registers
(DeepSeek-V3 technical report, §3.3.2); this emulation is the promoted (fp32)
accumulation, so a kernel using "fast accumulation" is less accurate than
emulated. TF32 is modelled with round-to-nearest-even operand conversion, as
PyTorch documents; kernels feeding raw fp32 bits to the tensor core truncate
instead.

"Per tensor" means per matrix: a batched input ``[B, m, k]`` gets one scale
per matrix, as a grouped GEMM takes one scale per problem.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# OCP Microscaling Formats (MX) v1.0 spec, §5: every concrete MX format has a
# block of k = 32 elements sharing one E8M0 scale.
MX_BLOCK = 32
# K of one FP8 MMA instruction (PTX ISA: wgmma .e4m3/.e5m2 shape m64nNk32;
# Blackwell tcgen05.mma kind::f8f6f4 also steps K by 32): the granularity at
# which the FP8 emulation rounds partial sums to fp32.
CHUNK_K = 32
# OCP MX v1.0 §5.4.1: E8M0 encodes exponents -127..127 (255 is NaN).
E8M0_MIN_EXP, E8M0_MAX_EXP = -127, 127
# NVIDIA A100 whitepaper: TF32 has fp32's 8 exponent bits and 10 mantissa bits.
TF32_DROPPED_BITS = 23 - 10
# Bound on the fp64 block-product buffer of one chunked GEMM (memory, not maths).
_CHUNK_BUFFER_BYTES = 64 * 2**20


class FormatKind(enum.Enum):
    """How a format's operands are rounded before the exact product."""

    FLOAT = "float"  # a cast to the storage dtype
    TF32 = "tf32"  # fp32 with 10 mantissa bits kept
    FP8 = "fp8"  # one per-tensor scale, then an fp8 cast
    MX = "mx"  # power-of-two scales per 32-element block, then an fp8 cast


@dataclass(frozen=True)
class Format:
    """One tensor-core compute format.

    ``storage`` is where an NS iterate lives between iterations in this format
    (FP8 is only a GEMM operand format: the iterate stays bf16).
    """

    name: str  # the dtype's name in hocompile.ir.dtypes where it is one ("bf16", "fp8_e4m3")
    kind: FormatKind
    storage: torch.dtype
    element: torch.dtype | None = None  # the fp8 dtype of fp8/mx operands

    @property
    def max(self) -> float:
        assert self.element is not None
        return float(torch.finfo(self.element).max)

    @property
    def emax(self) -> int:
        """Exponent of the largest power of two ≤ max (OCP MX v1.0 Table 1: 8 for E4M3, 15 for E5M2)."""
        return math.frexp(self.max)[1] - 1


FORMATS: dict[str, Format] = {
    f.name: f
    for f in (
        Format("fp32", FormatKind.FLOAT, torch.float32),
        Format("tf32", FormatKind.TF32, torch.float32),
        Format("bf16", FormatKind.FLOAT, torch.bfloat16),
        Format("fp16", FormatKind.FLOAT, torch.float16),
        Format("fp8_e4m3", FormatKind.FP8, torch.bfloat16, torch.float8_e4m3fn),
        Format("fp8_e5m2", FormatKind.FP8, torch.bfloat16, torch.float8_e5m2),
        Format("mxfp8_e4m3", FormatKind.MX, torch.bfloat16, torch.float8_e4m3fn),
        Format("mxfp8_e5m2", FormatKind.MX, torch.bfloat16, torch.float8_e5m2),
    )
}


def _format(fmt: str) -> Format:
    if fmt not in FORMATS:
        raise ValueError(f"unknown compute format {fmt!r}; known: {sorted(FORMATS)}")
    return FORMATS[fmt]


def round_tf32(x: torch.Tensor) -> torch.Tensor:
    """Round fp32 to 10 mantissa bits, nearest-even, keeping fp32 storage.

    Adding ``0x0FFF + lsb`` to the bit pattern and clearing the 13 low bits is
    round-half-to-even on the magnitude (the sign bit never changes); a carry
    out of the mantissa bumps the exponent, which is right, up to fp32 max →
    inf. NaN is passed through (its payload could otherwise round to inf).
    """
    x = x.to(torch.float32)
    bits = x.view(torch.int32)
    lsb = (bits >> TF32_DROPPED_BITS) & 1
    half = (1 << (TF32_DROPPED_BITS - 1)) - 1
    rounded = ((bits + half + lsb) & ~((1 << TF32_DROPPED_BITS) - 1)).view(torch.float32)
    return torch.where(torch.isnan(x), x, rounded)


def _pow2(exp: torch.Tensor) -> torch.Tensor:
    """Exact fp32 2**exp for integer exp in [-127, 127] (2^-127 is subnormal), built from bits."""
    exp = exp.to(torch.int32)
    normal = (exp + 127) << 23
    subnormal = torch.ones_like(exp) << (exp + 149).clamp(min=0)
    return torch.where(exp >= -126, normal, subnormal).view(torch.float32)


def _saturating_cast(x: torch.Tensor, f: Format) -> torch.Tensor:
    """Round to the fp8 element type, nearest-even, clamping to ±max (e4m3fn has no inf: overflow would be NaN)."""
    assert f.element is not None
    return x.clamp(-f.max, f.max).to(f.element)


def quantize(x: torch.Tensor, fmt: str, *, axis: int = -1) -> tuple[torch.Tensor, torch.Tensor | None]:
    """How the hardware sees an fp32 GEMM operand: ``(q, scale)`` with x ≈ q * scale.

    - fp32: ``(x, None)``; tf32: nearest-even to 10 mantissa bits, fp32 storage;
      bf16/fp16: the torch cast (nearest-even). No scale.
    - fp8_*: per-matrix scale ``amax / max`` (Transformer Engine's current
      scaling; ``scale = 1`` for an all-zero matrix), ``q = x / scale`` cast
      with saturation; scale has shape ``[..., 1, 1]``.
    - mxfp8_*: blocks of 32 consecutive elements along ``axis`` (the GEMM's K),
      zero-padded at the end; each block's scale is
      ``2^(floor(log2(amax_block)) - emax)`` clamped to E8M0's range, 2^-127 for
      an all-zero block; scale has x's shape with ``axis`` of length
      ``ceil(K / 32)``. q has x's shape (padding removed).
    """
    f = _format(fmt)
    x = x.to(torch.float32)
    if f.kind is FormatKind.FLOAT:
        return (x if f.storage == torch.float32 else x.to(f.storage)), None
    if f.kind is FormatKind.TF32:
        return round_tf32(x), None
    if f.kind is FormatKind.FP8:
        if x.dim() < 2:
            raise ValueError(f"fp8 per-matrix scaling needs a matrix, got shape {tuple(x.shape)}")
        amax = x.abs().amax(dim=(-2, -1), keepdim=True)
        scale = torch.where(amax > 0, amax / f.max, torch.ones_like(amax))
        return _saturating_cast(x / scale, f), scale
    xm = x.movedim(axis, -1)
    k = xm.shape[-1]
    padded = F.pad(xm, (0, -k % MX_BLOCK))
    blocks = padded.reshape(*padded.shape[:-1], -1, MX_BLOCK)
    amax = blocks.abs().amax(dim=-1)
    # frexp: amax = mantissa * 2^e with mantissa in [0.5, 1), so floor(log2(amax)) = e - 1, exactly.
    exp = (torch.frexp(amax).exponent - 1 - f.emax).clamp(E8M0_MIN_EXP, E8M0_MAX_EXP)
    exp = torch.where(amax > 0, exp, torch.full_like(exp, E8M0_MIN_EXP))
    scale = _pow2(exp)
    q = _saturating_cast(blocks / scale.unsqueeze(-1), f).reshape(padded.shape)[..., :k]
    return q.movedim(-1, axis), scale.movedim(-1, axis)


def emulated_matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    fmt: str,
    out_dtype: torch.dtype = torch.float32,
    *,
    c: torch.Tensor | None = None,
    alpha: float = 1.0,
    beta: float = 1.0,
) -> torch.Tensor:
    """``alpha * (a @ b) + beta * c`` as a tensor core in ``fmt`` computes it (module docstring).

    ``a`` is [..., m, k] (quantised along k, its rows), ``b`` [..., k, n]
    (quantised along k, its columns); ``c`` is the epilogue input, read as is
    (not quantised). The result is rounded once to ``out_dtype``.
    """
    f = _format(fmt)
    if f.kind in (FormatKind.FLOAT, FormatKind.TF32):
        return _blas_matmul(a, b, f, c, alpha, beta).to(out_dtype)
    qa, sa = quantize(a, fmt, axis=-1)
    assert sa is not None
    sb: torch.Tensor | None
    if _is_transpose_of(b, a):
        # X @ Xᵀ: both operands are blocked along the same K, so B's quantisation is A's, transposed.
        qb, sb = qa.mT, (sa if f.kind is FormatKind.FP8 else sa.mT)
    elif b is a and f.kind is FormatKind.FP8:
        qb, sb = qa, sa  # A @ A with one per-matrix scale: the same quantisation
    else:
        qb, sb = quantize(b, fmt, axis=-2)
    assert sb is not None
    if f.kind is FormatKind.MX:
        acc = _chunked_dot(qa, qb, sa, sb)
    else:
        acc = _chunked_dot(qa, qb, None, None) * (sa * sb)
    if alpha != 1.0:
        acc = acc * alpha
    if c is not None:
        # Two fp32 roundings, kept as separate ops so no FMA contraction changes the bits.
        acc = acc + c.to(torch.float32) * beta
    return acc.to(out_dtype)


def _is_transpose_of(b: torch.Tensor, a: torch.Tensor) -> bool:
    return (
        b.dtype == a.dtype and b.data_ptr() == a.data_ptr() and b.shape == a.mT.shape
        and b.stride() == a.mT.stride()
    )


def _dequantize_float(q: torch.Tensor) -> torch.Tensor:
    # .to() preserves strides, so a transposed view stays a transposed view and
    # BLAS is called exactly as _Arith calls it (same bits).
    return q.to(torch.float32)


def _blas_matmul(
    a: torch.Tensor, b: torch.Tensor, f: Format, c: torch.Tensor | None, alpha: float, beta: float
) -> torch.Tensor:
    qa = _dequantize_float(quantize(a, f.name)[0])
    qb = _dequantize_float(quantize(b, f.name)[0])
    if c is None:
        prod = qa @ qb
        return prod if alpha == 1.0 else prod * alpha
    c = c.to(torch.float32)
    if qa.dim() == 3:
        return torch.baddbmm(c, qa, qb, beta=beta, alpha=alpha)
    return torch.addmm(c, qa, qb, beta=beta, alpha=alpha)


def _chunked_dot(
    qa: torch.Tensor, qb: torch.Tensor, sa: torch.Tensor | None, sb: torch.Tensor | None
) -> torch.Tensor:
    """fp32 accumulation over K-chunks of 32 whose dot products are exact (module docstring, step 3).

    ``sa`` [..., m, nblk] and ``sb`` [..., nblk, n] are MX block scales or None.
    """
    k = qa.shape[-1]
    if qb.shape[-2] != k:
        raise ValueError(f"inner dimensions differ: {tuple(qa.shape)} @ {tuple(qb.shape)}")
    pad = -k % CHUNK_K
    a64 = F.pad(qa.to(torch.float64), (0, pad))
    b64 = F.pad(qb.to(torch.float64), (0, 0, 0, pad))
    nblk = (k + pad) // CHUNK_K
    m, n = a64.shape[-2], b64.shape[-1]
    a_chunks = a64.reshape(*a64.shape[:-1], nblk, CHUNK_K).movedim(-2, -3)  # [..., nblk, m, 32]
    b_chunks = b64.reshape(*b64.shape[:-2], nblk, CHUNK_K, n)  # [..., nblk, 32, n]
    batch = math.prod(torch.broadcast_shapes(a64.shape[:-2], b64.shape[:-2]))
    group = max(1, _CHUNK_BUFFER_BYTES // max(1, 8 * m * n * batch))
    acc: torch.Tensor | None = None
    for start in range(0, nblk, group):
        stop = min(start + group, nblk)
        part = (a_chunks[..., start:stop, :, :] @ b_chunks[..., start:stop, :, :]).to(torch.float32)
        if sa is not None and sb is not None:
            part = part * sa[..., start:stop].movedim(-1, -2).unsqueeze(-1) * sb[..., start:stop, :].unsqueeze(-2)
        for j in range(stop - start):
            acc = part[..., j, :, :] if acc is None else acc + part[..., j, :, :]
    if acc is None:  # k == 0
        shape = torch.broadcast_shapes(a64.shape[:-2], b64.shape[:-2]) + (m, n)
        return torch.zeros(shape, dtype=torch.float32, device=qa.device)
    return acc
