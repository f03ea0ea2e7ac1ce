"""Tensors an optimizer keeps inside containers: lists, tuples, dicts, deques and plain objects.

SOAP-style ``state["GG"] = [L, R]``, a deque of past grads, a projector object
with its basis in ``self.P``, a dict of scratch buffers cached on the optimizer:
each tensor leaf is a step input of its own (an :class:`~hocompile.ir.graph.InputSlot`
with ``leaf``: its index in :func:`flatten`'s order), and the container's shape
(its :class:`Spec`) is part of the step's signature, so a step compiled for two
leaves never runs on three.

The trace runs the step on a *copy* of each container (:func:`rebuild`), with
fakes for its tensors: the step may mutate the copy freely (append, assign an
item, set an attribute) and the real container is untouched until the compiled
step writes back. After the trace the copy is compared with what went in:
unchanged leaves need nothing, replaced leaves are written in place
(:func:`replace_leaves`), and a container whose structure the step changed (or
created) is rebuilt from its spec with the step's outputs.

What counts as a container: list, tuple (named ones too), dict (any dict
subclass with the usual constructor: OrderedDict, defaultdict), deque, and an
object with a ``__dict__`` (a dataclass, a plain class) that holds a tensor
somewhere inside. Modules, tensors' own subclasses and anything torch owns are
leaves, kept by reference.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any

import torch

_MAX_DEPTH = 8


@dataclass(frozen=True)
class Spec:
    """A container's structure, with its non-tensor leaves (compared by value, or by identity)."""

    kind: str  # "tensor" | "value" | "list" | "tuple" | "dict" | "deque" | "object"
    type: Any = None  # the container's own class (OrderedDict, a namedtuple, the object's class)
    keys: tuple[Any, ...] = ()  # dict keys / attribute names, in order; a deque's (maxlen,)
    children: tuple[Spec, ...] = ()
    value: Any = None  # a "value" leaf: what it holds (see _frozen)
    extra: Any = None  # a defaultdict's default_factory

    def signature(self) -> Any:
        """Hashable and comparable: what the guards hold."""
        if self.kind == "tensor":
            return ("tensor",)
        if self.kind == "value":
            return ("value", _frozen(self.value))
        kind = self.type.__qualname__ if self.type is not None else self.kind
        return (kind, self.keys, tuple(c.signature() for c in self.children))


def _frozen(value: Any) -> Any:
    try:
        hash(value)
    except TypeError:
        return ("id", type(value).__name__, id(value))
    if isinstance(value, (bool, int, float, str, bytes, type(None), torch.dtype, torch.device)):
        return (type(value).__name__, value)
    return ("id", type(value).__name__, id(value))  # an arbitrary object: kept as this very object


def _is_object(value: Any) -> bool:
    if isinstance(value, (torch.Tensor, torch.nn.Module, torch.optim.Optimizer, type)):
        return False
    if not hasattr(value, "__dict__"):
        return False
    if hasattr(value, "param_groups") and hasattr(value, "state"):
        return False  # an optimizer-like object: its state is its own (compile it on its own)
    module = type(value).__module__ or ""
    return not module.startswith(("torch", "builtins", "numpy", "logging", "threading"))


