"""Opt-in autotuning of the matmul tiles (``compile_optimizer(..., autotune=True)``).

The default is the deterministic table in tiles.py: start-up autotuning costs
peers ~30 s per shape per rank. When asked, each matmul kernel of a step is
timed once per candidate tile (tiles.candidates) on inputs of its own shape,
and the winner is written to ``<cache dir>/autotune-<arch>.json`` by kernel
name, so later compiles (and other processes) reuse it without timing again.
A candidate the device cannot run (too much shared memory) is skipped.
A winners file that is not a map of kernel names to valid tiles is warned
about once and ignored (kernels are timed again and the file rewritten); an
unwritable cache directory keeps the winners for this compile only.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ...diskcache import read_json, write_json
from .code import KernelSource
from .matmul_kernels import GemmSpec, GramSpec, SymPolySpec, generate_gemm, generate_gram, generate_sym_poly
from .module import assemble, interpreting, load
from .tiles import TileConfig, candidates, tile_overrides

log = logging.getLogger("hocompile")

Timer = Callable[[Callable[[], Any]], float]
_GENERATORS: dict[str, Callable[[Any, str], KernelSource]] = {
    "gram": generate_gram,
    "sym_poly": generate_sym_poly,
    "gemm": generate_gemm,
}


def winners_path(cache_dir: Path, arch: str) -> Path:
    return Path(cache_dir) / f"autotune-{arch}.json"


def load_winners(cache_dir: Path, arch: str) -> dict[str, TileConfig]:
    return read_json(winners_path(cache_dir, arch), _winners_from_json) or {}


def _winners_from_json(data: object) -> dict[str, TileConfig]:
    """ValueError unless ``data`` maps kernel names to tiles Triton can compile (power-of-two blocks and warps)."""
    if not isinstance(data, dict):
        raise ValueError("expected an object mapping kernel names to tiles")
    fields = {f.name for f in dataclasses.fields(TileConfig)}
    winners = {}
    for name, tile in data.items():
        if not isinstance(tile, dict) or set(tile) != fields:
            raise ValueError(f"{name}: expected the keys {sorted(fields)}")
        for key, value in tile.items():
            # bool is an int; tl.arange needs power-of-two block sizes, and warps come in powers of two too.
            power_of_two = key == "num_stages" or (isinstance(value, int) and value & (value - 1) == 0)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0 or not power_of_two:
                raise ValueError(f"{name}: {key}={value!r} is not a valid tile value")
        winners[name] = TileConfig(**tile)
    return winners


def device_timer(device: torch.device, repeats: int = 5) -> Timer:
    def timer(launch: Callable[[], Any]) -> float:
        launch()  # compiles
        samples = []
        for _ in range(repeats):
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                launch()
                end.record()
                end.synchronize()
                samples.append(start.elapsed_time(end) / 1e3)
            else:
                begin = time.perf_counter()
                launch()
                samples.append(time.perf_counter() - begin)
        return statistics.median(samples)

    return timer


def autotune(
    kernels: list[KernelSource], cache_dir: Path, arch: str, device: torch.device, timer: Timer | None = None
) -> dict[str, TileConfig]:
    """Winning tiles for every matmul kernel in ``kernels`` (timed now or read from disk)."""
    winners = load_winners(cache_dir, arch)
    timer = timer or device_timer(device)
    tuned = 0
    for kernel in kernels:
        if kernel.family not in _GENERATORS or kernel.name in winners:
            continue
        best: tuple[float, TileConfig] | None = None
        for tile in candidates(arch, kernel.spec.dtype):  # type: ignore[attr-defined]
            with tile_overrides({kernel.name: tile}):
                source = _GENERATORS[kernel.family](kernel.spec, kernel.origin)
            module, _ = load(assemble([source]), cache_dir)
            args, kwargs = _inputs(kernel.spec, device)
            launch = getattr(module, source.launcher)
            try:
                seconds = timer(functools.partial(launch, *args, **kwargs))
            except Exception as exc:  # e.g. triton OutOfResources: the device cannot run this tile
                log.info("hocompile: autotune %s: %s skipped (%s)", kernel.name, tile, type(exc).__name__)
                continue
            if best is None or seconds < best[0]:
                best = (seconds, tile)
        if best is not None:
            winners[kernel.name] = best[1]
            tuned += 1
            log.info("hocompile: autotune %s: %s (%.3g ms)", kernel.name, best[1], best[0] * 1e3)
    if tuned:
        _write(winners_path(cache_dir, arch), winners)
    return winners


def _write(path: Path, winners: dict[str, TileConfig]) -> None:
    write_json(path, {name: tile.as_dict() for name, tile in sorted(winners.items())})


def _inputs(spec: Any, device: torch.device) -> tuple[list[Any], dict[str, Any]]:
    """Arguments of one launch of ``spec``'s kernel, on inputs of its shape."""
    upcast = interpreting()
    gen = torch.Generator(device=device).manual_seed(0)  # not the user's stream

    def randn(*shape: int, dtype: torch.dtype = spec.dtype) -> torch.Tensor:
        return torch.randn(*shape, device=device, generator=gen).to(dtype)

    if isinstance(spec, GramSpec):
        x = randn(spec.batch, spec.m, spec.k)
        out = torch.empty(spec.batch, spec.m, spec.m, device=device, dtype=spec.dtype)
        kwargs: dict[str, Any] = {"upcast": upcast}
        if spec.normalize:
            kwargs["x0"] = torch.empty_like(x)
            kwargs["partials"] = torch.ones(spec.batch, 1, device=device)
            kwargs["eps"] = torch.tensor(1e-7, device=device)
        return [x, out], kwargs
    if isinstance(spec, SymPolySpec):
        a = randn(spec.batch, spec.m, spec.m)
        a = (a + a.mT) / 2
        return [a, torch.empty_like(a), 0.0, -4.775, 2.0315], {"upcast": upcast}
    if isinstance(spec, GemmSpec):
        left, right = randn(spec.batch, spec.m, spec.k), randn(spec.batch, spec.k, spec.n)
        out = torch.empty(spec.batch, spec.m, spec.n, device=device, dtype=spec.stored_dtype)
        kwargs = {"upcast": upcast}
        if spec.accumulate:
            kwargs.update(C=randn(spec.batch, spec.m, spec.n), beta=3.4445)
        return [left, right, out, 1.0], kwargs
    raise TypeError(f"no autotune inputs for {type(spec).__name__}")
