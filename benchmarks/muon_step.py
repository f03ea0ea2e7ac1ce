"""One Muon step on real model shapes: eager, torch.compile, hocompile and peers, in one run.

    .venv/bin/python benchmarks/muon_step.py                       # GPT-2 small, all variants
    .venv/bin/python benchmarks/muon_step.py --shapes tiny          # smoke run, seconds
    .venv/bin/python benchmarks/muon_step.py --shapes d1024x24 --variants hocompile

Each variant runs in its own subprocess (so peak memory is its own and no
compile cache leaks between variants) on identical fp32 params and grads
(seeded), for warmup + timed calls: the first call is reported separately
(it includes capture/compile), the median of the timed ones is the steady
step. Memory: "peak MB" is the process's peak RSS growth from before the
optimizer was built (includes imports, compilers, state); "step MB" is what
the last (steady) call adds at its peak over the RSS it started with,
sampled every 2 ms. The parent then compares every variant's params with eager's
after one step and measures each implementation's Newton–Schulz error
against an fp64 evaluation of the same polynomial on one matrix per shape.

Every report names its machine (CPU model, this CPU's calibrated bf16/fp32 GEMM
rates) and the load average before and after: timings on the shared 2-core
hosts move with other processes (run with ``OMP_WAIT_POLICY=PASSIVE``, and
retry when ``uptime`` shows a load over 1.5). ``--plan-target cpu-avx2``
also prints the plan hocompile would make for a CPU of the other kind
(no bf16 units), from that kind's rates.

Variants: eager (torch.optim.Muon), torch.compile (of opt.step), hocompile
(compile_optimizer(torch.optim.Muon)), emerging (emerging_optimizers Muon with
Keller Jordan's coefficients, when installed), heavyball (heavyball.Muon, when
installed). Eager Muon runs its NS in bf16; on CPUs without a bf16 GEMM (this
project's AVX2 machines: ~0.7 GFLOP/s bf16 vs ~90 fp32) one GPT-2 step takes
~15 minutes, so the defaults time one steady step for the bf16 variants.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import typing
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

SHAPES: dict[str, list[tuple[int, int]]] = {
    "gpt2": [(768, 2304), (768, 768), (768, 3072), (3072, 768)] * 12,
    "d1024x24": [(1024, 3072), (1024, 1024), (1024, 4096), (4096, 1024)] * 24,
    "gpt2-layer": [(768, 2304), (768, 768), (768, 3072), (3072, 768)],
    "d1024-layer": [(1024, 3072), (1024, 1024), (1024, 4096), (4096, 1024)],
    "tiny": [(64, 192), (64, 64), (64, 256), (256, 64)] * 2,
}
MUON_KW: dict[str, Any] = {"lr": 0.02, "momentum": 0.95, "weight_decay": 0.01}
KJ = (3.4445, -4.775, 2.0315)
# (warmup calls, timed steady calls) per variant. hocompile compiles on its
# first two calls (the first creates the optimizer state); the bf16 variants
# are slow on AVX2 CPUs, so eager's single call is both its first and steady.
DEFAULT_CALLS = {
    "eager": (1, 0), "torch.compile": (1, 1), "hocompile": (2, 5), "emerging": (1, 0), "heavyball": (1, 1),
}
# Variants implementing torch.optim.Muon's update (comparable param for param).
SAME_UPDATE = {"eager", "torch.compile", "hocompile"}


def make_tensors(shapes: list[tuple[int, int]], seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=gen) * 0.02 for s in shapes]
    grads = [torch.randn(s, generator=gen) * 1e-3 for s in shapes]
    return params, grads


def build(variant: str, params: list[torch.Tensor]) -> Any:
    if variant in ("eager", "torch.compile", "hocompile"):
        opt = torch.optim.Muon(params, **MUON_KW)
        if variant == "torch.compile":
            return torch.compile(opt.step), opt
        if variant == "hocompile":
            import hocompile

            compiled = hocompile.compile_optimizer(opt)
            return compiled.step, compiled
        return opt.step, opt
    if variant == "emerging":
        if not hasattr(typing, "override"):
            import typing_extensions

            typing.override = typing_extensions.override  # type: ignore[attr-defined]
        from emerging_optimizers.orthogonalized_optimizers import Muon

        opt = Muon(params, lr=MUON_KW["lr"], momentum=MUON_KW["momentum"], weight_decay=MUON_KW["weight_decay"],
                   coefficient_type="simple", nesterov=True)
        return opt.step, opt
    if variant == "heavyball":
        import heavyball

        opt = heavyball.Muon(params, lr=MUON_KW["lr"])
        return opt.step, opt
    raise ValueError(variant)


class RssSampler:
    """Peak resident memory while running, sampled from /proc every few ms."""

    def __init__(self) -> None:
        import threading

        self.peak = self.now()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def now() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def _run(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, self.now())

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()


def child(args: argparse.Namespace) -> int:
    """Run one variant; write timings, peak memory and final params."""
    params, grads = make_tensors(SHAPES[args.shapes], args.seed)
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    step, opt = build(args.variant, params)
    times = []
    step_peaks = []
    for i in range(args.warmup + args.steps):
        for p, g in zip(params, grads):
            p.grad = g.clone()
        before = RssSampler.now()
        start = time.perf_counter()
        with RssSampler() as sampler:
            step()
        times.append(time.perf_counter() - start)
        step_peaks.append((sampler.peak - before) / 2**20)
        print(f"  {args.variant} call {i + 1}: {times[-1]:.3f} s", flush=True)
        if i == 0:  # variants run different numbers of calls: compare after the first
            torch.save([p.detach().clone() for p in params], args.params_out)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    steady = times[args.warmup:] or times[-1:]
    result: dict[str, Any] = {
        "first_call_s": times[0],
        "warmup_s": times[: args.warmup],
        "steady_s": steady,
        "median_steady_s": statistics.median(steady),
        "peak_rss_growth_mb": (peak - rss_before) / 1024,
        # memory the step itself adds at its peak (the last call: steady state)
        "step_peak_mb": step_peaks[-1],
        "step_peaks_mb": step_peaks,
    }
    if args.variant == "torch.compile":
        from torch._dynamo.utils import counters

        result["dynamo_unique_graphs"] = counters["stats"]["unique_graphs"]
    if args.variant == "hocompile":
        import hocompile

        result["explain"] = hocompile.explain(opt)
        result["counters"] = dict(opt.counters)
        # capture + passes (measurement included) + lowering of each compile, the steps excluded
        result["compile_s"] = [e.compile_seconds for es in opt._entries.values() for e in es]
    Path(args.result_out).write_text(json.dumps(result))
    return 0


def interleaved(args: argparse.Namespace, variants: list[str]) -> dict[str, Any]:
    """All variants in one process, one step each per round (``--interleave``): a busy neighbour
    slows every variant alike, so the ratios of the medians hold under load. Memory is each step's
    RSS growth in this shared process (allocator caches make it a lower bound)."""
    runs = {}
    for variant in variants:
        params, grads = make_tensors(SHAPES[args.shapes], args.seed)
        step, _ = build(variant, params)
        runs[variant] = (step, params, grads)
    times: dict[str, list[float]] = {v: [] for v in variants}
    peaks: dict[str, list[float]] = {v: [] for v in variants}
    warmups = {v: DEFAULT_CALLS[v][0] for v in variants}
    for round_ in range(max(warmups.values()) + args.steps):
        for variant in variants:
            if round_ < max(warmups.values()) - warmups[variant]:
                continue  # fewer warm-ups: start later, finish with the others
            step, params, grads = runs[variant]
            for p, g in zip(params, grads):
                p.grad = g.clone()
            before = RssSampler.now()
            start = time.perf_counter()
            with RssSampler() as sampler:
                step()
            times[variant].append(time.perf_counter() - start)
            peaks[variant].append((sampler.peak - before) / 2**20)
            print(f"  round {round_ + 1} {variant}: {times[variant][-1]:.3f} s", flush=True)
    results: dict[str, Any] = {}
    for variant in variants:
        steady = times[variant][warmups[variant]:] or times[variant][-1:]
        results[variant] = {
            "first_call_s": times[variant][0], "warmup_s": times[variant][: warmups[variant]], "steady_s": steady,
            "median_steady_s": statistics.median(steady), "peak_rss_growth_mb": float("nan"),
            "step_peak_mb": statistics.median(peaks[variant][warmups[variant]:] or peaks[variant][-1:]),
        }
        if variant == "hocompile":
            import hocompile

            compiled = runs[variant][0].__self__
            results[variant]["explain"] = hocompile.explain(compiled)
            results[variant]["compile_s"] = [e.compile_seconds for es in compiled._entries.values() for e in es]
    return results


def ns_errors(shapes: list[tuple[int, int]], variants: list[str], seed: int) -> dict[str, dict[str, float]]:
    """Relative NS error vs fp64 of the same polynomial, one matrix per distinct shape."""
    from torch.optim._muon import _zeropower_via_newtonschulz

    import hocompile
    from hocompile.ops.newton_schulz_math import newton_schulz, reference_fp64
    from hocompile.passes.choose_algorithm import decide, measured_plan
    from hocompile.precision.measure_ns import wall_timer
    from hocompile.precision.measure_session import MeasureSession
    from hocompile.settings import Settings
    from hocompile.targets import resolve_target

    target = resolve_target("auto", Settings.resolve().cache_dir)
    session = MeasureSession(target, wall_timer)  # the hocompile child's cached timings: nothing re-measured
    gen = torch.Generator().manual_seed(seed + 1)
    out: dict[str, dict[str, float]] = {}
    for shape in dict.fromkeys(shapes):
        g = torch.randn(shape, generator=gen)
        ref = reference_fp64(g, [KJ] * 5, 1e-7, transpose=shape[0] > shape[1])
        errs: dict[str, float] = {}
        if "eager" in variants or "torch.compile" in variants:
            errs["eager"] = _rel(_zeropower_via_newtonschulz(g, KJ, 5, 1e-7), ref)
        if "hocompile" in variants:
            m, n = min(shape), max(shape)
            plan = decide(m, n, 1, [KJ] * 5, torch.bfloat16, "auto", target)
            if target.measured:  # the thread count only: it never changes the bits
                plan = measured_plan(plan, m, n, 1, [KJ] * 5, session)
            x = newton_schulz(g, [KJ] * 5, 1e-7, transpose=shape[0] > shape[1], compute_dtype=plan.compute_dtype,
                              algorithm=plan.algorithm, restarts=plan.restarts, matmul=plan.matmul,
                              out_dtype=torch.bfloat16, blocks=plan.blocks)
            errs["hocompile"] = _rel(x, ref)
            errs["hocompile_plan"] = plan.label()  # type: ignore[assignment]
        out[f"{shape[0]}x{shape[1]}"] = errs
    del hocompile
    return out


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref).norm() / ref.norm()).item()


def machine() -> dict[str, Any]:
    """CPU model and this CPU's calibrated GEMM rates (hocompile's target calibration, cached)."""
    from hocompile.settings import Settings
    from hocompile.targets import resolve_target

    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), "unknown")
    flags = Path("/proc/cpuinfo").read_text()
    target = resolve_target("auto", Settings.resolve().cache_dir)
    return {"cpu": model, "avx512_bf16": "avx512_bf16" in flags, "amx_bf16": "amx_bf16" in flags,
            "gemm_gflops": {k: round(v, 1) for k, v in target.gflops.items()}}


def plan_for(target: str, shapes: list[tuple[int, int]], seed: int) -> str:
    """hocompile.plan for these shapes on ``target`` (a CPU of another kind: planned from its rates)."""
    import hocompile

    params, grads = make_tensors(shapes, seed)
    opt = torch.optim.Muon(params, **MUON_KW)
    for p, g in zip(params, grads):
        p.grad = g
    return hocompile.plan(opt, target=target)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", choices=sorted(SHAPES), default="gpt2")
    parser.add_argument("--variants", default="hocompile,eager,torch.compile,emerging",
                        help="comma-separated; also: heavyball")
    parser.add_argument("--steps", type=int, default=None, help="steady steps for every variant")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--no-ns-error", action="store_true")
    parser.add_argument("--interleave", action="store_true",
                        help="run the variants in one process, one step each per round (fair under load)")
    parser.add_argument("--plan-target", default=None,
                        help="also print the plan for this target (e.g. cpu-avx2: a CPU without bf16 units)")
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    parser.add_argument("--warmup", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--params-out", help=argparse.SUPPRESS)
    parser.add_argument("--result-out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant:
        return child(args)

    variants = [v for v in args.variants.split(",") if v]
    shapes = SHAPES[args.shapes]
    out = args.out or Path(f"benchmarks/results/muon_step_{args.shapes}.json")
    load_before = os.getloadavg()
    host = machine()
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs ({host['cpu']}, GEMM GFLOP/s {host['gemm_gflops']}); "
          f"{len(shapes)} matrices ({args.shapes}); variants {variants}; load average {load_before}", flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="hocompile-bench-"))
    results: dict[str, Any] = {}
    if args.interleave:
        args.steps = args.steps if args.steps is not None else 5
        results = interleaved(args, variants)
    for variant in [] if args.interleave else variants:
        warmup, steps = DEFAULT_CALLS[variant]
        steps = args.steps if args.steps is not None else steps
        cmd = [sys.executable, __file__, "--variant", variant, "--shapes", args.shapes, "--seed", str(args.seed),
               "--warmup", str(warmup), "--steps", str(steps), "--params-out", str(tmp / f"{variant}.pt"),
               "--result-out", str(tmp / f"{variant}.json")]
        print(f"running {variant} ({warmup} warmup + {steps} timed calls) ...", flush=True)
        start = time.perf_counter()
        proc = subprocess.run(cmd, check=False)
        if proc.returncode != 0:
            results[variant] = {"error": f"exit code {proc.returncode}"}
            continue
        results[variant] = json.loads((tmp / f"{variant}.json").read_text())
        results[variant]["wall_s"] = time.perf_counter() - start
    final = {v: torch.load(tmp / f"{v}.pt") for v in results if (tmp / f"{v}.pt").exists()}
    eager = results.get("eager", {}).get("median_steady_s")
    compiled = results.get("torch.compile", {}).get("median_steady_s")
    for v, res in results.items():
        if "error" in res:
            continue
        res["speedup_vs_eager"] = eager / res["median_steady_s"] if eager else None
        res["speedup_vs_torch_compile"] = compiled / res["median_steady_s"] if compiled else None
        if "eager" in final and v != "eager" and v in SAME_UPDATE:
            res["max_rel_param_diff_vs_eager"] = max(
                ((a - b).abs().max() / b.abs().max()).item() for a, b in zip(final[v], final["eager"])
            )
    load_after = os.getloadavg()
    errors = {} if args.no_ns_error else ns_errors(shapes, variants, args.seed)
    other_plan = plan_for(args.plan_target, shapes, args.seed) if args.plan_target else None

    print(f"\n{'variant':<14}{'first call s':>13}{'steady s':>11}{'vs eager':>10}{'vs t.compile':>13}"
          f"{'peak MB':>9}{'step MB':>9}{'d param':>10}")
    for v, res in results.items():
        if "error" in res:
            print(f"{v:<14} FAILED ({res['error']})")
            continue
        fmt = lambda x, f: "-" if x is None else format(x, f)  # noqa: E731
        print(f"{v:<14}{res['first_call_s']:>13.3f}{res['median_steady_s']:>11.3f}"
              f"{fmt(res['speedup_vs_eager'], '>10.2f')}{fmt(res['speedup_vs_torch_compile'], '>13.2f')}"
              f"{res['peak_rss_growth_mb']:>9.0f}{res['step_peak_mb']:>9.0f}"
              f"{fmt(res.get('max_rel_param_diff_vs_eager'), '>10.1e')}")
    for shape, errs in errors.items():
        print(f"NS error vs fp64 {shape}: " + ", ".join(
            f"{k} {v:.2e}" if isinstance(v, float) else f"{k} {v}" for k, v in errs.items()))
    if "hocompile" in results and "compile_s" in results["hocompile"]:
        print("hocompile compile s (capture + passes + measurement + lowering): "
              + ", ".join(f"{s:.2f}" for s in results["hocompile"]["compile_s"]))
    print(f"load average before {load_before}, after {load_after}")
    if other_plan:
        print(f"\nplan on {args.plan_target}:\n{other_plan}")
    report = {
        "benchmark": "muon_step",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join(["python", *sys.argv]),
        "git": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "machine": host,
        "load_average": {"before": load_before, "after": load_after},
        "plan_target": {args.plan_target: other_plan} if other_plan else None,
        "shapes": args.shapes,
        "n_matrices": len(shapes),
        "results": results,
        "ns_error_vs_fp64": errors,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
    return 0 if all("error" not in r for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
