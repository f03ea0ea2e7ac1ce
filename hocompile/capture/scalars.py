"""Hyperparameters as runtime inputs: exact host-side scalar expressions.

During capture every schedulable hyperparameter (lr, momentum, betas, weight
decay, eps, step counters) is handed to the optimizer as a :class:`HyperParam`:
a ``float`` whose *payload* is a unique sentinel value and which records the
arithmetic done on it as an :class:`Expr` tree. When a derived value such as
``1 - lr * weight_decay`` reaches an aten op, the graph holds the sentinel; the
capture later swaps that constant for a scalar input whose expression the
runtime evaluates on the host before every step.

Why our own expression trees rather than sympy: eager Python evaluates
``lr * ratio`` left to right in IEEE doubles. sympy canonicalises and
reassociates (``(a*b)*c`` may become ``a*(b*c)``), which changes the last bit.
Replaying the exact operation order keeps the compiled step bit-identical to
eager.

Branches on hyperparameters (``if weight_decay != 0``) are decided on the
*real* value and recorded as :class:`Guard` s, so a schedule that crosses a
branch recompiles instead of silently running the wrong program.
"""

from __future__ import annotations

import builtins
import math
import numbers
import operator
import os
import struct
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Union

import torch

from ..errors import CaptureError  # noqa: F401  (defined there, re-exported here)

Number = Union[int, float]


_BINARY: dict[str, Callable[[Any, Any], Any]] = {
    "+": operator.add,
    "-": operator.sub,
    "*": operator.mul,
    "/": operator.truediv,
    "**": operator.pow,
    "//": operator.floordiv,
    "%": operator.mod,
}


def round_f32(x: Any) -> float:
    """``x`` rounded to the nearest float32, as a Python float.

    A 0-d float32 counter updated on the device (``mu_product *= mu``) holds
    ``fl32(a * fl32(b))``; doing the operation in double and rounding once is
    the same number, since double has more than twice float32's precision.
    """
    return float(struct.unpack("f", struct.pack("f", float(x)))[0])


_UNARY: dict[str, Callable[[Any], Any]] = {"neg": operator.neg, "pos": operator.pos, "abs": abs, "f32": round_f32}
# ``math`` functions a step applies to hyperparameters and counters (bias
# corrections): followed during capture (HostScalarMode patches them there)
# and evaluated by the very same functions on the host.
MATH_UNARY = ("sqrt", "exp", "log", "log2", "log10", "log1p", "expm1", "sin", "cos", "tanh", "fabs")
MATH_BINARY = ("pow",)
_UNARY.update({f"math.{name}": getattr(math, name) for name in MATH_UNARY})
_BINARY.update({f"math.{name}": getattr(math, name) for name in MATH_BINARY})
# Python's max/min of two numbers (HostScalarMode follows them while tracing): evaluated by
# the builtins themselves, captured here before any trace patches them.
_BINARY.update({"max": builtins.max, "min": builtins.min})
_COMPARE: dict[str, Callable[[Any, Any], bool]] = {
    "==": operator.eq,
    "!=": operator.ne,
    "<": operator.lt,
    "<=": operator.le,
    ">": operator.gt,
    ">=": operator.ge,
}


@dataclass(frozen=True)
class Expr:
    """A node of a host scalar expression; leaves are inputs or constants."""

    op: str  # "input", "const", a key of _BINARY or _UNARY
    args: tuple[Expr, ...] = ()
    name: str = ""  # for "input": e.g. "g0.lr", "g0.p1.state.step"
    # for "const": an int stays an int, so ``step + 1`` evaluates with Python's
    # own int semantics (exact, and an int again), as it does in eager
    value: Number = 0.0

    def inputs(self) -> set[str]:
        if self.op == "input":
            return {self.name}
        out: set[str] = set()
        for a in self.args:
            out |= a.inputs()
        return out

    def renamed(self, names: dict[str, str]) -> Expr:
        """This expression with its inputs renamed (those not in ``names`` kept)."""
        if self.op == "input":
            return Expr("input", name=names.get(self.name, self.name))
        if not self.args:
            return self
        return Expr(self.op, tuple(a.renamed(names) for a in self.args), self.name, self.value)

    def evaluate(self, env: dict[str, Any]) -> Any:
        if self.op == "input":
            return env[self.name]
        if self.op == "const":
            return self.value
        if self.op in _UNARY:
            return _UNARY[self.op](self.args[0].evaluate(env))
        return _BINARY[self.op](self.args[0].evaluate(env), self.args[1].evaluate(env))

    def render(self, names: dict[str, str] | None = None) -> str:
        """Python source for this expression; ``names`` maps inputs to identifiers."""
        if self.op == "input":
            return names[self.name] if names else self.name
        if self.op == "const":
            return repr(self.value)
        if self.op == "neg":
            return f"(-{self.args[0].render(names)})"
        if self.op == "pos":
            return f"(+{self.args[0].render(names)})"
        if self.op == "abs":
            return f"abs({self.args[0].render(names)})"
        if self.op in ("f32", "max", "min") or self.op.startswith("math."):
            return f"{self.op}({', '.join(a.render(names) for a in self.args)})"
        left, right = (a.render(names) for a in self.args)
        return f"({left} {self.op} {right})"

    def pretty(self) -> str:
        """Human rendering without the outermost parentheses."""
        text = self.render()
        if text.startswith("(") and text.endswith(")") and _balanced(text[1:-1]):
            return text[1:-1]
        return text


