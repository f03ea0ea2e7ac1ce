"""Tile configs per architecture: a deterministic table, no start-up autotuning.

Peers report ~30 s of autotuning per shape per rank, and OOM/NaN when eight
GPUs autotune at once, so the default is this table. ``interpret`` is the
Triton interpreter on CPU: blocks of 16 (the smallest a GPU ``tl.dot``
accepts, so interpreted kernels stay valid GPU kernels) keep tests fast.

Opt-in autotuning (``compile_optimizer(..., autotune=True)``) times the
candidates of :func:`candidates` once per kernel and persists the winner in
the cache directory (see autotune.py); the table stays the default.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True)
class TileConfig:
    BLOCK_M: int
    BLOCK_N: int
    BLOCK_K: int
    num_warps: int = 4
    num_stages: int = 3

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass(frozen=True)
class PointwiseTile:
    BLOCK: int
    num_warps: int = 4


# Matmul families (gram, sym_poly, gemm). Values follow the shapes Triton's
# own matmul tutorial and Inductor's mm configs favour per generation: Hopper
# and Blackwell have more shared memory, so deeper pipelines and wider tiles.
MATMUL_TILES: dict[str, TileConfig] = {
    "interpret": TileConfig(16, 16, 16, num_warps=1, num_stages=1),
    "sm80": TileConfig(128, 128, 32, num_warps=8, num_stages=3),
    "sm89": TileConfig(128, 128, 32, num_warps=8, num_stages=3),
    "sm90": TileConfig(128, 128, 64, num_warps=8, num_stages=4),
    "sm100": TileConfig(128, 128, 64, num_warps=8, num_stages=4),
    "sm103": TileConfig(128, 128, 64, num_warps=8, num_stages=4),
}

POINTWISE_TILES: dict[str, PointwiseTile] = {
    "interpret": PointwiseTile(64, num_warps=1),
    "sm80": PointwiseTile(1024, num_warps=4),
    "sm89": PointwiseTile(1024, num_warps=4),
    "sm90": PointwiseTile(2048, num_warps=8),
    "sm100": PointwiseTile(2048, num_warps=8),
    "sm103": PointwiseTile(2048, num_warps=8),
}


# fp32 operands take twice the shared memory per stage: 128x128x64 tiles with
# 4 stages would need 256 KiB, over Hopper's 227 KiB per block, so fp32 uses
# BLOCK_K=32 and 3 stages (96 KiB) everywhere.
FP32_MATMUL_TILES: dict[str, TileConfig] = {
    "interpret": MATMUL_TILES["interpret"],
    **{
        arch: TileConfig(128, 128, 32, num_warps=8, num_stages=3) for arch in ("sm80", "sm89", "sm90", "sm100", "sm103")
    },
}


# Winners of an opt-in autotune (autotune.py), by kernel name, while a step
# is generated; empty otherwise, so the table above decides.
_OVERRIDES: ContextVar[dict[str, TileConfig] | None] = ContextVar("hocompile_tile_overrides", default=None)


@contextmanager
def tile_overrides(overrides: dict[str, TileConfig]) -> Iterator[None]:
    token = _OVERRIDES.set(overrides)
    try:
        yield
    finally:
        _OVERRIDES.reset(token)


def matmul_tile(arch: str, dtype: torch.dtype = torch.bfloat16, kernel: str = "") -> TileConfig:
    override = (_OVERRIDES.get() or {}).get(kernel)
    if override is not None:
        return override
    table = FP32_MATMUL_TILES if dtype == torch.float32 else MATMUL_TILES
    if arch not in table:
        raise ValueError(f"no tile config for architecture {arch!r}; known: {sorted(table)}")
    return table[arch]


def pointwise_tile(arch: str) -> PointwiseTile:
    if arch not in POINTWISE_TILES:
        raise ValueError(f"no tile config for architecture {arch!r}; known: {sorted(POINTWISE_TILES)}")
    return POINTWISE_TILES[arch]


def candidates(arch: str, dtype: torch.dtype = torch.bfloat16) -> list[TileConfig]:
    """Matmul configs an opt-in autotune tries (the table's entry first)."""
    base = matmul_tile(arch, dtype)
    if arch == "interpret":
        return [base, TileConfig(32, 32, 16, num_warps=1, num_stages=1)]
    # fp32 tiles keep BLOCK_K=32 and <= 3 stages (shared memory, see above).
    shapes = (
        [(64, 128, 32, 4, 3), (128, 64, 32, 4, 3), (64, 64, 32, 4, 3)]
        if dtype == torch.float32
        else [(64, 128, 64, 4, 4), (128, 64, 64, 4, 4), (128, 256, 64, 8, 3), (64, 64, 32, 4, 4)]
    )
    out = [base]
    for bm, bn, bk, warps, stages in shapes:
        config = TileConfig(bm, bn, bk, warps, stages)
        if config != base:
            out.append(config)
    return out
