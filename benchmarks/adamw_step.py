"""AdamW and SGD-momentum steps on GPT-2 small's 48 matrices: eager, foreach, fused, torch.compile, hocompile.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/adamw_step.py                  # both optimizers, all variants
    .venv/bin/python benchmarks/adamw_step.py --shapes tiny --steps 3                    # smoke run, seconds
    .venv/bin/python benchmarks/adamw_step.py --optimizers adamw --variants eager,fused,hocompile,hocompile+fused

All variants live in one process, each on its own copy of identical params
(seeded) with the same grads, and their steady steps are *interleaved*
(round r runs every variant once, in an order rotated each round), so load
from other processes hits them alike and the ratios come from one run. The
first calls (compile, state creation) are reported apart; the figure is the
median of the timed steps. After the run every variant's params are compared
with the eager for-loop's (same number of steps): bitwise, or the max abs
difference. Results are printed and written to benchmarks/results/adamw_step.md
with the machine (CPU model, cores, load average before and after).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from muon_step import SHAPES  # noqa: E402  (the benchmarks share one table of model shapes)

# hocompile: the default (bitwise eager: re-inplaced aten ops); hocompile+fused: opt-in fused kernels.
VARIANTS = ("eager", "foreach", "fused", "torch.compile", "hocompile", "hocompile+fused")
ADAMW_KW: dict[str, Any] = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
SGD_KW: dict[str, Any] = {"lr": 1e-2, "momentum": 0.9, "nesterov": True, "weight_decay": 1e-4}
OUT = Path(__file__).resolve().parent / "results" / "adamw_step.md"


def make_tensors(shapes: list[tuple[int, int]], seed: int) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """Initial params and, per step, grads (a few distinct sets, cycled: each step sees new values)."""
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=gen) * 0.02 for s in shapes]
    grads = [[torch.randn(s, generator=gen) * 1e-3 for s in shapes] for _ in range(2)]
    return params, grads


def build(optimizer: str, variant: str, params: list[torch.Tensor], cache_dir: str) -> tuple[Callable[[], Any], Any]:
    cls = torch.optim.AdamW if optimizer == "adamw" else torch.optim.SGD
    kw = dict(ADAMW_KW if optimizer == "adamw" else SGD_KW)
    if variant in ("eager", "torch.compile", "hocompile", "hocompile+fused"):
        kw["foreach"] = False
    elif variant == "foreach":
        kw["foreach"] = True
    elif variant == "fused":
        kw["fused"] = True
    opt = cls(params, **kw)
    if variant == "torch.compile":
        return torch.compile(opt.step), opt
    if variant.startswith("hocompile"):
        import hocompile

        # "hocompile+fused": the opt-in fused AdamW/SGD kernels (settings.py, HOCOMPILE_FUSED_UPDATES).
        before = os.environ.get("HOCOMPILE_FUSED_UPDATES")
        os.environ["HOCOMPILE_FUSED_UPDATES"] = "1" if variant == "hocompile+fused" else "0"
        try:
            compiled = hocompile.compile_optimizer(opt, cache_dir=cache_dir)
        finally:
            if before is None:
                del os.environ["HOCOMPILE_FUSED_UPDATES"]
            else:
                os.environ["HOCOMPILE_FUSED_UPDATES"] = before
        return compiled.step, compiled
    return opt.step, opt


def machine() -> str:
    model = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads"


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def run(optimizer: str, variants: list[str], shapes: list[tuple[int, int]], steps: int, warmup: int,
        seed: int, cache_dir: str) -> dict[str, Any]:
    init, grads = make_tensors(shapes, seed)
    states: dict[str, tuple[list[torch.Tensor], Callable[[], Any]]] = {}
    first: dict[str, list[float]] = {}
    for variant in variants:
        params = [p.clone() for p in init]
        step, _ = build(optimizer, variant, params, cache_dir)
        states[variant] = (params, step)
        first[variant] = []
    times: dict[str, list[float]] = {v: [] for v in variants}
    done = 0
    for r in range(warmup + steps):
        order = variants[r % len(variants):] + variants[: r % len(variants)]
        for variant in order:
            params, step = states[variant]
            for p, g in zip(params, grads[r % len(grads)]):
                p.grad = g
            start = time.perf_counter()
            step()
            elapsed = time.perf_counter() - start
            (first[variant] if r < warmup else times[variant]).append(elapsed)
        done += 1
        print(f"  {optimizer} round {r + 1}/{warmup + steps}: "
              + ", ".join(f"{v} {(first[v] if r < warmup else times[v])[-1] * 1e3:.1f} ms" for v in variants),
              flush=True)
    reference = states["eager"][0] if "eager" in states else None
    result: dict[str, Any] = {"median_ms": {}, "first_ms": {}, "diff": {}, "steps": done}
    for variant in variants:
        result["median_ms"][variant] = statistics.median(times[variant]) * 1e3
        result["first_ms"][variant] = [t * 1e3 for t in first[variant]]
        if reference is not None:
            params = states[variant][0]
            diff = max(float((a - b).abs().max()) for a, b in zip(params, reference))
            bitwise = all(torch.equal(a, b) for a, b in zip(params, reference))
            result["diff"][variant] = "bitwise" if bitwise else f"max |diff| {diff:.2e}"
    return result


def report(results: dict[str, dict[str, Any]], args: argparse.Namespace, loads: tuple[str, str], wall: float) -> str:
    n = sum(a * b for a, b in SHAPES[args.shapes])
    lines = [
        "# AdamW and SGD-momentum step (benchmarks/adamw_step.py)",
        "",
        f"- date: {datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}",
        f"- machine: {machine()}",
        f"- load average (1, 5, 15 min): before {loads[0]}; after {loads[1]}",
        f"- shapes: {args.shapes} ({len(SHAPES[args.shapes])} matrices, {n / 1e6:.1f} M params), fp32",
        f"- steps: {args.warmup} warm-up + {args.steps} timed per variant, interleaved; median; run took {wall:.0f} s",
        f"- command: `OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '')} .venv/bin/python "
        f"benchmarks/adamw_step.py {' '.join(sys.argv[1:])}`",
        f"- AdamW {ADAMW_KW}; SGD {SGD_KW}",
        "",
    ]
    for optimizer, result in results.items():
        eager = result["median_ms"].get("eager")
        fused = result["median_ms"].get("fused")
        lines += [f"## {optimizer}", "", "| variant | median step ms | vs eager | vs fused | first calls ms | "
                  f"params after {result['steps']} steps vs eager |", "|---|---|---|---|---|---|"]
        for variant, ms in result["median_ms"].items():
            vs_eager = f"{eager / ms:.2f}x" if eager else "-"
            vs_fused = f"{fused / ms:.2f}x" if fused else "-"
            firsts = ", ".join(f"{t:.0f}" for t in result["first_ms"][variant])
            lines.append(f"| {variant} | {ms:.1f} | {vs_eager} | {vs_fused} | {firsts} | "
                         f"{result['diff'].get(variant, '-')} |")
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="gpt2", choices=sorted(SHAPES))
    parser.add_argument("--optimizers", default="adamw,sgd")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2, help="first calls not timed (compile, state creation)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--cache-dir", default=None, help="hocompile cache dir (default: a fresh temporary one)")
    args = parser.parse_args()
    variants = args.variants.split(",")
    cache_dir = args.cache_dir or tempfile.mkdtemp(prefix="hocompile-adamw-")
    before = load()
    start = time.perf_counter()
    results = {}
    for optimizer in args.optimizers.split(","):
        results[optimizer] = run(optimizer, variants, SHAPES[args.shapes], args.steps, args.warmup, args.seed,
                                 cache_dir)
    text = report(results, args, (before, load()), time.perf_counter() - start)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
