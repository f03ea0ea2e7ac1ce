"""The op-family registry: all hocompile knows about each ``hocompile::`` op, in one entry.

Passes rewrite recognised subgraphs into ``hocompile::`` ops; everything
downstream (the printer, ``explain()``, batching, the cost model, the
lowerings, the verify reference) asks this registry about an op instead of
knowing it by name. Adding a family is adding files: define the op with
``torch.library``, describe its arguments as an :class:`OpSpec` dataclass,
and :func:`register` an :class:`OpFamily`; a backend adds its lowering with
:func:`register_lowering` when it is imported (so this module, a leaf of the
layering, never imports a lowering).

Every argument of an op is read and written through its spec, by name:

    spec = family_of(node).spec.from_node(node)
    spec.replace(algorithm="gram").apply(node)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

import torch
import torch.fx as fx

# A tensor argument of an op: a graph node in passes, a tensor when an interpreter runs it.
Input = fx.Node | torch.Tensor
# A float argument that may be a host scalar: a constant, a placeholder node, or its runtime value.
Scalar = float | fx.Node | torch.Tensor

# Each field annotation an OpSpec may use, and the torch.library schema type it stands for.
SCHEMA_TYPES = {
    "Input": "Tensor",
    "Scalar": "float",
    "float": "float",
    "int": "int",
    "bool": "bool",
    "str": "str",
    "torch.dtype": "ScalarType",
    "tuple[float, ...]": "List[float]",
    "tuple[int, ...]": "List[int]",
}

S = TypeVar("S", bound="OpSpec")


@dataclass(frozen=True)
class OpSpec:
    """Base of one op's named, typed arguments (subclasses are frozen dataclasses).

    Field order is the op's argument order; a field with a default is an
    optional trailing argument. Sequence fields are stored as tuples and
    written back as lists, as graphs and schemas have them. Subclasses set
    ``qualname`` (``"hocompile::newton_schulz"``).
    """

    qualname: ClassVar[str] = ""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, list):
                object.__setattr__(self, f.name, tuple(value))

    # -- the op ---------------------------------------------------------------
    @classmethod
    def op(cls) -> Any:
        """The ``OpOverload`` graphs call (``torch.ops.<ns>.<name>.default``)."""
        namespace, name = cls.qualname.split("::")
        return getattr(getattr(torch.ops, namespace), name).default

    @classmethod
    def short_name(cls) -> str:
        return cls.qualname.split("::")[1]

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def tensor_fields(cls) -> tuple[str, ...]:
        """Names of the tensor arguments (annotated ``Input``)."""
        hints = _annotations(cls)
        return tuple(name for name in cls.field_names() if hints[name] == "Input")

    # -- reading --------------------------------------------------------------
    @classmethod
    def from_node(cls: type[S], node: fx.Node) -> S:
        """The spec of a call node of this op (positional args, kwargs, or trailing defaults)."""
        if node.op != "call_function" or node.target is not cls.op():
            raise ValueError(f"{node.name} is not a {cls.qualname} call (target {node.target})")
        return cls.from_args(node.args, node.kwargs)

    @classmethod
    def from_args(cls: type[S], args: Sequence[Any], kwargs: Mapping[str, Any] | None = None) -> S:
        """The spec of ``op(*args, **kwargs)``; trailing optional arguments take their defaults."""
        kwargs = dict(kwargs or {})
        names = cls.field_names()
        op = cls.short_name()
        if len(args) > len(names):
            raise ValueError(f"{op} takes at most {len(names)} arguments, got {len(args)}")
        unknown = sorted(set(kwargs) - set(names))
        if unknown:
            raise ValueError(f"unknown {op} argument(s) {unknown}; the op takes {list(names)}")
        twice = sorted(set(kwargs) & set(names[: len(args)]))
        if twice:
            raise ValueError(f"{op} argument(s) {twice} given both by position and by name")
        values = dict(zip(names, args)) | kwargs
        required = [f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING]
        missing = [name for name in required if name not in values]
        if missing:
            raise ValueError(f"{op} call is missing required argument(s) {missing}")
        return cls(**values)

    def node_of(self, name: str) -> fx.Node:
        """Tensor argument ``name`` as a graph node (passes and lowerings work on graphs)."""
        value = getattr(self, name)
        if not isinstance(value, fx.Node):
            raise TypeError(f"{self.short_name()} argument {name!r} is a {type(value).__name__}, not a graph node")
        return value

    def tensors(self) -> dict[str, Any]:
        """The tensor arguments by name (nodes in a graph, tensors at run time)."""
        return {name: getattr(self, name) for name in self.tensor_fields()}

    # -- writing --------------------------------------------------------------
    def to_args(self) -> tuple[Any, ...]:
        """Positional args for the op; trailing arguments at their default are left out."""
        fields = dataclasses.fields(self)
        args = [list(v) if isinstance(v, tuple) else v for v in (getattr(self, f.name) for f in fields)]
        for f in reversed(fields):
            if f.default is dataclasses.MISSING or args[-1] != f.default:
                break
            args.pop()
        return tuple(args)

    def apply(self, node: fx.Node) -> None:
        """Write this spec into ``node`` (a call of this op) as positional args."""
        if node.target is not self.op():
            raise ValueError(f"{node.name} is not a {self.qualname} call (target {node.target})")
        node.args = self.to_args()
        node.kwargs = {}

    def replace(self: S, **changes: Any) -> S:
        """A copy with ``changes`` (field names) applied."""
        unknown = sorted(set(changes) - set(self.field_names()))
        if unknown:
            raise TypeError(f"{type(self).__name__} has no field(s) {unknown}; fields: {list(self.field_names())}")
        return dataclasses.replace(self, **changes)


def _annotations(cls: type) -> dict[str, str]:
    return {f.name: str(f.type) for f in dataclasses.fields(cls)}


def schema_mismatches(spec: type[OpSpec]) -> list[str]:
    """Differences between an op's registered ``torch.library`` schema and its spec (empty: none)."""
    arguments = spec.op()._schema.arguments
    fields = dataclasses.fields(spec)
    if [a.name for a in arguments] != [f.name for f in fields]:
        return [f"names: schema {[a.name for a in arguments]} vs spec {[f.name for f in fields]}"]
    problems: list[str] = []
    for arg, f in zip(arguments, fields):
        expected = SCHEMA_TYPES.get(str(f.type))
        if expected != str(arg.real_type):  # real_type: ScalarType, where type says int
            problems.append(f"{f.name}: schema type {arg.real_type} vs spec annotation {f.type}")
        has_default = f.default is not dataclasses.MISSING
        if has_default != arg.has_default_value() or (has_default and f.default != arg.default_value):
            schema_default = arg.default_value if arg.has_default_value() else "none"
            spec_default = f.default if has_default else "none"
            problems.append(f"{f.name}: schema default {schema_default!r} vs spec default {spec_default!r}")
    return problems


