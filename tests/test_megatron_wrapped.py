"""What Megatron Core 0.19.2 builds, compiled whole (issue 32): ``compile_optimizer`` on the
``ChainedOptimizer`` of ``FP32Optimizer``\\ s that ``get_megatron_optimizer`` returns for a tiny
GPTModel compiles the torch optimizers inside it and returns the wrapper, whose own step (grads from
``main_grad``, the grad norm and its all-reduce, zero counting) stays Megatron's. 10 steps with an lr
change and a checkpoint swap at step 5 (each side loads the other's ``state_dict()``).

Runs tests/megatron_wrapped.py in a subprocess (torch.distributed and Megatron's parallel state must
not leak into other tests). Megatron's clipping asserts CUDA grads, so ``clip_grad=0`` there; its few
``device='cuda'`` factories are made on the CPU (the script says how).

Megatron's emerging-optimizers registry, as installed (megatron-core 0.19.2, emerging-optimizers
0.3.0): ``adaptive_muon`` (no ``scale_mode``), ``mop``, ``muon_hyperball``, ``polargrad``, ``scion``,
``sinkhorn_muon`` and ``spel`` (Megatron passes them ``betas``) fail in Megatron's own construction,
eagerly too; the rest run here.
"""

from __future__ import annotations

import importlib.util
import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

if importlib.util.find_spec("megatron") is None:
    pytest.skip("megatron-core is not installed", allow_module_level=True)

SCRIPT = Path(__file__).with_name("megatron_wrapped.py")


def _run(*args: str) -> dict:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    out = subprocess.run([sys.executable, str(SCRIPT), "--port", str(port), *args], capture_output=True,
                         text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name, inner", [
    ("muon", ["TensorParallelMuon", "AdamW"]), ("adam", ["AdamW"]), ("laprop", ["LaProp", "AdamW"]),
    ("lion", ["Lion", "AdamW"]), ("soap", ["SOAP", "AdamW"]), ("rekls", ["REKLS", "AdamW"]),
])
def test_megatrons_wrappers_compile_in_place_bitwise_eager(name: str, inner: list[str]) -> None:
    """Bitwise by the compiled programs themselves: no step fell back to eager (a fallback is eager's
    bits too, which is how LaProp passed here while its compiled step was not). Lion, LaProp, SOAP and
    REKLS call torch.compile'd helpers (Inductor) with their betas, eps and step counter: each call
    runs as compiled, with this step's values."""
    report = _run("--optimizer", name)
    assert report["wrapper"] == "ChainedOptimizer" and report["same_object"] and report["inner"] == inner
    assert report["params"] and all(report["params"].values()), report["params"]
    assert report["eager_fallbacks"] == 0 and not report["warnings"], report["warnings"]
    assert report["step_results_equal"] and report["compiles"] >= 2 * len(inner)
    assert report["explain_head"].startswith(f"ChainedOptimizer: {len(inner)} optimizer(s) compiled inside")


def test_megatron_muon_with_its_passes_on_stays_within_the_ns_budget() -> None:
    """Fused and planned Newton–Schulz (bf16, as Megatron's eager): the self-check judges every
    checked step within budget, and no step fell back."""
    report = _run("--optimizer", "muon", "--passes", "on")
    assert report["eager_fallbacks"] == 0 and "SelfCheckWarning" not in report["warnings"]
    assert report["max_abs"] < 1e-2


def test_a_compiled_program_that_differs_falls_back_loudly_through_the_wrapper() -> None:
    """A planted wrong elementwise op in every program (``--plant``): the self-check finds it on its
    first check, warns, and every later step is eager's, so the wrapper's params end bitwise its eager
    twin's."""
    report = _run("--optimizer", "muon", "--plant")
    assert "SelfCheckWarning" in report["warnings"] and report["eager_fallbacks"] > 0
    assert all(report["params"].values()), report["params"]


def test_the_layer_wise_optimizer_at_data_parallelism_two_steps_each_ranks_own_matrices_bitwise() -> None:
    """``LayerWiseDistributedOptimizer`` on two gloo ranks (tests/megatron_layer_wise.py): each rank's torch
    optimizers hold the params Megatron assigned it (disjoint, together every param), compiled in place,
    and over 10 steps each owned param is bitwise Megatron's eager inner step (NS passes off). Megatron's
    own step around them and its all-gather of uneven sizes do not run on CPU/gloo, eagerly either: the
    script says why."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    script = SCRIPT.with_name("megatron_layer_wise.py")
    procs = [subprocess.Popen([sys.executable, str(script), "--rank", str(rank), "--port", str(port)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=SCRIPT.parent)
             for rank in range(2)]
    reports = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
        reports.append(json.loads(out.strip().splitlines()[-1]))
    owned = [set(r["owned"]) for r in reports]
    assert owned[0] and owned[1] and not owned[0] & owned[1] and len(owned[0] | owned[1]) == reports[0]["params"]
    assert any(name.endswith("linear_qkv.weight") for name in owned[0] | owned[1])
    for report, mine in zip(reports, owned):
        assert report["wrapper"] == "LayerWiseDistributedOptimizer"
        assert report["inner"] == ["TensorParallelMuon", "AdamW"] and report["eager_fallbacks"] == 0
        assert set(report["bitwise"]) == mine and all(report["bitwise"].values()), report["bitwise"]
