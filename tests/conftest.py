from __future__ import annotations

import os
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