def _balanced(text: str) -> bool:
    depth = 0
    for ch in text:
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth < 0:
            return False
    return depth == 0


def const(value: Number) -> Expr:
    """A constant; ints stay ints (Python's ``1 - x`` and ``1.0 - x`` agree bit for bit anyway)."""
    if isinstance(value, bool):
        return Expr("const", value=int(value))
    if isinstance(value, int):
        return Expr("const", value=int(value))
    return Expr("const", value=float(value))


def input_expr(name: str) -> Expr:
    return Expr("input", name=name)


@dataclass(frozen=True)
class Guard:
    """A branch decision taken during capture: ``lhs <op> rhs`` was ``outcome``."""

    lhs: Expr
    op: str
    rhs: Expr
    outcome: bool

    def holds(self, env: dict[str, Any]) -> bool:
        return _COMPARE[self.op](self.lhs.evaluate(env), self.rhs.evaluate(env)) == self.outcome

    def describe(self) -> str:
        return f"({self.lhs.pretty()} {self.op} {self.rhs.pretty()}) is {self.outcome}"


@dataclass
class ScalarTracker:
    """Collects every HyperParam made during one trace and the guards taken."""

    real: dict[str, Any]  # input name -> real value (int, float or a numpy scalar, as the user set it)
    by_payload: dict[float, list[Expr]] = field(default_factory=dict)
    guards: list[Guard] = field(default_factory=list)
    salt: int = 0  # which of the capture's two traces (payloads made here must differ between them)
    made: int = 0  # payloads made by extremum() so far

    def make(self, payload: float, expr: Expr) -> HyperParam:
        payload = self._unique(float(payload), expr)
        hp = HyperParam(payload, expr, self)
        self.by_payload.setdefault(payload, []).append(expr)
        return hp

    def _unique(self, payload: float, expr: Expr) -> float:
        """A payload no other expression of this trace has: the graph's constant names one expression.

        Nudges can cancel: ``lr / max(1.0, read0) * min(1.0, ...)`` and the same with ``read2`` came out
        the same double when both extrema picked their constant 1.0, so param 2's ``1 - plr * wd`` was
        lifted as param 0's (found by tests/fuzz_steps.py). Counters and constants (whole numbers,
        expressions of no input) keep their value: it is what they are."""
        taken = self.by_payload.get(payload)
        if not taken or all(e == expr for e in taken) or not expr.inputs() or payload.is_integer():
            return payload
        for k in range(1, 1 << 16):
            bumped = payload * (1.0 + k * 2.0**-45) if payload else k * 2.0**-1000
            if not any(e != expr for e in self.by_payload.get(bumped, ())):
                return bumped
        raise CaptureError("too many host scalars share one value to tell apart")

    def real_value(self, expr: Expr) -> Any:
        return expr.evaluate(self.real)


def _as_expr(x: Any) -> Expr | None:
    if isinstance(x, HyperParam):
        return x.expr
    if isinstance(x, (int, float)):
        return const(x)
    if isinstance(x, numbers.Real):  # numpy scalars: their Python value
        return const(x.item() if hasattr(x, "item") else float(x))
    return None