def check_schema(spec: type[OpSpec]) -> None:
    """Fail fast if an op's schema and its spec have drifted apart."""
    problems = schema_mismatches(spec)
    if problems:
        raise RuntimeError(f"{spec.qualname} schema and {spec.__name__} differ: " + "; ".join(problems))


# ----------------------------------------------------------------- the entry


@dataclass(frozen=True)
class Cost:
    """Work of one call: FLOPs by compute format, and bytes read plus written."""

    flops: float
    bytes: float
    matmul_flops: float = 0.0  # the part of ``flops`` in GEMMs (the cost model's rate applies to these)


@dataclass(frozen=True)
class BatchRule:
    """How calls of one op with the same key become one call on stacked inputs.

    ``key(spec)``: calls with equal keys batch together; None: this call does
    not batch (e.g. its input is already batched). ``transposed(spec)``: the
    call's (single) tensor input joins the batch transposed, its output is
    transposed back (``polar(Gᵀ) = polar(G)ᵀ``). ``batched(spec, stacked)``:
    the spec of the one call on the stacked inputs (``stacked`` maps each
    tensor field to its stack node). The op's output must be one tensor whose
    leading dimension is the batch.
    """

    key: Callable[[Any], Hashable | None]
    batched: Callable[[Any, dict[str, fx.Node]], Any]
    transposed: Callable[[Any], bool] = lambda spec: False
    stack_bytes: Callable[[Any], int] | None = None  # bytes one member adds to the stack (input + output)
    # For families whose batched call runs one single-threaded library call (LAPACK) per
    # matrix across the cores (ops/per_matrix.py): whether that pays for this call on
    # a multi-core CPU, where stacking GEMM-bound ops does not (small matrices lose to the
    # thread hand-off). None: never on such a target.
    per_matrix_threads: Callable[[Any], bool] | None = None


