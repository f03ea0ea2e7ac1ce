"""Loss curves of the tiny transformer under SOAP, REKLS, Shampoo and MOP, eager vs compiled.

Issue 12's check that ``hocompile.compile_optimizer`` is a drop-in for the Shampoo
family too, over a whole training run rather than one step:

* model, data, the hidden/rest parameter split, AdamW and the LR schedule come from
  ``examples/tiny_transformer.py`` (imported, not copied): the 2-D hidden matrices
  get the optimizer under test, everything else AdamW; the hidden optimizer carries
  the example's ``LambdaLR`` (warmup, then cosine), so the compiled step must honour
  LR changes made from outside;
* per optimizer, two identical model copies see the same batches for ``--steps``
  steps: one stepped eagerly, the other by ``hocompile.compile_optimizer`` of an
  identical optimizer (and of its AdamW);
* seed noise: the eager run is repeated with other seeds (model init and data), and
  the spread (max - min) of the final losses over the ``--seeds`` eager runs is the
  tolerance: PASS when |compiled - eager| of the final loss is within it. "Final
  loss" is the mean over the last 20 steps, which damps batch-to-batch noise.

Exit status 1 when any optimizer FAILs. The curves go to one PNG, a subplot per
optimizer (needs matplotlib, the ``bench`` extra; without it the plot is skipped).

Run: ``.venv/bin/python examples/shampoo_family.py [--steps 300] [--seeds 3]
[--optimizers SOAP,MOP] [--out PATH.png]``
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import typing_extensions
from torch import nn

import hocompile
from hocompile.optimizers import Shampoo

if not hasattr(typing, "override"):  # emerging-optimizers 0.3.0 imports typing.override (Python >= 3.12)
    typing.override = typing_extensions.override  # type: ignore[attr-defined]

from emerging_optimizers.orthogonalized_optimizers import MOP  # noqa: E402
from emerging_optimizers.soap import REKLS, SOAP  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # examples/ is not a package
from tiny_transformer import TinyTransformer, lr_lambda, make_batches, make_optimizers, train_step  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "shampoo_family_loss.png"
TAIL = 20  # steps averaged into the "final loss"
DATA_SEED = 1234  # tiny_transformer's batch seed; seed s uses DATA_SEED + s

# Learning rates: the best of a 100-step eager sweep on this model (SOAP/REKLS/Shampoo
# 3e-3 or 1e-2; MOP 3e-3..0.3). MOP scales its polar factor by the nuclear norm of the
# momentum, which is small for these small gradients, hence its large lr.
OPTIMIZERS: dict[str, Callable[[list[nn.Parameter]], torch.optim.Optimizer]] = {
    "SOAP": lambda ps: SOAP(ps, lr=1e-2, weight_decay=0.01),
    "REKLS": lambda ps: REKLS(ps, lr=1e-2, weight_decay=0.01),
    "Shampoo": lambda ps: Shampoo(ps, lr=1e-2, weight_decay=0.01, precondition_frequency=10),
    "MOP": lambda ps: MOP(ps, lr=0.3, weight_decay=0.01),
}


@dataclass
class Run:
    """Losses of one training run (``compiled`` empty for an eager-only run)."""

    eager: list[float] = field(default_factory=list)
    compiled: list[float] = field(default_factory=list)
    counters: dict[str, dict[str, Any]] = field(default_factory=dict)
    seconds: float = 0.0


def make_pair(model: nn.Module, name: str) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
    """(optimizer under test on the hidden matrices, AdamW on the rest), split as tiny_transformer does.

    tiny_transformer's ``make_optimizers`` builds Muon for the hidden matrices; we keep its
    split and its AdamW and hand Muon's params to the optimizer under test (an unstepped
    Muon holds no state, so dropping it is free).
    """
    muon, adamw = make_optimizers(model)
    hidden = list(muon.param_groups[0]["params"])
    return OPTIMIZERS[name](hidden), adamw


def train(name: str, seed: int, steps: int, compiled: bool, log: bool) -> Run:
    """Train eager (and, with ``compiled``, a compiled twin on the same batches) for ``steps``."""
    torch.manual_seed(seed)
    eager_model = TinyTransformer()
    comp_model = copy.deepcopy(eager_model)
    batches = make_batches(steps, seed=DATA_SEED + seed)
    eager_opts = make_pair(eager_model, name)
    eager_sched = torch.optim.lr_scheduler.LambdaLR(eager_opts[0], lr_lambda(steps))
    if compiled:
        comp_opts = tuple(hocompile.compile_optimizer(o) for o in make_pair(comp_model, name))
        comp_sched = torch.optim.lr_scheduler.LambdaLR(comp_opts[0], lr_lambda(steps))

    run = Run()
    start = time.perf_counter()
    for step, batch in enumerate(batches, start=1):
        run.eager.append(train_step(eager_model, eager_opts, batch)[0])
        eager_sched.step()
        if compiled:
            run.compiled.append(train_step(comp_model, comp_opts, batch)[0])
            comp_sched.step()
        if log and (step % 50 == 0 or step == steps):
            comp = f"{run.compiled[-1]:.4f}" if compiled else "-"
            print(
                f"  {name:<8} seed {seed} step {step:>4}: eager {run.eager[-1]:.4f}  compiled {comp}"
                f"  ({time.perf_counter() - start:.0f} s)",
                flush=True,
            )
    run.seconds = time.perf_counter() - start
    if compiled:
        run.counters = {type(o.optimizer).__name__: o.counters.as_dict() for o in comp_opts}
    return run


def final_loss(losses: list[float]) -> float:
    return statistics.fmean(losses[-TAIL:])


def plot(runs: dict[str, Run], out: Path, steps: int) -> None:
    """One subplot per optimizer, eager vs compiled loss curves; skipped without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib not installed (pip install -e '.[bench]'): skipping {out}")
        return
    fig, axes = plt.subplots(1, len(runs), figsize=(4.2 * len(runs), 3.4), squeeze=False, sharey=True)
    for ax, (name, run) in zip(axes[0], runs.items(), strict=True):
        x = range(1, len(run.eager) + 1)
        ax.plot(x, run.eager, label="eager", lw=1.4)
        ax.plot(x, run.compiled, label="hocompile", lw=1.0, ls="--")
        ax.set_title(f"{name} (hidden) + AdamW")
        ax.set_xlabel("step")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("train loss")
    axes[0][0].legend()
    fig.suptitle(f"tiny transformer, {steps} steps: eager vs hocompile.compile_optimizer")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="training steps (default 300)")
    parser.add_argument(
        "--optimizers", default=",".join(OPTIMIZERS), help=f"comma-separated subset of {list(OPTIMIZERS)}"
    )
    parser.add_argument("--seeds", type=int, default=3, help="eager seeds for the noise estimate (default 3, min 2)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="PNG path")
    args = parser.parse_args()
    names = [n for n in args.optimizers.split(",") if n]
    unknown = set(names) - set(OPTIMIZERS)
    if unknown:
        parser.error(f"unknown optimizers {sorted(unknown)}; choose from {list(OPTIMIZERS)}")
    steps, n_seeds = max(TAIL, args.steps), max(2, args.seeds)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; {steps} steps; "
        f"{len(names)} optimizer(s) x (eager + compiled + {n_seeds - 1} more eager seeds)",
        flush=True,
    )

    start = time.perf_counter()
    runs: dict[str, Run] = {}
    rows: list[tuple[str, float, float, float, bool]] = []
    for name in names:
        run = runs[name] = train(name, seed=0, steps=steps, compiled=True, log=True)
        for kind, counters in run.counters.items():
            recompiles = counters["recompiles"]
            print(
                f"  {name} counters, {kind}: compiles {counters['compiles']}, recompiles {len(recompiles)}"
                f"{' ' + str(recompiles) if recompiles else ''}, eager fallbacks {counters['eager_fallbacks']}, "
                f"variants {len(counters['variants'])}"
            )
        # Seed 0's eager run is one of the seeds: only the others run again.
        finals = [final_loss(run.eager)]
        for seed in range(1, n_seeds):
            finals.append(final_loss(train(name, seed=seed, steps=steps, compiled=False, log=False).eager))
        spread = max(finals) - min(finals)
        eager, comp = final_loss(run.eager), final_loss(run.compiled)
        ok = abs(comp - eager) <= spread
        rows.append((name, eager, comp, spread, ok))
        seeds = ", ".join(f"{f:.4f}" for f in finals)
        verdict = "PASS" if ok else "FAIL"
        print(f"  {name}: final eager {eager:.4f}, compiled {comp:.4f}; eager seeds [{seeds}] -> {verdict}")
        print(f"  ({time.perf_counter() - start:.0f} s elapsed)", flush=True)

    print(f"\n=== final loss (mean of the last {TAIL} of {steps} steps) ===")
    print(f"{'optimizer':<10} {'eager':>8} {'compiled':>9} {'|diff|':>9} {'seed spread':>12}  verdict")
    for name, eager, comp, spread, ok in rows:
        verdict = "PASS" if ok else "FAIL"
        print(f"{name:<10} {eager:>8.4f} {comp:>9.4f} {abs(comp - eager):>9.2e} {spread:>12.2e}  {verdict}")
    print(f"total {time.perf_counter() - start:.0f} s")
    plot(runs, args.out, steps)
    return 0 if all(row[4] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
