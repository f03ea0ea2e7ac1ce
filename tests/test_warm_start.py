"""Warm start (hocompile/runtime/warm.py): a new process loads compiled steps instead of tracing them.

Each test runs its optimizer in fresh Python processes that share one cache
directory, the way a restarted training job does: the first traces and keeps
records, the next loads them, checks its first loaded step against eager, and
must then match eager bitwise (the passes that leave eager's arithmetic are off).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

# A user's optimizer in its own file: the test edits it between processes.
OPTIMIZER = '''
import torch


class Momentum(torch.optim.Optimizer):
    def __init__(self, params, lr=0.1, momentum=0.9):
        super().__init__(params, {"lr": lr, "momentum": momentum})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "buf" not in state:
                    state["buf"] = torch.zeros_like(p)
                state["buf"].mul_(group["momentum"]).add_(p.grad)
                p.add_(state["buf"], alpha=-group["lr"] * SCALE)


SCALE = 1.0
'''

# Runs 4 steps compiled and eager on the same grads; prints what happened as JSON.
DRIVER = '''
import copy, json, sys, torch
sys.path.insert(0, {folder!r})
import hocompile
from user_optimizer import Momentum
{patch}
torch.manual_seed(0)
params = [torch.nn.Parameter(torch.randn(8, 16)) for _ in range(12)]
params += [torch.nn.Parameter(torch.randn(16)) for _ in range(6)]
twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
compiled = hocompile.compile_optimizer(
    Momentum(params), cache_dir={cache!r}, disable_passes=("fuse-newton-schulz",), warm_start=True
)
eager = Momentum(twins)
for step in range(4):
    for p, q in zip(params, twins):
        g = torch.randn(p.shape)
        p.grad, q.grad = g.clone(), g.clone()
    compiled.step()
    eager.step()
same = all(torch.equal(p, q) for p, q in zip(params, twins))
print(json.dumps({{
    "same": same,
    "warm": compiled.counters.warm_starts,
    "compiles": compiled.counters.compiles,
    "stamped": [e.stamped is not None for e in compiled.history],
    "verified": [e.verification.steps + e.self_check.checks for e in compiled.history],
    "stale": [e.fallback for e in compiled.history],
}}))
'''


def _run(tmp_path: Path, patch: str = "") -> dict[str, object]:
    folder, cache = tmp_path / "user", tmp_path / "cache"
    script = tmp_path / "driver.py"
    script.write_text(textwrap.dedent(DRIVER.format(folder=str(folder), cache=str(cache), patch=patch)))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture
def user_file(tmp_path: Path) -> Path:
    folder = tmp_path / "user"
    folder.mkdir()
    path = folder / "user_optimizer.py"
    path.write_text(OPTIMIZER)
    return path


def test_a_new_process_loads_the_steps_checks_them_and_matches_eager(tmp_path: Path, user_file: Path) -> None:
    first = _run(tmp_path)
    assert first == {**first, "same": True, "warm": 0, "compiles": 2, "stamped": [True, True]}
    second = _run(tmp_path)
    assert second["same"] and second["warm"] == 2 and second["compiles"] == 2
    # each loaded step's first step was checked against eager (by the self-check: sampled, on copies)
    assert all(checked >= 1 for checked in second["verified"]), second["verified"]
    assert second["stale"] == ["", ""]


def test_an_edited_optimizer_is_never_replayed(tmp_path: Path, user_file: Path) -> None:
    _run(tmp_path)
    user_file.write_text(OPTIMIZER.replace("SCALE = 1.0", "SCALE = 0.5"))  # the source changed
    after = _run(tmp_path)
    assert after["same"] and after["warm"] == 0  # refused by the file digest: traced afresh


def test_a_monkeypatch_the_new_process_lacks_is_caught_on_the_first_step(tmp_path: Path, user_file: Path) -> None:
    _run(tmp_path, patch="import user_optimizer; user_optimizer.SCALE = 0.25")  # compiled with the patch
    after = _run(tmp_path)  # no patch: the loaded records compute another step than eager's
    assert after["same"], "a stale record changed the training run"
    assert after["warm"] >= 1 and any("stale warm-start record" in str(s) for s in after["stale"])  # type: ignore[union-attr]


def test_a_loaded_step_is_dumped_too(tmp_path: Path, user_file: Path) -> None:
    """HOCOMPILE_DUMP_DIR: a step loaded from a record writes its lowered module and where it came from."""
    _run(tmp_path)
    dump = tmp_path / "dump"
    after = _run(tmp_path, patch=f"import os; os.environ['HOCOMPILE_DUMP_DIR'] = {str(dump)!r}")
    assert after["warm"] == 2
    folders = sorted(dump.iterdir())
    assert [f.name for f in folders] == ["compile-001", "compile-002"]
    for folder in folders:
        assert "loaded from the warm-start record" in (folder / "warm-start.txt").read_text()
        assert "def " in (folder / "lowered.py").read_text()
