"""What splitting a step at a host read costs: the same clipped-AdamW step with and without one.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/host_reads.py   # writes benchmarks/results/host_reads.md
    .venv/bin/python benchmarks/host_reads.py --params 4 --steps 5        # smoke run

Two optimizers differ only in where the global grad-norm clip factor lives:
*host read* computes ``total = sqrt(sum of squared norms)`` and reads it with
``.item()`` (``scale = min(1, max_norm / total)`` in Python, then ``alpha=``);
*device* keeps the same factor a tensor (``torch.clamp``), no sync. Both are
compiled with hocompile; the host-read step runs its read program first (the
norm), reads it, then the rest (hocompile/capture/host_reads.py). Adafactor (two reads
per param) is measured against its eager step too. Steps of all variants are
interleaved (round r runs each once, order rotated); the figure is the median.
Params are checked bitwise against eager after the run.
"""

from __future__ import annotations

import argparse
import os
import platform
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

import hocompile  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "host_reads.md"


class ClippedAdamW(torch.optim.Optimizer):
    """AdamW after a clip by the global grad norm; ``host_read`` picks where the clip factor lives."""

    def __init__(self, params: Any, host_read: bool, lr: float = 1e-3, max_norm: float = 1.0) -> None:
        super().__init__(params, {"lr": lr, "max_norm": max_norm, "betas": (0.9, 0.95), "eps": 1e-8})
        self.host_read = host_read

    @torch.no_grad()
    def step(self) -> None:  # type: ignore[override]
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            total = torch.stack([p.grad.norm() for p in params]).norm()
            if self.host_read:
                scale: Any = min(1.0, group["max_norm"] / (total.item() + 1e-6))
            else:
                scale = torch.clamp(group["max_norm"] / (total + 1e-6), max=1.0)
            beta1, beta2 = group["betas"]
            for p in params:
                state = self.state[p]
                if not state:
                    state["m"], state["v"] = torch.zeros_like(p), torch.zeros_like(p)
                g = p.grad * scale
                state["m"].lerp_(g, 1 - beta1)
                state["v"].mul_(beta2).addcmul_(g, g, value=1 - beta2)
                p.addcdiv_(state["m"], state["v"].sqrt().add_(group["eps"]), value=-group["lr"])


def _machine() -> str:
    model = platform.processor() or "unknown CPU"
    try:
        model = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    a = torch.randn(512, 512, dtype=torch.bfloat16)
    a @ a
    start = time.perf_counter()
    for _ in range(10):
        a @ a
    gflops = 10 * 2 * 512**3 / (time.perf_counter() - start) / 1e9
    return f"{model}, {os.cpu_count()} cores, bf16 512³ GEMM {gflops:.0f} GFLOP/s, torch {torch.__version__}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", type=int, default=48)
    ap.add_argument("--size", type=int, default=256)
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    shapes = [(args.size, args.size)] * args.params
    gen = torch.Generator().manual_seed(0)
    init = [torch.randn(s, generator=gen) * 0.02 for s in shapes]
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(2)]
    cache = tempfile.mkdtemp()
    variants: dict[str, tuple[Any, list[torch.Tensor]]] = {}
    makers: dict[str, Callable[[list[torch.Tensor]], Any]] = {
        "clip, host read: eager": lambda ps: ClippedAdamW(ps, True),
        "clip, host read: hocompile": lambda ps: hocompile.compile_optimizer(ClippedAdamW(ps, True), cache_dir=cache),
        "clip, on device: hocompile": lambda ps: hocompile.compile_optimizer(ClippedAdamW(ps, False), cache_dir=cache),
        "Adafactor: eager": lambda ps: torch.optim.Adafactor(ps, lr=1e-3),
        "Adafactor: hocompile": lambda ps: hocompile.compile_optimizer(torch.optim.Adafactor(ps, lr=1e-3),
                                                                      cache_dir=cache),
    }
    first: dict[str, float] = {}
    for name, make in makers.items():
        params = [p.clone() for p in init]
        opt = make(params)
        for p, g in zip(params, grads[0]):
            p.grad = g.clone()
        start = time.perf_counter()
        opt.step()
        opt.step()  # the steady state (state created on the first)
        first[name] = time.perf_counter() - start
        variants[name] = (opt, params)
    times: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for r in range(args.steps):
        for name in names[r % len(names):] + names[: r % len(names)]:
            opt, params = variants[name]
            for p, g in zip(params, grads[r % 2]):
                p.grad.copy_(g)
            start = time.perf_counter()
            opt.step()
            times[name].append(time.perf_counter() - start)
    med = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    same_clip = all(torch.equal(a, b) for a, b in zip(variants[names[0]][1], variants[names[1]][1]))
    same_ada = all(torch.equal(a, b) for a, b in zip(variants[names[3]][1], variants[names[4]][1]))
    ratio = med["clip, on device: hocompile"] / med["clip, host read: hocompile"]
    lines = [
        "# A step split at a host read, against the same step without one",
        "",
        f"Machine: {_machine()}.",
        f"Command: `OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/host_reads.py --params {args.params} "
        f"--size {args.size} --steps {args.steps}` ({args.params} params of {args.size}×{args.size}).",
        "",
        "| variant | first two steps (s) | median step (ms) |",
        "|---|---|---|",
        *[f"| {name} | {first[name]:.2f} | {med[name]:.2f} |" for name in names],
        "",
        f"Host-read step against the device-only step (both compiled): **{ratio:.2f}×** its speed "
        "(target ≥ 0.9×).",
        f"Compiled host-read clip bitwise eager's: {same_clip}; compiled Adafactor bitwise eager's: {same_ada}.",
        f"Compiled against eager: clip with a host read {med[names[0]] / med[names[1]]:.2f}×, "
        f"Adafactor {med[names[3]] / med[names[4]]:.2f}×.",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    OUT.write_text(text)


if __name__ == "__main__":
    main()
