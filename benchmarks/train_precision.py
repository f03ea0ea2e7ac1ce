"""Training check for the precision planner: FP8-early Newton–Schulz vs bf16 on the tiny transformer.

    .venv/bin/python benchmarks/train_precision.py                 # 300 steps, 5 variants (~2-3 min on 2 cores)
    .venv/bin/python benchmarks/train_precision.py --steps 40      # smoke run
    .venv/bin/python benchmarks/train_precision.py --variants a,c  # a subset

What it shows: whether a Muon whose Newton–Schulz (NS) runs its first
iterations in FP8 trains the ``examples/tiny_transformer.py`` model as well
as the bf16 NS of eager ``torch.optim.Muon``. Five variants start from the
same initial weights (``--seed``) and see the same batches (the example's
``make_batches``, seed 1234), with the example's Muon/AdamW split and LambdaLR
schedule; only Muon's NS differs:

    a  eager torch.optim.Muon (bf16 NS, the reference)
    b  hocompile schedule "bf16*5"
    c  hocompile schedule "fp8_e4m3*1+fp16*4" (the planner's pick on sm89/sm90/sm100, checked with hocompile.plan)
    d  hocompile schedule "fp8_e4m3*2+bf16*3" (more aggressive)
    e  hocompile schedule "mxfp8_e4m3*2+bf16*3" (block-scaled FP8, sm100)

In b-e every NS GEMM is emulated exactly as the tensor core computes it
(hocompile/precision/emulate.py, schedule_ns.py). They are compiled for
``--target sm90`` (default), so the NS algorithm and batching are those a
GPU would run (standard NS, matrices of one shape stacked); on this CPU,
``--target auto`` would pick Gram NS for the rectangular matrices instead.
AdamW is compiled with hocompile in all five variants (same target), so the
variants differ only in Muon's NS.

Recorded: per-step training loss; every ``--eval-every`` steps (and at step 0
and the last step) the loss on a fixed held-out batch of all 256 sequences
of the task (start 0..63 × stride 1..4) that is never stepped on. The task has
only 256 distinct sequences, so this is the population loss (a noise-free
comparison), not generalisation to unseen data. Per-step wall time (forward,
backward, both optimizer steps) and optimizer time are reported as medians
over steps 3..N (steps 1-2 include hocompile's capture and compile).

Outputs: benchmarks/results/train_precision.json (losses, times, metadata,
the planner's picks and plans, hocompile.explain of each compiled Muon) and
benchmarks/results/train_precision.png (needs matplotlib): smoothed training
loss (centred mean over ``--smooth`` steps) over faint raw loss and the
held-out loss, log-y, plus a lower panel with each variant's difference from
(a). Runs single-threaded by default (``--threads 1``): these GEMMs are tiny
and two threads on a shared 2-core machine are ~10x slower.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import platform
import re
import shlex
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as nnf
from torch import nn

import hocompile

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
import tiny_transformer as tt  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
PLANNER_TARGETS = ("sm89", "sm90", "sm100")
LAST_N = 20  # "final train loss" = mean of the last LAST_N steps


@dataclass(frozen=True)
class Variant:
    key: str
    label: str
    schedule: str | None  # None: eager torch.optim.Muon
    color: str


VARIANTS: tuple[Variant, ...] = (
    Variant("a", "eager Muon (bf16 NS)", None, "black"),
    Variant("b", "bf16*5", "bf16*5", "tab:blue"),
    Variant("c", "fp8_e4m3*1+fp16*4 (planner)", "fp8_e4m3*1+fp16*4", "tab:green"),
    Variant("d", "fp8_e4m3*2+bf16*3", "fp8_e4m3*2+bf16*3", "tab:orange"),
    Variant("e", "mxfp8_e4m3*2+bf16*3", "mxfp8_e4m3*2+bf16*3", "tab:red"),
)
PLANNER_SCHEDULE = "fp8_e4m3*1+fp16*4"


@dataclass
class Run:
    """One variant's trajectory and timings."""

    variant: Variant
    train_loss: list[float] = field(default_factory=list)
    eval_steps: list[int] = field(default_factory=list)
    eval_loss: list[float] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)
    opt_s: list[float] = field(default_factory=list)
    diverged_at: int | None = None
    explain: str = ""
    seconds: float = 0.0


def heldout_batch() -> torch.Tensor:
    """All 256 (start, stride) sequences of the task, as ``make_batches`` builds them."""
    start = torch.arange(tt.VOCAB).repeat_interleave(4).unsqueeze(1)
    stride = torch.arange(1, 5).repeat(tt.VOCAB).unsqueeze(1)
    return (start + stride * torch.arange(tt.SEQ + 1)) % tt.VOCAB


