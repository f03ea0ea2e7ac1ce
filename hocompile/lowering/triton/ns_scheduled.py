"""A standard Newton–Schulz with one compute format per iteration (a choose-precision schedule).

:func:`emit_newton_schulz_scheduled` follows
``precision.schedule_ns.newton_schulz_scheduled`` product by product:

- **normalisation** in fp32 (``ns_scale`` kernel: ``X0 = x / max(‖x‖, eps)``
  from the pre-kernel's partial sums of squares, nothing rounded below fp32),
  which also writes the amax partials of X0 when iteration 1 is per-tensor FP8;
- **iteration k** in ``schedule[k]``, 3 launches:

  - fp32 / bf16 / fp16: the gram, sym_poly and gemm kernels of that dtype
    (matmul_kernels.py); operands stored in another dtype (X0 in fp32, an
    FP8 iteration's bf16 iterate) are rounded to the format as they load
    (``GramSpec.in_dtype``, ``GemmSpec.r_dtype``), the epilogue's ``a X``
    reads X as stored, as ``emulated_matmul`` reads ``c``;
  - fp8_e4m3 / mxfp8_e4m3: three ``fp8_gemm`` launches (fp8_kernels.py),
    ``A = X Xᵀ``, ``B = c A² + b A``, ``X' = B X + a X``, each per-tensor
    kernel writing its output's amax partials for the next product's scale.
    An FP8 iteration that follows a non-FP8 one (or MXFP8, which writes no
    amax) gets X's amax from one ``ns_scale`` launch (amax only);

- **iterates** stored in the format's storage dtype (``emulate.FORMATS``:
  bf16 for FP8); the last iteration writes ``out`` (rounded to the storage
  dtype first, then to ``out_dtype``, as ``finish`` does).

Launches: 1 + 3 per iteration + 1 per switch into per-tensor FP8 from a
format that leaves no amax (+ 1 copy when an FP8 last iteration must be
converted to an out_dtype other than bf16: the reference rounds to bf16 and
then converts, a double rounding the fp8 kernel's single one does not do).

Not supported (NotImplementedError): Gram NS, tf32 and e5m2 formats (no
kernels), and FP8 iterations of cubic coefficient sets (``c = 0``: the
reference stores ``b A`` without a product, which would need its own amax).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ...ir import dtypes
from ...precision.emulate import FORMATS
from .code import CodeWriter, KernelSource
from .fp8_kernels import FP8_ARCHS, FP8_FORMATS, Fp8GemmSpec, amax_tiles, generate_fp8_gemm
from .matmul_kernels import BLOCK_P, GemmSpec, GramSpec, SymPolySpec, gram_denominator
from .ns_kernels import KernelSet, NSCall, NSLaunches, Temporaries

# Formats the scheduled kernels run natively as a storage dtype (names from hocompile.ir.dtypes).
FLOAT_FORMATS = frozenset({"fp32", "bf16", "fp16"})
SCALE_BLOCK = {"interpret": 256}  # elements per ns_scale program (the interpreter is slow per program)
DEFAULT_SCALE_BLOCK = 1024


def schedule_formats(arch: str) -> frozenset[str]:
    """The formats this backend has NS kernels for on ``arch``."""
    return FLOAT_FORMATS | (frozenset(FP8_FORMATS) if arch in FP8_ARCHS else frozenset())


def check_schedule(schedule: Sequence[str], arch: str, algorithm: str = "standard") -> None:
    """Raise NotImplementedError when this backend cannot run ``schedule`` (see module docstring)."""
    if algorithm != "standard":
        raise NotImplementedError(f"scheduled Newton–Schulz kernels run standard NS only, not {algorithm!r}")
    missing = sorted(set(schedule) - schedule_formats(arch))
    if missing:
        raise NotImplementedError(
            f"no Triton NS kernels for format(s) {missing} on {arch}; have {sorted(schedule_formats(arch))}"
        )


# ---------------------------------------------------------------- ns_scale


def _scale_name(batch: int, m: int, n: int, dtype: torch.dtype, normalize: bool, eps_mode: str, amax: bool) -> str:
    what = f"norm_{eps_mode}" if normalize else "amax"
    return f"ns_scale_{dtypes.name(dtype)}_b{batch}_{m}x{n}_{what}" + ("_amax" if normalize and amax else "")


def scale_parts(m: int, n: int, arch: str) -> int:
    """Amax partials per matrix an ``ns_scale`` launch writes (one per program)."""
    block = SCALE_BLOCK.get(arch, DEFAULT_SCALE_BLOCK)
    return -(-(m * n) // block)


def generate_scale(
    batch: int,
    m: int,
    n: int,
    dtype: torch.dtype,
    arch: str,
    origin: str,
    *,
    normalize: bool,
    eps_mode: str,
    amax: bool,
) -> KernelSource:
    """``normalize``: ``x0 = x / denom`` in fp32 (newton_schulz.normalize with fp32 compute), and with
    ``amax`` the amax partials of x0; else only the amax partials of x (stored in ``dtype``)."""
    name = _scale_name(batch, m, n, dtype, normalize, eps_mode, amax)
    block = SCALE_BLOCK.get(arch, DEFAULT_SCALE_BLOCK)
    parts = scale_parts(m, n, arch)
    w = CodeWriter()
    w.line(f"# kernel {name}: family ns_scale; from {' '.join(origin.split())}")
    w.line("@triton.jit")
    args = "x_ptr, x0_ptr, partials_ptr, P, eps_ptr, amax_ptr" if normalize else "x_ptr, amax_ptr"
    w.line(f"def {name}({args}, NUMEL: tl.constexpr, PARTS: tl.constexpr, BLOCK: tl.constexpr,")
    w.line("        BLOCK_P: tl.constexpr):")
    with w.indent():
        w.line("pid = tl.program_id(0)")
        w.line("batch = tl.program_id(1).to(tl.int64)")
        w.line("offs = pid * BLOCK + tl.arange(0, BLOCK)")
        w.line("mask = offs < NUMEL")
        w.line("v = tl.load(x_ptr + batch * NUMEL + offs, mask=mask, other=0.0).to(tl.float32)")
        if normalize:
            gram_denominator(w, GramSpec(batch, m, n, torch.float32, arch, normalize=True, eps_mode=eps_mode))
            w.line("v = tl.math.div_rn(v, denom)  # true division, fp32: the scheduled NS's normalisation")
            w.line("tl.store(x0_ptr + batch * NUMEL + offs, v, mask=mask)")
        if amax or not normalize:
            w.line("tl.store(amax_ptr + batch * PARTS + pid, tl.max(tl.where(mask, tl.abs(v), 0.0), axis=0))")
    w.line()
    w.line()
    grid = (parts, batch)
    if normalize:
        w.line(f"def launch_{name}(x, x0, partials, eps, amax=None):")
        call = "x, x0, partials, partials.shape[1], eps, amax if amax is not None else x0"
    else:
        w.line(f"def launch_{name}(x, amax):")
        call = "x, amax"
    with w.indent():
        w.line(f"assert x.is_contiguous() and tuple(x.shape) == ({batch}, {m}, {n})")
        if amax or not normalize:
            w.line(f"assert tuple(amax.shape) == ({batch}, {parts}) and amax.is_contiguous()")
        w.line(f"{name}[{grid}]({call}, NUMEL={m * n}, PARTS={parts}, BLOCK={block}, BLOCK_P={BLOCK_P})")
    spec = (batch, m, n, dtype, normalize, eps_mode, amax)
    return KernelSource(name, "ns_scale", spec, origin, w.text(), {"BLOCK": block}, tuple(sorted(w.helpers)))


# ---------------------------------------------------------------- emitter


def emit_newton_schulz_scheduled(w: CodeWriter, call: NSCall, schedule: Sequence[str]) -> NSLaunches:
    """Write the launches of one scheduled NS into ``out``: as :func:`ns_kernels.emit_newton_schulz`,
    but ``call.x`` must hold the NS input in fp32 (the reference normalises the fp32 input) and
    ``schedule`` names iteration k's format."""
    x, partials, P, eps, out, upcast, prefix = (call.x, call.partials, call.P, call.eps, call.out, call.upcast,
                                                call.prefix)
    batch, m, n, coefficients, out_dtype = call.batch, call.m, call.n, call.coefficients, call.out_dtype
    eps_mode, algorithm, arch, origin = call.eps_mode, call.algorithm, call.arch, call.origin
    if m > n:
        raise ValueError(f"emit_newton_schulz_scheduled takes the wide orientation (m <= n), got {m}x{n}")
    if len(schedule) != len(coefficients) or not coefficients:
        raise ValueError(f"schedule has {len(schedule)} formats for {len(coefficients)} iterations")
    unknown = [f for f in schedule if f not in FORMATS]
    if unknown:
        raise ValueError(f"unknown compute formats {unknown}")
    check_schedule(schedule, arch, algorithm)
    for fmt, (_, _, c) in zip(schedule, coefficients):
        if fmt in FP8_FORMATS and float(c) == 0.0:
            raise NotImplementedError(f"{fmt} iterations of cubic coefficients (c = 0) have no kernels")
    kernels = KernelSet(origin)
    extra: dict[str, KernelSource] = {}
    temps = Temporaries(prefix, batch, torch.float32)
    launches = 0  # ns_scale launches and the final copy; KernelSet counts the rest
    key = "+".join(schedule)
    w.line(
        f"# Newton-Schulz (standard, scheduled {key}) on {x}: {batch} x {m}x{n}, fp32 -> {dtypes.name(out_dtype)}; "
        f"partials {partials} [{batch}, {P}]"
    )

    def per_tensor(k: int) -> bool:
        return k < len(schedule) and schedule[k] == "fp8_e4m3"

    def scale_kernel(dtype: torch.dtype, normalize: bool, amax: bool) -> str:
        nonlocal launches
        launches += 1
        kernel = generate_scale(batch, m, n, dtype, arch, origin, normalize=normalize, eps_mode=eps_mode, amax=amax)
        extra.setdefault(kernel.name, kernel)
        return kernel.launcher

    parts = scale_parts(m, n, arch)
    # normalise in fp32; X0's amax partials when iteration 1 is per-tensor FP8
    X = temps.take(m, n, torch.float32, busy=[])
    x_amax: str | None = None
    w.line("# normalisation in fp32 (X0 = x / max(norm, eps)), as the scheduled reference's start()")
    if per_tensor(0):
        x_amax = temps.fixed("amax_norm", (batch, parts), torch.float32)
        w.line(f"{scale_kernel(torch.float32, True, True)}({x}, {X}, {partials}, {eps}, {x_amax})")
    else:
        w.line(f"{scale_kernel(torch.float32, True, False)}({x}, {X}, {partials}, {eps})")
    stored = torch.float32  # the dtype X is stored in
    for k, (a, b, c) in enumerate(coefficients):
        a, b, c = float(a), float(b), float(c)
        fmt = schedule[k]
        last = k == len(coefficients) - 1
        storage = FORMATS[fmt].storage
        w.line(f"# iteration {k + 1} in {fmt}: a={a!r}, b={b!r}, c={c!r}")
        A = temps.take(m, m, storage, busy=[X])
        B = temps.take(m, m, storage, busy=[A, X])
        if fmt in FLOAT_FORMATS:
            dtype = dtypes.dtype(fmt)
            gram = GramSpec(batch, m, n, dtype, arch, in_dtype=stored)
            w.line(f"{kernels.gram(gram)}({X}, {A}, upcast={upcast})")
            poly = SymPolySpec(batch, m, dtype, arch, cubic=c == 0.0)
            w.line(f"{kernels.sym_poly(poly)}({A}, {B}, 0.0, {b!r}, {c!r}, upcast={upcast})")
            target = out if last else temps.take(m, n, storage, busy=[B, X])
            gemm = GemmSpec(
                batch, m, n, m, dtype, arch, out_dtype=out_dtype if last else None, accumulate=True, r_dtype=stored
            )
            w.line(f"{kernels.gemm(gemm)}({B}, {X}, {target}, 1.0, upcast={upcast}, C={X}, beta={a!r})")
            X, x_amax, stored = target, None, storage
            continue
        tensor = fmt == "fp8_e4m3"

        def amax_buf(spec: Fp8GemmSpec, name: str, k: int = k) -> str:
            return temps.fixed(f"amax_{name}{k}", (batch, amax_tiles(spec)), torch.float32)

        if tensor and x_amax is None:
            x_amax = temps.fixed(f"amax_x{k}", (batch, parts), torch.float32)
            w.line(f"{scale_kernel(stored, False, True)}({X}, {x_amax})")
        gram8 = Fp8GemmSpec(batch, m, m, n, fmt, arch, storage, symmetric=True, amax_out=tensor)
        a_amax = amax_buf(gram8, "a") if tensor else None
        amaxes = f", l_amax={x_amax}, r_amax={x_amax}, amax_out={a_amax}" if tensor else ""
        w.line(f"{_fp8(kernels, gram8)}({X}, {X}.mT, {A}, 1.0, upcast={upcast}{amaxes})")
        poly8 = Fp8GemmSpec(batch, m, m, m, fmt, arch, storage, accumulate=True, symmetric=True, amax_out=tensor)
        b_amax = amax_buf(poly8, "b") if tensor else None
        amaxes = f", l_amax={a_amax}, r_amax={a_amax}, amax_out={b_amax}" if tensor else ""
        w.line(f"{_fp8(kernels, poly8)}({A}, {A}, {B}, {c!r}, upcast={upcast}, C={A}, beta={b!r}{amaxes})")
        direct = last and out_dtype in (torch.bfloat16,)
        next_amax = per_tensor(k + 1)
        update = Fp8GemmSpec(batch, m, n, m, fmt, arch, storage, accumulate=True, amax_out=next_amax)
        target = out if direct else temps.take(m, n, storage, busy=[B, X])
        x_next_amax = amax_buf(update, "next_x") if next_amax else None
        amaxes = f", l_amax={b_amax}, r_amax={x_amax}" if tensor else ""
        amaxes += f", amax_out={x_next_amax}" if next_amax else ""
        w.line(f"{_fp8(kernels, update)}({B}, {X}, {target}, 1.0, upcast={upcast}, C={X}, beta={a!r}{amaxes})")
        if last and not direct:
            w.line(f"{out}.copy_({target})  # bf16 storage, then out_dtype, as the reference's finish()")
            launches += 1
        X, x_amax, stored = target, x_next_amax, storage
    kernel_list = list(extra.values()) + list(kernels.used.values())
    return NSLaunches(kernel_list, temps.buffers, launches + kernels.launches)


def _fp8(kernels: KernelSet, spec: Fp8GemmSpec) -> str:
    return kernels._use(spec.name, lambda: generate_fp8_gemm(spec, kernels.origin))


__all__ = ["check_schedule", "emit_newton_schulz_scheduled", "generate_scale", "schedule_formats"]
