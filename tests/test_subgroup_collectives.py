"""A collective over a group of one rank inside a larger world is a local copy, as in a one-rank world.

Megatron's tensor-parallel Muon calls its collectives on the TP group; at TP 1 in a data-parallel
world that group holds one rank, and eager's collective changes nothing. The capture used to judge
by the world's size and refused such a step; it now judges by the call's group. A collective over
a group of several ranks is compiled as a functional collective (test_collectives_across_ranks.py).
"""

from __future__ import annotations

import datetime
from typing import Any

import torch

import hocompile

from .dist_helpers import spawned

WORLD = 2


class SubgroupSGD(torch.optim.Optimizer):
    """All-reduces each update over its own one-rank group (Megatron's TP group at TP 1)."""

    def __init__(self, params: Any, group: Any) -> None:
        super().__init__(params, {"lr": 0.1})
        self.group = group

    @torch.no_grad()
    def step(self) -> None:  # type: ignore[override]
        import torch.distributed as dist

        for p in self.param_groups[0]["params"]:
            update = p.grad.sign()
            dist.all_reduce(update, group=self.group)
            gathered = [torch.empty_like(update)]
            dist.all_gather(gathered, update, self.group)
            p.add_(gathered[0], alpha=-self.param_groups[0]["lr"])


def _on_rank(rank: int, port: int, cache_dir: str, answers: Any) -> None:
    import torch.distributed as dist

    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=WORLD, rank=rank,
                                timeout=datetime.timedelta(seconds=60))
        try:
            groups = [dist.new_group([r]) for r in range(WORLD)]  # every rank makes every group
            mine = groups[rank]
            gen = torch.Generator().manual_seed(rank)
            want = [torch.randn(4, 3, generator=gen) for _ in range(2)]
            got = [w.clone() for w in want]
            eager = SubgroupSGD(want, mine)
            compiled = hocompile.compile_optimizer(SubgroupSGD(got, mine), cache_dir=f"{cache_dir}/{rank}",
                                                   fallback="error")
            for _ in range(3):
                for a, b in zip(want, got):
                    a.grad = torch.randn(4, 3, generator=gen)
                    b.grad = a.grad.clone()
                eager.step()
                compiled.step()
            same = all(torch.equal(a, b) for a, b in zip(want, got))
            answers.put(f"rank {rank}: {'bitwise' if same else 'DIFFERS'}, compiles {compiled.counters.compiles}")
        finally:
            dist.destroy_process_group()
    except BaseException as exc:  # always answer: a regression fails the test instead of hanging it
        answers.put(f"rank {rank}: {type(exc).__name__}: {exc}")


def test_a_one_rank_group_in_a_two_rank_world_compiles_bitwise(tmp_path: Any) -> None:
    seen = sorted(spawned(_on_rank, WORLD, str(tmp_path)))
    assert seen == [f"rank {r}: bitwise, compiles 1" for r in range(WORLD)], seen