def evaluate(model: nn.Module, batch: torch.Tensor) -> float:
    with torch.no_grad():
        logits = model(batch[:, :-1])
        return nnf.cross_entropy(logits.reshape(-1, tt.VOCAB), batch[:, 1:].reshape(-1)).item()


def planner_picks(model: nn.Module, batch: torch.Tensor) -> tuple[dict[str, str], dict[str, str]]:
    """What hocompile.plan picks for this model's Muon on each GPU target: ({target: schedule}, {target: report})."""
    model = copy.deepcopy(model)
    muon, _ = tt.make_optimizers(model)
    logits = model(batch[:, :-1])
    nnf.cross_entropy(logits.reshape(-1, tt.VOCAB), batch[:, 1:].reshape(-1)).backward()
    picks: dict[str, str] = {}
    reports: dict[str, str] = {}
    for target in PLANNER_TARGETS:
        report = hocompile.plan(muon, target=target)
        found = set(re.findall(r"^\s*choose-precision: (\S+) ×\d+", report, flags=re.MULTILINE))
        picks[target] = ",".join(sorted(found)) or "?"
        reports[target] = report
    return picks, reports


def train(
    variant: Variant,
    init: nn.Module,
    batches: list[torch.Tensor],
    heldout: torch.Tensor,
    args: argparse.Namespace,
    cache_dir: str,
) -> Run:
    """Train a copy of ``init`` on ``batches`` with this variant's Muon; stops at the first non-finite loss."""
    run = Run(variant)
    model = copy.deepcopy(init)
    muon, adamw = tt.make_optimizers(model)
    if variant.schedule is not None:
        muon = hocompile.compile_optimizer(muon, schedule=variant.schedule, target=args.target, cache_dir=cache_dir)
    adamw = hocompile.compile_optimizer(adamw, target=args.target, cache_dir=cache_dir)
    sched = torch.optim.lr_scheduler.LambdaLR(muon, tt.lr_lambda(len(batches)))
    steps = len(batches)
    run.eval_steps.append(0)
    run.eval_loss.append(evaluate(model, heldout))
    t_start = time.perf_counter()
    for step, batch in enumerate(batches, start=1):
        t0 = time.perf_counter()
        loss, opt_s = tt.train_step(model, (muon, adamw), batch)
        sched.step()
        run.step_s.append(time.perf_counter() - t0)
        run.opt_s.append(opt_s)
        run.train_loss.append(loss)
        if not math.isfinite(loss):
            run.diverged_at = step
            run.eval_steps.append(step)
            run.eval_loss.append(math.nan)
            break
        if step % args.eval_every == 0 or step == steps:
            run.eval_steps.append(step)
            run.eval_loss.append(evaluate(model, heldout))
        if step % 50 == 0 or step == steps:
            print(
                f"  [{variant.key}] step {step:>4}/{steps}  loss {loss:.4f}  held-out {run.eval_loss[-1]:.4f}  "
                f"{statistics.median(run.step_s[2:] or run.step_s) * 1e3:.1f} ms/step",
                flush=True,
            )
    run.seconds = time.perf_counter() - t_start
    if isinstance(muon, hocompile.CompiledOptimizer):
        run.explain = hocompile.explain(muon)
    return run


