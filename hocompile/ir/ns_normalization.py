# fx.Node.args is typed as a wide union (nodes, lists, dtypes, ...); every
# helper checks the node's target before reading its args, which mypy cannot follow.
# mypy: disable-error-code="union-attr"
"""What fuse-newton-schulz reads before the iterations: the normalisation, casts and transposes.

``x / d`` is a Frobenius normalisation when ``d`` is ``‖y‖ + eps``,
``max(‖y‖, eps)`` or ``‖y‖`` alone, with casts allowed around each step
(a norm taken in fp32, then cast), an ``expand`` (``F.normalize``), a
constant safety factor inside or outside the eps (``‖y‖ * s + eps``,
``(‖y‖ + eps) * s``), and ``y`` the same matrix as ``x`` up to casts and
transposes (``G.bf16() / (G.norm() + eps)``). A per-matrix norm of a stack
keeps its dims (``keepdim=True``): a ``[B]`` norm would divide the last dim.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from ..capture.scalars import Expr
from .declined import Declined
from .graph import ROLE
from .matrix_polynomial import is_call, is_number, transposed

aten = torch.ops.aten


def is_cast(node: Any) -> bool:
    return (
        is_call(node, aten._to_copy.default)
        and set(node.kwargs) <= {"dtype"}
        and len(node.args) == 1
        and node.meta["val"].dtype.is_floating_point
    )


def strip_casts(node: Any) -> Any:
    while is_cast(node):
        node = node.args[0]
    return node


def scalar_arg(arg: Any) -> bool:
    """A constant or a host scalar (hyperparameter) input."""
    return is_number(arg) or (
        isinstance(arg, fx.Node) and arg.op == "placeholder" and isinstance(arg.meta.get(ROLE), Expr)
    )


def safety_factor(node: Any) -> tuple[float | Declined, Any]:
    """``node`` as ``s * base`` for a constant s (casts skipped); s is Declined when it is a hyperparameter."""
    s = 1.0
    node = strip_casts(node)
    while is_call(node, aten.mul.Tensor, aten.div.Tensor) and not isinstance(node.args[1], fx.Node):
        if not is_number(node.args[1]) or node.args[1] == 0:
            return Declined(f"the norm is scaled by {node.args[1]!r}"), strip_casts(node.args[0])
        s = s * float(node.args[1]) if node.target is aten.mul.Tensor else s / float(node.args[1])
        node = strip_casts(node.args[0])
    if is_call(node, aten.mul.Tensor, aten.div.Tensor) and scalar_arg(node.args[1]):
        reason = f"the norm's safety factor {node.args[1].name} is a hyperparameter, not a constant"
        return Declined(reason), strip_casts(node.args[0])
    return s, node


@dataclass
class Normalization:
    x: fx.Node  # the numerator
    y: fx.Node  # what the norm is taken of
    eps: Any
    eps_mode: str
    s_in: float  # d = s_out * (s_in * ‖y‖ ⊕ eps)
    s_out: float


def normalization(div: fx.Node) -> Normalization | Declined | None:
    """The normalisation ``div`` computes; None if it is none (an ordinary division), Declined if it almost is."""
    x, denom = div.args[0], div.args[1]
    if not isinstance(x, fx.Node) or not isinstance(denom, fx.Node):
        return None
    if is_call(denom, aten.expand.default):
        denom = denom.args[0]
    s_out, denom = safety_factor(denom)
    clamp = is_call(denom, aten.clamp.default, aten.clamp_min.default) and len(denom.args) >= 2
    if clamp and scalar_arg(denom.args[1]):
        if is_call(denom, aten.clamp.default) and len(denom.args) > 2 and denom.args[2] is not None:
            return None  # an upper clamp is not a normalisation
        inner, eps, mode = denom.args[0], denom.args[1], "clamp"
    elif is_call(denom, aten.add.Tensor) and scalar_arg(denom.args[1]) and "alpha" not in denom.kwargs:
        inner, eps, mode = denom.args[0], denom.args[1], "add"
    else:
        inner, eps, mode = denom, 0.0, "add"  # x / ‖x‖, no eps
    s_in, norm = safety_factor(inner)
    norm = strip_casts(norm)
    if not is_call(norm, aten.linalg_vector_norm.default):
        return None
    y = norm.args[0]
    ord_: Any = norm.args[1] if len(norm.args) > 1 else norm.kwargs.get("ord", 2)
    dims = norm.args[2] if len(norm.args) > 2 else norm.kwargs.get("dim")
    ndim = y.meta["val"].dim()
    if not is_number(ord_) or float(ord_) != 2.0 or ndim not in (2, 3):
        return None
    if dims is not None and sorted(d % ndim for d in dims) != [ndim - 2, ndim - 1]:
        return None
    if dims is None and ndim != 2:
        return None  # a norm over the whole batch is not per-matrix
    keepdim = norm.args[3] if len(norm.args) > 3 else norm.kwargs.get("keepdim", False)
    if ndim == 3 and not keepdim:
        return None  # [B] norms broadcast against the last dim, not per matrix
    for s in (s_in, s_out):
        if isinstance(s, Declined):
            return s
        if s <= 0.0:
            return Declined(f"the norm is scaled by {s}, not a positive safety factor")
    assert isinstance(s_in, float) and isinstance(s_out, float)
    return Normalization(x, y, eps, mode, s_in, s_out)


def layout_step(node: Any) -> Any:
    """The input of a cast, a last-two-dims transpose or a copy (``.contiguous()``), else None."""
    if is_cast(node) or (is_call(node, aten.clone.default) and set(node.kwargs) <= {"memory_format"}):
        return node.args[0]
    return transposed(node)


def back_through_layout(node: fx.Node) -> list[fx.Node]:
    """``node`` and what it was cast or transposed from, back to the first other node."""
    path = [node]
    while (prev := layout_step(path[-1])) is not None:
        path.append(prev)
    return path


def one_dtype_change(path: list[fx.Node]) -> bool:
    """Along ``path`` (in execution order) the dtype changes at most once."""
    dtypes = [n.meta["val"].dtype for n in path]
    changes = sum(1 for a, b in zip(dtypes, dtypes[1:]) if a != b)
    return changes <= 1
