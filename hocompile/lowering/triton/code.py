"""Small helpers for writing generated Python/Triton source.

Generators build source line by line with :class:`CodeWriter`; no template
string holds logic, so every branch of a generator is plain Python
that reads top to bottom.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from .jit_helpers import ROUND_BF16

TL_DTYPE = {
    torch.float32: "tl.float32",
    torch.bfloat16: "tl.bfloat16",
    torch.float16: "tl.float16",
    torch.float64: "tl.float64",
}


class CodeWriter:
    """An indented line buffer (the idea of Inductor's IndentedBuffer)."""

    def __init__(self) -> None:
        self._lines: list[str] = []
        self._depth = 0
        self.helpers: set[str] = set()  # shared @triton.jit helpers the text calls (jit_helpers.py)

    def line(self, text: str = "") -> None:
        self._lines.append(("    " * self._depth + text) if text else "")

    def lines(self, texts: list[str]) -> None:
        for text in texts:
            self.line(text)

    @contextmanager
    def indent(self) -> Iterator[None]:
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1

    def extend(self, other: CodeWriter) -> None:
        """Append ``other``'s lines, indented to this writer's current depth."""
        self._lines += [("    " * self._depth + line) if line else "" for line in other._lines]
        self.helpers |= other.helpers

    def text(self) -> str:
        return "\n".join(self._lines) + "\n"

    def mark(self) -> int:
        """A position to read back from with :meth:`since`."""
        return len(self._lines)

    def since(self, mark: int) -> list[str]:
        """The lines written after ``mark``."""
        return self._lines[mark:]


@dataclass(frozen=True)
class KernelSource:
    """One generated kernel: its stable name, spec, origin, and source.

    ``source`` defines ``@triton.jit def <name>`` and a host launcher
    ``def launch_<name>(...)`` that computes the grid from the spec and the
    tile config; the step wrapper only ever calls launchers.
    """

    name: str
    family: str
    spec: object
    origin: str  # pass and graph nodes this kernel came from
    source: str
    tile: dict[str, int] = field(default_factory=dict)
    helpers: tuple[str, ...] = ()  # shared @triton.jit helpers ``source`` calls; assemble() defines them once

    @property
    def launcher(self) -> str:
        return f"launch_{self.name}"


def emit_round(w: CodeWriter, var: str, dtype: torch.dtype) -> None:
    """Round the fp32 ``var`` to ``dtype`` in place, keeping it fp32."""
    if dtype == torch.float32:
        return
    if dtype == torch.float16:
        w.line(f"{var} = {var}.to(tl.float16).to(tl.float32)")
        return
    # bf16: the shared helper rounds on the bits (jit_helpers.py says why).
    w.helpers.add(ROUND_BF16)
    w.line(f"{var} = {ROUND_BF16}({var})")


class ValueNames:
    """Python names of graph values in a generated function."""

    def __init__(self) -> None:
        self.expr: dict[fx.Node, str] = {}

    def of(self, node: fx.Node) -> str:
        return self.expr[node]


def python_arg(arg: Any, names: ValueNames) -> str:
    """A node argument as a Python expression of the generated module."""
    if isinstance(arg, fx.Node):
        return names.of(arg)
    if isinstance(arg, (list, tuple)):
        inner = ", ".join(python_arg(a, names) for a in arg)
        return f"[{inner}]" if isinstance(arg, list) else f"({inner}{',' if len(arg) == 1 else ''})"
    if isinstance(arg, torch.dtype):
        return str(arg)  # "torch.float32"
    if isinstance(arg, torch.device):
        return "dev"
    if isinstance(arg, (torch.memory_format, torch.layout)):
        return str(arg)
    if isinstance(arg, float) and not math.isfinite(arg):
        return f"float('{arg}')"  # repr(inf) is a bare name in the generated module
    return repr(arg)
