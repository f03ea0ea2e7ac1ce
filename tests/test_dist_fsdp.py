"""FSDP2 ``Shard(0)`` DTensors through a compiled step (distributed/sharded.py, passes/route_sharded.py).

The reference is torch.optim.Muon on the full, unsharded params in one
process. Ranks run as threads of one process group (fast); one test runs
real gloo processes. Shapes include 1 and 3 rows, so at world sizes 2–4
some ranks hold no rows of a matrix.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode

import hocompile

from .dist_helpers import comm_counts, threaded

SHAPES = [(8, 6), (3, 5), (1, 4), (6, 8), (5, 5)]
# choose-algorithm/-precision plan the NS by timing this machine (fp32 where bf16 measures slow,
# symmetric products...): off, the fused NS is eager's own program, so a routed step must equal
# eager's to rounding. The default pipeline is checked against the compiled single-process step.
EAGERS_NS = {"disable_passes": ["choose-algorithm", "choose-precision"]}
STEPS = 3
A2A = "all_to_all_single"


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One cache for the module: the target's calibration is measured once, not per test."""
    return tmp_path_factory.mktemp("cache")


def full_params(shapes: list[tuple[int, int]], dtype: torch.dtype = torch.float64) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=gen, dtype=dtype) for s in shapes]


def full_grads(
    shapes: list[tuple[int, int]], steps: int, dtype: torch.dtype = torch.float64
) -> list[list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [[torch.randn(s, generator=gen, dtype=dtype) for s in shapes] for _ in range(steps)]


def single_process(
    params: list[torch.Tensor], grads: list[list[torch.Tensor]], compiled_in: Path | None = None
) -> list[torch.Tensor]:
    """torch.optim.Muon on the full params in one process; compiled (with that cache) if ``compiled_in``."""
    ps = [torch.nn.Parameter(p.clone()) for p in params]
    opt: Any = torch.optim.Muon(ps, lr=0.02, weight_decay=0.1)
    if compiled_in is not None:
        opt = hocompile.compile_optimizer(opt, cache_dir=compiled_in)
    for step in grads:
        for p, g in zip(ps, step):
            p.grad = g.clone()
        opt.step()
    return [p.detach() for p in ps]


class Holder(torch.nn.Module):
    def __init__(self, params: list[torch.Tensor]) -> None:
        super().__init__()
        self.ps = torch.nn.ParameterList([torch.nn.Parameter(p.clone()) for p in params])


def sharded(params: list[torch.Tensor], world: int) -> tuple[Holder, Any]:
    model = Holder(params)
    mesh = init_device_mesh("cpu", (world,))
    fully_shard(model, mesh=mesh)
    return model, mesh


def compiled_sharded_run(
    params: list[torch.Tensor], grads: list[list[torch.Tensor]], world: int, cache: str, **options: Any
) -> Callable[[int], Any]:
    def body(rank: int) -> Any:
        model, mesh = sharded(params, world)
        ps = list(model.parameters())
        muon = torch.optim.Muon(ps, lr=0.02, weight_decay=0.1)
        opt = hocompile.compile_optimizer(muon, cache_dir=cache, **options)
        counts = []
        for step in grads:
            for p, g in zip(ps, step):
                p.grad = distribute_tensor(g.clone(), mesh, p.placements)
            with CommDebugMode() as mode:
                opt.step()
            counts.append(comm_counts(mode))
        buffers = [opt.state[p]["momentum_buffer"] for p in ps]
        layouts = [(type(b), tuple(b.placements), tuple(b.shape), b.stride()) for b in buffers]
        return [p.full_tensor() for p in ps], counts, layouts, opt.counters.as_dict()

    return body


@pytest.mark.parametrize("world", [2, 3, 4])
def test_sharded_step_matches_single_process(world: int, cache: Path) -> None:
    params, grads = full_params(SHAPES), full_grads(SHAPES, STEPS)
    expected = single_process(params, grads)
    results = threaded(world, compiled_sharded_run(params, grads, world, str(cache), **EAGERS_NS))
    for rank, (finals, counts, layouts, counters) in results.items():
        for shape, got, want in zip(SHAPES, finals, expected):
            err = (got - want).abs().max().item()
            assert err <= 1e-12, f"rank {rank}, {shape}: {err:.3g} from the single-process step"
        # one fp64 bucket: two all-to-alls per step, nothing gathered
        assert counts == [{A2A: 2}] * STEPS, counts
        for shape, layout in zip(SHAPES, layouts):
            assert layout == (DTensor, (Shard(0),), shape, (shape[1], 1))
        assert counters["eager_fallbacks"] == 0 and counters["compiles"] == 2


def test_each_dtype_bucket_has_two_all_to_alls(cache: Path) -> None:
    shapes32 = [(4, 6), (2, 3)]
    p64, p32 = full_params(SHAPES), full_params(shapes32, torch.float32)
    g64, g32 = full_grads(SHAPES, 2), full_grads(shapes32, 2, torch.float32)
    params, grads = p64 + p32, [a + b for a, b in zip(g64, g32)]
    expected = single_process(params, grads, compiled_in=cache)
    results = threaded(2, compiled_sharded_run(params, grads, 2, str(cache)))
    for finals, counts, _, _ in results.values():
        assert counts == [{A2A: 4}] * 2
        for got, want in zip(finals, expected):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-12 if want.dtype == torch.float64 else 1e-6)


