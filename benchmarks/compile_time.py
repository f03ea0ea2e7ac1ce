"""Compile time of torch.optim.Muon on GPT-2 small's 48 matrices: the first two compiles of a process.

    HOCOMPILE_CACHE_DIR=<dir> .venv/bin/python benchmarks/compile_time.py

Run it twice with the same cache directory: the first run is a cold start (the NS
candidates are timed on this machine; with an empty directory the target is also
calibrated first), the second a warm start (new process, timings and generated
modules read from the cache; the step is still captured). Each compile is capture +
passes (including timing) + lowering; the step itself is not included.
"""

from __future__ import annotations

import torch

import hocompile

SHAPES = [(768, 2304), (768, 768), (768, 3072), (3072, 768)] * 12


def main() -> None:
    params = [torch.nn.Parameter(torch.randn(*s) * 0.02) for s in SHAPES]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = hocompile.compile_optimizer(torch.optim.Muon(params, lr=0.02))
    for _ in range(2):  # the first step creates the momentum; the second compiles the steady state
        opt.step()
    for entry in opt.history:
        print(
            f"compile {entry.compile_seconds:.2f} s (passes {entry.pass_seconds:.2f} s, lowering "
            f"{entry.lower_seconds:.2f} s): {entry.reason}"
        )
    print(f"generated modules read from the cache: {opt.counters['disk_hits']} of {len(opt.history)}")


if __name__ == "__main__":
    main()
