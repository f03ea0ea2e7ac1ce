"""What the machine running the step is good at: measured, cached, overridable.

The cost model of choose-algorithm needs the GEMM throughput of each dtype
on the target, and batch-by-shape whether it gains from stacking (GPUs: one
launch per group; CPUs: no, see cpu_target). GPU targets come from a table of
data-sheet rates (``GPU_GFLOPS``, sm80 to sm103; ``device_arch`` names a
device's row); a CPU is measured once — small fp32/bf16/fp16 matmuls, a
fraction of a second — and the result cached in the cache directory. Measured on this project's 2-core
AVX2 CPUs: fp32 ~90 GFLOP/s, bf16 ~0.7 GFLOP/s (no bf16 GEMM in hardware),
while CPUs with AMX/AVX512-BF16 run bf16 faster than fp32.

What a plan computes never rests on these measurements: which dtypes have
GEMM units (and how fast they are relative to fp32) is declared by the CPU's
ISA flags (``declared_ratios``), and only the fp32 rate is read from the
measurement, scaling every prediction alike. So two processes on one kind of
CPU plan the same numerics however busy each was while measuring.

Calibrate on an idle machine: under load, multi-threaded GEMMs slow down
unevenly (measured here: fp32 MKL fell from ~90 to ~2 GFLOP/s while another
process kept both cores busy). The result is cached as
``<cache dir>/target-cpu-*.json`` and shown by explain(); delete the file to
measure again. A file that does not hold positive finite rates for every
dtype (corrupt, hand-edited, written by another version) is warned about
once and measured again: a nonsensical rate would silently skew every plan.
"""

from __future__ import annotations

import hashlib
import math
import os
import platform
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from .diskcache import read_json, write_json
from .ir import dtypes

# The GEMM dtypes a CPU is measured in (names of hocompile.ir.dtypes; rate tables are keyed by them).
_MEASURED = ("fp32", "bf16", "fp16")
_CALIBRATION_VERSION = 5


@dataclass(frozen=True)
class Target:
    name: str
    gflops: dict[str, float] = field(default_factory=dict)  # "fp32" / "bf16" / "fp16" -> GEMM GFLOP/s
    # One bmm over a stack beats a loop of mm (GPUs: one launch per group).
    prefers_batched: bool = False
    # Largest stack batch-by-shape builds (stacked input + output of a group
    # are alive at once): bounds the step's peak memory.
    stack_bytes: int = 256 * 2**20
    # Measured speed-up of X Xᵀ on 4x4 lower-triangle blocks over one dense
    # product (aten lowering); GPUs' Triton kernels use symmetric tiles anyway.
    symmetric_speedup: float = 1.0
    # GEMM operand formats a Newton–Schulz schedule may use here (names of
    # hocompile.precision.emulate.FORMATS); empty: the dtypes in ``gflops``.
    formats: tuple[str, ...] = ()
    # The machine running this process (calibrated here): Newton–Schulz plans
    # are then chosen by timing the candidates (hocompile/precision/measure_ns.py),
    # cached in ``cache_dir``; any other target is planned by the rates above.
    measured: bool = False
    cache_dir: Path | None = None
    # Declared GEMM rates relative to fp32, by dtype name (the measured CPU: from its ISA flags,
    # ``declared_ratios``). Where set, every plan reads its rates from these and the measured fp32
    # rate: the ranking of dtypes (what a plan computes in) is then a fact of the CPU's kind, not
    # of how busy it was while measured (under load fp32 read 4 GFLOP/s next to bf16's 800).
    ratios: dict[str, float] = field(default_factory=dict)

    def throughput(self, dtype: torch.dtype) -> float:
        """GEMM GFLOP/s in ``dtype``; a dtype without a rate here runs at the fp32 rate."""
        return self._rate(dtypes.name(dtype))

    def rate(self, fmt: str) -> float:
        """GEMM GFLOP/s for an operand format name ("fp8_e4m3" uses the "fp8" rate, "mxfp8_*" "mxfp8")."""
        return self._rate(fmt.split("_")[0] if fmt.startswith(("fp8", "mxfp8")) else fmt)

    def planning_throughput(self, dtype: torch.dtype) -> float:
        """GFLOP/s for choices that change what a step computes and weigh compute against something
        else (tensor-parallel modes: GEMMs vs collectives). The CPU running the step: a nominal rate
        per core (NOMINAL_CORE_GFLOPS) times its threads, times the declared ratio, the same however
        busy the machine was when measured; any other target: its table."""
        if not (self.measured and self.ratios):
            return self.throughput(dtype)
        return NOMINAL_CORE_GFLOPS * torch.get_num_threads() * self.ratios.get(dtypes.name(dtype), 1.0)

    def _rate(self, key: str) -> float:
        fp32 = self.gflops.get("fp32", 1.0)
        if self.ratios:
            return fp32 * self.ratios.get(key, 1.0)
        return self.gflops.get(key, fp32)

    def schedule_formats(self) -> tuple[str, ...]:
        """Formats a schedule may use: the declared ones, else the fast dtypes measured here."""
        if self.formats:
            return self.formats
        return tuple(k for k in _MEASURED if k == "fp32" or self.fast(dtypes.dtype(k)))

    def fast(self, dtype: torch.dtype) -> bool:
        """Does a GEMM in ``dtype`` beat the fp32 GEMM here?"""
        return self.throughput(dtype) >= self.throughput(torch.float32)

    def describe(self) -> str:
        batched = "bmm" if self.prefers_batched else "loop of mm"
        if self.ratios:
            fast = [k for k, v in sorted(self.ratios.items()) if v >= 1.0 and k != "fp32"]
            declared = f"; fast GEMM dtypes by ISA: {', '.join(['fp32', *fast])}"
            rates = ", ".join(f"{k} {v:.1f}" for k, v in sorted(self.gflops.items()))
            return f"{self.name} (GEMM GFLOP/s measured: {rates}{declared}; stacks run as {batched})"
        if self.gflops and min(self.gflops.values()) >= 1000:
            rates = ", ".join(f"{k} {v / 1000:g}" for k, v in sorted(self.gflops.items()))
            return f"{self.name} (GEMM TFLOP/s: {rates}; stacks run as {batched})"
        rates = ", ".join(f"{k} {v:.1f}" for k, v in sorted(self.gflops.items()))
        return f"{self.name} (GEMM GFLOP/s: {rates}; stacks run as {batched})"


