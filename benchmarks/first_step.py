"""The first step on a fresh machine: hocompile's first compiled step beside eager's, quiet and loaded.

    .venv/bin/python benchmarks/first_step.py            # writes benchmarks/results/first_step.md

Each figure is one new process on an empty cache directory (so the CPU is calibrated and every
plan made from scratch), timing the first ``step()`` of every optimizer of the model (Muon for the
matrices, AdamW for the rest), the second (hocompile compiles the steady state there, once the
first step made the state), and the median of steps 9-13 (after the self-check's early checks). "loaded": two busy loops
saturate the machine's cores for the whole process. Models:

- gpt2-small: GPT-2 small (48 Muon matrices, 100 AdamW tensors);
- qwen3-dense: a Qwen3-0.6B-shaped dense model, 8 of its 28 layers (hidden 1024, 16 q / 8 kv
  heads of 128, MLP 3072; tied 151,936-row embedding to AdamW);
- moe-views: a small MoE (hidden 512, 4 layers, 16 experts of 256 as ``[E, m, n]`` weights) handed
  to torch.optim.Muon as per-expert views, the way transformers 5.x users must.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
MODELS = ("gpt2-small", "qwen3-dense", "moe-views")
WARM = 8  # steps before the timed ones: the first two compile, the self-check runs on 1, 2, 4 and 8
STEPS = 5  # timed: steps 9-13 (the next self-check is on step 16)


def _qwen3_dense() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    hidden, q, kv, mlp, layers, vocab = 1024, 2048, 1024, 3072, 8, 151936
    shapes = [(q, hidden), (kv, hidden), (kv, hidden), (hidden, q), (mlp, hidden), (mlp, hidden), (hidden, mlp)]
    muon = [torch.randn(s, generator=gen) * 0.02 for _ in range(layers) for s in shapes]
    adamw = [torch.randn(vocab, hidden, generator=gen) * 0.02] + [torch.ones(hidden) for _ in range(2 * layers + 1)]
    adamw += [torch.ones(128) for _ in range(2 * layers)]  # q_norm, k_norm
    return muon, adamw


def _moe_views() -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """Muon's per-expert views, AdamW's tensors, and the bases whose grads the views read."""
    gen = torch.Generator().manual_seed(0)
    hidden, layers, experts, inter = 512, 4, 16, 256
    attention = [torch.randn(s, generator=gen) * 0.02 for _ in range(layers) for s in [(hidden, hidden)] * 4]
    bases = [
        torch.randn(e, generator=gen) * 0.02
        for _ in range(layers)
        for e in ((experts, inter, hidden), (experts, inter, hidden), (experts, hidden, inter))
    ]
    views = [b[e] for b in bases for e in range(experts)]
    routers = [torch.randn(experts, hidden, generator=gen) * 0.02 for _ in range(layers)]
    adamw = [torch.randn(32000, hidden, generator=gen) * 0.02] + [torch.ones(hidden) for _ in range(2 * layers)]
    return attention + routers + views, adamw, bases


def _child(model: str, compiled: bool, cache_dir: str, warm: int = WARM, steps: int = STEPS) -> dict[str, float]:
    sys.path.insert(0, str(ROOT))
    import hocompile
    from benchmarks.self_check import gpt2_small

    bases: list[torch.Tensor] = []
    if model == "gpt2-small":
        muon, adamw = gpt2_small()
    elif model == "qwen3-dense":
        muon, adamw = _qwen3_dense()
    else:
        muon, adamw, bases = _moe_views()
    grads = {id(b): torch.randn(b.shape) * 0.01 for b in bases}
    for t in muon + adamw:
        base = next((b for b in bases if t._base is b), None)  # a view's grad is the view of its base's
        t.grad = torch.randn(t.shape) * 0.01 if base is None else None
    for b in bases:
        for e, view in enumerate(v for v in muon if v._base is b):
            view.grad = grads[id(b)][e]
    opts: list[torch.optim.Optimizer] = [torch.optim.Muon(muon, lr=0.02), torch.optim.AdamW(adamw, lr=1e-3)]
    if compiled:
        opts = [hocompile.compile_optimizer(o, cache_dir=cache_dir) for o in opts]
    times = []
    for _ in range(warm + steps):
        start = time.perf_counter()
        for o in opts:
            o.step()
        times.append(time.perf_counter() - start)
    return {"first_s": times[0], "second_s": times[1], "step_s": statistics.median(times[warm:])}


def _run(model: str, compiled: bool, loaded: bool) -> dict[str, float]:
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 2)] \
        if loaded else []
    try:
        with tempfile.TemporaryDirectory() as cache_dir:
            code = (f"import json, benchmarks.first_step as f; "
                    f"print(json.dumps(f._child({model!r}, {compiled}, {cache_dir!r})))")
            done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                                  env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=1800)
    finally:
        for b in burners:
            b.kill()
            b.wait()
    if done.returncode:
        raise RuntimeError(done.stderr[-2000:])
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def main() -> None:
    import argparse

    from hocompile.targets import _cpu_id, _measure, declared_ratios

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="first_step.md", help="file name under benchmarks/results/")
    args = parser.parse_args()

    model_name = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if "model name" in line), "?")
    bf16 = _measure(torch.bfloat16)
    lines = [
        "# First step on a fresh cache: hocompile beside eager",
        "",
        f"Machine: {model_name}, {os.cpu_count()} cores; bf16 GEMM {bf16:.0f} GFLOP/s (256³); declared "
        f"{declared_ratios()}; torch {torch.__version__}, Python {platform.python_version()}, cpu id {_cpu_id()}.",
        f"Command: `.venv/bin/python benchmarks/first_step.py --out {args.out}`. One new process per cell, "
        "empty cache directory; "
        "'loaded': one busy loop per core for the whole process.",
        "",
        "| model | load | eager first step | hocompile first step | hocompile second step | eager step "
        "| hocompile step | step ratio |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for model in MODELS:
        for loaded in (False, True):
            eager = _run(model, False, loaded)
            mine = _run(model, True, loaded)
            ratio = eager["step_s"] / mine["step_s"]
            load = "loaded" if loaded else "quiet"
            row = (f"| {model} | {load} | {eager['first_s']:.2f} s | {mine['first_s']:.2f} s "
                   f"| {mine['second_s']:.2f} s | {eager['step_s']:.3f} s | {mine['step_s']:.3f} s | {ratio:.2f}x |")
            print(row, flush=True)
            lines.append(row)
    out = ROOT / "benchmarks" / "results" / args.out
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