class HyperParam(float):
    """A float that remembers how it was computed from hyperparameters.

    Its float value is a sentinel: it flows into the traced aten graph, where
    the capture recognises it. Comparisons and ``bool`` use the real value.
    """

    expr: Expr
    tracker: ScalarTracker

    def __new__(cls, payload: float, expr: Expr, tracker: ScalarTracker) -> HyperParam:
        obj = super().__new__(cls, payload)
        obj.expr = expr
        obj.tracker = tracker
        return obj

    # -- arithmetic: build a new HyperParam, payload computed like Python would
    def _binary(self, other: Any, op: str, reflected: bool) -> Any:
        other_expr = _as_expr(other)
        if other_expr is None:
            return NotImplemented  # let a Tensor's reflected operator take over
        fn = _BINARY[op]
        a, b = (float(other), float(self)) if reflected else (float(self), float(other))
        ea, eb = (other_expr, self.expr) if reflected else (self.expr, other_expr)
        if ea.op == "const" and eb.op == "const":
            # Python folds nothing either: the same op on the same doubles.
            return self.tracker.make(fn(a, b), const(fn(ea.value, eb.value)))
        return self.tracker.make(fn(a, b), Expr(op, (ea, eb)))

    def __add__(self, o: Any) -> Any:
        return self._binary(o, "+", False)

    def __radd__(self, o: Any) -> Any:
        return self._binary(o, "+", True)

    def __sub__(self, o: Any) -> Any:
        return self._binary(o, "-", False)

    def __rsub__(self, o: Any) -> Any:
        return self._binary(o, "-", True)

    def __mul__(self, o: Any) -> Any:
        return self._binary(o, "*", False)

    def __rmul__(self, o: Any) -> Any:
        return self._binary(o, "*", True)

    def __truediv__(self, o: Any) -> Any:
        return self._binary(o, "/", False)

    def __rtruediv__(self, o: Any) -> Any:
        return self._binary(o, "/", True)

    def __pow__(self, o: Any, mod: Any = None) -> Any:
        return self._binary(o, "**", False)

    def __rpow__(self, o: Any, mod: Any = None) -> Any:
        return self._binary(o, "**", True)

    def __floordiv__(self, o: Any) -> Any:
        return self._binary(o, "//", False)

    def __rfloordiv__(self, o: Any) -> Any:
        return self._binary(o, "//", True)

    def __mod__(self, o: Any) -> Any:
        return self._binary(o, "%", False)

    def __rmod__(self, o: Any) -> Any:
        return self._binary(o, "%", True)

    def __neg__(self) -> HyperParam:
        return self.tracker.make(-float(self), Expr("neg", (self.expr,)))

    def __pos__(self) -> HyperParam:
        return self

    def apply(self, op: str, *others: Any) -> HyperParam:
        """``math.<op>(self, *others)``: the payload computed like Python would, the expression recorded."""
        exprs = [self.expr] + [_as_expr(o) or const(float(o)) for o in others]
        fn = _UNARY[op] if not others else _BINARY[op]
        return self.tracker.make(fn(float(self), *(float(o) for o in others)), Expr(op, tuple(exprs)))

    def as_float32(self) -> HyperParam:
        """This value as a float32 tensor holds it. The payload is not rounded:
        it must keep its per-trace nudge so the capture can still recognise it."""
        if self.expr.op == "const" and round_f32(self.expr.value) == self.expr.value:
            return self  # 1, 0.5: already float32 values
        if self.expr.op == "f32":
            return self
        return self.tracker.make(float(self), Expr("f32", (self.expr,)))

    def __abs__(self) -> HyperParam:
        return self.tracker.make(abs(float(self)), Expr("abs", (self.expr,)))

    # -- decisions: taken on the real value, remembered as guards
    def _compare(self, other: Any, op: str) -> Any:
        other_expr = _as_expr(other)
        if other_expr is None:
            return NotImplemented
        real_self = self.tracker.real_value(self.expr)
        real_other = self.tracker.real_value(other_expr)
        outcome = _COMPARE[op](real_self, real_other)
        self.tracker.guards.append(Guard(self.expr, op, other_expr, outcome))
        return outcome

    def __eq__(self, o: object) -> Any:
        return self._compare(o, "==")

    def __ne__(self, o: object) -> Any:
        return self._compare(o, "!=")

    def __lt__(self, o: Any) -> Any:
        return self._compare(o, "<")

    def __le__(self, o: Any) -> Any:
        return self._compare(o, "<=")

    def __gt__(self, o: Any) -> Any:
        return self._compare(o, ">")

    def __ge__(self, o: Any) -> Any:
        return self._compare(o, ">=")

    def __bool__(self) -> bool:
        return bool(self._compare(0.0, "!="))

    def __hash__(self) -> int:
        return float.__hash__(self)

    # -- conversions to an int would return a plain number computed from the
    # sentinel payload: a value baked in at capture time. Refuse instead.
    def _baked(self, what: str) -> CaptureError:
        where = user_line()
        if any(name.startswith("read") for name in self.expr.inputs()):
            return CaptureError(
                f"the step calls {what} on {self.expr.pretty()}, a tensor's value read on the host{where}: "
                "used as an int (a loop count, an index) its outcomes are not bounded, so hocompile cannot "
                "compile one program per outcome; fallback='eager' runs such a step eagerly"
            )
        return CaptureError(
            f"the step calls {what} on the host scalar {self.expr.pretty()}{where}; its result would be baked "
            "into the compiled step as a constant. Keep it a float (or mark the key structural)"
        )

    def __int__(self) -> int:
        raise self._baked("int()")

    def __trunc__(self) -> int:
        raise self._baked("math.trunc()")

    def __floor__(self) -> int:
        raise self._baked("math.floor()")

    def __ceil__(self) -> int:
        raise self._baked("math.ceil()")

    def __round__(self, ndigits: Any = None) -> Any:
        raise self._baked("round()")

    def __repr__(self) -> str:
        return f"HyperParam({self.expr.pretty()})"


