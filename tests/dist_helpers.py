"""Shared by the distributed tests: ranks as threads of one process group, and collective counts."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from torch.distributed.tensor.debug import CommDebugMode
from torch.testing._internal.common_distributed import spawn_threads_and_init_comms


def threaded(world: int, body: Callable[[int], Any]) -> dict[int, Any]:
    """Run ``body(rank)`` on ``world`` threads of one threaded process group; each rank's result."""
    results: dict[int, Any] = {}

    @spawn_threads_and_init_comms(world_size=world)
    def run(_: Any) -> None:
        results[dist.get_rank()] = body(dist.get_rank())

    run(None)
    return results


def comm_counts(mode: CommDebugMode) -> dict[str, int]:
    """Collectives by short name (``all_to_all_single``, ``allreduce_``...) and how many ran."""
    return {str(op).split(".")[-1].rstrip("')>"): n for op, n in mode.get_comm_counts().items()}
