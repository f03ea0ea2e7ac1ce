"""Triton emitters for registered ops with several tensor inputs (``factor_update``, ``two_sided``).

op_groups.py lowers *matrix functions* (one tensor in, a result of its
shape), whose input the feeding pointwise kernels store into a workspace.
``factor_update`` (a factor and a gradient) and ``two_sided`` (a matrix and
two factors) are not: they read graph values as they are, any strides
(a transposed view costs nothing: the launchers pass strides), and write
one contiguous result. Their emitters implement :class:`CallEmitter` and
register with ``registry.register_lowering(op, "triton", emitter)``.

In a Triton step each such call is a *call unit* (:func:`find_calls`): the
wrapper allocates its result ``cout<c>`` (and the emitter's temporaries)
in ``buffers()`` and writes the emitter's launch lines where the unit is
scheduled. Its inputs are whatever the graph computed them as (a stack
batch-by-shape made stays an aten ``stack``: the call reads the stacked
tensor, one launch for the group). A call the kernels cannot take stays an
aten call, with its reason (a :class:`CallDecline`, shown in ``explain()``).

:func:`standalone_text` wraps one emitted call in a module with a
``run(...)`` entry, for tests and benchmarks/gpu_check_shampoo.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.fx as fx

from ...ir import dtypes
from ...ir.registry import OpFamily
from .code import CodeWriter
from .module import assemble
from .op_groups import GroupCode, allocations, triton_emitter
from .regions import is_placeholder_slot

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


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


@dataclass
class CallGroup:
    """One registered multi-input call lowered as a unit (a stacked call: the whole batch, one unit)."""

    index: int
    node: fx.Node
    family: OpFamily
    emitter: CallEmitter
    fields: list[str]  # its tensor fields, in the spec's order

    def inputs(self) -> dict[str, fx.Node]:
        spec = self.family.spec_of(self.node)
        return {f: spec.node_of(f) for f in self.fields}


@dataclass(frozen=True)
class CallDecline:
    """A multi-input call with a Triton emitter that stays an aten call, and why."""

    node: fx.Node
    reason: str


def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def _decline_reason(node: fx.Node, inputs: list[fx.Node], emitter: CallEmitter) -> str | None:
    """Why the kernels cannot take this call (None: they can)."""
    out = _val(node)
    if not isinstance(out, torch.Tensor) or out.dim() not in (2, 3) or out.numel() == 0:
        return "the result is not a non-empty matrix or stack of matrices"
    if out.dtype not in _DTYPES:
        return f"the kernels take {', '.join(str(d) for d in _DTYPES)}, not {out.dtype}"
    for x in inputs:
        val = _val(x)
        if not isinstance(val, torch.Tensor) or val.dim() != out.dim() or val.numel() == 0:
            return f"input {x.name} is not a non-empty tensor of the result's rank"
        if val.dtype != out.dtype:
            return f"input {x.name} is {val.dtype}, the result {out.dtype}: the kernels read one dtype"
    for value in emitter.scalars(node):
        # The kernels read scalars from the step's device table: constants and host scalars only.
        if isinstance(value, fx.Node) and (value.op != "placeholder" or is_placeholder_slot(value)):
            return f"scalar {value.name} is computed inside the step, not a host scalar or constant"
    return None


def find_calls(gm: fx.GraphModule) -> tuple[list[CallGroup], list[CallDecline]]:
    """Calls of registered ops with several tensor inputs and a Triton emitter, and those declined."""
    calls: list[CallGroup] = []
    declines: list[CallDecline] = []
    for node in gm.graph.nodes:
        found = triton_emitter(node)
        if found is None:
            continue
        family, emitter = found
        spec = family.spec_of(node)
        fields = [name for name in spec.tensor_fields() if isinstance(getattr(spec, name), fx.Node)]
        if len(fields) < 2 or hasattr(emitter, "workspace"):
            continue  # a matrix function: op_groups.py's
        reason = _decline_reason(node, [spec.node_of(f) for f in fields], emitter)  # type: ignore[arg-type]
        if reason is not None:
            declines.append(CallDecline(node, reason))
            continue
        calls.append(CallGroup(len(calls), node, family, emitter, fields))  # type: ignore[arg-type]
    return calls, declines


def emit_call(
    call: CallGroup, inputs: dict[str, str], scalar: Callable[[Any], str], upcast: str, arch: str
) -> tuple[GroupCode, list[str]]:
    """The call's code, writing ``cout<c>``; and the ``buffers()`` lines allocating it and its temporaries."""
    c, val = call.index, call.node.meta["val"]
    code = call.emitter.emit(call.node, CallNames(inputs, f"cout{c}", f"c{c}_", scalar, upcast, arch))
    lines = [
        f"# {call.family.name} call {c} ({call.node.name}): {tuple(val.shape)} {dtypes.name(val.dtype)}",
        f"cout{c} = torch.empty({tuple(val.shape)}, dtype={val.dtype}, device=dev)",
        *allocations(code.buffers, "dev"),
    ]
    return code, lines


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


__all__ = ["CallDecline", "CallEmitter", "CallGroup", "CallNames", "emit_call", "find_calls", "standalone_text"]
