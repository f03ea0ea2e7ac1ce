"""What the self-check (on by default) costs: per check, per step, and averaged over 1,000 steps.

    .venv/bin/python benchmarks/self_check.py                       # GPT-2-small and Qwen3-30B-A3B's count
    .venv/bin/python benchmarks/self_check.py --models gpt2 --steps 12

Per model, torch.optim.Muon over the hidden matrices and torch.optim.AdamW over the rest, each
wrapped by ``hocompile.compile_optimizer`` with the default settings (self-check on), are stepped
together as a training step would, for ``--steps`` steps with fresh seeded grads each:

- per check: the seconds the self-check spent on copies (``entry.self_check.each``: the compiled
  program and eager on the sampled members, eager once more under another summation order where a
  planned tensor is not eager's bits), summed over both optimizers;
- per step: the median wall time of the steps where neither checked (the compiled steps alone);
- over 1,000 steps: a program's steps 1, 2, 4, …, 512 and 1,000 are checked (11 checks; the
  first-step program once, the steady one ten times: its first check on two members per class,
  the later ones on one), so the average overhead is ``sum of the checks' seconds / (1,000 ×
  step)``, with the first-program check, the steady program's first check and the mean of its
  later checks as measured here.

Models: ``gpt2``, GPT-2 small at its real size (124M: 48 hidden matrices to Muon, embeddings, biases
and norms to AdamW); ``qwen3``, Qwen3-30B-A3B's parameter count (18,867 params) with every dimension
divided by ``--scale`` (benchmarks/structures.py). Results: benchmarks/results/self_check.md.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import hocompile  # noqa: E402
from benchmarks.structures import build  # noqa: E402
from hocompile.runtime.check import self_check  # noqa: E402
from hocompile.runtime.check.self_check import CHECK_EVERY, SelfCheck, check_now, due  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "self_check.md"


def gpt2_small() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """GPT-2 small's params (HF Conv1D layout): 12 layers of attention and MLP matrices, to Muon;
    token and position embeddings, biases and layer norms, to AdamW."""
    gen = torch.Generator().manual_seed(0)

    def p(*shape: int) -> torch.nn.Parameter:
        return torch.nn.Parameter(torch.randn(*shape, generator=gen) * 0.02)

    d = 768
    muon: list[torch.Tensor] = []
    adamw: list[torch.Tensor] = [p(50257, d), p(1024, d)]
    for _ in range(12):
        muon += [p(d, 3 * d), p(d, d), p(d, 4 * d), p(4 * d, d)]
        adamw += [p(3 * d), p(d), p(4 * d), p(d), p(d), p(d), p(d), p(d)]  # biases, ln_1, ln_2
    return muon, adamw + [p(d), p(d)]  # ln_f


def params_for(model: str, scale: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    if model == "gpt2":
        return gpt2_small()
    return build("qwen3", scale=scale)


def measure(model: str, scale: int, steps: int, cache_dir: str) -> dict[str, Any]:
    muon_params, adamw_params = params_for(model, scale)
    opts = [
        hocompile.compile_optimizer(torch.optim.Muon(muon_params, lr=0.02), cache_dir=cache_dir),
        hocompile.compile_optimizer(torch.optim.AdamW(adamw_params, lr=1e-3), cache_dir=cache_dir),
    ]
    params = muon_params + adamw_params
    gen = torch.Generator().manual_seed(1)
    walls: list[tuple[float, bool]] = []
    budget, self_check.BUDGET = self_check.BUDGET, math.inf  # every scheduled check runs, to be measured
    for step in range(1, steps + 1):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).mul_(0.01)
        before = [sum(e.self_check.checks for e in o.history) for o in opts]
        started = time.perf_counter()
        for o in opts:
            o.step()
        wall = time.perf_counter() - started
        checked = [sum(e.self_check.checks for e in o.history) for o in opts] != before
        walls.append((wall, checked))
        print(f"  {model} step {step}: {wall:.3f} s{' (checked)' if checked else ''}", flush=True)
    self_check.BUDGET = budget
    first = [o.history[0].self_check for o in opts]
    steady = [o.history[-1].self_check for o in opts]
    fallbacks = [e.fallback for o in opts for e in o.history if e.fallback]
    if fallbacks:  # reported, not hidden: a program the check sent to eager has no later checks to measure
        print("\n".join(["FALLBACK: " + f for f in fallbacks]))
        return {"model": model, "fallbacks": fallbacks}
    step_s = statistics.median(w for w, checked in walls[2:] if not checked)
    per_opt = []
    for name, f, r in zip(("Muon", "AdamW"), first, steady):
        step = r.step_seconds / r.runs  # this program's own compiled steps, checks not counted
        costs = (f.each[0], r.each[0], statistics.mean(r.each[1:]))
        per_opt.append((name, step, costs, *over_1000(costs, step)))
    total = sum(o[3] for o in per_opt)  # (name, step, costs, budgeted seconds, bare seconds, checks run)
    unbudgeted = sum(o[4] for o in per_opt)
    return {
        "model": model,
        "params": len(params),
        "members": sum(r.members for r in steady),
        "step_s": step_s,
        "per_opt": per_opt,
        "overhead_1000": total / (CHECK_EVERY * sum(o[1] for o in per_opt)),
        "unbudgeted_1000": unbudgeted / (CHECK_EVERY * sum(o[1] for o in per_opt)),
        "worst": [r.worst for r in steady],
    }


def over_1000(costs: tuple[float, float, float], step: float) -> tuple[float, float, int]:
    """Seconds of checking over 1,000 steps of one optimizer, as the runtime schedules it (self_check.check_now,
    with the measured costs: first program, steady first, steady later) and as the bare schedule would; and
    how many of the steady program's checks run."""
    first, steady_first, later = costs
    record = SelfCheck()
    for run in range(1, CHECK_EVERY):  # the steady program's runs (step 1 was the first program's)
        record.runs = run
        if check_now(record):
            cost = steady_first if record.checks == 0 else later
            record.checks += 1
            record.each.append(cost)
            record.seconds += cost
        record.step_seconds += step
    bare = first + steady_first + (sum(due(n) for n in range(1, CHECK_EVERY)) - 1) * later
    return first + record.seconds, bare, record.checks


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    from hocompile.targets import cpu_target

    rates = cpu_target(Path(tempfile.gettempdir()) / "hocompile-bench-target").gflops
    return (f"{cpu}, {os.cpu_count()} cores ({torch.get_num_threads()} torch threads), torch {torch.__version__}, "
            f"GEMM GFLOP/s as hocompile measured them: " + ", ".join(f"{k} {v:.0f}" for k, v in rates.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["gpt2", "qwen3"], choices=["gpt2", "qwen3"])
    parser.add_argument("--steps", type=int, default=9, help="steps per model (checks at 1, 2, 3, 5, 9)")
    parser.add_argument("--scale", type=int, default=16, help="qwen3: every dimension divided by this")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as cache_dir:
        for model in args.models:
            rows.append(measure(model, args.scale, args.steps, cache_dir))
    lines = [
        "# Self-check cost",
        "",
        f"Machine: {machine()}.",
        "",
        f"Command: `{' '.join(['python', *sys.argv])}` ({datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC).",
        "",
        "Each optimizer is its own program with its own budget (1 % of its compiled steps' time plus 1 s; "
        "a program's first check always runs). Per check: seconds on copies (the compiled program and eager "
        "on sampled members, eager once more under another summation order where planned tensors are not "
        "eager's bits). Step: the program's own compiled step. Over 1,000 steps: "
        "the check seconds of 1,000 steps as the runtime schedules them (self_check.check_now run on the "
        "measured costs) / (1,000 × step); 'without budget': every scheduled check (1, 2, 4, …, 512, 1,000).",
        "",
        "| model | optimizer | its compiled step s | check s: first program | steady, first | steady, later (mean) "
        "| later check / step | steady checks run in 1,000 steps | overhead, 1,000 steps (budgeted) | without budget |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "fallbacks" in r:
            why = "; ".join(r["fallbacks"])[:300]
            lines.append(f"| {r['model']} | a program fell back to eager: {why} |" + " |" * 8)
            continue
        for name, step, costs, total, bare, checks in r["per_opt"]:
            lines.append(
                f"| {r['model']} | {name} | {step:.3f} | {costs[0]:.3f} | {costs[1]:.3f} | {costs[2]:.3f} | "
                f"{costs[2] / step:.2f} | {checks} of 10 | {100 * total / (CHECK_EVERY * step):.2f} % | "
                f"{100 * bare / (CHECK_EVERY * step):.2f} % |"
            )
        lines.append(
            f"| {r['model']} | **both** | {sum(o[1] for o in r['per_opt']):.3f} | | | | | | "
            f"**{100 * r['overhead_1000']:.2f} %** | {100 * r['unbudgeted_1000']:.2f} % |"
        )
    lines += ["", "Closest planned tensor to its bound on the last check, per model (Muon, AdamW):", ""]
    lines += [f"- {r['model']}: {'; '.join(w or 'all bitwise' for w in r['worst'])}" for r in rows if "worst" in r]
    text = "\n".join(lines) + "\n"
    print(text)
    RESULTS.write_text(text)


if __name__ == "__main__":
    main()