def cpu_id() -> str:
    """This machine's identity for cached measurements: CPU model and flags, torch, threads."""
    return _cpu_id()


def _cpu_id() -> str:
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("model name", "flags")):
                    model += line
    except OSError:
        pass
    # oneDNN's ISA cap (ONEDNN_MAX_CPU_ISA=AVX2 hides the bf16 units) changes every GEMM rate:
    # measurements taken under it must not be read without it, nor the other way round.
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA", "") or os.environ.get("DNNL_MAX_CPU_ISA", "")
    text = f"{model}|{torch.__version__}|{torch.get_num_threads()}|{_CALIBRATION_VERSION}|{isa}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _measure(dtype: torch.dtype, size: int = 256, repeats: int = 5, window_s: float = 0.03) -> float:
    """GFLOP/s of a size³ GEMM: the best of at least ``repeats`` runs spread over ``window_s``.

    A 256³ GEMM takes ~0.1 ms: five back-to-back runs can all land in one busy
    moment of a shared machine (a bf16 rate read as 4 GFLOP/s instead of 350 was
    cached that way), so runs continue until the window has passed.
    """
    gen = torch.Generator().manual_seed(0)  # not the user's stream: a step that draws noise draws eager's
    a = torch.randn(size, size, generator=gen).to(dtype)
    b = torch.randn(size, size, generator=gen).to(dtype)
    a @ b  # warm up (oneDNN builds its kernels on first use)
    best = float("inf")
    begin = time.perf_counter()
    runs = 0
    while runs < repeats or (time.perf_counter() - begin < window_s and runs < 1000):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
        runs += 1
    return 2 * size**3 / best / 1e9


def cpu_target(cache_dir: Path | None) -> Target:
    """This CPU, calibrated (cached per CPU model, torch version and threads)."""
    path = cache_dir / f"target-cpu-{_cpu_id()}.json" if cache_dir is not None else None
    cached = read_json(path, _calibration_from_json) if path is not None else None
    if cached is not None:
        return replace(cached, measured=True, cache_dir=cache_dir, ratios=declared_ratios())
    gflops = {name: _measure(dtypes.dtype(name)) for name in _MEASURED}
    # A CPU never prefers stacks: measured here, a GPT-2 layer's step took
    # 0.73 s batched vs 0.76 s unbatched (noise), while stacking 24 layers of
    # d=1024 matrices raised the step's peak memory from ~130 MB to 708 MB.
    batched = False
    if path is not None:
        # Unwritable: warned once inside, and this process keeps measuring per compile.
        write_json(path, {"gflops": gflops, "prefers_batched": batched})
    # No symmetric row blocks: they round differently from eager's dense products, and whether
    # they pay is no rule of the shape here (768×2304 bf16: 1.17x; 1024×4096: 0.82x; 2048²: 0.47x).
    return Target("cpu", gflops, batched, measured=True, cache_dir=cache_dir, ratios=declared_ratios())


