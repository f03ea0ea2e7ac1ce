"""A step that calls a torch.compile'd helper per param (emerging-optimizers' Lion), eager vs hocompile.

    .venv/bin/python benchmarks/compiled_helper_step.py                  # 400 params, 30 timed steps
    .venv/bin/python benchmarks/compiled_helper_step.py --params 40 --steps 5   # smoke run

Eager calls the user's Inductor-compiled update once per param; hocompile runs each call as the user
compiled it (an opaque ``hocompile_torch::compiled_call``), the rest of the step as its plan. Both run
in one process on identical params and grads, their steady steps interleaved (round r runs each once,
order alternating), so load from elsewhere hits them alike. Reported: the first step of each, the
median steady step, the ratio, and whether params and momenta are bitwise eager's after the run.
Results are appended to benchmarks/results/compiled_helper_step.md with the machine.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
import types
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

OUT = Path(__file__).resolve().parent / "results" / "compiled_helper_step.md"
SHAPES = [(64, 64), (64,), (128, 64), (32,)]


@torch.no_grad()
def _lion_update(grad: torch.Tensor, exp_avg: torch.Tensor, *, betas: tuple[float, float], step: int) -> torch.Tensor:
    beta1, beta2 = betas
    update = exp_avg.lerp(grad, 1 - beta1)
    exp_avg.lerp_(grad, 1 - beta2)
    return torch.sign(update) / (1 - beta2**step)


helpers = types.ModuleType("helpers")
helpers.update = torch.compile(_lion_update)  # type: ignore[attr-defined]


class CompiledLion(torch.optim.Optimizer):
    def __init__(self, params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.99)) -> None:
        super().__init__(params, {"lr": lr, "betas": betas})

    @torch.no_grad()
    def step(self) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if not state:
                    state["exp_avg"], state["step"] = torch.zeros_like(p), 0
                state["step"] += 1
                update = helpers.update(p.grad, state["exp_avg"], betas=group["betas"], step=state["step"])
                p.add_(update, alpha=-group["lr"])


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params", type=int, default=400)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    import hocompile

    gen = torch.Generator().manual_seed(0)
    shapes = [SHAPES[i % len(SHAPES)] for i in range(args.params)]
    eager_params = [torch.nn.Parameter(torch.randn(*s, generator=gen)) for s in shapes]
    compiled_params = [torch.nn.Parameter(p.detach().clone()) for p in eager_params]
    eager = CompiledLion(eager_params)
    compiled = hocompile.compile_optimizer(CompiledLion(compiled_params), cache_dir=tempfile.mkdtemp())

    def grads(k: int) -> None:
        g = torch.Generator().manual_seed(100 + k)
        for p, q in zip(eager_params, compiled_params):
            p.grad = torch.randn(p.shape, generator=g)
            q.grad = p.grad.clone()

    times: dict[str, list[float]] = {"eager": [], "hocompile": []}
    first: dict[str, float] = {}
    load_before = os.getloadavg()[0]
    for k in range(args.steps + 2):
        grads(k)
        order = [("eager", eager), ("hocompile", compiled)]
        for name, opt in order if k % 2 == 0 else order[::-1]:
            t0 = time.perf_counter()
            opt.step()
            dt = time.perf_counter() - t0
            if k == 0:
                first[name] = dt
            elif k >= 2:  # the second step may still settle (self-check, Dynamo's cache)
                times[name].append(dt)
    bitwise = all(torch.equal(p, q) for p, q in zip(eager_params, compiled_params)) and all(
        torch.equal(eager.state[p]["exp_avg"], compiled.state[q]["exp_avg"])
        for p, q in zip(eager_params, compiled_params)
    )
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    ratio = med["eager"] / med["hocompile"]
    lines = [
        f"## {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {_cpu()}, {os.cpu_count()} cores, "
        f"torch {torch.__version__}",
        f"`{' '.join([Path(sys.argv[0]).name, *sys.argv[1:]])}`: {args.params} params, {args.steps} timed steps, "
        f"load {load_before:.1f} -> {os.getloadavg()[0]:.1f}",
        "",
        "| | first step | steady step (median) |",
        "|---|---|---|",
        f"| eager | {first['eager']:.2f} s | {med['eager']:.2f} ms |",
        f"| hocompile | {first['hocompile']:.2f} s | {med['hocompile']:.2f} ms |",
        "",
        f"speed-up {ratio:.2f}x; after {args.steps + 2} steps bitwise with eager (params, momenta): {bitwise}; "
        f"eager fallbacks {compiled.counters.eager_fallbacks}",
        "",
    ]
    print("\n".join(lines))
    OUT.parent.mkdir(parents=True, exist_ok=True)
    with OUT.open("a") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