@dataclass(frozen=True)
class OpFamily:
    """Everything hocompile knows about one ``hocompile::`` op.

    - ``spec``: its named arguments (:class:`OpSpec`); schema checked at :func:`register`;
    - ``title``: what it computes, for ``explain()`` ("Newton–Schulz orthogonalisation");
    - ``reference(spec)``: the exact result in fp64 (spec's tensors are tensors) for tests and verify;
    - ``describe(spec, fmt)``: the printed arguments (``fmt`` renders any value as the printer does);
    - ``cost(spec)``: :class:`Cost` from the inputs' ``meta["val"]`` shapes;
    - ``batch``: its :class:`BatchRule`, or None when calls never batch.

    The CPU implementation is the op's own registered kernel; the fake
    implementation is registered with the op (``register_fake``).
    ``lowerings`` holds backend emitters added by :func:`register_lowering`.
    """

    spec: type[OpSpec]
    title: str
    reference: Callable[[Any], torch.Tensor]
    describe: Callable[[Any, Callable[[Any], str]], list[str]]
    cost: Callable[[Any], Cost]
    batch: BatchRule | None = None
    lowerings: dict[str, Any] = field(default_factory=dict, compare=False)
    # Raises torch.linalg.LinAlgError on some data (an SVD, eigh or Cholesky inside): the
    # lowering writes nothing back before it, so the runtime can run that step eagerly.
    fallible: bool = False

    @property
    def op(self) -> Any:
        return self.spec.op()

    @property
    def name(self) -> str:
        """``"newton_schulz"``; the printer shows ``hocompile.newton_schulz``."""
        return self.spec.short_name()

    def spec_of(self, node: fx.Node) -> Any:
        return self.spec.from_node(node)

    def lowering(self, backend: str) -> Any | None:
        return self.lowerings.get(backend)


_FAMILIES: dict[Any, OpFamily] = {}


def register(family: OpFamily) -> OpFamily:
    """Add (or replace) ``family``; its spec is checked against the op's schema first."""
    check_schema(family.spec)
    previous = _FAMILIES.get(family.op)
    if previous is not None:
        family.lowerings.update({k: v for k, v in previous.lowerings.items() if k not in family.lowerings})
    _FAMILIES[family.op] = family
    return family


def unregister(op: Any) -> None:
    """Remove an op's family (tests that add a toy family clean up with this)."""
    _FAMILIES.pop(op, None)


def register_lowering(op: Any, backend: str, emitter: Any) -> None:
    """Attach ``emitter`` as ``op``'s lowering for ``backend`` ("triton", ...)."""
    family = _FAMILIES.get(op)
    if family is None:
        raise KeyError(f"{op} has no registered op family; register the family before its lowerings")
    family.lowerings[backend] = emitter


def family_of(node_or_target: fx.Node | Any) -> OpFamily | None:
    """The family of a call node (or an op overload); None for anything not registered."""
    if isinstance(node_or_target, fx.Node):
        if node_or_target.op != "call_function":
            return None
        node_or_target = node_or_target.target
    try:
        return _FAMILIES.get(node_or_target)
    except TypeError:  # unhashable targets are never ops
        return None


def families() -> list[OpFamily]:
    """Registered families, in registration order."""
    return list(_FAMILIES.values())


def registered_calls(graph: fx.Graph) -> list[tuple[fx.Node, OpFamily]]:
    """Every call of a registered op in ``graph``, with its family, in graph order."""
    calls = []
    for node in graph.nodes:
        family = family_of(node)
        if family is not None:
            calls.append((node, family))
    return calls


__all__ = [
    "BatchRule",
    "Cost",
    "Input",
    "OpFamily",
    "OpSpec",
    "Scalar",
    "check_schema",
    "families",
    "family_of",
    "register",
    "register_lowering",
    "registered_calls",
    "schema_mismatches",
    "unregister",
]
