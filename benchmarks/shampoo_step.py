"""Shampoo steps, eager vs hocompile-compiled, on the four-matrix set of issue 12.

    .venv/bin/python benchmarks/shampoo_step.py                  # writes benchmarks/results/shampoo_step.md
    .venv/bin/python benchmarks/shampoo_step.py --periods 1 --out /tmp/x.md   # quicker

Params (256,1024)×2, (1024,256), (512,512), fp32, Shampoo defaults (eigh roots,
Adam grafting, max_preconditioner_dim=1024) with precondition_frequency=10.
Both optimizers first run one whole period plus the next refresh untimed, so
the compiled one has built its three variants (first step, steps between
refreshes, refresh). Then each timed period of 10 steps runs every step on
both, interleaved (eager then compiled, order swapped every period) so that a
busy neighbour slows both alike. Reported: the median step between refreshes,
the median refresh step, and the median over periods of (period time / 10),
the amortised cost per step. Grads are fixed seeded tensors, cycled.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

import hocompile
from hocompile.optimizers import Shampoo

SHAPES = [(256, 1024), (256, 1024), (1024, 256), (512, 512)]
ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "shampoo_step.md"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def load_average() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "n/a"


def busy_note(load: str) -> list[str]:
    """A warning line when other processes held the CPUs: then absolute times drift between runs."""
    try:
        busy = float(load.split()[0]) > (os.cpu_count() or 1)
    except (ValueError, IndexError):
        return []
    if not busy:
        return []
    return [
        f"Note: the machine was shared (1-min load {load.split()[0]} on {os.cpu_count()} CPUs): absolute "
        "times drift by tens of percent between runs; only the interleaved ratios are comparable.",
        "",
    ]


def make_params(seed: int) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=gen) * 0.02) for shape in SHAPES]


def timed_step(opt: torch.optim.Optimizer, params: list[torch.nn.Parameter], grads: list[torch.Tensor]) -> float:
    for p, g in zip(params, grads):
        p.grad = g
    start = time.perf_counter()
    opt.step()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--periods", type=int, default=5, help="timed refresh periods (default 5)")
    parser.add_argument("--frequency", type=int, default=10, help="precondition_frequency (default 10)")
    parser.add_argument("--root-method", default="eigh", choices=["eigh", "newton"])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    freq = args.frequency
    kw = dict(lr=1e-3, precondition_frequency=freq, root_method=args.root_method)
    gen = torch.Generator().manual_seed(1)
    grad_sets = [[torch.randn(shape, generator=gen) for shape in SHAPES] for _ in range(4)]
    eager_params, compiled_params = make_params(0), make_params(0)
    eager = Shampoo(eager_params, **kw)
    compiled = hocompile.compile_optimizer(
        Shampoo(compiled_params, **kw),
        cache_dir=tempfile.mkdtemp(prefix="hocompile-shampoo-bench-"),
    )
    load_before = load_average()
    # Untimed: steps 1 .. freq+1, so every compiled variant exists (step 1, 2, freq+1).
    first = {"eager": 0.0, "compiled": 0.0}
    for step in range(freq + 1):
        grads = grad_sets[step % len(grad_sets)]
        first["eager"] += timed_step(eager, eager_params, grads)
        first["compiled"] += timed_step(compiled, compiled_params, grads)
    times: dict[str, dict[str, list[float]]] = {
        name: {"between": [], "refresh": [], "period": []} for name in ("eager", "compiled")
    }
    runners = {"eager": (eager, eager_params), "compiled": (compiled, compiled_params)}
    step = freq + 1  # the last untimed step was a refresh: the next period starts after it
    for period in range(args.periods):
        order = ("eager", "compiled") if period % 2 == 0 else ("compiled", "eager")
        totals = dict.fromkeys(order, 0.0)
        for _ in range(freq):
            step += 1
            refresh = (step - 1) % freq == 0
            grads = grad_sets[step % len(grad_sets)]
            for name in order:
                opt, params = runners[name]
                seconds = timed_step(opt, params, grads)
                totals[name] += seconds
                times[name]["refresh" if refresh else "between"].append(seconds)
        for name in order:
            times[name]["period"].append(totals[name] / freq)
    counters = compiled.counters
    # The steady variant (the steps between refreshes) is the second compiled entry.
    steady_source = compiled.history[1].lowered.source if compiled.history[1].lowered is not None else ""
    writebacks = steady_source.count("aten.copy_.default(")
    worst = max(float((a.detach() - b.detach()).abs().max()) for a, b in zip(eager_params, compiled_params))

    def ms(name: str, kind: str) -> float:
        return statistics.median(times[name][kind]) * 1e3

    rows = []
    for kind, label in (
        ("between", "step between refreshes (median)"),
        ("refresh", "refresh step (median)"),
        ("period", f"amortised per step over a period of {freq} (median of periods)"),
    ):
        e, c = ms("eager", kind), ms("compiled", kind)
        rows.append(f"| {label} | {e:.1f} | {c:.1f} | {e / c:.2f}× |")
    command = " ".join(shlex.quote(a) for a in [".venv/bin/python", "benchmarks/shampoo_step.py", *sys.argv[1:]])
    lines = [
        "# Shampoo step: eager vs hocompile (CPU, aten backend)",
        "",
        f"Command: `{command}`  ",
        f"CPU: {cpu_model()}, {os.cpu_count()} logical CPUs, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads; load average before/after: {load_before} / {load_average()}  ",
        f"Params: {', '.join(f'{r}×{c}' for r, c in SHAPES)} fp32; Shampoo(lr=1e-3, "
        f"precondition_frequency={freq}, root_method={args.root_method!r}), other options default "
        "(Adam grafting, epsilon=1e-12, max_preconditioner_dim=1024).  ",
        f"{args.periods} timed periods ({args.periods * (freq - 1)} steps between refreshes and "
        f"{args.periods} refreshes per variant), interleaved; untimed warm-up of {freq + 1} steps "
        f"(eager {first['eager']:.1f} s, compiled {first['compiled']:.1f} s including its compiles).",
        "",
        "| | eager ms | compiled ms | speed-up |",
        "|---|---:|---:|---:|",
        *rows,
        "",
        f"Compiled: {counters.compiles} compiles ({len(counters.recompiles)} counted as recompiles: "
        f"{'; '.join(counters.recompiles) or 'none'}), {counters.cache_hits} cache hits, "
        f"{counters.eager_fallbacks} eager fallbacks. Max |param eager − compiled| after "
        f"{step} steps: {worst:.3g}.",
        "",
        *busy_note(load_before),
        "What the compiled step runs: eager's arithmetic, with the factor updates, the "
        "preconditioning products and the inverse roots as registered ops "
        "(`hocompile.factor_update`, `two_sided`, `inverse_root`); write-backs are re-inplaced "
        f"({writebacks} copies into a param or state tensor left per step between refreshes), and "
        "each eigh stays one LAPACK call per factor. Between refreshes the step is GEMM-bound at "
        "this CPU's fp32 rate (benchmarks/step_floor.py): at eager's FLOPs no plan can gain much.",
        "",
    ]
    text = "\n".join(lines)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
