"""The ways to compile a Muon step, side by side: compile time (first two steps) and step time.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/torch_compile_paths.py   # writes results/torch_compile_paths.md
    .venv/bin/python benchmarks/torch_compile_paths.py --matrices 4 --steps 3      # smoke run

Variants, each on its own copy of the same params (torch.optim.Muon, a tensor lr, cosine
schedule so every step has a new lr), steps interleaved (round r runs each once), median:

- eager: ``opt.step()``;
- ``torch.compile(opt.step)`` (Inductor, torch's default);
- ``torch.compile(opt.step, backend="hocompile")`` (hocompile's passes and aten lowering);
- ``torch.compile(opt.step)`` with ``hocompile.inductor_passes()`` installed (NS fused in Inductor);
- ``hocompile.compile_optimizer(opt)`` (hocompile's own capture: one trace per parameter class).

``--scale`` also times the first step alone at 4x the matrices for the Dynamo backend and for
compile_optimizer: Dynamo traces every param (its cost grows with them), compile_optimizer traces
one representative per class.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from host_reads import _machine  # noqa: E402  (benchmarks/ is on sys.path when run as a script)

import hocompile  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "torch_compile_paths.md"


def _shapes(n: int, size: int) -> list[tuple[int, int]]:
    """GPT-style: square, 4x wide and 4x tall matrices in turn."""
    cycle = [(size, size), (size, 4 * size), (4 * size, size)]
    return [cycle[k % 3] for k in range(n)]


class Variant:
    def __init__(self, name: str, shapes: list[tuple[int, int]], make_step: Callable[[Any], Callable[[], Any]]) -> None:
        gen = torch.Generator().manual_seed(0)
        self.name = name
        self.params = [torch.nn.Parameter(torch.randn(s, generator=gen) * 0.02) for s in shapes]
        self.opt = torch.optim.Muon(self.params, lr=torch.tensor(0.02))
        self.schedule = torch.optim.lr_scheduler.CosineAnnealingLR(self.opt, T_max=1000)
        self.step_fn = make_step(self.opt)
        self.times: list[float] = []
        self.first = 0.0

    def step(self, grads: list[torch.Tensor]) -> float:
        for p, g in zip(self.params, grads):
            p.grad = g.clone()
        start = time.perf_counter()
        self.step_fn()
        elapsed = time.perf_counter() - start
        self.schedule.step()
        return elapsed


def _makers(cache: str) -> dict[str, Callable[[Any], Callable[[], Any]]]:
    pre, post = hocompile.inductor_passes(cache_dir=cache)

    def with_passes(opt: Any) -> Callable[[], Any]:
        compiled = torch.compile(opt.step)

        def run() -> Any:
            with torch._inductor.config.patch(post_grad_custom_pre_pass=pre, post_grad_custom_post_pass=post):
                return compiled()

        return run

    return {
        "eager": lambda opt: opt.step,
        "torch.compile (Inductor)": lambda opt: torch.compile(opt.step),
        "torch.compile, backend=hocompile": lambda opt: torch.compile(
            opt.step, backend="hocompile", options={"cache_dir": cache}
        ),
        "torch.compile + hocompile.inductor_passes()": with_passes,
        "hocompile.compile_optimizer": lambda opt: hocompile.compile_optimizer(opt, cache_dir=cache).step,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--matrices", type=int, default=12)
    ap.add_argument("--size", type=int, default=128)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--scale", type=int, default=4, help="also time the first step at this many times the matrices")
    args = ap.parse_args()
    torch._inductor.config.fx_graph_cache = False  # every variant compiles afresh: compile times comparable
    cache = tempfile.mkdtemp()
    shapes = _shapes(args.matrices, args.size)
    gen = torch.Generator().manual_seed(1)
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(2)]
    variants = []
    for name, make in _makers(cache).items():
        # (no dynamo reset between variants: they step interleaved; each optimizer is its own guard set)
        v = Variant(name, shapes, make)
        v.first = v.step(grads[0]) + v.step(grads[1])
        variants.append(v)
    for r in range(args.steps):
        order = variants[r % len(variants):] + variants[: r % len(variants)]
        for v in order:
            v.times.append(v.step(grads[r % 2]))
    eager = statistics.median(variants[0].times)
    rows = [
        f"| {v.name} | {v.first:.2f} | {statistics.median(v.times) * 1e3:.2f} | "
        f"{eager / statistics.median(v.times):.2f}× |"
        for v in variants
    ]
    ref = variants[-1].params
    same = {v.name: all(torch.equal(a, b) for a, b in zip(v.params, ref)) for v in variants}
    spread = {v.name: max(float((a - b).abs().max()) for a, b in zip(v.params, variants[0].params)) for v in variants}
    lines = [
        "# Compiling a Muon step: torch.compile with and without hocompile, and compile_optimizer",
        "",
        f"Machine: {_machine()}.",
        "Command: `OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/torch_compile_paths.py "
        f"--matrices {args.matrices} --size {args.size} --steps {args.steps} --scale {args.scale}` "
        f"({args.matrices} matrices of "
        f"{args.size}², {args.size}×{4 * args.size} and {4 * args.size}×{args.size}; torch.optim.Muon, tensor lr, "
        "cosine schedule; Inductor's FX-graph cache off).",
        "",
        "| variant | first two steps (s) | median step (ms) | speed vs eager |",
        "|---|---:|---:|---:|",
        *rows,
        "",
        "Largest param difference from eager after the run: "
        + ", ".join(f"{k}: {v:.1e}" for k, v in spread.items())
        + ". Bitwise equal to compile_optimizer's: "
        + ", ".join(f"{k}: {v}" for k, v in same.items() if k != variants[-1].name)
        + ".",
    ]
    if args.scale > 1:
        big = _shapes(args.matrices * args.scale, args.size)
        big_grads = [torch.randn(s, generator=gen) for s in big]
        scale_rows = []
        for name in ("torch.compile, backend=hocompile", "hocompile.compile_optimizer", "torch.compile (Inductor)"):
            for count, shape_list, g in ((args.matrices, shapes, grads[0]), (len(big), big, big_grads)):
                torch._dynamo.reset()
                v = Variant(name, shape_list, _makers(cache)[name])
                scale_rows.append(f"| {name} | {count} | {v.step(g):.2f} |")
        lines += [
            "",
            "First step alone as the matrices grow (Dynamo traces and guards every param; compile_optimizer "
            "traces one per parameter class and stamps the rest):",
            "",
            "| variant | matrices | first step (s) |",
            "|---|---:|---:|",
            *scale_rows,
        ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.matrices >= 12:
        OUT.write_text(text)


if __name__ == "__main__":
    main()