# fp32 GEMM GFLOP/s per core for planning_throughput: this project's 2-core machines measured 42 (AVX2),
# 90 (AVX-512) and 170 (AMX) per core; a middle value, so a choice never rests on a measurement.
NOMINAL_CORE_GFLOPS = 90.0

# oneDNN's ISA caps in increasing order (ONEDNN_MAX_CPU_ISA): a cap below a level hides its units.
_ONEDNN_ISAS = (
    "SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI",
    "AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX512_CORE_AMX", "AVX512_CORE_AMX_FP16",
)
# Relative to fp32, as measured on this project's machines (256³-768³ GEMMs): AMX-BF16 2.5x,
# AVX-512-BF16 1.9x, AVX-512-FP16 0.85x; without the units a half GEMM is emulated, ~100x slower.
_UNIT_RATIOS = (
    ("bf16", "amx_bf16", "AVX512_CORE_AMX", 2.5),
    ("bf16", "avx512_bf16", "AVX512_CORE_BF16", 1.9),
    ("fp16", "amx_fp16", "AVX512_CORE_AMX_FP16", 2.5),
    ("fp16", "avx512_fp16", "AVX512_CORE_FP16", 0.85),
)
_EMULATED = 0.01


def declared_ratios(flags: frozenset[str] | None = None, cap: str | None = None) -> dict[str, float]:
    """This CPU's half-precision GEMM rates relative to fp32, from its ISA flags and oneDNN's cap.

    A rule, not a measurement: two processes on one kind of CPU plan alike however loaded.
    """
    flags = _cpu_flags() if flags is None else flags
    if cap is None:
        cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "") or os.environ.get("DNNL_MAX_CPU_ISA", "")
    cap = cap.upper()
    allowed = len(_ONEDNN_ISAS) if cap in ("", "ALL", "DEFAULT") or cap not in _ONEDNN_ISAS else (
        _ONEDNN_ISAS.index(cap) + 1
    )
    ratios = {"fp32": 1.0, "bf16": _EMULATED, "fp16": _EMULATED}
    for dtype, flag, isa, ratio in reversed(_UNIT_RATIOS):  # the best unit present wins
        if flag in flags and _ONEDNN_ISAS.index(isa) < allowed:
            ratios[dtype] = ratio
    return ratios


def _cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def _calibration_from_json(data: object) -> Target:
    """The Target a calibration file describes; ValueError unless it has exactly the shape cpu_target writes."""
    if not isinstance(data, dict) or set(data) != {"gflops", "prefers_batched"}:
        raise ValueError("expected an object with keys gflops, prefers_batched")
    gflops = data["gflops"]
    if not isinstance(gflops, dict) or set(gflops) != set(_MEASURED):
        raise ValueError(f"gflops must map exactly {sorted(_MEASURED)} to rates")
    if not isinstance(data["prefers_batched"], bool):
        raise ValueError("prefers_batched must be true or false")
    rates = {name: _positive_finite(rate, f"gflops.{name}") for name, rate in gflops.items()}
    return Target("cpu", rates, data["prefers_batched"])


def _positive_finite(value: object, name: str) -> float:
    # bool is an int; json.loads accepts NaN and Infinity.
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} is {value!r}, not a positive finite number")
    return float(value)