def test_state_dict_matches_eager(cache: Path) -> None:
    shapes = [(8, 6), (6, 8), (4, 4)]  # eager Muon on DTensors needs rows >= world
    params, grads = full_params(shapes), full_grads(shapes, 2)

    def body(rank: int) -> Any:
        dicts, dcp = [], []
        for compiled in (False, True):
            model, mesh = sharded(params, 2)
            ps = list(model.parameters())
            opt: Any = torch.optim.Muon(ps, lr=0.02)
            if compiled:
                opt = hocompile.compile_optimizer(opt, cache_dir=str(cache))
            for step in grads:
                for p, g in zip(ps, step):
                    p.grad = distribute_tensor(g.clone(), mesh, p.placements)
                opt.step()
            dicts.append(opt.state_dict())
            # What a DCP checkpoint saves: state keyed by FQN, DTensors as they are.
            dcp.append(get_optimizer_state_dict(model, opt))
        assert dcp[0]["state"] and dcp[0].keys() == dcp[1].keys() and dcp[0]["state"].keys() == dcp[1]["state"].keys()
        for fqn, state in dcp[0]["state"].items():
            assert {k: type(v) for k, v in state.items()} == {k: type(v) for k, v in dcp[1]["state"][fqn].items()}
        return dicts

    for eager, ours in threaded(2, body).values():
        assert eager["param_groups"] == ours["param_groups"]
        assert eager["state"].keys() == ours["state"].keys()
        for index, state in eager["state"].items():
            assert state.keys() == ours["state"][index].keys()
            for key, value in state.items():
                mine = ours["state"][index][key]
                assert type(mine) is type(value)
                if isinstance(value, DTensor):
                    layout = (mine.placements, mine.shape, mine.stride())
                    assert layout == (value.placements, value.shape, value.stride())
                    assert mine.device_mesh == value.device_mesh
                    torch.testing.assert_close(mine.to_local(), value.to_local(), rtol=0, atol=1e-12)


