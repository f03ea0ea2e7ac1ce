"""One-command GPU check of hocompile's Triton backend: correctness, the write fence, timings, distributed.

    .venv/bin/python benchmarks/gpu_check.py            # one CUDA GPU: every section, <= 6 min on an H200 (estimate)
    .venv/bin/python benchmarks/gpu_check.py --smoke    # CPU, Triton interpreter, tiny shapes: the same code paths
    .venv/bin/python benchmarks/gpu_check.py --sections env,kernels --out /tmp/check.json

Sections (each guarded: an error is recorded in the JSON and the next section runs; ``timing`` names gpt2+large):

- env: torch/triton versions, GPU name and capability, hocompile's device_arch, what backend="auto" resolves to.
- kernels: gram (plain, normalising with eps clamp/clamp-hit/add), sym_poly (quintic, cubic), gemm (accumulate,
  symmetric, out_dtype) in fp32 and bf16 on sizes that are not tile multiples with batch > 1, against fp64 with
  rounding-order bounds; whole Newton–Schulz programs from emit_newton_schulz (error vs fp64 within 1.25x of the
  aten emulation's + 1e-5); the pointwise family through a compiled AdamW (triton vs aten backend).
- step: compiled torch.optim.Muon, backend="triton" vs "aten" vs eager, precision fp32 (triton vs aten within 2
  bf16 ulps of the update) and auto (NS error vs fp64 within 1.25x of eager's + 1e-3), two steps.
- fence (gpu_check_fence.py): a launch failing midway leaves params and state bitwise unchanged; an injected eigh
  failure in a Triton Shampoo step falls back to eager (LinAlgFallbackWarning, bitwise); strided grads and params.
- gpt2 / large (timing): 12 x {768x2304, 768x768, 768x3072, 3072x768} and 8 x 4096x4096 + 8 x 4096x14336 (fp32
  params, torch.optim.Muon defaults: bf16 NS): eager, hocompile and (GPT-2) torch.compile(opt.step), (large)
  hocompile with NS pinned to bf16; first and second call (both compile), steady median (wall with sync, and
  CUDA events), ratio vs eager, NS TFLOP/s, launches per step (hocompile's count and the profiler's), memory.
- shampoo_family (gpu_check_shampoo.py): SOAP, REKLS, MOP, PolarGrad (emerging-optimizers) and hocompile's Shampoo
  on one GPT-2 layer's matrices, eager vs compile_optimizer (backend auto): step times, params vs eager
  (--smoke: SOAP and Shampoo only, gpu_check_shampoo.SMOKE_FAMILY).
- distributed (gpu_check_dist.py): with more than one GPU, replicated Muon on the Triton backend at world
  min(GPUs, 8), NCCL: bitwise the single-process Triton step on every rank. Skipped on one GPU.

Before running, it prints its estimate per section for one H200 (ESTIMATE_S, with the assumptions it rests on);
each section then gets its estimate's share of the budget (default 360 s) and later work is skipped past it.
Results go to benchmarks/results/gpu-<arch>.json and a short gpu-<arch>.md beside it (or --out PATH.json),
rewritten after every case so a timeout keeps what ran; a readable summary is printed (flushed) as it goes. Exit
status 0 only when every check passed. Triton and Inductor caches start empty (fresh temp dirs): cold compiles.
"""

from __future__ import annotations

import os
import sys
import tempfile

if "--smoke" in sys.argv:  # before anything imports Triton: it decides then whether kernels are interpreted
    os.environ["TRITON_INTERPRET"] = "1"
_CACHE_ROOT = tempfile.mkdtemp(prefix="gpu-check-")
os.environ.setdefault("TRITON_CACHE_DIR", os.path.join(_CACHE_ROOT, "triton"))
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(_CACHE_ROOT, "inductor"))

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import shlex  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from collections.abc import Callable, Iterator  # noqa: E402
from contextlib import contextmanager  # noqa: E402
from datetime import datetime, timezone  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

import hocompile  # noqa: E402
from hocompile.ops.newton_schulz_math import flops  # noqa: E402
from hocompile.targets import device_arch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_check_dist  # noqa: E402
import gpu_check_fence  # noqa: E402
import gpu_check_kernels  # noqa: E402
import gpu_check_report  # noqa: E402
import gpu_check_shampoo  # noqa: E402