def _kind(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return "tensor"
    if isinstance(value, collections.deque):
        return "deque"
    if isinstance(value, list):
        return "list"
    if isinstance(value, tuple):
        return "tuple"
    if isinstance(value, dict):
        return "dict"
    if _is_object(value):
        return "object"
    return "value"


def holds_tensors(value: Any, depth: int = 0) -> bool:
    """Whether ``value`` is a container with a tensor somewhere inside."""
    kind = _kind(value)
    if kind in ("tensor", "value") or depth > _MAX_DEPTH:
        return False
    return any(isinstance(v, torch.Tensor) or holds_tensors(v, depth + 1) for v in _items(value, kind))


def is_mutable_container(value: Any) -> bool:
    """A list, dict, deque or tensor-holding object: the step can change it in place."""
    kind = _kind(value)
    return kind in ("list", "dict", "deque") or (kind == "object" and holds_tensors(value))


def _items(value: Any, kind: str) -> list[Any]:
    if kind == "dict":
        return list(value.values())
    if kind == "object":
        return list(vars(value).values())
    return list(value)


def flatten(value: Any) -> tuple[list[torch.Tensor], Spec, list[str]]:
    """The tensor leaves of ``value`` in order, its spec, and each leaf's path (``[0]``, ``['L']``, ``.P``)."""
    leaves: list[torch.Tensor] = []
    paths: list[str] = []
    seen: set[int] = set()

    def walk(v: Any, path: str, depth: int) -> Spec:
        kind = _kind(v)
        if kind == "tensor":
            leaves.append(v)
            paths.append(path)
            return Spec("tensor")
        if kind == "value" or (kind == "object" and not holds_tensors(v)):
            return Spec("value", value=v)
        if depth > _MAX_DEPTH or id(v) in seen:
            raise ValueError(f"a container nested deeper than {_MAX_DEPTH} levels, or holding itself, at {path!r}")
        seen.add(id(v))
        try:
            if kind == "dict":
                keys = tuple(v)
                children = tuple(walk(v[k], f"{path}[{k!r}]", depth + 1) for k in keys)
                factory = v.default_factory if isinstance(v, collections.defaultdict) else None
                return Spec("dict", type(v), keys, children, extra=factory)
            if kind == "object":
                keys = tuple(vars(v))
                children = tuple(walk(getattr(v, k), f"{path}.{k}", depth + 1) for k in keys)
                return Spec("object", type(v), keys, children)
            children = tuple(walk(item, f"{path}[{n}]", depth + 1) for n, item in enumerate(v))
            keys = (v.maxlen,) if kind == "deque" else ()
            return Spec(kind, type(v), keys, children)
        finally:
            seen.discard(id(v))

    spec = walk(value, "", 0)
    return leaves, spec, paths


def tensor_leaves(value: Any, depth: int = 0) -> list[torch.Tensor]:
    """``flatten(value)[0]`` without the spec and paths: the read of a container's tensors before
    every step (flatten builds a spec per node: 3x the step's own cost at 1,000 lists of 8x8)."""
    kind = _kind(value)
    if kind == "tensor":
        return [value]
    if kind == "value" or depth > _MAX_DEPTH:  # (a too deep or cyclic one was refused at capture)
        return []
    out: list[torch.Tensor] = []
    for item in _items(value, kind):
        out += tensor_leaves(item, depth + 1)
    return out


def leaf(value: Any, index: int) -> torch.Tensor:
    """Tensor leaf ``index`` of ``value`` (flatten's order)."""
    return tensor_leaves(value)[index]


def unflatten(spec: Spec, tensors: list[torch.Tensor]) -> Any:
    """A new container of ``spec``'s structure holding ``tensors`` (its value leaves as they were)."""
    it = iter(tensors)

    def build(s: Spec) -> Any:
        if s.kind == "tensor":
            return next(it)
        if s.kind == "value":
            return s.value
        items = [build(c) for c in s.children]
        if s.kind == "dict":
            out = collections.defaultdict(s.extra) if s.type is collections.defaultdict else s.type()
            out.update(zip(s.keys, items))
            return out
        if s.kind == "object":
            obj = s.type.__new__(s.type)
            for key, item in zip(s.keys, items):
                object.__setattr__(obj, key, item)  # frozen dataclasses too
            return obj
        if s.kind == "deque":
            return s.type(items, maxlen=s.keys[0]) if s.type is collections.deque else s.type(items)
        if s.kind == "tuple" and hasattr(s.type, "_fields"):
            return s.type(*items)  # a namedtuple
        return s.type(items)

    out = build(spec)
    if next(it, None) is not None:
        raise ValueError("more tensors than the spec has leaves")
    return out


def rebuild(value: Any, tensors: list[torch.Tensor]) -> Any:
    """A copy of ``value``'s containers with ``tensors`` for its tensor leaves (what the trace runs on)."""
    _, spec, _ = flatten(value)
    return unflatten(spec, tensors)


def replace_leaves(value: Any, new: dict[int, torch.Tensor]) -> Any:
    """Set tensor leaves ``new`` (by index) in ``value`` itself; tuples on the way are rebuilt.

    Returns ``value``, or its replacement when ``value`` is itself a tuple."""
    counter = [0]

    def walk(v: Any) -> Any:
        kind = _kind(v)
        if kind == "tensor":
            n = counter[0]
            counter[0] += 1
            return new.get(n, v)
        if kind == "value" or (kind == "object" and not holds_tensors(v)):
            return v
        if kind == "dict":
            for k in list(v):
                item = walk(v[k])
                if item is not v[k]:
                    v[k] = item
            return v
        if kind == "object":
            for k in list(vars(v)):
                item = walk(getattr(v, k))
                if item is not getattr(v, k):
                    object.__setattr__(v, k, item)
            return v
        items = [walk(item) for item in v]
        if kind in ("list", "deque"):
            for n, item in enumerate(items):
                if item is not v[n]:
                    v[n] = item
            return v
        if all(a is b for a, b in zip(items, v)):
            return v
        return type(v)(*items) if hasattr(type(v), "_fields") else type(v)(items)

    return walk(value)


def describe_spec(spec: Spec) -> str:
    """``list of 2 tensors``, ``deque(maxlen=4) of 3 tensors``, ``Projector object``: for messages."""
    count = sum(1 for _ in _tensor_specs(spec))
    name = spec.type.__name__ if spec.type is not None else spec.kind
    if spec.kind == "deque":
        name = f"deque(maxlen={spec.keys[0]})"
    return f"{name} holding {count} tensor{'s' if count != 1 else ''}"


def _tensor_specs(spec: Spec) -> Any:
    if spec.kind == "tensor":
        yield spec
    for child in spec.children:
        yield from _tensor_specs(child)
