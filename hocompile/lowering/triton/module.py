"""Assemble generated kernels (and a step wrapper) into one importable module; the wrapper's
``tables()`` and ``forward()`` text."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from types import ModuleType

from ...diskcache import DiskCache, load_generated
from .code import CodeWriter, KernelSource
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


def write_tables(
    w: CodeWriter, tables: list[tuple[str, str, list[list[str]]]], scalars: list[str], inputs: str, unpack: str
) -> None:
    """``tables()``: each fused launch's labelled table (its offset ``PW<k>`` in the one device
    table, defined above it) and the scalar values."""
    if tables:
        w.line("# Where each fused launch's table starts in the one device pointer table tables() builds.")
        offset = 0
        for label, header, rows in tables:
            w.line(f"{label.upper()} = {offset}  # {header.split(',')[0]}")
            offset += sum(len(row) for row in rows)
        w.line()
        w.line()
    w.line(f"def tables(B, {inputs}):")
    with w.indent():
        w.line('"""Host lists: a pointer table per fused launch (per member: operand addresses, then scalar')
        w.line('indices), concatenated; and the scalar values (host scalars, then constants)."""')
        w.line(unpack)
        for label, header, rows in tables:
            w.line(f"# {header}")
            w.line(f"{label} = [")
            with w.indent():
                w.lines([f"{', '.join(row)},  # member {i}" for i, row in enumerate(rows)])
            w.line("]")
        w.line(f"return [{', '.join('*' + label for label, _, _ in tables)}], [{', '.join(scalars)}]")


def write_forward(w: CodeWriter, inputs: str, tensors: list[str], written: list[int], device: str) -> None:
    """``forward()``: buffers, tables, launch; a strided tensor input runs the step on contiguous
    copies (``_dense_step``; ``written`` are the inputs it writes back into)."""
    w.line(f"def forward(self, {inputs}):")
    with w.indent():
        if tensors:
            w.line("# The kernels index tensors by address, row-major: a strided input runs on a copy.")
            w.line(f"if not all_dense({', '.join(tensors)}):")
            with w.indent():
                w.line(f"return _dense_step(forward, self, [{inputs}], {tuple(written)})")
        w.line(f"dev = {device}")
        w.line("B = buffers(self, dev)")
        w.line(f"host_ptrs, host_scal = tables(B, {inputs})")
        w.line("ptrs = torch.tensor(host_ptrs, dtype=torch.int64, device=dev)")
        w.line("scal = torch.tensor(host_scal, dtype=torch.float32, device=dev)")
        w.line(f"return launch(self, B, ptrs, scal, {inputs})")
