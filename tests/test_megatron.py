"""Megatron Core 0.19.2's own Muon (its inner ``TensorParallelMuon``, built by ``get_megatron_optimizer``'s
param-group code on a tiny GPTModel), compiled with the NS pass off: every param bitwise eager's, the
QKV-split attention weights included (issue 30: they were 0.41 off when the stand-ins lacked ``is_qkv``).

Runs tests/megatron_muon.py in a subprocess (it initialises torch.distributed and Megatron's parallel
state). Skipped where megatron-core is not installed (the Makefile installs it).
"""

from __future__ import annotations

import importlib.util
import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

# Not imported here: megatron-core pulls in emerging-optimizers, which needs typing.override (Python 3.12)
if importlib.util.find_spec("megatron") is None:
    pytest.skip("megatron-core is not installed", allow_module_level=True)

SCRIPT = Path(__file__).with_name("megatron_muon.py")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _run(*args: str, port: int = 0) -> dict:
    port = port or _free_port()
    out = subprocess.run([sys.executable, str(SCRIPT), "--port", str(port), *args], capture_output=True,
                         text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("split_qkv", [1, 0])
def test_megatron_muon_is_bitwise_eager(split_qkv: int) -> None:
    report = _run("--split-qkv", str(split_qkv))
    assert report["split_qkv"] is bool(split_qkv)
    assert len(report["qkv"]) == 2  # Megatron tagged both layers' linear_qkv
    assert report["params"] and all(report["params"].values()), report["params"]
    assert report["counters"]["eager_fallbacks"] == 0 and report["self_checks"] > 0


def test_the_comparison_sees_the_qkv_split() -> None:
    """The negative control: stand-ins without the params' attributes orthogonalise QKV whole."""
    report = _run("--split-qkv", "1", "--lose-attributes")
    wrong = {name for name, same in report["params"].items() if not same}
    assert wrong == set(report["qkv"])


@pytest.mark.parametrize("mode, collective", [("duplicated", "all_gather_into_tensor"),
                                              ("distributed", "all_reduce"), ("blockwise", None)])
def test_tensor_parallel_muon_on_two_ranks(mode: str, collective: str | None) -> None:
    """TP 2 over gloo, NS passes off: each muon_tp_mode is bitwise Megatron's eager step over 10 steps,
    its collectives compiled as functional collectives (duplicated: the shards all-gathered;
    distributed: X·Xᵀ and the norm all-reduced), none dropped (collectives.py), and self-checked by
    both ranks at the same steps (check_ranks.py)."""
    port = _free_port()
    procs = [
        subprocess.Popen([sys.executable, str(SCRIPT), "--world", "2", "--rank", str(rank), "--tp-mode", mode,
                          "--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for rank in range(2)
    ]
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
        report = json.loads(out.strip().splitlines()[-1])
        assert "refused" not in report, report
        assert report["params"] and all(report["params"].values()), report["params"]
        assert report["counters"]["eager_fallbacks"] == 0 and report["self_checks"] > 0  # by both ranks together
        assert report["collectives"] == ([collective] if collective else []), report["collectives"]
