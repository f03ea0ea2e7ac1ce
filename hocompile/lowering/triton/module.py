"""Assemble generated kernels (and a step wrapper) into one importable module."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from types import ModuleType

from ...diskcache import DiskCache, load_generated
from .code import KernelSource
from .jit_helpers import helper_source

PRELUDE = [
    "import os",
    "",
    "import torch",
    "import triton",
    "import triton.language as tl",
]


def assemble(kernels: list[KernelSource], body: str = "", header: str = "") -> str:
    """Module text: header, imports, the shared helpers the kernels call, each kernel once (by name), then ``body``."""
    parts = [header.rstrip("\n")] if header else []
    parts.append("\n".join(PRELUDE))
    helpers = helper_source(name for kernel in kernels for name in kernel.helpers)
    if helpers:
        parts.append(helpers)
    seen: set[str] = set()
    for kernel in kernels:
        if kernel.name in seen:
            continue
        seen.add(kernel.name)
        parts.append(kernel.source.rstrip("\n"))
    if body:
        parts.append(body.rstrip("\n"))
    return "\n\n\n".join(parts) + "\n"


def interpreting() -> bool:
    """Kernels defined now run in Triton's CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def load(text: str, cache_dir: Path) -> tuple[ModuleType, bool]:
    """Write ``text`` to the cache (atomically) and run it as a module; (module, found on disk).

    Triton reads kernel source with ``inspect``: load_generated registers the
    text in linecache, so that works even when the cache directory could not
    be written and the module runs from memory. Triton also decides at
    definition time whether a kernel is interpreted, so ``TRITON_INTERPRET``
    must be set before this is called.
    """
    key = hashlib.sha256(text.encode()).hexdigest()
    module, _, from_disk = load_generated(DiskCache(Path(cache_dir)), key, text, {})
    return module, from_disk