KJ = (3.4445, -4.775, 2.0315)
SECTIONS = ("env", "kernels", "step", "fence", "gpt2", "large", "shampoo_family", "distributed")
ALIASES = {"timing": ("gpt2", "large")}
GPT2 = [(768, 2304), (768, 768), (768, 3072), (3072, 768)] * 12
LARGE = [(4096, 4096)] * 8 + [(4096, 14336)] * 8
SMOKE_SETS = {"gpt2": [(16, 32), (32, 16), (16, 16)] * 2, "large": [(24, 24), (24, 40)]}
# hocompile plans its NS precision per iteration (FP8 early on sm89+); "hocompile-bf16" pins bf16 throughout,
# so the pair is the FP8-vs-bf16 NS timing (on the large set, where NS dominates). torch.compile last: its
# compile is the likeliest to overrun; on GPT-2 only (its compile of the large set would not fit 6 minutes).
VARIANTS = {
    "gpt2": ("eager", "hocompile", "torch.compile"),
    "large": ("eager", "hocompile", "hocompile-bf16"),
}
BUDGET_S = 360.0  # the whole run on one H200: 6 minutes
# Seconds per section on one H200, cold caches. Not measured (no GPU has run this yet): the sums of
# assumptions written beside each, so the first run's JSON ("estimate_s" vs "seconds" per section)
# calibrates them. Triton JIT-compiles a generated kernel in ~1 s (matmul kernels with tl.dot and
# pipelining; simple pointwise ones less) and every shape is a new kernel; hocompile's capture and
# passes take ~2-4 s per compile (this repo's CPU figures); torch.compile of a 48-matrix Muon step
# ~60 s (Inductor, cold); the steps themselves are milliseconds.
ESTIMATE_S: dict[str, float] = {
    "env": 5.0,  # imports, nvidia-smi, one tiny compile
    "kernels": 50.0,  # 26 cases, ~40 kernels to JIT
    "step": 25.0,  # 2 precisions x (aten, triton, eager): ~15 Triton kernels, 4 compiles
    "fence": 30.0,  # Muon (fp32) ~12 kernels, Shampoo ~8, the layouts step ~12; 6 compiles
    "gpt2": 110.0,  # eager 5, hocompile 30 (4 shape groups: ~25 kernels), torch.compile 75
    "large": 45.0,  # eager 5, hocompile 20 (2 groups), hocompile-bf16 20
    "shampoo_family": 90.0,  # 5 optimizers x (eager + compile + ~8 kernels): ~18 s each
    "distributed": 0.0,  # one GPU: skipped (with more: ~40 s, each rank compiling its own kernels)
}


