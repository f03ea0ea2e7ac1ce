"""The float32 matmul precision a step's products ran under in eager, honoured by the compiled step.

``torch.set_float32_matmul_precision("medium")`` (emerging-optimizers' and Megatron's
``fp32_matmul_prec`` sets it around Newton–Schulz; training scripts set "high" for TF32) changes what
an fp32 ``mm`` computes: on a CPU with bf16 units, oneDNN then multiplies in bf16 (measured here on
the AMX Xeon, torch 2.13: a 32x32 product 0.05 off its "highest" result, a 1024³ one 3x faster).
The captured graph holds the ``mm`` and not the setting, so the compiled step ran it under whatever
the caller had (its default "highest"): a silently different step, caught only by the self-check.

The capture records the setting at each product (host_scalars.HostScalarMode). One setting for the
step's products (the usual case, whether set globally or around them): each op of the graph
is tagged with it, and the aten lowering calls every product under that setting (:func:`honour`). Products under
different settings in one step cannot be told apart in the graph: the step is refused, naming them.
Products inside hocompile's own ops (fused Newton–Schulz) follow their plan, not the tag.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.fx as fx

from ..errors import CaptureError

MATMUL_PRECISION = "hocompile.matmul_precision"  # node.meta: the setting an aten product ran under in eager
_PRODUCTS = frozenset({"mm", "bmm", "addmm", "baddbmm", "addbmm", "matmul", "mv", "addmv", "dot"})


def _is_product(node: fx.Node) -> bool:
    target = node.target
    return (
        node.op == "call_function" and isinstance(target, torch._ops.OpOverload) and target.namespace == "aten"
        and target._schema.name.split("::", 1)[1].rstrip("_") in _PRODUCTS
    )


def tag(gm: fx.GraphModule, precisions: Iterable[str], where: str) -> str:
    """Tag ``gm``'s products with the one setting they ran under; a note for explain() ('' if none is needed)."""
    seen = sorted(set(precisions))
    if len(seen) > 1:
        raise CaptureError(
            f"{where} runs matrix products under several float32 matmul precisions ({', '.join(seen)}); the "
            "compiled step cannot tell which product ran under which, and each computes differently on this "
            "machine. Set one precision for the whole step (fallback='eager' runs it eagerly)"
        )
    if not seen or seen == ["highest"]:
        return ""
    for node in gm.graph.nodes:  # every op: a product a pass makes later finds the step's setting beside it
        if node.op == "call_function":
            node.meta[MATMUL_PRECISION] = seen[0]
    return (f"the step's matrix products ran under float32 matmul precision {seen[0]!r}: the compiled step "
            "runs each under it too (planned Newton–Schulz follows its plan)")


_WRAPPED: dict[tuple[Any, str], Callable[..., Any]] = {}


def _under(fn: Any, precision: str) -> Callable[..., Any]:
    """``fn`` called under ``torch.set_float32_matmul_precision(precision)``, the caller's restored after."""
    known = _WRAPPED.get((fn, precision))
    if known is not None:
        return known

    def call(*args: Any, **kwargs: Any) -> Any:
        previous = torch.get_float32_matmul_precision()
        if previous == precision:
            return fn(*args, **kwargs)
        torch.set_float32_matmul_precision(precision)
        try:
            return fn(*args, **kwargs)
        finally:
            torch.set_float32_matmul_precision(previous)

    name = str(fn).replace(".", "_")
    call.__name__ = call.__qualname__ = f"{name}_under_{precision}_precision"  # as the generated code names it
    call.__module__ = __name__
    call.__wrapped__ = fn  # type: ignore[attr-defined]
    _WRAPPED[(fn, precision)] = call
    return call


def honour(graph: fx.Graph) -> int:
    """Call every aten product of a tagged step's graph under the step's one setting (before aten calls
    become tensor methods), those a pass made after the capture included; how many."""
    precision = next((n.meta[MATMUL_PRECISION] for n in graph.nodes if MATMUL_PRECISION in n.meta), None)
    if precision is None:
        return 0
    done = 0
    for node in graph.nodes:
        if _is_product(node):
            node.target = _under(node.target, precision)
            done += 1
    return done
