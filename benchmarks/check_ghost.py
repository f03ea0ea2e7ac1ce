"""Reproduce issue 30's AdamW "ghost": a first self-check that fails on one OpenMP half, rarely.

    .venv/bin/python benchmarks/check_ghost.py --runs 60 --self-check 1 --load 2

Each run is a fresh process: a whole-traced ``torch.optim.AdamW`` over a 2304x1824 matrix (and two
small tensors), compiled on an empty cache and stepped once, with its first check on the whole
member (slicing off), beside eager's step from the same values. ``--load N`` keeps N busy
processes running. A run prints ``BAD`` when the compiled optimizer fell back (its check saw a
difference) or its params differ from eager's, with the rows that differ. Seen on the 2-core AMX
Xeon, 2 threads, loaded: 1 of 54 and 5 of ~120 runs with the self-check on, 0 of 60 with it off,
0 of 100 in one process; never with OMP_NUM_THREADS=1. ``--calibrated`` hands each run a cache
directory that already holds this CPU's calibration, so the process times no bf16/fp32 GEMMs before
its step: 0 of 100 (the lead, at p ~ 0.03, that the calibration's GEMMs are part of it).
Never seen on a 2-core AMD EPYC (avx512_bf16, no AMX; microcode 0x1000065), same torch and
command, loaded: 0 of 230 runs uncalibrated with the self-check on (p ~ 3e-4 at the Xeon's rate),
so the ghost belongs to the AMX Xeon (its AMX tile state, or its OpenMP/oneDNN path there): the
next step is on that CPU, e.g. the same command with ``ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import warnings

import torch

SHAPES = [(2304, 1824), (64,), (24, 40)]


def _cache_dir(calibration: str | None) -> str:
    """A new cache directory, holding the calibration files found in ``calibration`` if given."""
    import shutil
    from pathlib import Path

    path = tempfile.mkdtemp()
    for found in Path(calibration).glob("target-cpu-*.json") if calibration else []:
        shutil.copy(found, path)
    return path


def child(seed: int, self_check: bool, calibration: str | None) -> str:
    import hocompile
    from hocompile.runtime.check import slices as check_slices

    warnings.simplefilter("ignore")
    check_slices.SLICE_FROM = 1 << 40  # the first check on the whole member, as before slicing
    torch.manual_seed(seed)
    base = [torch.randn(*s) for s in SHAPES]
    grads = [torch.randn(*s) for s in SHAPES]
    params = [torch.nn.Parameter(b.clone()) for b in base]
    twins = [torch.nn.Parameter(b.clone()) for b in base]
    for p, q, g in zip(params, twins, grads):
        p.grad, q.grad = g.clone(), g.clone()
    opt = hocompile.compile_optimizer(torch.optim.AdamW(params, lr=1e-2, foreach=False),
                                      cache_dir=_cache_dir(calibration), self_check=self_check)
    opt.step()
    torch.optim.AdamW(twins, lr=1e-2, foreach=False).step()
    diff = (params[0] - twins[0]).abs()
    fell_back = opt.counters.eager_fallbacks
    if diff.max() > 0 or fell_back:
        rows = (diff.amax(1) > 0).nonzero().flatten().tolist()
        reason = opt.history[0].fallback[:160] if fell_back else ""
        return f"BAD seed {seed}: max |d| {float(diff.max()):.3g}, rows {rows[:1]}..{rows[-1:]}, fallback {reason!r}"
    return f"ok seed {seed}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=60)
    parser.add_argument("--first-seed", type=int, default=1000)
    parser.add_argument("--self-check", type=int, default=1)
    parser.add_argument("--load", type=int, default=2)
    parser.add_argument("--calibrated", action="store_true", help="runs start with this CPU's calibration")
    parser.add_argument("--child", type=int, default=None)
    parser.add_argument("--calibration", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print(child(args.child, bool(args.self_check), args.calibration), flush=True)
        return
    extra = []
    if args.calibrated:
        from pathlib import Path

        from hocompile.targets import cpu_target

        calibration = tempfile.mkdtemp()
        cpu_target(Path(calibration))  # measured once, here, before the load starts
        extra = ["--calibration", calibration]
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.load)]
    bad = 0
    try:
        for seed in range(args.first_seed, args.first_seed + args.runs):
            command = [sys.executable, __file__, "--child", str(seed), "--self-check", str(args.self_check), *extra]
            out = subprocess.run(command, capture_output=True, text=True, timeout=600).stdout.strip().splitlines()
            line = out[-1] if out else f"ERROR seed {seed}"
            bad += not line.startswith("ok")
            print(line, flush=True)
    finally:
        for b in burners:
            b.kill()
            b.wait()
    print(f"{bad} of {args.runs} runs differ (self_check={bool(args.self_check)}, load {args.load}, "
          f"calibrated {args.calibrated})")


if __name__ == "__main__":
    main()