def smooth(values: list[float], window: int) -> list[float]:
    """Centred mean over ``window`` steps (``window // 2`` each side, fewer at the ends): no lag behind raw."""
    half = max(0, window // 2)
    prefix = [0.0]
    for v in values:
        prefix.append(prefix[-1] + v)
    out: list[float] = []
    for i in range(len(values)):
        lo, hi = max(0, i - half), min(len(values), i + half + 1)
        out.append((prefix[hi] - prefix[lo]) / (hi - lo))
    return out


def final_train(run: Run) -> float:
    if run.diverged_at is not None:
        return math.nan
    return statistics.fmean(run.train_loss[-LAST_N:])


def max_eval_diff(run: Run, ref: Run | None) -> float:
    """Largest |held-out loss difference| at the common eval steps (NaN if either diverged or no reference)."""
    if ref is None:
        return math.nan
    ref_at = dict(zip(ref.eval_steps, ref.eval_loss))
    diffs = [abs(v - ref_at[s]) for s, v in zip(run.eval_steps, run.eval_loss) if s in ref_at]
    return max(diffs) if diffs else math.nan


def median_ms(times: list[float]) -> float:
    return statistics.median(times[2:] or times) * 1e3


def finite_or_none(x: Any) -> Any:
    """JSON has no NaN/inf: map them to null, recursively."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: finite_or_none(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [finite_or_none(v) for v in x]
    return x


def summary_rows(runs: list[Run]) -> list[dict[str, Any]]:
    by_key = {r.variant.key: r for r in runs}
    rows = []
    for r in runs:
        rows.append(
            {
                "variant": r.variant.key,
                "schedule": r.variant.schedule or "eager bf16",
                "final_train_loss": final_train(r),
                "final_heldout_loss": r.eval_loss[-1],
                "max_abs_heldout_diff_vs_b": max_eval_diff(r, by_key.get("b")),
                "max_abs_heldout_diff_vs_a": max_eval_diff(r, by_key.get("a")),
                "step_ms_median": median_ms(r.step_s),
                "opt_ms_median": median_ms(r.opt_s),
                "first_step_s": r.step_s[0],
                "diverged_at": r.diverged_at,
            }
        )
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    head = (
        f"{'':2} {'NS schedule':<20} {'train(last ' + str(LAST_N) + ')':>15} {'held-out':>9} "
        f"{'max|Δho| vs b':>14} {'max|Δho| vs a':>14} {'ms/step':>8} {'opt ms':>7} {'1st step s':>10}"
    )
    print(head)
    for row in rows:
        note = f"  diverged at step {row['diverged_at']}" if row["diverged_at"] else ""
        print(
            f"{row['variant']:2} {row['schedule']:<20} {row['final_train_loss']:>15.4f} "
            f"{row['final_heldout_loss']:>9.4f} {row['max_abs_heldout_diff_vs_b']:>14.2e} "
            f"{row['max_abs_heldout_diff_vs_a']:>14.2e} {row['step_ms_median']:>8.1f} {row['opt_ms_median']:>7.1f} "
            f"{row['first_step_s']:>10.2f}{note}"
        )


def plot(runs: list[Run], args: argparse.Namespace, path: Path) -> bool:
    """Write the figure; False if matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.lines import Line2D
        from matplotlib.ticker import FuncFormatter
    except ImportError:
        print("matplotlib is not installed: no PNG (.venv/bin/pip install matplotlib)")
        return False
    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(11, 9), sharex=True, gridspec_kw={"height_ratios": [3, 2]}, constrained_layout=True
    )
    ref = next((r for r in runs if r.variant.key == "a"), None)
    ref_smooth = smooth(ref.train_loss, args.smooth) if ref is not None else None
    ref_eval = dict(zip(ref.eval_steps, ref.eval_loss)) if ref is not None else {}
    for r in runs:
        c = r.variant.color
        x = list(range(1, len(r.train_loss) + 1))
        sm = smooth(r.train_loss, args.smooth)
        top.plot(x, r.train_loss, color=c, alpha=0.12, lw=0.6)
        top.plot(x, sm, color=c, lw=1.4, label=f"({r.variant.key}) {r.variant.label}")
        top.plot(r.eval_steps, r.eval_loss, color=c, ls="--", lw=1.0, marker="o", ms=3.5)
        if ref is not None and ref_smooth is not None and r is not ref:
            n = min(len(sm), len(ref_smooth))
            bottom.plot(x[:n], [sm[i] - ref_smooth[i] for i in range(n)], color=c, lw=1.2)
            pts = [(s, v - ref_eval[s]) for s, v in zip(r.eval_steps, r.eval_loss) if s in ref_eval]
            bottom.plot([p[0] for p in pts], [p[1] for p in pts], color=c, ls="--", lw=1.0, marker="o", ms=3.5)
    top.set_yscale("log")
    # Plain numbers, labelled only at mantissas 1, 2, 3, 5 (log-axis minor ticks are too dense otherwise).
    tick = FuncFormatter(lambda y, _pos: f"{y:g}" if f"{y:.0e}"[0] in "1235" else "")
    top.yaxis.set_major_formatter(tick)
    top.yaxis.set_minor_formatter(tick)
    top.set_ylabel("cross-entropy loss (log scale)")
    top.grid(True, which="both", alpha=0.3)
    style = [
        Line2D([], [], color="gray", lw=1.4, label=f"train, centred mean of {2 * (args.smooth // 2) + 1} steps"),
        Line2D([], [], color="gray", lw=0.6, alpha=0.3, label="train, raw"),
        Line2D([], [], color="gray", ls="--", marker="o", ms=3.5, label="held-out (all 256 sequences)"),
    ]
    first = top.legend(
        loc="upper right", title="Muon Newton–Schulz schedule\n(curves overlap: see the lower panel)", fontsize=9
    )
    top.add_artist(first)
    top.legend(handles=style, loc="lower left", fontsize=9)
    bottom.axhline(0.0, color="black", lw=0.8)
    bottom.set_ylabel("loss − (a) eager bf16")
    bottom.set_xlabel("step")
    bottom.grid(True, alpha=0.3)
    bottom.set_title("difference from (a): smoothed train (solid), held-out (dashed, markers)", fontsize=10)
    fig.suptitle(
        f"Tiny transformer (d_model {tt.D_MODEL}, {tt.N_LAYERS} layers, Muon + AdamW), {args.steps} steps: "
        f"FP8-early vs bf16 Newton–Schulz (emulated, target {args.target})",
        fontsize=11,
    )
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="training steps per variant (default 300)")
    parser.add_argument("--seed", type=int, default=0, help="model init seed (default 0, as the example)")
    parser.add_argument("--data-seed", type=int, default=1234, help="batch generator seed (default 1234)")
    parser.add_argument("--eval-every", type=int, default=25, help="held-out loss every N steps (default 25)")
    parser.add_argument("--smooth", type=int, default=LAST_N, help=f"plot smoothing window (default {LAST_N})")
    parser.add_argument("--target", default="sm90", help="hocompile target for the compiled variants (default sm90)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--variants", default=",".join(v.key for v in VARIANTS), help="subset, e.g. a,b,c")
    parser.add_argument("--cache-dir", default=None, help="hocompile cache (default: a fresh temporary one)")
    parser.add_argument("--out", type=Path, default=RESULTS / "train_precision.json")
    parser.add_argument("--png", type=Path, default=RESULTS / "train_precision.png")
    args = parser.parse_args()
    args.steps = max(1, args.steps)
    wanted = set(args.variants.split(","))
    variants = [v for v in VARIANTS if v.key in wanted]
    if not variants:
        parser.error(f"no variants in {args.variants!r}; known: {[v.key for v in VARIANTS]}")
    torch.set_num_threads(args.threads)

    torch.manual_seed(args.seed)
    init = tt.TinyTransformer()
    batches = tt.make_batches(args.steps, seed=args.data_seed)
    heldout = heldout_batch()

    picks, plans = planner_picks(init, batches[0])
    planner_ok = all(p == PLANNER_SCHEDULE for p in picks.values())
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s); {args.steps} steps; target {args.target}")
    print(f"planner picks: {picks} -> {'matches' if planner_ok else 'DIFFERS from'} (c) {PLANNER_SCHEDULE}")

    t0 = time.perf_counter()
    runs: list[Run] = []
    with tempfile.TemporaryDirectory(prefix="hocompile-train-precision-") as tmp:
        for v in variants:
            print(f"({v.key}) {v.label}", flush=True)
            runs.append(train(v, init, batches, heldout, args, args.cache_dir or tmp))
    seconds = time.perf_counter() - t0

    rows = summary_rows(runs)
    print(f"\n=== summary ({args.steps} steps, {seconds:.0f} s) ===")
    print_table(rows)

    meta = {
        "description": (
            "tiny transformer (examples/tiny_transformer.py) trained with Muon whose Newton-Schulz runs each "
            "schedule, every GEMM emulated exactly; same init and batches for all variants"
        ),
        "command": " ".join(shlex.quote(a) for a in [".venv/bin/python", *sys.argv]),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
        "seconds": round(seconds, 1),
        "steps": args.steps,
        "seed": args.seed,
        "data_seed": args.data_seed,
        "eval_every": args.eval_every,
        "target": args.target,
        "model": {
            "vocab": tt.VOCAB,
            "d_model": tt.D_MODEL,
            "layers": tt.N_LAYERS,
            "heads": tt.N_HEADS,
            "seq": tt.SEQ,
            "batch": tt.BATCH,
        },
        "heldout": "all 256 (start, stride) sequences, never stepped on (the task has no others: population loss)",
        "final_train_loss": f"mean of the last {LAST_N} steps' training loss",
        "step_ms_median": "median over steps 3..N of forward + backward + both optimizer steps",
        "adamw": "hocompile.compile_optimizer(AdamW, target=target) in every variant",
        "schedules": {v.key: v.schedule or "eager torch.optim.Muon (bf16)" for v in variants},
        "planner": {"picks": picks, "expected": PLANNER_SCHEDULE, "matches": planner_ok, "plans": plans},
    }
    doc = {
        "metadata": meta,
        "summary": rows,
        "runs": {
            r.variant.key: {
                "label": r.variant.label,
                "schedule": r.variant.schedule,
                "train_loss": r.train_loss,
                "eval_steps": r.eval_steps,
                "heldout_loss": r.eval_loss,
                "step_ms": [round(t * 1e3, 3) for t in r.step_s],
                "opt_ms": [round(t * 1e3, 3) for t in r.opt_s],
                "seconds": round(r.seconds, 1),
                "diverged_at": r.diverged_at,
                "explain": r.explain,
            }
            for r in runs
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(finite_or_none(doc), indent=1) + "\n")
    print(f"wrote {args.out}")
    if plot(runs, args, args.png):
        print(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
