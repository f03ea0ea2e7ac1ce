from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

# Triton kernels run on CPU tensors only in its interpreter, which must be
# switched on before triton is first imported (see lowering/triton/__init__.py).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config: pytest.Config) -> None:
    # A self-check mismatch fails the test that caused it: a test must not pass by comparing eager
    # with the eager fallback (tests that plant a wrong step expect the warning with pytest.warns).
    # Added here, after TRITON_INTERPRET: resolving the category imports hocompile (and triton).
    config.addinivalue_line("filterwarnings", "error::hocompile.errors.SelfCheckWarning")


def _stance() -> str | None:
    """Dynamo's current stance (a private attribute of torch 2.13's; None where a torch lacks it)."""
    held = getattr(torch._dynamo.eval_frame, "_stance", None)
    return getattr(held, "stance", None)


@pytest.fixture(autouse=True)
def _dynamo_stance_left_as_found() -> Iterator[None]:
    """A test that leaves Dynamo's stance changed (``force_eager``) makes every later
    ``torch.compile`` in its worker silently eager: fail the test that did it, and restore."""
    stance = _stance()
    yield
    left = _stance()
    if left != stance and stance is not None:
        torch.compiler.set_stance(stance)
        pytest.fail(f"the test left torch.compiler's stance at {left!r} (was {stance!r})")


@pytest.fixture(scope="session")
def new_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """Makes fresh cache directories that hold only this CPU's calibration (targets.cpu_target).

    The calibration is measured once per session, as a user's cache holds it after the first
    compile: measured in every fresh directory it cost ~0.5-1 s per test on this project's 2-core
    CPUs (175 times in one run). A test whose torch thread count differs from the session's finds
    no file for its CPU id and measures its own. Tests of the cache and of the calibration itself
    start from an empty directory (tests/test_cache_faults.py).
    """
    from hocompile.targets import cpu_target  # here: after TRITON_INTERPRET is set above

    calibrated = tmp_path_factory.mktemp("calibration")
    cpu_target(calibrated)
    files = sorted(calibrated.glob("target-cpu-*.json"))
    assert files, f"no calibration written to {calibrated}"

    def new(path: Path | None = None) -> Path:
        path = path if path is not None else tmp_path_factory.mktemp("cache")
        path.mkdir(parents=True, exist_ok=True)
        for file in files:
            shutil.copy(file, path)
        return path

    return new


@pytest.fixture
def cache_dir(tmp_path: Path, new_cache_dir: Callable[..., Path]) -> Path:
    """This test's own cache directory, holding this session's CPU calibration (see new_cache_dir)."""
    return new_cache_dir(tmp_path / "cache")


@pytest.fixture(autouse=True, scope="module")
def _parity_tests_verify_against_eager(request: pytest.FixtureRequest) -> Iterator[None]:
    """Every test of tests/test_parity.py runs with ``HOCOMPILE_VERIFY=1``: the first steps of each
    compiled step are also checked against eager on copies (hocompile/runtime/check/verify.py)."""
    if request.module.__name__.rpartition(".")[2] != "test_parity":
        yield
        return
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HOCOMPILE_VERIFY", "1")
        yield
