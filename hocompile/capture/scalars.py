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
import operator
import os
import struct
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Union

import torch

Number = Union[int, float]


BINARY: dict[str, Callable[[Any, Any], Any]] = {
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


UNARY: dict[str, Callable[[Any], Any]] = {"neg": operator.neg, "pos": operator.pos, "abs": abs, "f32": round_f32}
# ``math`` functions a step applies to hyperparameters and counters (bias
# corrections): followed during capture (HostScalarMode patches them there)
# and evaluated by the very same functions on the host.
MATH_UNARY = ("sqrt", "exp", "log", "log2", "log10", "log1p", "expm1", "sin", "cos", "tanh", "fabs")
MATH_BINARY = ("pow",)
UNARY.update({f"math.{name}": getattr(math, name) for name in MATH_UNARY})
BINARY.update({f"math.{name}": getattr(math, name) for name in MATH_BINARY})
# Python's max/min of two numbers (HostScalarMode follows them while tracing): evaluated by
# the builtins themselves, captured here before any trace patches them.
BINARY.update({"max": builtins.max, "min": builtins.min})
COMPARE: dict[str, Callable[[Any, Any], bool]] = {
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

    op: str  # "input", "const", a key of BINARY or UNARY
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
        if self.op in UNARY:
            return UNARY[self.op](self.args[0].evaluate(env))
        return BINARY[self.op](self.args[0].evaluate(env), self.args[1].evaluate(env))

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
        return COMPARE[self.op](self.lhs.evaluate(env), self.rhs.evaluate(env)) == self.outcome

    def describe(self) -> str:
        return f"({self.lhs.pretty()} {self.op} {self.rhs.pretty()}) is {self.outcome}"


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
# Both end in a separator: a sibling whose name merely starts the same (``torchao/``, a user's
# ``hocompile_train.py`` beside the package) is not theirs.
HOCOMPILE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "")
TORCH_DIR = os.path.join(os.path.dirname(torch.__file__), "")


def user_line(frames: list[traceback.FrameSummary] | None = None) -> str:
    """`` at file:line (`code`)`` of the innermost frame outside torch and hocompile: where in the
    user's step a refusal comes from (``frames``: an exception's traceback; default: the current stack)."""
    internal = (TORCH_DIR, HOCOMPILE_DIR)
    for frame in reversed(traceback.extract_stack() if frames is None else frames):
        if not frame.filename.startswith(internal) and "<" not in frame.filename[:1]:
            code = f" (`{frame.line.strip()}`)" if frame.line else ""
            return f" at {frame.filename}:{frame.lineno}{code}"
    return ""
