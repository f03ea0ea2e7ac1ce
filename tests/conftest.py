from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

# Triton kernels run on CPU tensors only in its interpreter, which must be
# switched on before triton is first imported (see lowering/triton/__init__.py).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def cache_dir(tmp_path: Path) -> Path:
    return tmp_path / "cache"


@pytest.fixture(autouse=True, scope="module")
def _parity_tests_verify_against_eager(request: pytest.FixtureRequest) -> Iterator[None]:
    """Every test of tests/test_parity.py runs with ``HOCOMPILE_VERIFY=1``: the first steps of each
    compiled step are also checked against eager on copies (hocompile/runtime/verify.py)."""
    if request.module.__name__.rpartition(".")[2] != "test_parity":
        yield
        return
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HOCOMPILE_VERIFY", "1")
        yield