def extremum(op: str, a: Any, b: Any) -> Any:
    """``max(a, b)`` / ``min(a, b)`` with a HyperParam among them: an expression, not a branch
    (a value read on the host, ``max(eps, norm)``, then needs no guard per outcome)."""
    hp = a if isinstance(a, HyperParam) else b
    ea, eb = _as_expr(a), _as_expr(b)
    if not isinstance(hp, HyperParam) or ea is None or eb is None:
        return _BINARY[op](a, b)
    # Its own payload, nudged per trace: equal to an operand's, lift_scalars could not tell
    # max(a, b) from a; equal in both traces (max(1, x) picking the constant 1), it would not be
    # lifted at all, and the compiled step would keep 1 when x grows past it.
    tracker = hp.tracker
    tracker.made += 1
    nudge = (1 + tracker.made % 1024 + 1024 * tracker.salt) * 2.0**-36
    chosen = float(_BINARY[op](float(a), float(b)))
    payload = chosen * (1.0 + nudge) if chosen else nudge * 2.0**-40
    return tracker.make(payload, Expr(op, (ea, eb)))


def sentinel(real: float, index: int, salt: int) -> float:
    """A payload for input ``index`` that no natural constant will equal.

    It is the real value nudged by a few parts in 2**32: close enough that
    signs and orderings the step's arithmetic depends on survive (``1 - beta2
    ** step`` stays positive for beta2 = 0.999), different per input and per
    trace (``salt``), so two traces tell hyperparameter-dependent constants
    from fixed ones. A zero becomes a tiny positive number for the same reason.
    """
    nudge = (1 + index + 64 * salt) * 2.0**-32
    if real == 0.0:
        return nudge * 2.0**-8
    return real * (1.0 + nudge)


@dataclass(frozen=True)
class ScalarProgram:
    """Evaluates the graph's scalar inputs from the live hyperparameter values."""

    input_names: tuple[str, ...]
    exprs: tuple[Expr, ...]
    source: str
    fn: Callable[..., tuple[float, ...]]

    def __call__(self, env: dict[str, Any]) -> tuple[float, ...]:
        # Inputs keep their own types (a numpy lr computes in numpy, as in
        # eager); aten gets Python numbers, which is what eager's numpy
        # scalars are converted to at the op boundary as well.
        values = self.fn(*(env[n] for n in self.input_names))
        return tuple(v if type(v) in (int, float, bool) else float(v) for v in values)


def build_scalar_program(exprs: Sequence[Expr]) -> ScalarProgram:
    """Generate one Python function computing every expression in eager order."""
    names = sorted(set().union(*(e.inputs() for e in exprs))) if exprs else []
    idents = {n: f"h{i}" for i, n in enumerate(names)}
    body = ", ".join(e.render(idents) for e in exprs)
    source = f"def scalar_program({', '.join(idents.values())}):\n    return ({body}{',' if exprs else ''})\n"
    namespace: dict[str, Any] = {"f32": round_f32, "math": math}
    exec(compile(source, "<hocompile scalar program>", "exec"), namespace)
    return ScalarProgram(tuple(names), tuple(exprs), source, namespace["scalar_program"])


# hocompile's own source tree (this file is in hocompile/capture/): frames and files under it are
# hocompile's, never the user's. Every "is this our code?" test uses it, so a module moving between
# the package's folders cannot shrink "ours" to its own folder.
HOCOMPILE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def user_line(frames: list[traceback.FrameSummary] | None = None) -> str:
    """`` at file:line (`code`)`` of the innermost frame outside torch and hocompile: where in the
    user's step a refusal comes from (``frames``: an exception's traceback; default: the current stack)."""
    internal = (os.path.dirname(torch.__file__), HOCOMPILE_DIR)
    for frame in reversed(traceback.extract_stack() if frames is None else frames):
        if not frame.filename.startswith(internal) and "<" not in frame.filename[:1]:
            code = f" (`{frame.line.strip()}`)" if frame.line else ""
            return f" at {frame.filename}:{frame.lineno}{code}"
    return ""
