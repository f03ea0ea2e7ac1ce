"""One SOAP step (emerging-optimizers 0.3.0) on CPU: eager vs hocompile, with and without fuse-eigenbasis.

    .venv/bin/python benchmarks/soap_step.py                    # issue 12's params, writes results/soap_step.md
    .venv/bin/python benchmarks/soap_step.py --shapes tiny --rounds 3 --out /tmp/soap.md
    .venv/bin/python benchmarks/soap_step.py --optimizer rekls --out benchmarks/results/rekls_step.md
    .venv/bin/python benchmarks/soap_step.py --shapes gpt2 --variants eager,default --lean \
        --rounds 2 --warmup 2 --out benchmarks/results/soap_step_gpt2.md   # ~1 min per step here

Variants, stepped in turn every round on identical params and grads (so
machine noise hits all alike; medians over rounds):

- ``eager``: ``SOAP.step`` itself;
- ``default``: ``compile_optimizer`` with the default pipeline (fuse-eigenbasis
  and the Kronecker passes; ``power_qr`` stacked per factor size from n = 256,
  one LAPACK thread per matrix);
- ``batched``: batch-by-shape forced on, so every registered op with a batch
  rule stacks, small factors too.

Also reported: matmul FLOPs per steady step counted from the graphs before
and after the passes, a QR microbenchmark (ATen's batched call vs a loop vs
``power_qr``'s per-matrix threads) and each variant's max relative param
difference to eager after the timed steps.
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import shlex
import statistics
import sys
import tempfile
import time
import typing
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
import typing_extensions

if not hasattr(typing, "override"):  # emerging-optimizers 0.3.0 imports typing.override (Python >= 3.12)
    typing.override = typing_extensions.override  # type: ignore[attr-defined]

from hocompile.capture.group_hypers import STRUCTURAL_KEYS  # noqa: E402
from hocompile.capture.trace import capture  # noqa: E402
from hocompile.ir.registry import registered_calls  # noqa: E402
from hocompile.ops.eigenbasis import power_qr  # noqa: E402
from hocompile.passes import BatchByShape, Pass, run_pipeline  # noqa: E402
from hocompile.runtime import CompiledOptimizer  # noqa: E402
from hocompile.runtime.compile_step import step_pipeline  # noqa: E402
from hocompile.settings import Settings  # noqa: E402

SHAPES = {
    "issue12": [(256, 1024), (256, 1024), (1024, 256), (512, 512)],
    # GPT-2 small's 48 matrices (attn c_attn, c_proj; mlp c_fc, c_proj per layer)
    "gpt2": [(768, 2304), (768, 768), (768, 3072), (3072, 768)] * 12,
    "gpt2-layer": [(768, 2304), (768, 768), (768, 3072), (3072, 768)],  # one of its 12 identical layers
    "tiny": [(16, 32), (16, 32), (32, 16)],
}
VARIANTS = ("eager", "default", "batched")
aten = torch.ops.aten


def matmul_flops(gm: fx.GraphModule) -> float:
    """2·m·k·n per ``aten.mm`` and per matrix of ``aten.bmm``, from the nodes' shapes, plus the GEMM
    FLOPs of every registered op (factor_update, two_sided, ...: its family's cost model)."""
    total = 0.0
    for node, family in registered_calls(gm.graph):
        total += family.cost(family.spec_of(node)).matmul_flops
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in (aten.mm.default, aten.bmm.default):
            continue
        a, b = (arg.meta["val"] for arg in node.args[:2])
        batch = a.shape[0] if a.dim() == 3 else 1
        total += 2.0 * batch * a.shape[-2] * a.shape[-1] * b.shape[-1]
    return total


OPTIMIZER = "soap"  # set from --optimizer


def soap(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    """SOAP(lr=0.01), or REKLS(lr=0.01) with ``--optimizer rekls``; defaults otherwise."""
    from emerging_optimizers.soap import REKLS, SOAP

    return REKLS(params, lr=0.01) if OPTIMIZER == "rekls" else SOAP(params, lr=0.01)


def pipelines(settings: Settings) -> dict[str, tuple[Pass, ...]]:
    base, _ = step_pipeline(settings, torch.device("cpu"), "aten")
    forced = tuple(dataclasses.replace(p, force=True) if isinstance(p, BatchByShape) else p for p in base)
    return {"default": base, "batched": forced}


def graph_flops(shapes: list[tuple[int, int]], pipes: dict[str, tuple[Pass, ...]]) -> dict[str, float]:
    """Matmul FLOPs of the steady-state (QR-path) step: captured, and after each pipeline."""
    params = [torch.randn(*s) for s in shapes]
    opt = soap(params)
    for p in params:
        p.grad = torch.randn(p.shape)
    opt.step()  # step 0 (the eigh path) creates the state; the graph captured next is the QR path's
    out = {"captured": matmul_flops(capture(opt, STRUCTURAL_KEYS).gm)}
    for name, pipe in pipes.items():
        out[name] = matmul_flops(run_pipeline(capture(opt, STRUCTURAL_KEYS).gm, pipe)[0])
    return out


def qr_microbench(shapes: list[tuple[int, int]], rounds: int) -> list[tuple[int, int, dict[str, float]]]:
    """Per factor size n with B factors: ms for ATen's batched QR, a loop of QRs, and power_qr's threads."""
    sizes: dict[int, int] = {}
    for m, n in shapes:
        sizes[m] = sizes.get(m, 0) + 1
        sizes[n] = sizes.get(n, 0) + 1
    rows = []
    for n, count in sorted(sizes.items()):
        x = torch.randn(count, n, n)
        order = torch.arange(n).expand(count, n).contiguous()
        fns: dict[str, Callable[[], Any]] = {  # defaults bind this round's stack
            "aten batched": lambda x=x: torch.linalg.qr(x).Q,
            "loop": lambda x=x: [torch.linalg.qr(m).Q for m in x],
            "per-matrix threads": lambda x=x, order=order: power_qr(x, order),
        }
        times: dict[str, list[float]] = {k: [] for k in fns}
        for _ in range(rounds):
            for name, fn in fns.items():
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
        rows.append((n, count, {k: statistics.median(v) * 1e3 for k, v in times.items()}))
    return rows


def eager_one_thread_diff(
    initial: list[torch.Tensor], history: list[list[torch.Tensor]], reference: list[torch.Tensor]
) -> float:
    """Max relative param difference of eager SOAP replayed with 1 thread vs the timed (2-thread) eager run.

    SOAP's trajectory is this sensitive to rounding alone (ill-conditioned factors in the first
    QR steps): the floor any non-bitwise compiled variant is measured against.
    """
    params = [p.clone() for p in initial]
    opt = soap(params)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for grads in history:
            for p, g in zip(params, grads):
                p.grad = g.clone()
            opt.step()
    finally:
        torch.set_num_threads(threads)
    return max(((a - b).abs().max() / a.abs().max()).item() for a, b in zip(reference, params))


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def extras(flops: dict[str, float], qr_rows: list[tuple[int, int, dict[str, float]]]) -> list[str]:
    """The FLOP count and QR table (skipped with --lean)."""
    lines = [
        "",
        "Matmul FLOPs per steady (QR-path) step, counted from the graphs (2·m·k·n per mm/bmm):",
        "",
        "| graph | GFLOP | vs captured |",
        "|---|---:|---:|",
    ]
    for name, value in flops.items():
        lines.append(f"| {name} | {value / 1e9:.3f} | {value / flops['captured'] - 1:+.1%} |")
    lines += [
        "",
        "QR of each factor-size group (ms, median, interleaved): ATen's batched call, a loop of",
        "2-D calls (what eager SOAP does), power_qr's one-thread-per-matrix pool:",
        "",
        "| n | B | aten batched | loop | per-matrix threads | threads vs loop |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for n, count, row in qr_rows:
        speedup = row["loop"] / row["per-matrix threads"]
        lines.append(
            f"| {n} | {count} | {row['aten batched']:.1f} | {row['loop']:.1f} | "
            f"{row['per-matrix threads']:.1f} | {speedup:.2f}x |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", choices=sorted(SHAPES), default="issue12")
    parser.add_argument("--rounds", type=int, default=9, help="timed steps per variant (interleaved)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (compiles happen here)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "soap_step.md")
    parser.add_argument("--append", action="store_true", help="add this run to --out instead of replacing it")
    parser.add_argument("--threads", type=int, default=0, help="intra-op threads (default: torch's)")
    parser.add_argument("--optimizer", choices=("soap", "rekls"), default="soap")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="a subset of " + ",".join(VARIANTS))
    parser.add_argument(
        "--lean", action="store_true", help="skip the 1-thread noise floor, FLOP count and QR table (large shapes)"
    )
    args = parser.parse_args()
    global OPTIMIZER
    OPTIMIZER = args.optimizer
    variants = tuple(v for v in VARIANTS if v in args.variants.split(","))
    if not variants or variants[0] != "eager":
        parser.error("--variants must include eager (the baseline)")
    if args.threads:
        torch.set_num_threads(args.threads)
    shapes = SHAPES[args.shapes]
    load_before = Path("/proc/loadavg").read_text().split()[:3] if Path("/proc/loadavg").exists() else ["?"]
    settings = Settings.resolve(cache_dir=tempfile.mkdtemp(prefix="hocompile-soap-"))
    pipes = pipelines(settings)
    gen = torch.Generator().manual_seed(0)
    initial = [torch.randn(*s, generator=gen) for s in shapes]
    params = {v: [p.clone() for p in initial] for v in variants}
    opts: dict[str, Any] = {"eager": soap(params["eager"])}
    for name in variants[1:]:
        opts[name] = CompiledOptimizer(soap(params[name]), settings, pipes[name])
    times: dict[str, list[float]] = {v: [] for v in variants}
    first: dict[str, float] = {}
    history: list[list[torch.Tensor]] = []
    for step in range(args.warmup + args.rounds):
        grads = [torch.randn(*s, generator=gen) for s in shapes]
        history.append(grads)
        rotation = variants[step % len(variants) :] + variants[: step % len(variants)]
        for name in rotation:
            for p, g in zip(params[name], grads):
                p.grad = g.clone()
            start = time.perf_counter()
            opts[name].step()
            seconds = time.perf_counter() - start
            if step < 2:  # steps 0 and 1 compile (eigh path, then the QR path); eager's torch.compile too
                first[name] = first.get(name, 0.0) + seconds
            if step >= args.warmup:
                times[name].append(seconds)
        shown = ", ".join(f"{v} {times[v][-1] * 1e3:.0f} ms" for v in variants if times[v])
        print(f"step {step}: {shown}", flush=True)
    median = {v: statistics.median(times[v]) * 1e3 for v in variants}
    diffs = {
        v: max(((a - b).abs().max() / a.abs().max()).item() for a, b in zip(params["eager"], params[v]))
        for v in variants[1:]
    }
    load_after = Path("/proc/loadavg").read_text().split()[:3] if Path("/proc/loadavg").exists() else ["?"]
    if not args.lean:
        diffs["eager, 1 thread (noise floor)"] = eager_one_thread_diff(initial, history, params["eager"])
    flops = {} if args.lean else graph_flops(shapes, {k: v for k, v in pipes.items() if k in variants})
    qr_rows = [] if args.lean else qr_microbench(shapes, max(3, args.rounds))

    lines = [
        f"# {args.optimizer.upper()} step on CPU: eager vs hocompile",
        "",
        f"Command: `{shlex.join(['.venv/bin/python', 'benchmarks/soap_step.py', *sys.argv[1:]])}`",
        "",
        f"- {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC; CPU: {cpu_model()}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} intra-op threads; emerging-optimizers {args.optimizer.upper()}(lr=0.01), fp32",
        f"- params {shapes}; {args.warmup} warm-up steps, then {args.rounds} timed steps per variant, "
        "variants interleaved (rotating order) on identical grads; median ms/step",
        f"- load average (1/5/15 min) before {' '.join(load_before)}, after the steps {' '.join(load_after)} "
        "(other processes share these cores: compare variants within this run only)",
        "",
        "| variant | median ms/step | min | max | vs eager | steps 0+1 s | max rel param diff vs eager |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for v in variants:
        diff = f"{diffs[v]:.1e}" if v in diffs else "-"
        if v == "eager" and not args.lean:
            floor = diffs["eager, 1 thread (noise floor)"]
            diff = f"(eager 1 thread vs {torch.get_num_threads()}: {floor:.1e})"
        lines.append(
            f"| {v} | {median[v]:.1f} | {min(times[v]) * 1e3:.1f} | {max(times[v]) * 1e3:.1f} | "
            f"{median['eager'] / median[v]:.2f}x | {first[v]:.2f} | {diff} |"
        )
    if not args.lean:
        lines += extras(flops, qr_rows)
    text = "\n".join(lines) + "\n"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.append and args.out.exists():
        text = args.out.read_text() + "\n" + text.replace("# ", "## Another run: ", 1)
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
