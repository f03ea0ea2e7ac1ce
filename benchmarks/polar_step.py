"""One MOP step (emerging-optimizers): eager vs hocompile with fuse-polar (exact SVD, opt-in gram_eigh).

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/polar_step.py   # issue 12's set, writes results/polar_step.md
    .venv/bin/python benchmarks/polar_step.py --rounds 3 --no-write      # smoke run

On a shared, loaded machine set ``OMP_WAIT_POLICY=PASSIVE``: with more
runnable threads than cores, OpenMP's spinning barriers made a 512×512 SVD
take 1.2 s instead of 0.12 s here (it must be set before torch loads).

Params (256,1024)×2, (1024,256), (512,512), fp32. Every variant steps its own
copy of the same params on the same grads; rounds are interleaved (eager,
then each compiled variant, then eager again...) so a load change on this
shared machine hits all variants alike, and the tables report medians. The
step is timed twice: with one intra-op thread in the stepping thread's CPU
seconds (robust to other processes on the machine), and with all threads
in wall-clock seconds. The first two calls of each variant are warmup
(capture + compile; the second compiles the step with state). "vs eager"
is the max-abs param difference after the first step, relative to the
largest param change eager made.

Then the polar factor of the stacked 3 × 256×1024 group alone: ATen's
batched call vs one matrix per thread (hocompile.ops.polar._per_matrix);
and each method's error against the fp64 SVD factor by condition number.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import typing
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

SHAPES = [(256, 1024), (256, 1024), (1024, 256), (512, 512)]
RESULTS = Path(__file__).parent / "results" / "polar_step.md"


def _mop(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    if not hasattr(typing, "override"):  # emerging-optimizers 0.3.0 imports typing.override (Python >= 3.12)
        import typing_extensions

        typing.override = typing_extensions.override  # type: ignore[attr-defined]
    from emerging_optimizers.orthogonalized_optimizers import MOP

    return MOP(params, lr=3e-4)


def variants(cache: str) -> dict[str, Callable[[list[torch.Tensor]], Any]]:
    """name -> builder(params) -> object with .step()."""
    from hocompile.passes import BatchByShape, Canonicalize
    from hocompile.passes.fuse_polar import FusePolar
    from hocompile.runtime import CompiledOptimizer
    from hocompile.settings import Settings

    settings = Settings.resolve(cache_dir=cache)

    def compiled(*passes: Any) -> Callable[[list[torch.Tensor]], Any]:
        return lambda params: CompiledOptimizer(_mop(params), settings, pipeline=(Canonicalize(), *passes))

    gram = FusePolar(method="gram_eigh")
    return {
        "eager MOP": _mop,
        "hocompile, no fuse-polar (aten svd)": compiled(),
        "hocompile polar svd": compiled(FusePolar()),
        "hocompile polar svd, batched": compiled(FusePolar(), BatchByShape(force=True)),
        "hocompile polar gram_eigh (opt-in)": compiled(gram),
        "hocompile polar gram_eigh (opt-in), batched": compiled(gram, BatchByShape(force=True)),
    }


def step_table(rounds: int, warmup: int, clock: Callable[[], float]) -> list[str]:
    gen = torch.Generator().manual_seed(0)
    start = [torch.randn(s, generator=gen) * 0.02 for s in SHAPES]
    grads = [torch.randn(s, generator=gen) for s in SHAPES]
    with tempfile.TemporaryDirectory() as cache:
        builders = variants(cache)
        params = {name: [p.clone() for p in start] for name in builders}
        opts = {name: build(params[name]) for name, build in builders.items()}
        times: dict[str, list[float]] = {name: [] for name in builders}
        first_diff: dict[str, float] = {}
        for r in range(warmup + rounds):
            for name, opt in opts.items():
                for p, g in zip(params[name], grads):
                    p.grad = g.clone()
                t0 = clock()
                opt.step()
                elapsed = clock() - t0
                if r >= warmup:
                    times[name].append(elapsed)
                if r == 0:
                    moved = max((p - s).abs().max().item() for p, s in zip(params["eager MOP"], start))
                    diff = max((p - q).abs().max().item() for p, q in zip(params[name], params["eager MOP"]))
                    first_diff[name] = diff / moved
            print(f"round {r + 1}/{warmup + rounds}: " + ", ".join(
                f"{n.split(' (')[0]} {1e3 * t[-1]:.0f}" for n, t in times.items() if t), flush=True)
    eager = statistics.median(times["eager MOP"])
    lines = [
        "| variant | median ms/step | min | max | speedup vs eager | vs eager after step 1 |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, ts in times.items():
        med = statistics.median(ts)
        same = "bitwise" if first_diff[name] == 0 else f"{first_diff[name]:.1e}"
        lines.append(f"| {name} | {1e3 * med:.1f} | {1e3 * min(ts):.1f} | {1e3 * max(ts):.1f} "
                     f"| {eager / med:.2f}x | {same} |")
    return lines


def pool_table(rounds: int) -> list[str]:
    from hocompile.ops.per_matrix import per_matrix
    from hocompile.ops.polar import polar_gram_eigh, polar_svd

    wide = torch.randn(3, 256, 1024, generator=torch.Generator().manual_seed(1))
    tall = wide.mT.contiguous()  # svd stacks tall (the faster orientation), gram_eigh wide
    Polar = Callable[[torch.Tensor, str], torch.Tensor]

    def batched(fn: Polar, x: torch.Tensor) -> Callable[[], Any]:
        return lambda: fn(x, "nuclear")

    def pooled(fn: Polar, x: torch.Tensor) -> Callable[[], Any]:
        return lambda: per_matrix(lambda m: fn(m, "nuclear"), x)

    calls: dict[str, Callable[[], Any]] = {}
    for method, fn, x in (("svd", polar_svd, tall), ("gram_eigh", polar_gram_eigh, wide)):
        calls[f"{method} {tuple(x.shape)}: ATen batched call"] = batched(fn, x)
        calls[f"{method} {tuple(x.shape)}: one matrix per thread"] = pooled(fn, x)
    times: dict[str, list[float]] = {name: [] for name in calls}
    for r in range(rounds + 1):
        for name, call in calls.items():
            t0 = time.perf_counter()
            call()
            if r:
                times[name].append(time.perf_counter() - t0)
    lines = ["| polar of the stacked group | median ms | min |", "|---|---:|---:|"]
    lines += [f"| {n} | {1e3 * statistics.median(t):.1f} | {1e3 * min(t):.1f} |" for n, t in times.items()]
    return lines


def error_table() -> list[str]:
    """Max-abs error of each method against the fp64 SVD factor, singular values log-spaced 1 … 1/κ."""
    from hocompile.ops.polar import gram_eigh_error_bound, polar_gram_eigh, polar_svd

    lines = ["| shape | κ | svd | gram_eigh | bound eps·(4 + κ²/4) |", "|---|---:|---:|---:|---:|"]
    for m, n in ((256, 1024), (512, 512)):
        for kappa in (1.0, 10.0, 100.0, 1000.0, 1e4):
            gen = torch.Generator().manual_seed(0)
            k = min(m, n)
            u, _ = torch.linalg.qr(torch.randn(m, k, generator=gen, dtype=torch.float64))
            v, _ = torch.linalg.qr(torch.randn(n, k, generator=gen, dtype=torch.float64))
            s = torch.logspace(0, -torch.log10(torch.tensor(kappa)).item(), k, dtype=torch.float64)
            x = ((u * s) @ v.T).float()
            exact = polar_svd(x.double(), "none")
            errs = [(f(x, "none").double() - exact).abs().max().item() for f in (polar_svd, polar_gram_eigh)]
            bound = gram_eigh_error_bound(kappa)
            lines.append(f"| {m}x{n} | {kappa:g} | {errs[0]:.1e} | {errs[1]:.1e} | {bound:.1e} |")
    return lines


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    threads = torch.get_num_threads()
    # One intra-op thread, timed in the main thread's CPU seconds: all the step's work runs on that
    # thread then, so time other processes take from it does not count. The robust comparison here.
    torch.set_num_threads(1)
    steps_cpu = step_table(args.rounds, args.warmup, time.thread_time)
    torch.set_num_threads(threads)
    steps_wall = step_table(args.rounds, args.warmup, time.perf_counter)
    pool = pool_table(args.rounds)
    errors = error_table()
    load = os.getloadavg()
    policy = f"OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']} " if "OMP_WAIT_POLICY" in os.environ else ""
    command = f"{policy}.venv/bin/python benchmarks/polar_step.py " + " ".join(sys.argv[1:])
    text = "\n".join([
        "# MOP step: eager vs hocompile fuse-polar",
        "",
        f"`{command.strip()}` — {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {cpu_model()}, "
        f"{os.cpu_count()} cores, torch {torch.__version__}, "
        f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}, load average at the end "
        f"{load[0]:.1f}/{load[1]:.1f}/{load[2]:.1f} (a shared machine).",
        "",
        f"Params {', '.join(f'{m}x{n}' for m, n in SHAPES)} (fp32), MOP lr 3e-4, nuclear-norm scale; "
        f"{args.rounds} interleaved rounds after {args.warmup} warmup calls each.",
        "",
        "**1 thread, CPU seconds of the stepping thread** (`time.thread_time`; insensitive to other load):",
        "",
        *steps_cpu,
        "",
        f"**{threads} threads, wall clock** (`time.perf_counter`; rounds interleaved so load hits every "
        "variant alike, but with more runnable threads than cores OpenMP barriers stall and times swing):",
        "",
        *steps_wall,
        "",
        f"**{threads} threads, wall clock**, the stacked group alone:",
        "",
        *pool,
        "",
        "Polar factor error, fp32, max-abs against the fp64 SVD factor (the bound is meant while "
        "eps·κ² ≪ 1; past κ ≈ 1/√eps gram_eigh drops the directions it cannot resolve):",
        "",
        *errors,
        "",
    ])
    print(text)
    if not args.no_write:
        RESULTS.write_text(text)
        print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
