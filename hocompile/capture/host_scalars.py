"""Tracing-time helpers that keep host-visible scalars symbolic.

Two things an optimizer step reads on the host, which a fake-tensor trace
cannot evaluate and must not bake in:

- its hyperparameters (``group["lr"]``, ``group["betas"]``...): replaced by
  :class:`~hocompile.capture.hyper_params.HyperParam` for the duration of the trace;
- step counters kept as 0-d tensors and read with ``.item()`` (Adam's
  ``state["step"]``): :class:`HostScalarMode` mirrors each such tensor as a
  host expression, follows ``+=``/``add_`` by a number, and answers ``.item()``
  with that expression. Any other data-dependent read raises a clear error.
"""

from __future__ import annotations

import builtins
import math
import operator
from collections.abc import Callable
from typing import Any, cast

import torch
from torch.overrides import TorchFunctionMode

from ..errors import CaptureError
from . import fused_kernels, inplace_foreach
from .host_state import is_number
from .hyper_params import HyperParam, ScalarTracker, extremum, sentinel
from .scalars import MATH_BINARY, MATH_UNARY, Expr, const, input_expr, user_line
from .stand_ins import real_flag, real_id

__all__ = ["HostScalarMode"]


class HostScalarMode(TorchFunctionMode):
    """Answers ``.item()`` on step counters with host expressions.

    A counter is followed through updates the host can repeat bit for bit:
    add, sub, mul and div by numbers or other counters, in place or not, one
    tensor at a time or through ``torch._foreach_add_`` and friends (the
    foreach Adam family), ``fill_``, ``zero_``, ``copy_`` and ``clone``. A
    float32 counter's value is rounded as the device rounds it (measured:
    ``fl32(a op fl32(b))``). Any other in-place op on it, or on a list holding
    it, makes its host value unknown: a later ``.item()`` then refuses to
    compile instead of returning a stale value.
    """

    def __init__(self, tracker: ScalarTracker, salt: int) -> None:
        super().__init__()
        self.tracker = tracker
        self.salt = salt
        # id(tensor) -> (tensor kept alive so the id stays unique, its value or
        # None when an update could not be followed, and that update's name)
        self.mirrors: dict[int, tuple[torch.Tensor, HyperParam | None, str]] = {}
        # float32 matmul precisions in force at the step's matmuls
        # (emerging-optimizers switches it around its Newton-Schulz).
        self.matmul_precisions: set[str] = set()
        self.fused_kernels: set[str] = set()  # torch's fused optimizer kernels the step ran
        # Evaluates a tensor the step reads on the host that is not a counter (host_reads.py):
        # (its host input's name, its real value); None: such a read is refused.
        self.reader: Callable[[torch.Tensor, str], tuple[str, Any]] | None = None
        # id(traced param) -> the real param: what a step reads of a param is the real one's (stand_ins.py)
        self.stand_ins: dict[int, torch.Tensor] = {}

    def __enter__(self) -> HostScalarMode:
        # math.sqrt(x) of a float subclass reads its payload and returns a plain
        # float: the hyperparameter would be baked in. While tracing, math's
        # functions follow HyperParams (and pass anything else straight through).
        self._saved_math = {name: getattr(math, name) for name in MATH_UNARY + MATH_BINARY}
        for name, fn in self._saved_math.items():
            setattr(math, name, _following(fn, f"math.{name}"))
        # max(eps, x) / min(x, 1.0) of a hyperparameter or a value read on the host: an
        # expression the host evaluates, instead of a guard per outcome (the trace lock
        # keeps this to one trace at a time; other arguments pass straight through).
        self._saved_builtins = (builtins.max, builtins.min, builtins.id)
        builtins.max, builtins.min = _extremum_of("max"), _extremum_of("min")
        builtins.id = real_id(self.stand_ins, builtins.id)
        return super().__enter__()  # type: ignore[no-any-return]

    def __exit__(self, *exc: Any) -> None:
        for name, fn in self._saved_math.items():
            setattr(math, name, fn)
        builtins.max, builtins.min, builtins.id = self._saved_builtins
        super().__exit__(*exc)

    def track(self, tensor: torch.Tensor, name: str, real: float, index: int) -> None:
        self.tracker.real[name] = real
        value = self.tracker.make(sentinel(real, index, self.salt), input_expr(name))
        self.mirrors[id(tensor)] = (tensor, value, "")

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if self.stand_ins:
            answered, value = real_flag(func, args, self.stand_ins)
            if answered:
                return value
        if func is torch.Tensor.square_ and not kwargs:
            # functionalize cannot trace aten::square_ (it reports an alias annotation); ATen
            # computes it as pow_(2) (bitwise the same, tests/test_host_reads.py checks)
            return args[0].pow_(2)
        if func is torch.Tensor.item:
            return self._item(args[0])
        if func in _HOST_READS and isinstance(args[0], torch.Tensor) and args[0].numel() == 1:
            # bool(t), float(t), int(t), t.tolist(), min(t, x) on a one-element tensor:
            # a host read like .item(): a counter's value, or a clear refusal naming the line
            read = self._item(args[0])
            if func is torch.Tensor.__float__:
                # Python makes whatever __float__ returns a plain float: the value would be
                # baked in, a branch on it taken once for all steps (silently wrong later)
                raise CaptureError(
                    f"the step calls float() on a {tuple(args[0].shape)} {args[0].dtype} tensor{user_line()}; "
                    "Python turns the result into a plain float, which hocompile cannot follow through the "
                    "arithmetic and comparisons after it. Write `t.item()` instead: the same value, and "
                    "hocompile follows it (fallback='eager' runs such a step eagerly)"
                )
            return _HOST_READS[func](read) if func is not torch.Tensor.tolist or args[0].dim() == 0 else [read]
        name = getattr(func, "__name__", "")
        if name in _MATMULS:
            self.matmul_precisions.add(torch.get_float32_matmul_precision())
        first = args[0] if args else None
        if func in _NUMBER_TO_TENSOR or func is torch.Tensor.__setitem__:
            # A hyperparameter wrapped into a tensor at the Python level would be
            # baked into the graph as a tensor constant (and in float32 the
            # sentinel's nudge rounds away, so two traces cannot tell). Build
            # it with aten.full instead: a Scalar argument, lifted like any other.
            args, kwargs, made = self._lift_tensor_data(func, args, kwargs)
            if made is not None:
                return made
        # Values of mirrored counters after this call, computed before it runs
        # (an in-place op changes what its operands read).
        if func in fused_kernels.KERNELS:  # fused=True: torch's kernel as an opaque functional op
            self.fused_kernels.add(name)
            return fused_kernels.traced_call(func, args, kwargs)
        updates = self._updates(name, args, kwargs) if self.mirrors else []
        tail = inplace_foreach.graph_tail() if inplace_foreach.is_inplace_foreach(name) else None
        out = func(*args, **kwargs)
        inplace_foreach.tag_since(tail, name)  # eager ran the in-place kernel (inplace_foreach.py)
        for tensor, value in updates:
            self.mirrors[id(tensor)] = (tensor, value, name)
        if self.mirrors and name in _FUNCTIONAL_FOLLOW:
            self._follow_functional(name, args, kwargs, out)
        if func in _NUMBER_TO_TENSOR and isinstance(first, (int, float)) and not isinstance(first, bool):
            self.mirrors[id(out)] = (out, self._as_stored(out, first), name)
        elif name in _ZERO_D_FACTORIES and isinstance(out, torch.Tensor) and out.dim() == 0:
            fill = args[1] if name in ("full", "full_like") and len(args) > 1 else float(name.startswith("ones"))
            self.mirrors[id(out)] = (out, self._as_stored(out, self._known(fill)), name)
        return out

    def _lift_tensor_data(
        self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any], torch.Tensor | None]:
        if func is torch.Tensor.__setitem__:
            target, index, value = args
            if isinstance(value, HyperParam):
                value = torch.full((), value, dtype=target.dtype, device=target.device)
            return (target, index, value), kwargs, None
        owner = args[0] if func is torch.Tensor.new_tensor else None
        data = args[1] if owner is not None else (args[0] if args else kwargs.get("data"))
        values = list(data) if isinstance(data, (list, tuple)) else [data]
        if not any(isinstance(v, HyperParam) for v in values):
            return args, kwargs, None
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            raise CaptureError("the step builds a tensor from nested data holding hyperparameters; cannot compile it")
        reals = [v.tracker.real_value(v.expr) if isinstance(v, HyperParam) else v for v in values]
        natural = torch.int64 if all(isinstance(r, int) for r in reals) else torch.get_default_dtype()
        dtype = kwargs.get("dtype") or (owner.dtype if owner is not None else natural)
        device = kwargs.get("device") or (owner.device if owner is not None else None)
        if not (dtype.is_floating_point or dtype.is_complex):
            # the sentinel payload would be truncated to the same integer in both traces
            raise CaptureError(f"the step builds a {dtype} tensor from a host scalar ({values}); cannot compile it")
        parts = [torch.full((), cast(float, v), dtype=dtype, device=device) for v in values]
        for part, v in zip(parts, values):
            self.mirrors[id(part)] = (part, self._as_stored(part, v), "torch.tensor")
        return args, kwargs, parts[0] if not isinstance(data, (list, tuple)) else torch.stack(parts)

    def _item(self, tensor: torch.Tensor) -> HyperParam:
        entry = self.mirrors.get(id(tensor))
        if entry is None and self.reader is not None:
            # a data-dependent read: a host input of its own, the step split there (host_reads.py)
            name, real = self.reader(tensor, user_line())
            self.track(tensor, name, real, 2000 + len(self.mirrors))
            entry = self.mirrors[id(tensor)]
        if entry is None:
            raise CaptureError(
                "the step reads a tensor's value on the host (`.item()` / float(tensor)) "
                f"on a {tuple(tensor.shape)} {tensor.dtype} tensor that is not a step counter{user_line()}; "
                "a data-dependent host read cannot be compiled (fallback='eager' runs such a step eagerly)"
            )
        if entry[1] is None:
            raise CaptureError(
                f"the step reads a step counter on the host after updating it with `{entry[2]}`, which "
                "hocompile cannot follow exactly on the host (add, sub, mul, div by numbers, fill_, zero_ "
                "and copy_ are followed); refusing rather than using a stale value"
            )
        return entry[1]

    def _known(self, x: Any) -> HyperParam | int | float | None:
        """The host value of a number or a mirrored tensor; None if unknown."""
        if isinstance(x, torch.Tensor):
            entry = self.mirrors.get(id(x))
            return entry[1] if entry is not None else None
        if isinstance(x, (int, float)) and not isinstance(x, bool):
            return x
        return None

    def _updates(
        self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> list[tuple[torch.Tensor, HyperParam | None]]:
        """New host values of the mirrored counters an in-place op writes."""
        if not _mutates_first_arg(name) and "out" not in kwargs:
            return []
        written = _tensors(args[0] if args else None) + _tensors(kwargs.get("out"))
        mirrored = [t for t in written if id(t) in self.mirrors]
        if not mirrored:
            return []
        base = name.removeprefix("_foreach_").rstrip("_").removeprefix("__i").removesuffix("__")
        result: list[tuple[torch.Tensor, HyperParam | None]] = []
        for k, tensor in enumerate(mirrored):
            other = args[1] if len(args) > 1 else kwargs.get("other", kwargs.get("value"))
            if isinstance(other, (list, tuple)):  # a foreach ScalarList / TensorList
                position = next((j for j, t in enumerate(_tensors(args[0])) if t is tensor), k)
                other = other[position] if position < len(other) else None
            value = self._apply(base, tensor, other, kwargs.get("alpha", args[2] if len(args) > 2 else 1))
            result.append((tensor, value))
        return result

    def _apply(self, base: str, tensor: torch.Tensor, other: Any, alpha: Any) -> HyperParam | None:
        if base == "zero":
            return self._as_stored(tensor, 0)
        if base in ("fill", "copy"):
            return self._as_stored(tensor, self._known(other))
        current, operand, scale = self._known(tensor), self._known(other), self._known(alpha)
        if current is None or operand is None or scale is None:
            return None
        if scale != 1:
            # add(a, b, alpha) may run as one fused multiply-add on the device
            if base not in ("add", "sub") or not (_whole(operand) and _whole(scale)):
                return None
            operand = operand * scale
        if tensor.dtype == torch.float32:
            # measured: the device rounds a Python-number operand to float32
            # first, then computes and rounds once: fl32(a op fl32(b))
            operand = self._as_stored(tensor, operand)
        ops = {"add": operator.add, "sub": operator.sub, "mul": operator.mul, "div": operator.truediv}
        if base not in ops or operand is None:
            return None
        return self._as_stored(tensor, ops[base](self._hyper(current), operand))

    def _hyper(self, value: Any) -> HyperParam:
        return value if isinstance(value, HyperParam) else self.tracker.make(float(value), const(value))

    def _as_stored(self, tensor: torch.Tensor, value: Any) -> HyperParam | None:
        """``value`` as ``tensor``'s dtype holds it, exactly; None where the host cannot be exact."""
        if value is None:
            return None
        hp = self._hyper(value)
        if tensor.dtype == torch.float64:
            return hp
        if tensor.dtype == torch.float32:
            return hp.as_float32()
        if not tensor.dtype.is_floating_point and tensor.dtype != torch.bool and _whole(hp):
            return hp
        return None  # half precision counters, bools: not followed

    def _follow_functional(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        """``step + 1``, ``torch._foreach_add(steps, 1)``, ``step.clone()``: the result is a counter too."""
        sources = _tensors(args[0] if args else None)
        results = _tensors(out)
        if name in ("__radd__", "__rsub__") or len(sources) != len(results):
            return
        base = {"__add__": "add", "__sub__": "sub", "_foreach_add": "add", "_foreach_sub": "sub"}.get(name, name)
        for k, (src, res) in enumerate(zip(sources, results)):
            if id(src) not in self.mirrors:
                continue
            if base in ("clone", "detach"):
                value = self._known(src)
            else:
                other = args[1] if len(args) > 1 else kwargs.get("other")
                if isinstance(other, (list, tuple)):
                    other = other[k] if k < len(other) else None
                value = self._apply(base, src, other, kwargs.get("alpha", 1))
            self.mirrors[id(res)] = (res, self._as_stored(res, value), name)


_HOST_READS: dict[Any, Callable[[Any], Any]] = {
    torch.Tensor.__bool__: bool,
    torch.Tensor.__float__: lambda v: v,
    torch.Tensor.__int__: int,
    torch.Tensor.__index__: int,
    torch.Tensor.tolist: lambda v: v,
}
_MATMULS = frozenset({"mm", "matmul", "__matmul__", "__rmatmul__", "addmm", "bmm", "baddbmm", "addmm_", "baddbmm_"})
_NUMBER_TO_TENSOR = frozenset({torch.tensor, torch.as_tensor, torch.asarray, torch.Tensor.new_tensor})
_ZERO_D_FACTORIES = frozenset({"zeros", "ones", "zeros_like", "ones_like", "full", "full_like"})
_FUNCTIONAL_FOLLOW = frozenset({"add", "sub", "__add__", "__sub__", "_foreach_add", "_foreach_sub", "clone", "detach"})


def _extremum_of(op: str) -> Callable[..., Any]:
    original = builtins.max if op == "max" else builtins.min

    def follow(*args: Any, **kwargs: Any) -> Any:
        if kwargs or len(args) < 2 or not any(isinstance(a, HyperParam) for a in args):
            return original(*args, **kwargs)
        if not all(is_number(a) for a in args):
            return original(*args)
        out = args[0]
        for other in args[1:]:  # Python's order: the first of equal values wins
            out = extremum(op, out, other)
        return out

    follow.__wrapped__ = original  # type: ignore[attr-defined]
    return follow


def _following(fn: Callable[..., Any], op: str) -> Callable[..., Any]:
    def follow(*args: Any) -> Any:
        first = next((a for a in args if isinstance(a, HyperParam)), None)
        if first is None:
            return fn(*args)
        if isinstance(args[0], HyperParam):
            return args[0].apply(op, *args[1:])
        return first.tracker.make(fn(*(float(a) for a in args)), Expr(op, tuple(_expr_of(a) for a in args)))

    follow.__wrapped__ = fn  # type: ignore[attr-defined]
    return follow


def _expr_of(x: Any) -> Expr:
    return x.expr if isinstance(x, HyperParam) else const(x)


def _whole(x: Any) -> bool:
    """A whole number at capture: counters step by ones (real value, not the sentinel)."""
    real = x.tracker.real_value(x.expr) if isinstance(x, HyperParam) else x
    return float(real).is_integer() and abs(float(real)) < 2**24


def _tensors(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for t in x if isinstance(t, torch.Tensor)]
    return []


def _mutates_first_arg(name: str) -> bool:
    return name.endswith("_") and not name.endswith("__") or name.startswith("__i")
