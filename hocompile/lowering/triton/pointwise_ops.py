"""The elementwise aten ops the pointwise kernel generator knows, as Triton expressions.

Each entry turns the rendered arguments of one aten call (variable names or
literals; every value is an fp32 register) into one Triton expression. They
follow ATen's CPU formulas where the formula matters for rounding (``lerp``
switches form at weight 0.5 as ATen does); results of half-precision nodes
are rounded by the generator after each op, as eager rounds each op's output.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

from ...ir.graph import ROLE, InputSlot

aten = torch.ops.aten

Render = Callable[[list[str], dict[str, str]], str]


def _alpha(kwargs: dict[str, str], key: str = "alpha") -> str | None:
    value = kwargs.get(key)
    return None if value in (None, "1", "1.0") else value


def _add(args: list[str], kwargs: dict[str, str]) -> str:
    alpha = _alpha(kwargs)
    return f"{args[0]} + {args[1]}" if alpha is None else f"{args[0]} + {alpha} * {args[1]}"


def _sub(args: list[str], kwargs: dict[str, str]) -> str:
    alpha = _alpha(kwargs)
    return f"{args[0]} - {args[1]}" if alpha is None else f"{args[0]} - {alpha} * {args[1]}"


def _lerp(args: list[str], kwargs: dict[str, str]) -> str:
    start, end, weight = args
    # ATen: small weights lerp from start, large ones from end (exact at weight 1).
    small = f"{start} + {weight} * ({end} - {start})"
    large = f"{end} - ({end} - {start}) * (1.0 - {weight})"
    return f"tl.where(tl.abs({weight}) < 0.5, {small}, {large})"


def _addcmul(args: list[str], kwargs: dict[str, str]) -> str:
    value = kwargs.get("value", "1.0")
    return f"{args[0]} + {value} * {args[1]} * {args[2]}"


def _addcdiv(args: list[str], kwargs: dict[str, str]) -> str:
    value = kwargs.get("value", "1.0")
    return f"{args[0]} + {value} * tl.math.div_rn({args[1]}, {args[2]})"


def _clamp(args: list[str], kwargs: dict[str, str]) -> str:
    lo = args[1] if len(args) > 1 else kwargs.get("min", "None")
    hi = args[2] if len(args) > 2 else kwargs.get("max", "None")
    out = args[0]
    if lo != "None":
        out = f"tl.maximum({out}, {lo})"
    if hi != "None":
        out = f"tl.minimum({out}, {hi})"
    return out


def _pow(args: list[str], kwargs: dict[str, str]) -> str:
    base, exponent = args
    if exponent in ("2", "2.0"):
        return f"{base} * {base}"
    if exponent in ("0.5",):
        return f"tl.sqrt_rn({base})"
    raise NotImplementedError(f"pow with exponent {exponent}")


POINTWISE: dict[Any, Render] = {
    aten.add.Tensor: _add,
    aten.sub.Tensor: _sub,
    aten.mul.Tensor: lambda a, k: f"{a[0]} * {a[1]}",
    # Correctly rounded division and square root, as aten's (Triton's plain
    # ``/`` and ``tl.sqrt`` may be approximate on GPUs).
    aten.div.Tensor: lambda a, k: f"tl.math.div_rn({a[0]}, {a[1]})",
    aten.neg.default: lambda a, k: f"-{a[0]}",
    aten.sqrt.default: lambda a, k: f"tl.sqrt_rn({a[0]})",
    aten.rsqrt.default: lambda a, k: f"tl.math.div_rn(1.0, tl.sqrt_rn({a[0]}))",
    aten.reciprocal.default: lambda a, k: f"tl.math.div_rn(1.0, {a[0]})",
    aten.abs.default: lambda a, k: f"tl.abs({a[0]})",
    aten.exp.default: lambda a, k: f"tl.exp({a[0]})",
    aten.sign.default: lambda a, k: f"tl.where({a[0]} > 0, 1.0, tl.where({a[0]} < 0, -1.0, 0.0))",
    aten.lerp.Scalar: _lerp,
    aten.lerp.Tensor: _lerp,
    aten.addcmul.default: _addcmul,
    aten.addcdiv.default: _addcdiv,
    aten.maximum.default: lambda a, k: f"tl.maximum({a[0]}, {a[1]})",
    aten.minimum.default: lambda a, k: f"tl.minimum({a[0]}, {a[1]})",
    aten.clamp.default: _clamp,
    aten.clamp_min.default: lambda a, k: f"tl.maximum({a[0]}, {a[1]})",
    aten.pow.Tensor_Scalar: _pow,
    aten._to_copy.default: lambda a, k: a[0],  # the generator rounds to the node's dtype
    aten.clone.default: lambda a, k: a[0],
}


def is_scalar_arg(node: fx.Node) -> bool:
    """A host scalar placeholder (a hyperparameter expression evaluated per step)."""
    return node.op == "placeholder" and not isinstance(node.meta.get(ROLE), InputSlot)


def supported(node: fx.Node) -> bool:
    if node.target is aten.pow.Tensor_Scalar and node.args[1] not in (2, 2.0, 0.5):
        return False
    if node.target is aten._to_copy.default and set(node.kwargs) - {"dtype"}:
        return False  # device / layout / memory-format changes are not elementwise math
    return node.target in POINTWISE
