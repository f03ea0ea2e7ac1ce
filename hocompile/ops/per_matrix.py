"""Run a per-matrix linear-algebra call over a [B, ...] stack, matrices side by side on the CPU cores.

ATen's batched CPU QR/SVD/eigh call LAPACK once per matrix with every core
on each call, which scales poorly at n ≤ 1024; one matrix per core with one
intra-op thread each measured 1.5× (QR, n ≤ 512) and 2.1× (MOP's SVD step)
faster on this project's 2-core machine. Shared by the families whose
stacked calls are LAPACK loops (polar, eigenbasis).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

_POOLS: dict[int, ThreadPoolExecutor] = {}
_POOLS_LOCK = threading.Lock()


def _pool(workers: int) -> ThreadPoolExecutor:
    """A lasting pool per size: a fresh thread's first LAPACK call sets up MKL/OpenMP state (ms at n=256)."""
    with _POOLS_LOCK:
        if workers not in _POOLS:
            _POOLS[workers] = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="hocompile-linalg")
        return _POOLS[workers]


def per_matrix(fn: Callable[..., torch.Tensor], *stacks: torch.Tensor) -> torch.Tensor:
    """``torch.stack([fn(s[0][i], s[1][i], ...) for i in range(B)])``, matrices side by side.

    When B is not a multiple of the thread count, the last B mod T matrices
    share all T threads instead of leaving threads idle (B=3 on 2 cores: two
    matrices at once, then the third with both threads).
    ``torch.set_num_threads`` is per OpenMP thread (MKL's is thread-local),
    so workers set their own and the caller restores its count afterwards.
    """
    threads, count = torch.get_num_threads(), stacks[0].shape[0]
    if count < 2 or threads < 2:
        return fn(*stacks)
    # head: whole rounds of one-thread calls; tail: the rest, sharing all threads.
    tail = count % threads if count > threads else count
    head = count - tail
    per_tail = threads // tail if tail else 1

    def one(i: int, inner: int) -> torch.Tensor:
        if torch.get_num_threads() != inner:  # a worker keeps its count: resetting it rebuilds OpenMP state
            torch.set_num_threads(inner)
        return fn(*(s[i] for s in stacks))

    outs: list[torch.Tensor] = []
    pool = _pool(threads)
    try:
        outs += pool.map(one, range(head), [1] * head)
        if tail == 1:
            outs.append(fn(*(s[head] for s in stacks)))  # the caller's thread, all cores
        elif tail:
            outs += pool.map(one, range(head, count), [per_tail] * tail)
    finally:
        if torch.get_num_threads() != threads:  # ATen also keeps a global count; put it back for the caller
            torch.set_num_threads(threads)
    return torch.stack(outs)


__all__ = ["per_matrix"]
