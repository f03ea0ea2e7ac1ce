"""Hyperparameters while tracing: a ``float`` that records the host arithmetic done on it.

During capture every schedulable hyperparameter (lr, momentum, betas, weight decay, eps, step
counters) is handed to the optimizer as a :class:`HyperParam` whose payload is a unique sentinel
value (:func:`sentinel`); the arithmetic on it builds an :class:`~.scalars.Expr`, and branches on it
are decided on the real value and recorded as :class:`~.scalars.Guard` s. :class:`ScalarTracker`
collects both for one trace. The expression language itself, and the program that evaluates it
before each step, are in scalars.py.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Any

from ..errors import CaptureError
from .scalars import BINARY, COMPARE, UNARY, Expr, Guard, const, round_f32, user_line


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
        fn = BINARY[op]
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
        fn = UNARY[op] if not others else BINARY[op]
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
        outcome = COMPARE[op](real_self, real_other)
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
        return BINARY[op](a, b)
    # Its own payload, nudged per trace: equal to an operand's, lift_scalars could not tell
    # max(a, b) from a; equal in both traces (max(1, x) picking the constant 1), it would not be
    # lifted at all, and the compiled step would keep 1 when x grows past it.
    tracker = hp.tracker
    tracker.made += 1
    nudge = (1 + tracker.made % 1024 + 1024 * tracker.salt) * 2.0**-36
    chosen = float(BINARY[op](float(a), float(b)))
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
