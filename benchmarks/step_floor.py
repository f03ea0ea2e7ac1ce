"""How fast could a compiled step be at eager's arithmetic? The GEMM and LAPACK floor of an eager step.

    .venv/bin/python benchmarks/step_floor.py                  # SOAP and Shampoo on issue 12's params
    .venv/bin/python benchmarks/step_floor.py --optimizer shampoo --out /tmp/floor.md

Profiles one steady eager step (SOAP: the QR path; Shampoo: a step between
refreshes), lists its matrix products and factorisations with their shapes,
and times each one alone (best of ``--repeats``, on this machine's threads).
Their sum is the step's floor as long as the compiled step keeps eager's
FLOPs and precision: passes can drop Python and elementwise overhead (the
"other" row) and remove products (SOAP's CSE), but a GEMM at its isolated
best and a LAPACK call at its isolated best are what is left. The bound on
the speed-up is eager's step over (the floor minus what the compiled graph
removes).
"""

from __future__ import annotations

import argparse
import functools
import os
import shlex
import statistics
import sys
import time
import typing
from collections import defaultdict
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
import typing_extensions
from torch.profiler import ProfilerActivity, profile

if not hasattr(typing, "override"):  # emerging-optimizers 0.3.0 imports typing.override (Python >= 3.12)
    typing.override = typing_extensions.override  # type: ignore[attr-defined]

SHAPES = [(256, 1024), (256, 1024), (1024, 256), (512, 512)]
GEMMS = {"aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm"}
LAPACK = {"aten::linalg_qr", "aten::_linalg_eigh", "aten::_linalg_svd"}


def make(name: str, params: list[torch.Tensor]) -> torch.optim.Optimizer:
    if name == "shampoo":
        from hocompile.optimizers import Shampoo

        return Shampoo(params, lr=1e-3, precondition_frequency=10)
    from emerging_optimizers.soap import REKLS, SOAP

    return REKLS(params, lr=0.01) if name == "rekls" else SOAP(params, lr=0.01)


def isolated(op: str, shapes: list[list[int]], repeats: int) -> float:
    """Best-of-``repeats`` seconds of ``op`` alone on random inputs of ``shapes``."""
    fn: Callable[[], Any]
    if op == "aten::bmm":
        fn = functools.partial(torch.bmm, torch.randn(*shapes[0]), torch.randn(*shapes[1]))
    elif op in GEMMS:
        i = 1 if op.startswith("aten::addmm") else 0  # addmm(self, a, b)
        fn = functools.partial(torch.mm, torch.randn(*shapes[i]), torch.randn(*shapes[i + 1]))
    elif op == "aten::linalg_qr":
        fn = functools.partial(torch.linalg.qr, torch.randn(*shapes[0]))
    elif op == "aten::_linalg_eigh":
        g = torch.randn(*shapes[0])
        fn = functools.partial(torch.linalg.eigh, g @ g.mT + torch.eye(shapes[0][-1]))
    else:
        fn = functools.partial(torch.linalg.svd, torch.randn(*shapes[0]), full_matrices=False)
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def floor_of(name: str, repeats: int, steps: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(*s, generator=gen)) for s in SHAPES]
    opt = make(name, params)

    def step() -> float:
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        start = time.perf_counter()
        opt.step()
        return time.perf_counter() - start

    for _ in range(3):  # state, first refresh, torch.compile of SOAP's helpers
        step()
    times = [step() for _ in range(steps)]
    if name == "shampoo":  # the steps between refreshes: drop the refresh (the slowest) in the window
        times = sorted(times)[: max(1, len(times) - 1)]
    for _ in range(12):  # Shampoo: profile a step that is not a refresh (one without eigh)
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            step()
        if name != "shampoo" or not any(e.name == "aten::_linalg_eigh" for e in prof.events()):
            break
    calls: dict[tuple[str, str], int] = defaultdict(int)
    shapes_of: dict[tuple[str, str], list[list[int]]] = {}
    for event in prof.events():
        if event.name in GEMMS | LAPACK:
            key = (event.name, str(event.input_shapes))
            calls[key] += 1
            shapes_of[key] = [list(s) for s in event.input_shapes if s]
    rows = []
    for key, count in calls.items():
        op, _ = key
        seconds = isolated(op, shapes_of[key], repeats)
        rows.append((op, shapes_of[key], count, seconds))
    gemm = sum(c * s for op, _, c, s in rows if op in GEMMS)
    lapack = sum(c * s for op, _, c, s in rows if op in LAPACK)
    return {"step": statistics.median(times), "gemm": gemm, "lapack": lapack, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--optimizer", choices=("soap", "rekls", "shampoo", "all"), default="all")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "step_floor.md")
    args = parser.parse_args()
    names = ["soap", "rekls", "shampoo"] if args.optimizer == "all" else [args.optimizer]
    load = " ".join(Path("/proc/loadavg").read_text().split()[:3]) if Path("/proc/loadavg").exists() else "n/a"
    model = next(
        (ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines() if "model name" in ln),
        "unknown",
    )
    lines = [
        "# Eager step floors: GEMMs and LAPACK calls timed alone",
        "",
        f"Command: `{shlex.join(['.venv/bin/python', 'benchmarks/step_floor.py', *sys.argv[1:]])}`",
        "",
        f"- {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC; CPU: {model} ({os.cpu_count()} logical CPUs), "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; load average before: {load}",
        f"- params {SHAPES}, fp32; SOAP/REKLS(lr=0.01) from emerging-optimizers 0.3.0 (QR path, eigh for REKLS), "
        "hocompile's Shampoo(lr=1e-3, precondition_frequency=10) between refreshes",
        f"- step: median of {args.steps} eager steps; each product/factorisation timed alone, best of {args.repeats}",
        "",
        "| optimizer | eager step ms | GEMMs alone ms | LAPACK alone ms | other ms | floor share |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    details = []
    for name in names:
        r = floor_of(name, args.repeats, args.steps)
        other = r["step"] - r["gemm"] - r["lapack"]
        share = (r["gemm"] + r["lapack"]) / r["step"]
        lines.append(
            f"| {name} | {r['step'] * 1e3:.1f} | {r['gemm'] * 1e3:.1f} | {r['lapack'] * 1e3:.1f} | "
            f"{other * 1e3:.1f} | {share:.0%} |"
        )
        details += ["", f"{name}: calls per step (op, input shapes, calls, ms alone each)", ""]
        details += [f"- {op} {shapes} x{count}: {sec * 1e3:.2f}" for op, shapes, count, sec in sorted(r["rows"])]
        print(lines[-1], flush=True)
    text = "\n".join(lines + details) + "\n"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
