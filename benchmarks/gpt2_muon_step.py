"""Benchmark one ``torch.optim.Muon`` step on the 48 hidden matrices of GPT-2 small.

Run from the repository root::

    .venv/bin/python benchmarks/gpt2_muon_step.py            # full GPT-2 small shapes
    .venv/bin/python benchmarks/gpt2_muon_step.py --shapes tiny --steps 3   # smoke run

Three variants are timed in one run, each on its own clone of the same fp32
parameters and gradients (random, fixed seed; the gradients are re-copied before every
step, outside the timed region):

* ``eager``          -- plain ``torch.optim.Muon(...).step()``;
* ``torch.compile``  -- ``torch.compile(opt.step)`` on a separate Muon instance;
* ``hocompile``      -- ``hocompile.compile_optimizer(torch.optim.Muon(...)).step()``.

Each variant runs ``--warmup`` calls (the first one is reported as "first call": for
the compiled variants it includes capture + compilation) followed by ``--steps`` timed
steady calls, whose median is reported. After the same number of steps every variant's
params are compared with the eager ones: max over tensors of
``max|p - p_eager| / max|p_eager|``. Results (plus torch version, CPU count, date and
command line) go to ``--out`` as JSON, with every step's time.

hocompile compiles twice (step 1 creates the optimizer state, step 2 is the steady
graph), so with the default ``--warmup 1`` one steady sample includes a compile; the
median absorbs it, ``--warmup 2`` excludes it.

Cost note: ``torch.optim.Muon`` runs Newton-Schulz in bfloat16; on CPUs without native
bf16 matmul (e.g. AVX2-only) one full GPT-2 step can take many minutes. Use ``--layers``
to time fewer layers (``--layers 1`` = 4 matrices).
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import logging
import os
import shlex
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from collections.abc import Callable

MUON_KW: dict[str, Any] = {"lr": 0.02, "momentum": 0.95, "weight_decay": 0.01}
# Per-layer matrices {attn c_attn, attn c_proj, mlp c_fc, mlp c_proj}, default layers.
LAYER_SHAPES: dict[str, tuple[list[tuple[int, int]], int]] = {
    "gpt2": ([(768, 2304), (768, 768), (768, 3072), (3072, 768)], 12),  # GPT-2 small
    "tiny": ([(64, 192), (64, 64), (64, 256), (256, 64)], 2),
}
VARIANTS = ("eager", "torch.compile", "hocompile")


def make_tensors(shapes: list[tuple[int, int]], seed: int) -> tuple[list[torch.Tensor], ...]:
    """Random fp32 params and grads for ``shapes`` from a seeded generator."""
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=gen) * 0.02 for s in shapes]
    grads = [torch.randn(s, generator=gen) * 1e-3 for s in shapes]
    return params, grads


def build_step(variant: str, opt: torch.optim.Optimizer) -> tuple[Callable[[], Any], Any]:
    """Return (step function, the compiled optimizer to report on, or None)."""
    if variant == "eager":
        return opt.step, None
    if variant == "torch.compile":
        return torch.compile(opt.step), None
    # Imported lazily so that the other variants still run if hocompile is broken.
    hocompile = importlib.import_module("hocompile")
    compiled = hocompile.compile_optimizer(opt)
    return compiled.step, compiled


def run_variant(
    variant: str,
    params0: list[torch.Tensor],
    grads: list[torch.Tensor],
    warmup: int,
    steps: int,
) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """Run ``warmup + steps`` Muon steps on clones; return timings and final params."""
    params = [p.clone().requires_grad_(True) for p in params0]
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()
    step_fn, compiled = build_step(variant, torch.optim.Muon(params, **MUON_KW))

    times: list[float] = []
    for i in range(warmup + steps):
        with torch.no_grad():
            for p, g in zip(params, grads, strict=True):
                p.grad.copy_(g)  # type: ignore[union-attr]
        t0 = time.perf_counter()
        step_fn()
        times.append(time.perf_counter() - t0)
        kind = "warmup" if i < warmup else "steady"
        print(f"  {variant} step {i + 1} ({kind}): {times[-1]:.3f} s", flush=True)
    result: dict[str, Any] = {
        "first_call_s": times[0],
        "warmup_s": times[:warmup],
        "steady_s": times[warmup:],
        "median_steady_s": statistics.median(times[warmup:]),
    }
    if compiled is not None:
        hocompile = importlib.import_module("hocompile")
        result["counters"] = dict(compiled.counters)
        result["explain"] = hocompile.explain(compiled)
    return result, [p.detach() for p in params]


def max_rel_diff(a: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    """Max over tensors of ``max|x - ref| / max|ref|``."""
    return max(((x - r).abs().max() / r.abs().max().clamp_min(1e-30)).item() for x, r in zip(a, ref, strict=True))


def main() -> int:
    """Run the variants, print the table, write the JSON; 1 if any variant failed."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5, help="steady steps timed (default 5)")
    parser.add_argument(
        "--warmup",
        type=int,
        default=1,
        help="calls before the timed ones; the first is the 'first call' (default 1)",
    )
    parser.add_argument("--skip-torch-compile", action="store_true")
    parser.add_argument("--shapes", choices=sorted(LAYER_SHAPES), default="gpt2")
    parser.add_argument("--layers", type=int, default=None, help="layers (default: 12 gpt2, 2 tiny)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/gpt2_muon_step.json"))
    args = parser.parse_args()
    if args.warmup < 1 or args.steps < 1:
        parser.error("--warmup and --steps must be >= 1")

    layer_shapes, default_layers = LAYER_SHAPES[args.shapes]
    n_layers: int = default_layers if args.layers is None else args.layers
    shapes = layer_shapes * n_layers
    params0, grads = make_tensors(shapes, args.seed)
    n_params = sum(p.numel() for p in params0)
    print(
        f"torch {torch.__version__}, {os.cpu_count()} CPUs, "
        f"{torch.get_num_threads()} threads; "
        f"{len(shapes)} matrices ({args.shapes}, {n_layers} layers), "
        f"{n_params:,} params; "
        f"warmup {args.warmup}, steps {args.steps}",
        flush=True,
    )

    variants = [v for v in VARIANTS if not (v == "torch.compile" and args.skip_torch_compile)]
    results: dict[str, dict[str, Any]] = {}
    eager_params: list[torch.Tensor] = []
    failed = False
    for variant in variants:
        print(f"running {variant} ...", flush=True)
        try:
            res, final = run_variant(variant, params0, grads, args.warmup, args.steps)
        except Exception as exc:  # record it, keep the other variants' numbers
            failed = True
            logging.getLogger("gpt2_muon_step").exception("variant %s failed", variant)
            results[variant] = {"error": f"{type(exc).__name__}: {exc}"}
            continue
        if variant == "eager":
            eager_params = final
        elif eager_params:
            res["max_rel_param_diff_vs_eager"] = max_rel_diff(final, eager_params)
        results[variant] = res
        del final
        gc.collect()

    eager_med = results.get("eager", {}).get("median_steady_s")
    print(
        f"\n{'variant':<15} {'first call s':>13} {'median steady s':>16} {'eager/variant':>14} {'max rel dparam':>15}"
    )
    for variant, res in results.items():
        if "error" in res:
            print(f"{variant:<15} FAILED: {res['error']}")
            continue
        ratio = eager_med / res["median_steady_s"] if eager_med else float("nan")
        res["speedup_vs_eager"] = ratio
        diff = res.get("max_rel_param_diff_vs_eager", 0.0 if variant == "eager" else None)
        diff_s = "n/a" if diff is None else f"{diff:.2e}"
        print(f"{variant:<15} {res['first_call_s']:>13.3f} {res['median_steady_s']:>16.4f} {ratio:>14.2f} {diff_s:>15}")
    for variant, res in results.items():
        if "counters" in res:
            print(f"\n{variant} counters: {res['counters']}")

    report = {
        "benchmark": "gpt2_muon_step",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join([sys.executable, *sys.argv]),
        "torch_version": torch.__version__,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "shapes": args.shapes,
        "n_layers": n_layers,
        "n_matrices": len(shapes),
        "n_params": n_params,
        "muon_kwargs": MUON_KW,
        "warmup": args.warmup,
        "steps": args.steps,
        "seed": args.seed,
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
