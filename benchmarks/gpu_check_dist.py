"""gpu_check's ``distributed`` section: ``distributed="replicated"`` on the Triton backend, one node.

With more than one GPU, one process per GPU (NCCL, up to 8) compiles torch.optim.Muon with
``backend="triton", distributed="replicated"`` (each rank orthogonalises its share and the results
are all-gathered) and, on the same params and grads, the single-process Triton step; every rank's
params must be bitwise the single-process ones (hence equal across ranks). With one GPU the section
is skipped. ``--smoke`` runs the same code on CPU with one gloo process (world 1: nothing is
shared, so it checks the script); two ranks on CPU are tests/test_dist_ddp.py's gloo Triton test.
"""

from __future__ import annotations

import datetime
import os
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import hocompile

TIMEOUT_S = 240


def _run(distributed: str, shapes: list[tuple[int, int]], device: torch.device, cache: str) -> list[torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(60)
    params = [torch.nn.Parameter(torch.randn(*s, generator=gen, device=device)) for s in shapes]
    muon = torch.optim.Muon(params, lr=0.02, weight_decay=0.01, ns_steps=2)
    # On CPU, plan by the FLOP model (as the tests do), not by timing a busy machine: every rank and
    # both runs then choose the same Newton–Schulz program. GPU targets plan by the model anyway.
    target = "cpu-avx2" if device.type == "cpu" else "auto"
    opt = hocompile.compile_optimizer(muon, backend="triton", distributed=distributed, target=target, cache_dir=cache)
    for step in range(2):  # the first step and the steady state (each a compile)
        g = torch.Generator(device=device).manual_seed(1000 + step)
        for p in params:
            p.grad = torch.randn(p.shape, generator=g, device=device)
        opt.step()
    return [p.detach().cpu().clone() for p in params]


def _worker(rank: int, world: int, init: str, out: str, backend: str, shapes: list[tuple[int, int]]) -> None:
    timeout = datetime.timedelta(seconds=TIMEOUT_S)
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world, timeout=timeout)
    try:
        device = torch.device("cpu")
        if backend == "nccl":
            device = torch.device("cuda", rank)
            torch.cuda.set_device(device)
        cache = tempfile.mkdtemp(prefix=f"gpu-check-dist-{rank}-")
        start = time.perf_counter()
        got = _run("replicated", shapes, device, cache)
        want = _run("local", shapes, device, cache)
        torch.save(
            {
                "bitwise": [torch.equal(a, b) for a, b in zip(got, want)],
                "params": got,
                "seconds": time.perf_counter() - start,
            },
            f"{out}.{rank}",
        )
    finally:
        dist.destroy_process_group()


def section(ctx: Any, out: dict[str, Any]) -> None:
    if ctx.smoke:
        world, backend = 1, "gloo"
        shapes = [(16, 32), (32, 16)]
    else:
        count = torch.cuda.device_count()
        if count < 2:
            out["skipped"] = f"{count} GPU on this node: replicated needs two or more"
            print(f"  skipped: {out['skipped']}", flush=True)
            return
        world, backend = min(count, 8), "nccl"
        shapes = [(256, 512), (512, 256), (384, 256), (256, 384)] * 2
    out.update(world=world, backend=backend, shapes=[list(s) for s in shapes])
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # inherited by the workers
    with tempfile.TemporaryDirectory() as tmp:
        init, result = f"file://{tmp}/init", f"{tmp}/result"
        args = (world, init, result, backend, shapes)
        context = mp.start_processes(_worker, args=args, nprocs=world, join=False, start_method="spawn")
        deadline = time.monotonic() + TIMEOUT_S
        while not context.join(timeout=2):  # re-raises a worker's exception
            if time.monotonic() > deadline:
                for process in context.processes:
                    process.kill()
                raise TimeoutError(f"distributed workers still running after {TIMEOUT_S} s")
        ranks = [torch.load(f"{result}.{rank}") for rank in range(world)]
    agree = all(torch.equal(a, b) for r in ranks[1:] for a, b in zip(r["params"], ranks[0]["params"]))
    out["ranks"] = [{"bitwise_single_process": r["bitwise"], "seconds": round(r["seconds"], 2)} for r in ranks]
    out["ranks_agree"] = agree
    out["passed"] = agree and all(all(r["bitwise"]) for r in ranks)
    print(
        f"  [{'PASS' if out['passed'] else 'FAIL'}] replicated Triton at world {world} ({backend}): bitwise the "
        f"single-process Triton step on every rank: {all(all(r['bitwise']) for r in ranks)}, ranks agree {agree}",
        flush=True,
    )
    ctx.check("distributed: replicated Triton bitwise the single-process step", out["passed"])

