"""Collectives a step calls across several ranks are compiled as functional collectives, never dropped.

Megatron's tensor-parallel Muon all-gathers the shards (``duplicated``) or all-reduces X·Xᵀ
(``distributed``) on plain tensors inside ``step()``; several public Muons all-gather their updates.
The capture records ``all_gather``, ``all_gather_into_tensor`` and ``all_reduce`` across ranks as
``_c10d_functional`` ops and writes their results where eager's call writes them (collectives.py).
Here: two gloo ranks, a step using each form (an ``async_op`` handle too), bitwise eager's over three
steps, self-checked by both ranks together (a plan wrong on one rank only makes both fall back);
what is not compiled (a broadcast, a reduction outside sum/max/min/product, collectives over
two process groups) is refused naming it, with nothing written. Megatron's own modes:
tests/test_megatron.py.
"""

from __future__ import annotations

import datetime
import warnings
from pathlib import Path
from typing import Any

import torch

import hocompile

from .dist_helpers import spawned
from .helpers import PerturbLastAdd

WORLD = 2


class GatherReduce(torch.optim.Optimizer):
    """Each update all-reduced (sum, async), its sign all-gathered as a list and into one tensor."""

    def __init__(self, params: Any, variant: str = "", other_group: Any = None) -> None:
        super().__init__(params, {"lr": 0.1})
        self.variant, self.other_group = variant, other_group

    @torch.no_grad()
    def step(self) -> None:  # type: ignore[override]
        import torch.distributed as dist

        for p in self.param_groups[0]["params"]:
            update = p.grad * 0.5
            dist.all_reduce(update, op=dist.ReduceOp.SUM, async_op=True).wait()
            pieces = [torch.empty_like(update) for _ in range(WORLD)]
            dist.all_gather(pieces, update.sign())
            flat = torch.empty(WORLD * update.numel(), dtype=update.dtype)
            dist.all_gather_into_tensor(flat, update.reshape(-1))
            p.add_(pieces[1] + flat[: update.numel()].view_as(p), alpha=-self.param_groups[0]["lr"])
            if self.variant == "broadcast":
                dist.broadcast(p, src=0)
            elif self.variant == "average":
                dist.all_reduce(p, op=dist.ReduceOp.AVG)
            elif self.variant == "two groups":
                dist.all_reduce(update, group=self.other_group)


def _twins(seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Generator]:
    """Two copies of two params, and the generator of their grads."""
    gen = torch.Generator().manual_seed(seed)
    want = [torch.randn(4, 3, generator=gen) for _ in range(2)]
    return want, [w.clone() for w in want], gen


def _steps(eager: Any, compiled: Any, want: list[torch.Tensor], got: list[torch.Tensor], gen: Any) -> bool:
    """Three steps of both on the same grads; whether the params end bitwise alike."""
    for _ in range(3):
        for a, b in zip(want, got):
            a.grad = torch.randn(4, 3, generator=gen)
            b.grad = a.grad.clone()
        eager.step()
        compiled.step()
    return all(torch.equal(a, b) for a, b in zip(want, got))


def _planted_on_rank_one(rank: int, cache_dir: str) -> tuple[Any, ...]:
    """A wrong addition planted in rank 1's plan only, after the collectives: rank 1's check sees it,
    rank 0's own step is right, and both fall back together (a rank running eagerly beside a compiled one
    would issue other collectives). A wrong op before a collective shows on every rank by itself."""
    from hocompile.runtime import CompiledOptimizer
    from hocompile.settings import Settings
    from tests.test_verify import AVX2_LIKE, _wrong

    want, got, gen = _twins(10 + rank)
    settings = Settings.resolve(cache_dir=cache_dir, target=AVX2_LIKE)
    compiled = CompiledOptimizer(GatherReduce(got), settings, _wrong(AVX2_LIKE, PerturbLastAdd())) if rank == 1 \
        else CompiledOptimizer(GatherReduce(got), settings)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        same = _steps(GatherReduce(want), compiled, want, got, gen)
    warned = [str(w.message) for w in caught if issubclass(w.category, hocompile.SelfCheckWarning)]
    return ("planted", rank, same, compiled.counters.eager_fallbacks, warned[0] if warned else "")


def _on_rank(rank: int, port: int, cache_dir: str, answers: Any) -> None:
    import torch.distributed as dist

    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=WORLD, rank=rank,
                                timeout=datetime.timedelta(seconds=60))
        try:
            other = dist.new_group(list(range(WORLD)))  # the same ranks, another group
            want, got, gen = _twins(rank)
            # warm_start=True: a step with its own collectives still writes no record (its ranks compile together)
            compiled = hocompile.compile_optimizer(GatherReduce(got), cache_dir=f"{cache_dir}/{rank}",
                                                   fallback="error", warm_start=True)
            same = _steps(GatherReduce(want), compiled, want, got, gen)
            records = sorted(p.name for p in Path(f"{cache_dir}/{rank}").rglob("warm-*.pkl"))
            graph = compiled.history[-1].final_graph
            ops = sorted({op for op in ("all_reduce", "all_gather_into_tensor") if f"_c10d_functional.{op}" in graph})
            checks = [(e.self_check.checks, e.self_check.skipped) for e in compiled.history]
            assert "checked against eager by every rank of process group" in hocompile.explain(compiled)
            answers.put(("bitwise" if same else "DIFFERS", compiled.counters.compiles, ops, checks, records))
            answers.put(_planted_on_rank_one(rank, f"{cache_dir}/{rank}-planted"))
            for variant in ("broadcast", "average", "two groups"):
                params = [torch.ones(4, 3)]
                params[0].grad = torch.ones(4, 3)
                refused = hocompile.compile_optimizer(GatherReduce(params, variant, other),
                                                      cache_dir=f"{cache_dir}/{rank}", fallback="error")
                try:
                    refused.step()
                    answers.put((variant, "compiled"))
                except hocompile.CaptureError as exc:
                    answers.put((variant, str(exc), torch.equal(params[0], torch.ones(4, 3))))
        finally:
            dist.destroy_process_group()
    except BaseException as exc:  # always answer: a regression fails the test instead of hanging it
        answers.put(("error", f"rank {rank}: {type(exc).__name__}: {exc}"))


def test_collectives_across_two_ranks_compile_bitwise_or_are_refused_by_name(tmp_path: Any) -> None:
    seen = spawned(_on_rank, WORLD, str(tmp_path), answers=5)
    assert not [a for a in seen if a[0] == "error"], seen
    steps = [a for a in seen if a[0] in ("bitwise", "DIFFERS")]
    # checked by both ranks together on its runs 1 and 2 (one program: the step keeps no state)
    assert steps == [("bitwise", 1, ["all_gather_into_tensor", "all_reduce"], [(2, "")], [])] * WORLD, steps
    planted = sorted(a[1:] for a in seen if a[0] == "planted")
    assert [p[:3] for p in planted] == [(0, True, 3), (1, True, 3)], planted  # every step eager's, on both
    assert "another rank of its process group" in planted[0][3], planted
    assert "differs where the plan keeps eager's arithmetic" in planted[1][3], planted
    refusals = {a[0]: a[1:] for a in seen if a[0] in ("broadcast", "average", "two groups")}
    assert "torch.distributed.broadcast across 2 ranks" in refusals["broadcast"][0], refusals
    assert "its reduction" in refusals["average"][0] and "not one of sum" in refusals["average"][0], refusals
    assert "collectives over 2 process groups" in refusals["two groups"][0], refusals
    assert all(untouched for _, untouched in refusals.values()), refusals  # nothing written