# Dense GEMM throughput from the vendors' data sheets, GFLOP/s (SXM parts;
# fp32 is the CUDA-core rate, "tf32" the tensor-core fp32 path). The
# choose-algorithm cost model only needs their ratios.
GPU_GFLOPS: dict[str, dict[str, float]] = {
    "sm80": {"fp32": 19_500, "tf32": 156_000, "bf16": 312_000, "fp16": 312_000},
    "sm89": {"fp32": 91_600, "tf32": 183_000, "bf16": 362_000, "fp16": 362_000, "fp8": 733_000},
    "sm90": {"fp32": 67_000, "tf32": 495_000, "bf16": 989_000, "fp16": 989_000, "fp8": 1_979_000},
    "sm100": {
        "fp32": 80_000,
        "tf32": 1_100_000,
        "bf16": 2_250_000,
        "fp16": 2_250_000,
        "fp8": 4_500_000,
        "mxfp8": 4_500_000,
    },
    "sm103": {
        "fp32": 75_000,
        "tf32": 1_100_000,
        "bf16": 2_250_000,
        "fp16": 2_250_000,
        "fp8": 4_500_000,
        "mxfp8": 4_500_000,
    },
}
# Tensor-core operand formats per generation: Ampere adds tf32/bf16/fp16 to
# fp32; Ada and Hopper add FP8 with per-tensor scales; Blackwell adds MXFP8
# (32-element blocks with power-of-two scales).
_AMPERE = ("fp32", "tf32", "bf16", "fp16")
_FP8 = ("fp8_e4m3", "fp8_e5m2")
_MXFP8 = ("mxfp8_e4m3", "mxfp8_e5m2")
GPU_FORMATS: dict[str, tuple[str, ...]] = {
    "sm80": _AMPERE,
    "sm89": _AMPERE + _FP8,
    "sm90": _AMPERE + _FP8,
    "sm100": _AMPERE + _FP8 + _MXFP8,
    "sm103": _AMPERE + _FP8 + _MXFP8,
}
# Nominal CPUs, to plan for one on any machine (target="cpu" measures this one).
# They are planned by these rates (the FLOP model): a CPU can only be timed
# by the process running on it.
CPU_DESCRIPTORS: dict[str, Target] = {
    # This project's 2-core AVX2 machines, as measured (no bf16 GEMM in hardware).
    "cpu-avx2": Target("cpu-avx2", {"fp32": 85.0, "bf16": 1.3, "fp16": 1.4}, symmetric_speedup=1.25),
    # This project's 2-core AMD EPYC machines with AVX-512-bf16, as measured
    # (targets.cpu_target, 256² GEMMs; 768×3072 products reach ~420 bf16 / ~180 fp32).
    "cpu-avx512bf16": Target(
        "cpu-avx512bf16", {"fp32": 180.0, "bf16": 420.0, "fp16": 1.8}, symmetric_speedup=1.25
    ),
    # A Sapphire Rapids-class CPU with AMX-BF16: bf16 GEMMs several times fp32 (nominal figures).
    "cpu-amx": Target("cpu-amx", {"fp32": 2_000.0, "bf16": 8_000.0, "fp16": 2.0}, symmetric_speedup=1.25),
}


def gpu_target(arch: str) -> Target:
    """A GPU architecture's row of the table: GPUs gain from one launch per group."""
    if arch not in GPU_GFLOPS:
        raise ValueError(f"unknown GPU architecture {arch!r}; known: {sorted(GPU_GFLOPS)}")
    # Tens of GiB of device memory: a whole model's group fits one stack
    # (GPT-2's 24 768x3072 matrices: 0.45 GB), which keeps launches per group.
    return Target(arch, dict(GPU_GFLOPS[arch]), prefers_batched=True, stack_bytes=4 * 2**30, formats=GPU_FORMATS[arch])


def device_arch(device: torch.device) -> str:
    """The architecture name of ``device``: "interpret" on CPU (Triton's interpreter), else smXY.

    A GPU newer than every row of the table gets the newest row not newer
    than it (an sm120 plans as sm103); one older than all of them, the oldest.
    The Triton tile tables are keyed by the same names.
    """
    if device.type != "cuda":
        return "interpret"
    major, minor = torch.cuda.get_device_capability(device)
    name = f"sm{major}{minor}"
    if name in GPU_GFLOPS:
        return name
    known = sorted(GPU_GFLOPS, key=lambda k: int(k[2:]))
    older = [k for k in known if int(k[2:]) <= major * 10 + minor]
    return older[-1] if older else known[0]


def resolve_target(spec: str | Target | None, cache_dir: Path | None, device: torch.device | None = None) -> Target:
    if isinstance(spec, Target):
        return spec
    if spec in (None, "auto") and device is not None and device.type == "cuda":
        return gpu_target(device_arch(device))
    if spec in (None, "auto", "cpu"):
        return cpu_target(cache_dir)
    if isinstance(spec, str) and spec in GPU_GFLOPS:
        return gpu_target(spec)
    if isinstance(spec, str) and spec in CPU_DESCRIPTORS:
        return CPU_DESCRIPTORS[spec]
    known = ["auto", "cpu", *CPU_DESCRIPTORS, *GPU_GFLOPS]
    raise ValueError(f"unknown target {spec!r}: use one of {known} or a hocompile.Target")