class Ctx:
    """Run-wide settings, the time budget and the JSON report (rewritten after every case)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.smoke: bool = args.smoke
        self.device = torch.device("cpu" if self.smoke else "cuda")
        self.cuda = self.device.type == "cuda"
        self.ns_steps = 2 if self.smoke else 5  # interpreted launches are slow: fewer iterations in smoke runs
        self.muon_kw: dict[str, Any] = {"lr": 0.02, "momentum": 0.95, "weight_decay": 0.01, "ns_steps": self.ns_steps}
        self.start = time.perf_counter()
        self.budget_s: float = args.budget_s
        self.cache_root = Path(_CACHE_ROOT)
        self.out: Path = args.out
        self.failures: list[str] = []
        self.compile_first_s: dict[str, float] = {}
        self.sections: list[str] = []
        torch.set_float32_matmul_precision("highest")  # fp32 references and aten's fp32 NS: no TF32
        self.data: dict[str, Any] = {
            "benchmark": "gpu_check",
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "command": shlex.join(["python", *sys.argv]),
            "smoke": self.smoke,
            "budget_s": self.budget_s,
            "sections": {},
        }

    def left(self) -> float:
        return self.budget_s - (time.perf_counter() - self.start)

    def save(self) -> None:
        self.data["elapsed_s"] = round(time.perf_counter() - self.start, 2)
        self.data["failures"] = self.failures
        self.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.out.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.data, indent=2, default=str) + "\n")
        tmp.replace(self.out)

    def reserve_after(self, section: str) -> float:
        """Seconds the selected sections after ``section`` are expected to need (ESTIMATE_S; none in smoke)."""
        if self.smoke:
            return 0.0
        later = self.sections[self.sections.index(section) + 1 :]
        return sum(ESTIMATE_S[s] for s in later)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def check(self, name: str, passed: bool) -> bool:
        if not passed:
            self.failures.append(name)
        return passed


# ---------------------------------------------------------------- env


def section_env(ctx: Ctx, out: dict[str, Any]) -> None:
    import triton  # type: ignore[import-untyped]

    out.update(
        torch=torch.__version__,
        triton=triton.__version__,
        python=sys.version.split()[0],
        hocompile=hocompile.__version__,
        cuda_runtime=torch.version.cuda,
        device=str(ctx.device),
        float32_matmul_precision=torch.get_float32_matmul_precision(),
        cache_root=str(ctx.cache_root),
        triton_interpret=os.environ.get("TRITON_INTERPRET", ""),
        cpus=os.cpu_count(),
    )
    smi = "nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv,noheader"
    for key, cmd in {
        "git": "git rev-parse --short HEAD",
        "git_status": "git status --short",
        "nvidia_smi": smi,
    }.items():
        try:
            out[key] = subprocess.run(cmd.split(), capture_output=True, text=True, timeout=20).stdout.strip()
        except Exception as exc:  # noqa: BLE001
            out[key] = f"unavailable: {exc}"
    if ctx.cuda:
        props = torch.cuda.get_device_properties(ctx.device)
        out.update(
            gpu=props.name,
            capability=list(torch.cuda.get_device_capability(ctx.device)),
            sms=props.multi_processor_count,
            memory_gib=round(props.total_memory / 2**30, 1),
        )
    out["device_arch"] = device_arch(ctx.device)
    probe = torch.nn.Parameter(torch.zeros(4, 4, device=ctx.device))
    out["backend_auto"] = hocompile.compile_optimizer(torch.optim.Muon([probe]), cache_dir=ctx.cache_root).backend
    shown = ("gpu", "capability", "device_arch", "torch", "triton", "backend_auto", "git")
    print("  " + ", ".join(f"{k} {out.get(k)}" for k in shown), flush=True)
    if ctx.cuda:
        ctx.check("env: backend auto is triton on CUDA", out["backend_auto"] == "triton")


# ---------------------------------------------------------------- kernels


def section_kernels(ctx: Ctx, out: dict[str, Any]) -> None:
    # batch, m, k, (batch, m, n) of two whole NS, AdamW shapes: none a multiple of the tiles (GPU 128/64, CPU 16)
    sizes = (2, 20, 37, (2, 20, 24), (1, 24, 40), ((5, 7), (5, 7), (9,)))
    if not ctx.smoke:
        sizes = (3, 300, 333, (3, 300, 520), (2, 1000, 1500), ((300, 700), (300, 700), (1001,)))
    env = gpu_check_kernels.KernelEnv(ctx.device, device_arch(ctx.device), ctx.smoke, ctx.cache_root / "k", *sizes)
    out["sizes"] = {k: getattr(env, k) for k in ("arch", "upcast", "batch", "m", "k", "ns_small", "ns_large")}
    cap = time.perf_counter() + (240 if ctx.smoke else 1.5 * ESTIMATE_S["kernels"])  # its share of the budget
    reserve = ctx.reserve_after("kernels")
    gpu_check_kernels.run_cases(env, out, ctx.save, lambda: min(cap - time.perf_counter(), ctx.left() - reserve))
    for name in out["failed"]:
        ctx.check(f"kernels: {name}", False)


# ---------------------------------------------------------------- step


def _make(ctx: Ctx, shapes: list[tuple[int, int]], seed: int, count: int) -> list[list[torch.Tensor]]:
    gen = torch.Generator(device=ctx.device).manual_seed(seed)
    return [[torch.randn(s, generator=gen, device=ctx.device) * 0.02 for s in shapes] for _ in range(count)]


def section_step(ctx: Ctx, out: dict[str, Any]) -> None:
    shapes = [(20, 37), (37, 20), (24, 24)] if ctx.smoke else [(200, 333), (200, 333), (333, 200), (256, 256)]
    p0, g1, g2 = _make(ctx, shapes, seed=10, count=3)
    for failed in gpu_check_kernels.step_check(p0, g1, g2, ctx.muon_kw, ctx.cache_root / "step", out, ctx.save):
        ctx.check(f"step: {failed}", False)


# ---------------------------------------------------------------- timing


@contextmanager
def _time_limit(seconds: float) -> Iterator[dict[str, bool]]:
    """Raise TimeoutError in this (main) thread after ``seconds`` (a guard on compiles, not a precise timer).

    Yields a dict whose "expired" tells whether it fired (torch may wrap the exception in its own).
    """
    state = {"expired": False}

    def expire(signum: int, frame: Any) -> None:
        state["expired"] = True
        raise TimeoutError(f"over its {seconds:.0f} s share of the budget")

    previous = signal.signal(signal.SIGALRM, expire)
    # re-fires every second: an exception raised inside a weakref callback or __del__ is swallowed
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 1.0), 1.0)
    try:
        yield state
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _timed(ctx: Ctx, fn: Callable[[], Any]) -> tuple[float, float | None]:
    """(wall seconds up to a device sync, CUDA-event seconds)."""
    ctx.sync()
    events = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if ctx.cuda else []
    start = time.perf_counter()
    if events:
        events[0].record()
    fn()
    if events:
        events[1].record()
    ctx.sync()
    wall = time.perf_counter() - start
    return wall, events[0].elapsed_time(events[1]) / 1e3 if events else None


def _profile(ctx: Ctx, fn: Callable[[], Any]) -> dict[str, int]:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx.cuda else [])
    with profile(activities=activities) as prof:
        fn()
        ctx.sync()
    device = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    copies = [e for e in device if "memcpy" in e.name.lower() or "memset" in e.name.lower()]
    cpu_ops = sum(1 for e in prof.events() if e.device_type == DeviceType.CPU)
    return {"device_kernels": len(device) - len(copies), "memcpy_memset": len(copies), "cpu_ops": cpu_ops}


def _mb(n: int) -> float:
    return round(n / 2**20, 1)


def run_variant(
    ctx: Ctx,
    set_name: str,
    variant: str,
    p0: list[torch.Tensor],
    grads: list[torch.Tensor],
    eager_after: list[torch.Tensor] | None,
) -> tuple[dict[str, Any], list[torch.Tensor] | None]:
    params = [torch.nn.Parameter(p.clone()) for p in p0]
    ctx.sync()
    mem0 = torch.cuda.memory_allocated() if ctx.cuda else 0
    opt: Any = torch.optim.Muon(params, **ctx.muon_kw)
    if variant == "torch.compile":
        from torch._dynamo.utils import counters

        torch._dynamo.reset()
        graphs0 = counters["stats"]["unique_graphs"]
        step = torch.compile(opt.step)
    elif variant.startswith("hocompile"):
        precision = "bf16" if variant == "hocompile-bf16" else "auto"
        opt = hocompile.compile_optimizer(
            opt, backend="triton", precision=precision, cache_dir=ctx.cache_root / f"{variant}-{set_name}"
        )
        step = opt.step
    else:
        step = opt.step

    def call() -> tuple[float, float | None]:
        for p, g in zip(params, grads):
            p.grad = g
        return _timed(ctx, step)

    res: dict[str, Any] = {}
    first, second = call(), None
    after = [p.detach().clone() for p in params]
    if eager_after is not None:  # the update after one step, relative to eager's
        res["max_rel_update_diff_vs_eager"] = max(
            ((a - e).norm() / (e - p).norm()).item() for a, e, p in zip(after, eager_after, p0)
        )
        after = []
    kept = sum(t.numel() * t.element_size() for t in after)
    second = call()
    res.update(first_call_s=first[0], second_call_s=second[0])
    print(f"    {variant}: first call {first[0]:.2f} s, second {second[0]:.2f} s", flush=True)
    if not ctx.smoke:
        call()
    state_bytes = (torch.cuda.memory_allocated() - mem0 - kept) if ctx.cuda else 0
    per = max(call()[0], 1e-6) if not ctx.smoke else 1.0
    reps = 1 if ctx.smoke else max(3, min(25, int(4.0 / per)))
    if ctx.cuda:
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if ctx.cuda else 0
    times = [call() for _ in range(reps)]
    walls = [t[0] for t in times]
    res.update(steady_s=walls, median_s=statistics.median(walls), reps=reps)
    if ctx.cuda:
        res["median_device_s"] = statistics.median([t[1] for t in times if t[1] is not None])
        res["step_peak_extra_mb"] = _mb(torch.cuda.max_memory_allocated() - base)
        res["state_mb"] = _mb(state_bytes)
    for p, g in zip(params, grads):
        p.grad = g
    try:
        res["profiler"] = _profile(ctx, step)
    except Exception as exc:  # noqa: BLE001 - counting is optional
        res["profiler"] = {"error": f"{type(exc).__name__}: {exc}"}
    if variant.startswith("hocompile"):
        lowered = opt.history[-1].lowered
        res.update(
            backend=opt.backend,
            launches=lowered.launches,
            units=lowered.units,
            kernels=len(opt.kernels()),
            counters=opt.counters.as_dict(),
            explain=hocompile.explain(opt),
            compile_s=[round(e.compile_seconds, 3) for e in opt.history],
        )
    if variant == "torch.compile":
        res["dynamo_unique_graphs"] = counters["stats"]["unique_graphs"] - graphs0
        ctx.compile_first_s[set_name] = first[0] + second[0]
    return res, after or None


def section_timing(ctx: Ctx, set_name: str, out: dict[str, Any]) -> None:
    shapes = SMOKE_SETS[set_name] if ctx.smoke else {"gpt2": GPT2, "large": LARGE}[set_name]
    coefficients = [KJ] * ctx.ns_steps
    ns_flops = sum(flops(m, n, coefficients, "standard") for m, n in shapes)
    out.update(n_matrices=len(shapes), shapes=sorted(set(shapes)), ns_gflop_per_step=ns_flops / 1e9)
    p0, grads = _make(ctx, shapes, seed=20, count=2)
    grads = [g * 0.05 for g in grads]
    results: dict[str, Any] = out.setdefault("variants", {})
    eager_after: list[torch.Tensor] | None = None
    for variant in VARIANTS[set_name]:
        limit = ctx.left() - ctx.reserve_after(set_name) - 5
        skip = (
            f"{limit:.0f} s of the budget left for it" if limit < (45 if variant == "torch.compile" else 15) else None
        )
        if variant == "torch.compile" and ctx.smoke:
            skip = "smoke: Inductor's CPU compile (~40 s) is not what this run checks"
        if skip:
            results[variant] = {"skipped": skip}
            print(f"    {variant}: skipped ({skip})", flush=True)
            continue
        guard = {"expired": False}
        try:
            with _time_limit(limit) as guard:
                res, after = run_variant(ctx, set_name, variant, p0, grads, eager_after)
            eager_after = after if variant == "eager" else eager_after
        except Exception as exc:  # noqa: BLE001
            res = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(limit=8)}
            res["timed_out"] = guard["expired"]
            if variant == "torch.compile" and guard["expired"]:
                ctx.compile_first_s[set_name] = float("inf")
            ctx.check(f"{set_name}: {variant} ran", False)
            print(f"    {variant}: ERROR {res['error']}", flush=True)
        results[variant] = res
        gc.collect()
        if ctx.cuda:
            torch.cuda.empty_cache()
        ctx.save()
    eager = results.get("eager", {}).get("median_s")
    compiled = results.get("torch.compile", {}).get("median_s")
    for variant, res in results.items():
        if "median_s" not in res:
            continue
        res["vs_eager"] = eager / res["median_s"] if eager else None
        res["vs_torch_compile"] = compiled / res["median_s"] if compiled else None
        res["ns_tflops"] = ns_flops / res["median_s"] / 1e12
        fmt = lambda x, f: "-" if x is None else format(x, f)  # noqa: E731
        print(
            f"  {set_name:<6}{variant:<14} first {res['first_call_s']:7.2f} s  steady {res['median_s'] * 1e3:9.3f} ms"
            f"  x{fmt(res['vs_eager'], '.2f')} vs eager  {res['ns_tflops']:7.1f} TFLOP/s  launches "
            f"{res.get('launches', '-')} (profiler {res['profiler'].get('device_kernels')})  peak +"
            f"{res.get('step_peak_extra_mb', '-')} MB  d-update {fmt(res.get('max_rel_update_diff_vs_eager'), '.2e')}",
            flush=True,
        )
    ctx.save()


# ---------------------------------------------------------------- main


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, Triton interpreter, tiny shapes")
    choices = SECTIONS + tuple(ALIASES)
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {choices}")
    parser.add_argument("--out", type=Path, default=None, help="the JSON report (the .md is written beside it)")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help=f"soft limit in seconds (default {BUDGET_S:.0f}, smoke 900): later work is skipped past it",
    )
    args = parser.parse_args()
    args.budget_s = args.budget_s or (900.0 if args.smoke else BUDGET_S)
    sections = [x for s in args.sections.split(",") if s for x in ALIASES.get(s, (s,))]
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}; choose from {choices}")
    if not args.smoke and not torch.cuda.is_available():
        parser.error("no CUDA device: run with --smoke on a CPU machine")
    arch = device_arch(torch.device("cpu" if args.smoke else "cuda"))
    args.out = args.out or Path(__file__).resolve().parent / "results" / f"gpu-{arch}.json"
    ctx = Ctx(args)
    ctx.sections = sections
    estimate = {name: ESTIMATE_S[name] for name in sections}
    ctx.data.update(arch=arch, estimate_h200_s=estimate, estimate_h200_total_s=sum(estimate.values()))
    print(f"gpu_check: sections {sections}, results -> {args.out}", flush=True)
    print(
        "estimate on one H200 (cold caches; see ESTIMATE_S): "
        + ", ".join(f"{k} {v:.0f} s" for k, v in estimate.items())
        + f"; total {sum(estimate.values()):.0f} s of the {BUDGET_S:.0f} s budget",
        flush=True,
    )
    runners: dict[str, Callable[[dict[str, Any]], None]] = {
        "env": lambda o: section_env(ctx, o),
        "kernels": lambda o: section_kernels(ctx, o),
        "step": lambda o: section_step(ctx, o),
        "fence": lambda o: gpu_check_fence.section(ctx, o),
        "gpt2": lambda o: section_timing(ctx, "gpt2", o),
        "large": lambda o: section_timing(ctx, "large", o),
        "shampoo_family": lambda o: gpu_check_shampoo.section(ctx, o, _make, _timed, _time_limit),
        "distributed": lambda o: gpu_check_dist.section(ctx, o),
    }
    for name in sections:
        print(f"== {name} ({time.perf_counter() - ctx.start:.0f} s elapsed, {ctx.left():.0f} s left)", flush=True)
        out: dict[str, Any] = ctx.data["sections"].setdefault(name, {})
        out["estimate_s"] = ESTIMATE_S[name]
        start = time.perf_counter()
        try:
            runners[name](out)
        except Exception as exc:  # noqa: BLE001
            out["error"] = f"{type(exc).__name__}: {exc}"
            out["traceback"] = traceback.format_exc(limit=10)
            ctx.check(f"{name}: section ran", False)
            print(f"  ERROR {out['error']}\n{out['traceback']}", flush=True)
        out["seconds"] = round(time.perf_counter() - start, 2)
        ctx.save()
    report = gpu_check_report.write_markdown(ctx.data, args.out.with_suffix(".md"))
    print(
        f"== done in {time.perf_counter() - ctx.start:.0f} s; {len(ctx.failures)} failure(s)"
        + "".join(f"\n  FAILED {f}" for f in ctx.failures)
        + f"\nwrote {args.out} and {report}",
        flush=True,
    )
    return 0 if not ctx.failures else 1


if __name__ == "__main__":
    sys.exit(main())
