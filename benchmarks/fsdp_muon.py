"""Compiled vs. eager torch.optim.Muon on the same FSDP2 DTensors, 2 gloo processes on CPU.

The matrices are GPT-2-small's per-layer shapes scaled down by ``--scale``
(qkv 3d×d, proj d×d, fc 4d×d, out d×4d with d = 768/scale) for ``--layers``
layers, fp32, each ``fully_shard``-ed as its own module (so every param is a
``Shard(0)`` DTensor over the 2 ranks, as FSDP2 shards a model). Eager Muon
runs its Newton–Schulz on DTensors (sharding propagation issues collectives
inside every iteration); the compiled step routes each matrix whole to one
owner with two all-to-alls per bucket (passes/route_sharded.py).

Per step: warm-up (compile) first, then eager and compiled steps interleaved
``--repeats`` times; medians and their ratio from the same run, plus the
collectives of one step of each counted with CommDebugMode. The grads are
fixed, so both optimizers do the same work every step.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python benchmarks/fsdp_muon.py [--scale 4 --layers 4 --repeats 7]``
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode

import hocompile

WORLD = 2


def shapes(scale: int, layers: int) -> list[tuple[int, int]]:
    d = 768 // scale
    return [(3 * d, d), (d, d), (4 * d, d), (d, 4 * d)] * layers


def build(shape_list: list[tuple[int, int]], mesh: Any) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    model = torch.nn.ModuleList(torch.nn.Linear(n, m, bias=False) for m, n in shape_list)
    with torch.no_grad():
        for layer in model:
            layer.weight.copy_(torch.randn(layer.weight.shape, generator=gen) * 0.02)
    for layer in model:
        fully_shard(layer, mesh=mesh)
    return list(model.parameters())


def timed_step(opt: Any) -> float:
    start = time.perf_counter()
    opt.step()
    return time.perf_counter() - start


def collectives(opt: Any) -> int:
    with CommDebugMode() as mode:
        opt.step()
    return int(mode.get_total_counts())


def run(rank: int, args: argparse.Namespace, init_file: str, out: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD, timeout=timedelta(seconds=300)
    )
    try:
        mesh = init_device_mesh("cpu", (WORLD,))
        shape_list = shapes(args.scale, args.layers)
        gen = torch.Generator().manual_seed(1)
        grads = [torch.randn(s, generator=gen) for s in shape_list]
        opts: dict[str, Any] = {}
        for name in ("eager", "compiled"):
            ps = build(shape_list, mesh)
            for p, g in zip(ps, grads):
                p.grad = distribute_tensor(g, mesh, p.placements)
            muon = torch.optim.Muon(ps, lr=0.02)
            opts[name] = muon if name == "eager" else hocompile.compile_optimizer(muon, cache_dir=out)
        warm = {name: [timed_step(opt) for _ in range(2)] for name, opt in opts.items()}  # state, then compile
        counts = {name: collectives(opt) for name, opt in opts.items()}
        times: dict[str, list[float]] = {"eager": [], "compiled": []}
        for _ in range(args.repeats):
            for name, opt in opts.items():
                dist.barrier()
                times[name].append(timed_step(opt))
        if rank == 0:
            med = {name: statistics.median(t) for name, t in times.items()}
            lines = [
                f"matrices: {len(shape_list)} ({', '.join(f'{m}x{n}' for m, n in shape_list[:4])} per layer), fp32",
                f"first two steps (state, compile): eager {warm['eager'][0]:.2f}+{warm['eager'][1]:.2f} s, "
                f"compiled {warm['compiled'][0]:.2f}+{warm['compiled'][1]:.2f} s",
                f"collectives per step (CommDebugMode): eager {counts['eager']}, compiled {counts['compiled']}",
                f"median step over {args.repeats} interleaved: eager {med['eager'] * 1e3:.1f} ms, "
                f"compiled {med['compiled'] * 1e3:.1f} ms, ratio eager/compiled {med['eager'] / med['compiled']:.1f}x",
            ]
            print("\n".join(lines))
            if args.explain:
                print(hocompile.explain(opts["compiled"]))
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=int, default=4, help="d_model = 768 / scale")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--explain", action="store_true", help="print rank 0's explain() of the compiled step")
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"
    print(f"torch {torch.__version__}, world {WORLD} (gloo, CPU), 1 thread per process")
    with tempfile.TemporaryDirectory() as tmp:
        cache = str(Path(tmp) / "cache")
        mp.start_processes(run, args=(args, str(Path(tmp) / "init"), cache), nprocs=WORLD, start_method="spawn")


if __name__ == "__main__":
    main()
