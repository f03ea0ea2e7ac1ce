"""Shared by the distributed tests: ranks as threads of one process group or as spawned processes, and
collective counts."""

from __future__ import annotations

import socket
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


def free_port() -> int:
    """A TCP port free on this machine now (for a process group's rendezvous)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def spawned(body: Callable[..., None], world: int, *args: Any, answers: int = 1) -> list[Any]:
    """Run ``body(rank, port, *args, queue)`` in ``world`` spawned processes (one gloo rank each, their
    rendezvous on a free port) and return the ``answers`` items each rank puts on the queue, in arrival
    order. A body should answer even when it fails, so that a regression fails the test, not hangs it."""
    import torch.multiprocessing as mp

    queue = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(body, args=(free_port(), *args, queue), nprocs=world, start_method="spawn")
    return [queue.get() for _ in range(answers * world)]


def comm_counts(mode: CommDebugMode) -> dict[str, int]:
    """Collectives by short name (``all_to_all_single``, ``allreduce_``...) and how many ran."""
    return {str(op).split(".")[-1].rstrip("')>"): n for op, n in mode.get_comm_counts().items()}
