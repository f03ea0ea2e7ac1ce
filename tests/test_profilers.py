"""A user profiling their training (cProfile, a sys.setprofile function) can compile their optimizer.

The capture notes which source files a step runs with ``sys.setprofile`` (executed_files.py). With
cProfile running, ``sys.getprofile()`` hands back its Profiler object, which putting back with
``sys.setprofile`` installed as a Python function: the capture failed with "'Profile' object is
not callable" and the user's profile was lost. A C-level profiler is now left alone (nothing
recorded, so no warm-start record is kept); a Python-level one is chained and put back.
"""

from __future__ import annotations

import cProfile
import pstats
import sys
from pathlib import Path
from typing import Any

import torch

import hocompile


def _params() -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(32, 16, generator=gen)) for _ in range(3)]
    for p in params:
        p.grad = torch.randn(32, 16, generator=gen)
    return params


def _marker() -> None:
    """Called after the compiled step: the user's profiler must still see it."""


def _steps(tmp_path: Path, **kw: Any) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    want, got = _params(), _params()
    eager = torch.optim.Muon(want, lr=0.02)
    # Newton–Schulz kept as eager writes it: on a CPU without bf16 units the fused plan computes in fp32,
    # and only a plan keeping eager's arithmetic promises the same bits on every machine.
    compiled = hocompile.compile_optimizer(
        torch.optim.Muon(got, lr=0.02), cache_dir=tmp_path, disable_passes=("fuse-newton-schulz",), **kw
    )
    for _ in range(3):
        eager.step()
        compiled.step()
    return want, got


def test_under_cprofile_the_step_compiles_and_the_profile_goes_on(tmp_path: Path) -> None:
    profile = cProfile.Profile()
    profile.enable()
    try:
        want, got = _steps(tmp_path, warm_start=True)
        _marker()
        assert sys.getprofile() is profile
    finally:
        profile.disable()
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    seen = {name for (_, _, name) in pstats.Stats(profile).stats}  # type: ignore[attr-defined]
    assert "_marker" in seen and "step" in seen
    assert not list(tmp_path.glob("warm-*.pkl"))  # files unknown: no record to outlive an edit


def test_a_python_profile_function_is_chained_and_put_back(tmp_path: Path) -> None:
    calls: list[str] = []

    def watch(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            calls.append(frame.f_code.co_name)

    sys.setprofile(watch)
    try:
        want, got = _steps(tmp_path)
        _marker()
        assert sys.getprofile() is watch
    finally:
        sys.setprofile(None)
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    assert "trace_once" in calls  # it saw the capture (capture/one_trace.py), while hocompile's own hook ran too
    assert calls[-1] == "_marker" or "_marker" in calls[-3:]