class NormalizedSGD(torch.optim.Optimizer):
    """p -= lr * g / ||g||: the norm is over the whole tensor, so not row-local."""

    def __init__(self, params: Any, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                p.sub_(group["lr"] * p.grad / p.grad.norm())


def test_refuses_an_op_that_is_not_row_local(cache: Path) -> None:
    params = full_params([(4, 3)])

    def body(rank: int) -> str:
        model, mesh = sharded(params, 2)
        (p,) = model.parameters()
        p.grad = distribute_tensor(torch.ones(4, 3, dtype=torch.float64), mesh, p.placements)
        before = p.to_local().clone()
        opt = hocompile.compile_optimizer(NormalizedSGD([p]), cache_dir=str(cache))
        with pytest.raises(hocompile.CaptureError) as info:
            opt.step()
        assert torch.equal(p.to_local(), before)  # refused before anything ran
        return str(info.value)

    for message in threaded(2, body).values():
        assert "linalg_vector_norm" in message and "param_groups[0]['params'][0]" in message
        assert "not elementwise" in message


def test_refuses_when_route_sharded_is_disabled(cache: Path) -> None:
    params = full_params([(4, 3)])

    def body(rank: int) -> str:
        model, mesh = sharded(params, 2)
        ps = list(model.parameters())
        opt = torch.optim.Muon(ps, lr=0.02)
        compiled = hocompile.compile_optimizer(opt, cache_dir=str(cache), disable_passes=["route-sharded"])
        ps[0].grad = distribute_tensor(torch.ones(4, 3, dtype=torch.float64), mesh, ps[0].placements)
        with pytest.raises(hocompile.CaptureError, match="route-sharded pass did not run") as info:
            compiled.step()
        return str(info.value)

    assert len(threaded(2, body)) == 2


def test_plain_params_beside_sharded_ones_run_as_before(cache: Path) -> None:
    shapes = [(3, 5), (4, 4)]
    params, grads = full_params(shapes), full_grads(shapes, 2)
    expected = single_process(params, grads)

    def body(rank: int) -> list[torch.Tensor]:
        model, mesh = sharded(params[:1], 2)
        (p,) = model.parameters()
        plain = torch.nn.Parameter(params[1].clone())  # replicated: the same on every rank
        muon = torch.optim.Muon([p, plain], lr=0.02, weight_decay=0.1)
        opt = hocompile.compile_optimizer(muon, cache_dir=str(cache), **EAGERS_NS)
        for step in grads:
            p.grad = distribute_tensor(step[0].clone(), mesh, p.placements)
            plain.grad = step[1].clone()
            opt.step()
        assert not isinstance(opt.state[plain]["momentum_buffer"], DTensor)
        return [p.full_tensor(), plain.detach().clone()]

    for finals in threaded(2, body).values():
        for got, want in zip(finals, expected):
            assert (got - want).abs().max().item() <= 1e-12


def test_owner_batches_its_same_shaped_matrices(cache: Path) -> None:
    from hocompile.passes import BatchByShape, Canonicalize, FuseNewtonSchulz
    from hocompile.runtime import CompiledOptimizer
    from hocompile.settings import Settings
    from hocompile.targets import Target

    shapes = [(4, 6)] * 4 + [(3, 5)]
    params, grads = full_params(shapes), full_grads(shapes, 2)
    expected = single_process(params, grads)
    # batch-by-shape declines on CPU by default; forced, as on a GPU target
    pipeline = (Canonicalize(), FuseNewtonSchulz(), BatchByShape(target=Target("test"), force=True))

    def body(rank: int) -> tuple[list[torch.Tensor], str]:
        model, mesh = sharded(params, 2)
        ps = list(model.parameters())
        opt = CompiledOptimizer(torch.optim.Muon(ps, lr=0.02, weight_decay=0.1), Settings(cache_dir=cache), pipeline)
        for step in grads:
            for p, g in zip(ps, step):
                p.grad = distribute_tensor(g.clone(), mesh, p.placements)
            opt.step()
        return [p.full_tensor() for p in ps], opt.history[-1].final_graph

    for finals, graph in threaded(2, body).values():
        assert "fp64[2, 4, 6] = aten.stack" in graph  # the owner's two 4×6 matrices in one call
        for got, want in zip(finals, expected):
            assert (got - want).abs().max().item() <= 1e-12


# ------------------------------------------------------------------ real gloo processes


def _gloo_rank(rank: int, world: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        params, grads = full_params(SHAPES), full_grads(SHAPES, STEPS)
        run = compiled_sharded_run(params, grads, world, os.path.join(out_dir, "cache"), **EAGERS_NS)
        finals, counts, _, _ = run(rank)
        torch.save({"finals": finals, "counts": counts}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_gloo_processes_match_single_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.multiprocessing as mp

    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # two processes on shared cores
    world = 2
    ctx = mp.start_processes(
        _gloo_rank, args=(world, str(tmp_path / "init"), str(tmp_path)), nprocs=world, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + 120
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:
            for process in ctx.processes:
                process.kill()
            pytest.fail("gloo ranks did not finish within 120 s")
    expected = single_process(full_params(SHAPES), full_grads(SHAPES, STEPS))
    for rank in range(world):
        result = torch.load(tmp_path / f"rank{rank}.pt")
        # Compiling steps (1 and 2) also agree across ranks (distributed/check.py): rank 0's target
        # is broadcast (broadcast_object_list: 2 broadcasts) and one all-reduce checks that the
        # ranks' collectives match; a steady step makes exactly its two all-to-alls.
        compiling, steady = result["counts"][:2], result["counts"][2:]
        assert steady == [{A2A: 2}] * (STEPS - 2), result["counts"]
        checks = {"allreduce_": 1, "broadcast_": 2}
        for counts in compiling:
            assert {k: n for k, n in counts.items() if k not in checks} == {A2A: 2}, result["counts"]
            assert all(counts.get(k, 0) <= n for k, n in checks.items()), result["counts"]
        for got, want in zip(result["finals"], expected):
            assert (got - want).abs().max().item() <= 1e-12
