"""Which functional ``_foreach_*`` nodes eager ran as the in-place overload.

The capture functionalises the step: eager's ``torch._foreach_mul_(params, s)`` becomes
``_foreach_mul(params, s)`` plus write-backs. For most ops the functional, in-place and
``out=`` overloads share one kernel; ATen's CPU in-place foreach kernels do not: on a bf16
tensor ``_foreach_mul_`` rounds the scalar to bf16 first, where ``_foreach_mul`` (and ``mul``,
``mul_``) compute in fp32 (torch 2.13: 181 of 300 random scalars near 1 give other bits). So
while tracing, each in-place foreach call the step makes tags the functional node it left in
the graph (:data:`EAGER_INPLACE`), and the aten lowering runs tagged nodes over 16-bit floats
with the in-place kernel on copies of their inputs: eager's bits, with the graph still
functional. (The Triton lowering does not yet: there the self-check catches the difference.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import get_proxy_mode

EAGER_INPLACE = "hocompile.eager_inplace"  # node meta: the in-place overload eager called


def is_inplace_foreach(name: str) -> bool:
    return name.startswith("_foreach_") and name.endswith("_") and not name.endswith("__")


def graph_tail() -> fx.Node | None:
    """The last node of the graph being traced (None outside a trace)."""
    mode = get_proxy_mode()
    graph = getattr(getattr(mode, "tracer", None), "graph", None)
    return None if graph is None else graph._root.prev


def tag_since(tail: fx.Node | None, name: str) -> None:
    """Tag the functional ``aten::<name without _>`` nodes traced after ``tail``."""
    if tail is None:
        return
    functional = f"aten::{name[:-1]}"
    node = tail.next
    while node.op != "root":
        target = node.target
        if isinstance(target, torch._ops.OpOverload) and target._schema.name == functional:
            node.meta[EAGER_INPLACE] = f"{name}.{target._overloadname}"
        node = node.next


_ON_COPIES: dict[str, Callable[..., Any]] = {}


def on_copies(qualname: str) -> Callable[..., Any]:
    """The in-place overload ``qualname`` ("_foreach_mul_.Scalar") run on copies of its first
    argument (a list of tensors), returning the copies: the functional op, with its kernel."""
    known = _ON_COPIES.get(qualname)
    if known is not None:
        return known
    name, overload = qualname.split(".")
    inplace = getattr(getattr(torch.ops.aten, name), overload)

    def call(tensors: list[torch.Tensor], *args: Any, **kwargs: Any) -> list[torch.Tensor]:
        copies = [t.clone() for t in tensors]
        inplace(copies, *args, **kwargs)
        return copies

    call.__name__ = call.__qualname__ = f"{name}on_copies"
    call.__module__ = __name__
    _ON_COPIES[qualname] = call
    return call


def _reduced(node: fx.Node) -> bool:
    """Whether the node computes a 16-bit float: only there do the kernels differ. Measured on
    torch 2.13's CPU, 100 scalars near 1 each: ``_foreach_mul_`` vs ``_foreach_mul`` differ in 58
    (bf16) and 94 (fp16), never in fp32 or fp64; ``add`` (scalar, alpha), ``lerp``, ``addcmul``,
    ``addcdiv`` and ``div`` never. fp32 and fp64 lists keep the functional op and its single pass
    over memory."""
    vals = node.meta.get("val")
    leaves = vals if isinstance(vals, (list, tuple)) else [vals]
    return any(isinstance(v, torch.Tensor) and v.is_floating_point() and v.element_size() < 4 for v in leaves)


def run_eager_inplace(graph: fx.Graph) -> int:
    """Point every tagged node of 16-bit floats at its in-place kernel on copies; how many."""
    count = 0
    for node in graph.nodes:
        qualname = node.meta.get(EAGER_INPLACE)
        if node.op != "call_function" or not isinstance(qualname, str) or not _reduced(node):
            continue
        # Still the functional op the capture tagged (a rewrite in between, e.g. to ``out=``, is left as it is)
        target = node.target
        if isinstance(target, torch._ops.OpOverload) and target._schema.name == f"aten::{qualname.split('.')[0][:-1]}":
            node.target = on_copies(qualname)
            count += 1
    return count


__all__ = ["EAGER_INPLACE", "graph_tail", "is_inplace_foreach", "on_copies", "run_eager_inplace", "tag_since"]
