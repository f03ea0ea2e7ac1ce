"""Triton emitters for registered ops with several tensor inputs (``factor_update``, ``two_sided``).

op_groups.py lowers *matrix functions* (one tensor in, a result of its
shape), whose input the feeding pointwise kernels store into a workspace.
``factor_update`` (a factor and a gradient) and ``two_sided`` (a matrix and
two factors) are not: they read graph values as they are, any strides
(a transposed view costs nothing: the launchers pass strides), and write
one result. Their emitters implement :class:`CallEmitter` and register with
``registry.register_lowering(op, "triton", emitter)``; find_op_groups skips
ops with more than one tensor argument, so until the step wrapper learns
to call a :class:`CallEmitter` these ops stay aten calls in a Triton step
(the kernels are generated, tested under the interpreter, and ready).

:func:`standalone_text` wraps one emitted call in a module with a
``run(...)`` entry, for tests and benchmarks/gpu_check_shampoo.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch.fx as fx

from .code import CodeWriter
from .module import assemble
from .op_groups import GroupCode, allocations


@dataclass(frozen=True)
class CallNames:
    """What the caller calls the op's values, for the emitter's launch lines."""

    inputs: dict[str, str]  # tensor field -> a tensor expression (2-D or [B, ...], any strides)
    out: str  # the result, contiguous, in the op's output dtype
    prefix: str  # for the emitter's own buffer names
    scalar: Callable[[Any], str]  # a scalar argument's 0-d device tensor
    upcast: str  # the expression launchers take as ``upcast``
    arch: str


class CallEmitter(Protocol):
    """What a multi-input family provides to be lowered to Triton."""

    def scalars(self, node: fx.Node) -> list[Any]:
        """Scalar arguments the kernels read on the device (constants or host scalars)."""
        ...

    def emit(self, node: fx.Node, names: CallNames) -> GroupCode:
        """Kernels, buffers and launch lines computing ``node``'s result into ``names.out``."""
        ...


def standalone_text(emitter: CallEmitter, node: fx.Node, fields: list[str], arch: str) -> tuple[str, list[Any]]:
    """Module text whose ``run(<fields>, out, s0, s1, ..., upcast)`` computes ``node``; and its scalars.

    The scalars come back in the order ``run`` takes them (as 0-d tensors).
    """
    scalars = emitter.scalars(node)
    index = {id(s): i for i, s in enumerate(scalars)}
    names = CallNames(
        inputs={f: f for f in fields},
        out="out",
        prefix="c0_",
        scalar=lambda s: f"s{index[id(s)]}",
        upcast="upcast",
        arch=arch,
    )
    code = emitter.emit(node, names)
    w = CodeWriter()
    params = ", ".join([*fields, "out", *(f"s{i}" for i in range(len(scalars))), "upcast"])
    w.line(f"def run({params}):")
    with w.indent():
        w.line(f"# {code.summary}")
        w.lines(allocations(code.buffers, "out.device"))
        w.lines(code.lines)
        w.line("return out")
    return assemble(code.kernels, w.text()), scalars


__all__ = ["CallEmitter", "CallNames", "standalone_text"]
