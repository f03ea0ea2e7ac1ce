"""One process of tests/test_same_bits.py: torch.optim.Muon compiled on a fresh cache, its params' digest.

    python -m tests.same_bits_child MODE CACHE_DIR

MODE ``compile_optimizer`` / ``backend`` (torch.compile(opt.step, backend="hocompile")) /
``replicated`` (2 gloo processes under ``distributed="replicated"``; rank 0 prints). Each prints
one line, the sha256 of every param's bytes after STEPS steps, and nothing else on stdout.
Every process runs on two intra-op threads: eager's own GEMMs round by thread count.
"""

from __future__ import annotations

import datetime
import hashlib
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# Small (a thread twin is timed), tiny (8 rows: below the calibrated shapes), and matrices where
# the old timing chose symmetric products and fp32 by the clock. (A 512x1024 one was dropped: its
# bf16 NS, emulated on CPUs without bf16 units, made the loaded process 70 s of make test there.)
SHAPES = [(64, 256), (8, 256), (256, 64), (256, 1024), (64, 256), (384, 384)]
STEPS = 3
THREADS = 2


def params() -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=gen) * 0.02) for s in SHAPES]


def digest(mode: str, cache_dir: str) -> str:
    import hocompile

    torch.set_num_threads(THREADS)
    ps = params()
    inner = torch.optim.Muon(ps, lr=0.02, weight_decay=0.01)
    if mode == "backend":
        step = torch.compile(inner.step, backend="hocompile", options={"cache_dir": cache_dir})
    else:
        distributed = "replicated" if mode == "replicated" else "local"
        step = hocompile.compile_optimizer(inner, cache_dir=cache_dir, distributed=distributed).step
    for k in range(STEPS):
        gen = torch.Generator().manual_seed(100 + k)
        for p in ps:
            p.grad = torch.randn(p.shape, generator=gen) * 0.01
        step()
    sha = hashlib.sha256()
    for p in ps:
        sha.update(p.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return sha.hexdigest()


def _rank(rank: int, init: str, cache_dir: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=300))
    try:
        # Each rank plans on its own cache directory, as ranks on separate machines would.
        found = digest("replicated", f"{cache_dir}/rank{rank}")
        Path(f"{out}.{rank}").write_text(found)
    finally:
        dist.destroy_process_group()


def main() -> None:
    mode, cache_dir = sys.argv[1], sys.argv[2]
    if mode != "replicated":
        print(digest(mode, cache_dir))
        return
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_rank, args=(f"file://{tmp}/init", cache_dir, f"{tmp}/out"), nprocs=2,
                           start_method="spawn")
        found = {Path(f"{tmp}/out.{rank}").read_text() for rank in range(2)}
    print(found.pop() if len(found) == 1 else f"ranks differ: {sorted(found)}")


if __name__ == "__main__":
    main()
