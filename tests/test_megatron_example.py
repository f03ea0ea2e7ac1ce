"""examples/megatron_muon.py runs (issue 32): Megatron Core's own Muon on its tiny GPTModel, forward and
backward on the CPU, compiled by hocompile beside eager; with ``--exact`` (NS passes off) every param is
bitwise Megatron's eager step on two gloo ranks with tensor parallelism 2."""

from __future__ import annotations

import importlib.util
import socket
import subprocess
import sys
from pathlib import Path

import pytest

if importlib.util.find_spec("megatron") is None:
    pytest.skip("megatron-core is not installed", allow_module_level=True)

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "megatron_muon.py"


def test_the_megatron_example_is_bitwise_eager_with_the_ns_passes_off(tmp_path: Path) -> None:
    """Two ranks (the one-rank run is the same code on rank 0; one subprocess keeps make test short)."""
    world = 2
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    out = subprocess.run(
        [sys.executable, str(EXAMPLE), "--steps", "4", "--world", str(world), "--exact", "--port", str(port),
         "--out", str(tmp_path / "loss.png")],
        capture_output=True, text=True, timeout=300, check=False, cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("params bitwise Megatron's eager: True") == world, out.stdout
    assert "ChainedOptimizer: 2 optimizer(s) compiled inside" in out.stdout
    rows = (tmp_path / "loss.csv").read_text().splitlines()
    assert rows[0] == "step,eager_loss,compiled_loss" and len(rows) == 5
