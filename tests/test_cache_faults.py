"""Corrupt or unusable cache state: rebuilt or bypassed with one CacheWarning, never an error or a wrong plan.

Covers the step modules (aten and Triton), the CPU calibration file and the
autotune winners: damaged files, unwritable directories, a crash mid-write,
and two processes compiling into one directory at once.
"""

from __future__ import annotations

import json
import linecache
import os
import random
import subprocess
import sys
import tempfile
import textwrap
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from hocompile import CacheWarning, targets
from hocompile.diskcache import DiskCache, entry_text
from hocompile.lowering.triton.tiles import TileConfig

from .helpers import EXACT, Pair

SHAPES = [(8, 8), (16, 8)]
# A fixed target: no calibration, so only the step modules touch the cache.
FIXED = {**EXACT, "target": "cpu-avx2"}


@pytest.fixture
def cache_dir(tmp_path: Path) -> Path:
    """Not yet created, nothing in it: this module tests what the cache itself does (conftest's
    cache_dir holds the session's calibration, so two racing processes would not measure theirs)."""
    return tmp_path / "cache"


def _adamw(ps: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)


@contextmanager
def cache_warnings() -> Iterator[list[str]]:
    """Messages of every CacheWarning raised inside (none filtered away by 'once' rules)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        messages: list[str] = []
        yield messages
    messages.extend(str(w.message) for w in caught if issubclass(w.category, CacheWarning))


def _steps(pair: Pair, n: int = 3) -> None:
    for _ in range(n):
        pair.step()
    assert pair.max_rel_diff() == 0.0
    pair.assert_state_equal()


def _entries(cache_dir: Path) -> list[Path]:
    return sorted(cache_dir.glob("step_*.py"))


def _random_bytes(text: bytes) -> bytes:
    return bytes(random.Random(0).randrange(256) for _ in range(512))


def _stale_entry(text: bytes) -> bytes:
    # A valid header and digest over a body that raises on import: another build's (broken) code.
    return entry_text("raise ImportError('not this build')\n").encode()


CORRUPTIONS: dict[str, Callable[[bytes], bytes]] = {
    "random-bytes": _random_bytes,
    "empty": lambda text: b"",
    "truncated": lambda text: text[: len(text) // 2],
    "header-only": lambda text: text.split(b"\n", 1)[0],
    "wrong-body": lambda text: text.replace(b"aten.", b"aten.x", 1),
    "stale-and-unimportable": _stale_entry,
}


@pytest.mark.parametrize("corrupt", sorted(CORRUPTIONS))
def test_damaged_step_entry_is_rebuilt_with_one_warning(cache_dir: Path, corrupt: str) -> None:
    _steps(Pair(_adamw, SHAPES, cache_dir, **FIXED), 1)
    [entry] = _entries(cache_dir)
    entry.write_bytes(CORRUPTIONS[corrupt](entry.read_bytes()))
    pair = Pair(_adamw, SHAPES, cache_dir, **FIXED)
    with cache_warnings() as messages:
        _steps(pair)  # the second step compiles a second graph: no warning for it
    assert len(messages) == 1 and str(entry) in messages[0], messages
    assert pair.compiled.counters.disk_hits == 0
    assert entry.read_text().startswith("# hocompile cache entry sha256=")
    again = Pair(_adamw, SHAPES, cache_dir, **FIXED)
    with cache_warnings() as messages:
        _steps(again)
    assert messages == [] and again.compiled.counters.disk_hits == 2


def test_damaged_triton_entry_is_rebuilt_with_one_warning(cache_dir: Path) -> None:
    pytest.importorskip("triton")
    kw: dict[str, Any] = {"backend": "triton", "target": "cpu-avx2"}
    Pair(_adamw, SHAPES, cache_dir, **kw).step()
    [entry] = _entries(cache_dir)
    entry.write_bytes(_random_bytes(b""))
    pair = Pair(_adamw, SHAPES, cache_dir, **kw)
    with cache_warnings() as messages:
        for _ in range(2):
            pair.step()
    assert len(messages) == 1 and str(entry) in messages[0], messages
    assert pair.max_rel_diff() < 1e-6


def _file_as_dir(tmp_path: Path) -> Path:
    (tmp_path / "cache").write_text("not a directory")
    return tmp_path / "cache"


def _under_file(tmp_path: Path) -> Path:
    (tmp_path / "file").write_text("not a directory")
    return tmp_path / "file" / "cache"


UNUSABLE_DIRS: dict[str, Callable[[Path], Path]] = {"is-a-file": _file_as_dir, "under-a-file": _under_file}


@pytest.mark.parametrize("make_dir", sorted(UNUSABLE_DIRS))
def test_unusable_cache_dir_runs_from_memory_with_one_warning(
    tmp_path: Path, make_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache_dir = UNUSABLE_DIRS[make_dir](tmp_path)
    # target="cpu": the calibration file cannot be written either; measured fast here.
    monkeypatch.setattr(targets, "_measure", lambda dtype: 50.0)
    pairs = [Pair(_adamw, SHAPES, cache_dir, **EXACT, target="cpu") for _ in range(2)]
    with cache_warnings() as messages:
        for pair in pairs:
            _steps(pair)
    assert len(messages) == 1, messages
    assert f"cache directory {cache_dir} is unusable" in messages[0] and "Error" in messages[0]
    # Tracebacks still show the generated lines (the call of test_runtime's traceback test).
    sgd = Pair(lambda ps: torch.optim.SGD(ps, lr=0.1), [(4, 4)], cache_dir, **EXACT, target="cpu")
    sgd.step()
    entry = sgd.compiled.history[-1].lowered
    assert entry is not None and not entry.path.exists() and "in-memory" in str(entry.path)
    with pytest.raises(Exception) as info:
        entry.run([torch.zeros(3, 3), torch.zeros(4, 4), 0.1])  # wrong shapes
    frames = [f for f in info.traceback if str(f.path) == str(entry.path)]
    assert frames and linecache.getline(str(entry.path), frames[-1].lineno + 1).strip()


@pytest.mark.parametrize("failing", ["tempfile.mkstemp", "os.replace"])
def test_unwritable_cache_dir_warns_once_and_writes_nothing(
    cache_dir: Path, failing: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Root ignores chmod: a read-only directory is simulated by the call that would write into it.
    def denied(*args: Any, **kwargs: Any) -> Any:
        raise PermissionError(13, "Permission denied")

    module, name = failing.split(".")
    monkeypatch.setattr({"tempfile": tempfile, "os": os}[module], name, denied)
    pair = Pair(_adamw, SHAPES, cache_dir, **FIXED)
    with cache_warnings() as messages:
        _steps(pair)
    assert len(messages) == 1 and f"cache directory {cache_dir} is unusable (PermissionError" in messages[0]
    assert list(cache_dir.iterdir()) == []  # nothing half-written left behind


def test_triton_module_runs_from_memory_when_cache_dir_is_a_file(tmp_path: Path) -> None:
    pytest.importorskip("triton")
    cache_dir = _file_as_dir(tmp_path)
    pair = Pair(_adamw, SHAPES, cache_dir, backend="triton", target="cpu-avx2")
    with cache_warnings() as messages:
        for _ in range(2):
            pair.step()
    assert len(messages) == 1 and str(cache_dir) in messages[0], messages
    assert pair.max_rel_diff() < 1e-6
    # Triton read the kernels' source through inspect, from linecache.
    lowered = pair.compiled.history[-1].lowered
    assert lowered is not None and "in-memory" in str(lowered.path)


@pytest.mark.parametrize("crash", [KeyboardInterrupt, OSError])
@pytest.mark.parametrize("at", ["fsync", "replace"])
def test_crash_mid_write_leaves_no_entry(
    cache_dir: Path, crash: type[BaseException], at: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    original = getattr(os, at)

    def crashing(*args: Any) -> Any:
        if at == "replace" and str(args[0]).endswith(".py"):  # a complete module: crash at the rename
            assert Path(args[0]).read_text().startswith("# hocompile cache entry")
        raise crash()

    monkeypatch.setattr(os, at, crashing)
    pair = Pair(_adamw, SHAPES, cache_dir, **FIXED)
    if crash is KeyboardInterrupt:
        with pytest.raises(KeyboardInterrupt):
            pair.step()  # an interrupt is never swallowed
    else:
        with cache_warnings() as messages:
            _steps(pair)
        assert len(messages) == 1 and "is unusable (OSError" in messages[0]
    assert list(cache_dir.iterdir()) == []
    monkeypatch.setattr(os, at, original)
    # A stray temporary file from a killed writer is never read as an entry.
    (cache_dir / ".tmp-killed.py").write_text("# hocompile cache entry sha256=0\nraise SystemExit\n")
    later = Pair(_adamw, SHAPES, cache_dir, **FIXED)
    with cache_warnings() as messages:
        _steps(later)
    assert messages == [] and later.compiled.counters.disk_hits == 0 and len(_entries(cache_dir)) == 2


BAD_CALIBRATIONS = {
    "list": "[]",
    "null": "null",
    "empty-object": "{}",
    "gflops-null": '{"gflops": null, "prefers_batched": false}',
    "zero-rate": '{"gflops": {"fp32": 0, "bf16": 1, "fp16": 1}, "prefers_batched": false}',
    "negative-rate": '{"gflops": {"fp32": -5, "bf16": 1, "fp16": 1}, "prefers_batched": false}',
    "nan-rate": '{"gflops": {"fp32": NaN, "bf16": 1, "fp16": 1}, "prefers_batched": false}',
    "inf-rate": '{"gflops": {"fp32": 9, "bf16": Infinity, "fp16": 1}, "prefers_batched": false}',
    "string-rate": '{"gflops": {"fp32": "90", "bf16": 1, "fp16": 1}, "prefers_batched": false}',
    "missing-dtype": '{"gflops": {"fp32": 90}, "prefers_batched": false}',
    "missing-key": '{"gflops": {"fp32": 90, "bf16": 1, "fp16": 1}}',
    "old-version": '{"gflops": {"fp32": 90, "bf16": 1, "fp16": 1}, "prefers_batched": false, "symmetric": 1.0}',
    "string": '"fast"',
    "truncated": '{"gflops": {"fp32": 9',
    "random-bytes": "\udcff",  # written with surrogateescape: a lone 0xff byte
}


@pytest.mark.parametrize("content", sorted(BAD_CALIBRATIONS))
def test_bad_calibration_file_is_measured_again_with_one_warning(
    cache_dir: Path, content: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    measured: list[torch.dtype] = []

    def measure(dtype: torch.dtype) -> float:
        measured.append(dtype)
        return 40.0

    monkeypatch.setattr(targets, "_measure", measure)
    cache_dir.mkdir()
    path = cache_dir / f"target-cpu-{targets._cpu_id()}.json"
    path.write_bytes(BAD_CALIBRATIONS[content].encode("utf-8", "surrogateescape"))
    with cache_warnings() as messages:
        target = targets.cpu_target(cache_dir)
    assert len(messages) == 1 and str(path) in messages[0], messages
    assert target.gflops == {"fp32": 40.0, "bf16": 40.0, "fp16": 40.0} and target.ratios == targets.declared_ratios()
    assert len(measured) == 3
    with cache_warnings() as messages:
        assert targets.cpu_target(cache_dir) == target  # read back from the rewritten file
    assert messages == [] and len(measured) == 3


def test_calibration_in_unwritable_dir_is_used_with_one_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(targets, "_measure", lambda dtype: 40.0)
    cache_dir = _under_file(tmp_path)
    with cache_warnings() as messages:
        for _ in range(3):
            assert targets.cpu_target(cache_dir).gflops["fp32"] == 40.0
    assert len(messages) == 1 and f"cache directory {cache_dir} is unusable" in messages[0], messages


BAD_WINNERS = {
    "list": "[]",
    "null": "null",
    "tile-null": '{"k": null}',
    "missing-field": '{"k": {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "num_warps": 4}}',
    "zero-block": '{"k": {"BLOCK_M": 0, "BLOCK_N": 32, "BLOCK_K": 32, "num_warps": 4, "num_stages": 2}}',
    "odd-block": '{"k": {"BLOCK_M": 24, "BLOCK_N": 32, "BLOCK_K": 32, "num_warps": 4, "num_stages": 2}}',
    "string-block": '{"k": {"BLOCK_M": "32", "BLOCK_N": 32, "BLOCK_K": 32, "num_warps": 4, "num_stages": 2}}',
    "extra-field": '{"k": {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "num_warps": 4, "num_stages": 2, "x": 1}}',
    "random-bytes": "\udcff\udcfe",
}


@pytest.mark.parametrize("content", sorted(BAD_WINNERS))
def test_bad_autotune_file_is_ignored_with_one_warning(cache_dir: Path, content: str) -> None:
    pytest.importorskip("triton")
    from hocompile.lowering.triton.autotune import load_winners, winners_path

    path = winners_path(cache_dir, "interpret")
    cache_dir.mkdir()
    path.write_bytes(BAD_WINNERS[content].encode("utf-8", "surrogateescape"))
    with cache_warnings() as messages:
        assert load_winners(cache_dir, "interpret") == {}
        assert load_winners(cache_dir, "interpret") == {}  # warned once per file
    assert len(messages) == 1 and str(path) in messages[0], messages


def test_autotune_winners_round_trip_and_unwritable_dir_warns(tmp_path: Path) -> None:
    pytest.importorskip("triton")
    from hocompile.lowering.triton.autotune import _write, load_winners, winners_path

    winners = {"gram_x": TileConfig(32, 32, 16, num_warps=2, num_stages=3)}
    _write(winners_path(tmp_path, "interpret"), winners)
    with cache_warnings() as messages:
        assert load_winners(tmp_path, "interpret") == winners
        bad = _under_file(tmp_path)
        _write(winners_path(bad, "interpret"), winners)
        _write(winners_path(bad, "interpret"), winners)
        assert load_winners(bad, "interpret") == {}
    assert len(messages) == 1 and f"cache directory {bad} is unusable" in messages[0], messages


_RACER = textwrap.dedent(
    """
    import os, pathlib, sys, time, warnings
    import torch, hocompile
    from tests.helpers import EXACT, Pair

    warnings.simplefilter("error", hocompile.CacheWarning)
    torch.set_num_threads(1)  # two calibrations at once: multi-threaded GEMMs would crawl
    # Rendezvous after the slow imports, so the compiles overlap.
    ready = pathlib.Path(sys.argv[2])
    (ready / str(os.getpid())).touch()
    deadline = time.time() + 60
    while len(list(ready.iterdir())) < 2 and time.time() < deadline:
        time.sleep(0.002)
    for factory in (lambda ps: torch.optim.AdamW(ps, lr=1e-2), lambda ps: torch.optim.Muon(ps, lr=0.02)):
        pair = Pair(factory, [(8, 8), (16, 8)], sys.argv[1], **EXACT)
        for _ in range(3):
            pair.step()
        assert pair.max_rel_diff() == 0.0, pair.max_rel_diff()
        pair.assert_state_equal()
    print("ok", flush=True)
    os._exit(0)  # skip interpreter teardown: seconds here, and nothing is left to flush
    """
)


def test_two_processes_compiling_into_one_cache_dir(cache_dir: Path, tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    ready.mkdir()
    root = Path(__file__).parent.parent
    env = {k: v for k, v in os.environ.items() if k != "HOCOMPILE_CACHE_DIR"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _RACER, str(cache_dir), str(ready)],
            cwd=root,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0 and out.strip() == "ok", err[-3000:]
    # Each process plans with its own calibration (measured at once), so keys may differ: 4 to 8 entries.
    entries = _entries(cache_dir)
    assert 4 <= len(entries) <= 8 and not list(cache_dir.glob(".tmp-*"))
    assert all(DiskCache(cache_dir).read(e.stem.removeprefix("step_")) for e in entries)
    calibration = json.loads(next(cache_dir.glob("target-cpu-*.json")).read_text())
    assert calibration["gflops"]["fp32"] > 0
