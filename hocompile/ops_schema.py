"""Named, typed arguments of ``hocompile::newton_schulz`` (:class:`NewtonSchulzSpec`).

The op takes 14 positional arguments. Passes, the printer, the verify
reference and the lowerings read and rewrite them through this one class, so
no code outside this module indexes ``node.args`` by position:

    spec = NewtonSchulzSpec.from_node(node)
    if spec.transpose: ...
    spec.replace(algorithm="gram", restarts=(2,)).apply(node)

The field names, order, defaults and types are checked against the op's
registered ``torch.library`` schema when this module is imported
(:func:`check_schema`), so the two cannot drift apart.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from . import ops  # noqa: F401  (registers hocompile::newton_schulz)

# The op's input: a graph node in passes, a tensor when an interpreter runs it.
Input = fx.Node | torch.Tensor
# eps: a constant, a host-scalar placeholder node, or its runtime value.
Eps = float | fx.Node | torch.Tensor

# Each field's annotation and the schema type it stands for (checked at import).
_SCHEMA_TYPES = {
    "Input": "Tensor",
    "tuple[float, ...]": "List[float]",
    "Eps": "float",
    "str": "str",
    "bool": "bool",
    "torch.dtype": "ScalarType",
    "tuple[int, ...]": "List[int]",
    "int": "int",
}


def newton_schulz_op() -> Any:
    """The ``hocompile::newton_schulz`` overload that graphs call."""
    return torch.ops.hocompile.newton_schulz.default


@dataclass(frozen=True)
class NewtonSchulzSpec:
    """The arguments of one ``hocompile::newton_schulz`` call, by name (see :mod:`hocompile.ops`).

    Sequences are stored as tuples (the spec is immutable); :meth:`to_args`
    writes them back as lists, as the op's schema and the graphs have them.
    """

    x: Input
    a: tuple[float, ...]
    b: tuple[float, ...]
    c: tuple[float, ...]
    eps: Eps
    eps_mode: str
    transpose: bool
    compute_dtype: torch.dtype
    out_dtype: torch.dtype
    algorithm: str
    restarts: tuple[int, ...]
    matmul: str
    blocks: int = 0
    schedule: str = ""

    def __post_init__(self) -> None:
        for name in ("a", "b", "c", "restarts"):
            object.__setattr__(self, name, tuple(getattr(self, name)))

    # -- reading --------------------------------------------------------------
    @classmethod
    def from_node(cls, node: fx.Node) -> NewtonSchulzSpec:
        """The spec of a ``newton_schulz`` call node (positional args, kwargs, or trailing defaults)."""
        if node.op != "call_function" or node.target is not newton_schulz_op():
            raise ValueError(f"{node.name} is not a hocompile::newton_schulz call (target {node.target})")
        return cls.from_args(node.args, node.kwargs)

    @classmethod
    def from_args(cls, args: Sequence[Any], kwargs: Mapping[str, Any] | None = None) -> NewtonSchulzSpec:
        """The spec of ``newton_schulz(*args, **kwargs)``; trailing optional arguments take their defaults."""
        kwargs = dict(kwargs or {})
        names = field_names()
        if len(args) > len(names):
            raise ValueError(f"newton_schulz takes at most {len(names)} arguments, got {len(args)}")
        unknown = sorted(set(kwargs) - set(names))
        if unknown:
            raise ValueError(f"unknown newton_schulz argument(s) {unknown}; the op takes {list(names)}")
        twice = sorted(set(kwargs) & set(names[: len(args)]))
        if twice:
            raise ValueError(f"newton_schulz argument(s) {twice} given both by position and by name")
        values = dict(zip(names, args)) | kwargs
        missing = [f.name for f in _required_fields() if f.name not in values]
        if missing:
            raise ValueError(f"newton_schulz call is missing required argument(s) {missing}")
        return cls(**values)

    @property
    def x_node(self) -> fx.Node:
        """The input as a graph node (passes and lowerings work on graphs)."""
        if not isinstance(self.x, fx.Node):
            raise TypeError(f"newton_schulz input is a {type(self.x).__name__}, not a graph node")
        return self.x

    @property
    def coefficients(self) -> list[tuple[float, float, float]]:
        """(a, b, c) per iteration."""
        return list(zip(self.a, self.b, self.c))

    # -- writing --------------------------------------------------------------
    def to_args(self) -> tuple[Any, ...]:
        """Positional args for the op; trailing arguments at their default are left out, as
        the passes always wrote them (so graphs, generated code and cache keys do not change)."""
        args: list[Any] = [
            self.x, list(self.a), list(self.b), list(self.c), self.eps, self.eps_mode, self.transpose,
            self.compute_dtype, self.out_dtype, self.algorithm, list(self.restarts), self.matmul,
            self.blocks, self.schedule,
        ]
        for f in reversed(dataclasses.fields(self)):
            if f.default is dataclasses.MISSING or args[-1] != f.default:
                break
            args.pop()
        return tuple(args)

    def apply(self, node: fx.Node) -> None:
        """Write this spec into ``node`` (a ``newton_schulz`` call) as positional args."""
        if node.target is not newton_schulz_op():
            raise ValueError(f"{node.name} is not a hocompile::newton_schulz call (target {node.target})")
        node.args = self.to_args()
        node.kwargs = {}

    def replace(self, **changes: Any) -> NewtonSchulzSpec:
        """A copy with ``changes`` (field names) applied."""
        unknown = sorted(set(changes) - set(field_names()))
        if unknown:
            raise TypeError(f"NewtonSchulzSpec has no field(s) {unknown}; fields: {list(field_names())}")
        return dataclasses.replace(self, **changes)


def field_names() -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(NewtonSchulzSpec))


def _required_fields() -> list[dataclasses.Field[Any]]:
    return [f for f in dataclasses.fields(NewtonSchulzSpec) if f.default is dataclasses.MISSING]


def schema_mismatches() -> list[str]:
    """Differences between the op's registered schema and :class:`NewtonSchulzSpec` (empty: none)."""
    arguments = newton_schulz_op()._schema.arguments
    fields = dataclasses.fields(NewtonSchulzSpec)
    problems: list[str] = []
    if [a.name for a in arguments] != [f.name for f in fields]:
        problems.append(f"names: schema {[a.name for a in arguments]} vs spec {[f.name for f in fields]}")
        return problems
    for arg, f in zip(arguments, fields):
        expected = _SCHEMA_TYPES.get(str(f.type))
        if expected != str(arg.real_type):  # real_type: ScalarType, where type says int
            problems.append(f"{f.name}: schema type {arg.real_type} vs spec annotation {f.type}")
        has_default = f.default is not dataclasses.MISSING
        if has_default != arg.has_default_value() or (has_default and f.default != arg.default_value):
            schema_default = arg.default_value if arg.has_default_value() else "none"
            spec_default = f.default if has_default else "none"
            problems.append(f"{f.name}: schema default {schema_default!r} vs spec default {spec_default!r}")
    return problems


def check_schema() -> None:
    """Fail fast if ``hocompile::newton_schulz``'s schema and the spec have drifted apart."""
    problems = schema_mismatches()
    if problems:
        raise RuntimeError("hocompile::newton_schulz schema and NewtonSchulzSpec differ: " + "; ".join(problems))


check_schema()

__all__ = ["NewtonSchulzSpec", "check_schema", "newton_schulz_op", "schema_mismatches"]
