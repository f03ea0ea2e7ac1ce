"""A helper the user wrapped in ``torch.compile``, called as they compiled it: an opaque op.

Eager runs such a helper (Scion's NS, dion's foreach updates) as Inductor's kernels, which
round differently from its plain Python (measured ~5e-5 apart after one Scion step). Traced
through, the compiled step is the plain Python's arithmetic: fine where hocompile's passes
replace that arithmetic anyway (Newton–Schulz fused and planned, within its budget), not where
the plan keeps eager's (every pass off: there the promise is bitwise).

So when Newton–Schulz fusion is off, the capture swaps each such helper's function, for the
length of the trace, for :func:`_opaque`: a call becomes one ``hocompile_torch::compiled_call``
op whose kernel calls the user's compiled wrapper itself on clones of its tensor arguments (its
Dynamo cache is eager's, its kernels too), returns its results and the arguments it mutated,
and the trace copies those back. Its fake kernel runs the plain Python on fakes for the shapes
and to see which arguments it mutates. A call with a hyperparameter among its arguments is
traced through as before (the value would be baked into the op), said by the warning that
names compiled helpers (executed_files.compiled_helpers_note).

The op refers to the wrapper by a number valid in this process only: a step holding one is not
kept for a warm start (runtime/warm.py).
"""

from __future__ import annotations

import contextlib
import itertools
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.utils import _pytree as pytree

from .executed_files import dynamo_wrapper_codes
from .scalars import HyperParam

OP_NAME = "hocompile_torch::compiled_call"


@dataclass
class _Call:
    wrapper: Any  # the user's torch.compile'd function (Dynamo's wrapper)
    fn: Any  # the plain Python it wraps
    spec: Any  # of (args, kwargs), tensors taken out
    constants: list[Any]  # the non-tensor leaves, None where a tensor goes
    mutated: list[int] = field(default_factory=list)  # tensor arguments the function writes
    out_spec: Any = None
    outputs: int = 0


_CALLS: dict[int, _Call] = {}
_KEYS = itertools.count(1)
# Qualified names of the helpers a trace ran as plain Python after all (a hyperparameter argument).
TRACED_THROUGH: set[str] = set()


def _arguments(call: _Call, tensors: list[Tensor]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    it = iter(tensors)
    leaves = [next(it) if c is None else c for c in call.constants]
    args, kwargs = pytree.tree_unflatten(leaves, call.spec)
    return args, kwargs


def _run(call: _Call, fn: Any, tensors: list[Tensor]) -> list[Tensor]:
    clones = [t.clone() for t in tensors]
    versions = [c._version for c in clones]
    args, kwargs = _arguments(call, clones)
    out = fn(*args, **kwargs)
    leaves, out_spec = pytree.tree_flatten(out)
    if not all(isinstance(x, Tensor) for x in leaves):
        raise TypeError(f"{getattr(call.fn, '__qualname__', call.fn)} returns something other than tensors")
    call.out_spec, call.outputs = out_spec, len(leaves)
    call.mutated = [i for i, (c, v) in enumerate(zip(clones, versions)) if c._version != v]
    taken: set[int] = {id(c) for c in clones}
    results = []
    for x in leaves:  # an op's outputs alias none of its inputs, nor each other
        results.append(x.clone() if id(x) in taken else x)
        taken.add(id(x))
    return results + [clones[i] for i in call.mutated]


@torch.library.custom_op(OP_NAME, mutates_args=())
def compiled_call(tensors: list[Tensor], key: int) -> list[Tensor]:
    call = _CALLS[key]
    return _run(call, call.wrapper, tensors)


@compiled_call.register_fake
def _compiled_call_fake(tensors: list[Tensor], key: int) -> list[Tensor]:
    call = _CALLS[key]
    return _run(call, call.fn, tensors)


def _opaque(fn: Any, wrapper: Any) -> Any:
    def call(*args: Any, **kwargs: Any) -> Any:
        leaves, spec = pytree.tree_flatten((args, kwargs))
        if any(isinstance(x, HyperParam) for x in leaves):
            TRACED_THROUGH.add(getattr(fn, "__qualname__", repr(fn)))
            return fn(*args, **kwargs)  # a hyperparameter would be baked in: traced through
        tensors = [x for x in leaves if isinstance(x, Tensor)]
        record = _Call(wrapper, fn, spec, [None if isinstance(x, Tensor) else x for x in leaves])
        key = next(_KEYS)
        _CALLS[key] = record
        outs = compiled_call(tensors, key)
        for i, value in zip(record.mutated, outs[record.outputs:]):
            tensors[i].copy_(value)
        return pytree.tree_unflatten(list(outs[: record.outputs]), record.out_spec)

    call.__wrapped__ = fn  # type: ignore[attr-defined]
    call.hocompile_opaque = True  # type: ignore[attr-defined]
    return call


def compiled_wrappers(opt: Any, step: Any) -> list[Any]:
    """torch.compile'd functions the step can reach by name: its module's globals, the class's
    attributes and the optimizer's (a helper passed in, ``self.ns``)."""
    codes = dynamo_wrapper_codes()
    found: dict[int, Any] = {}
    pools = [getattr(step, "__globals__", {}), vars(opt)]
    pools += [vars(c) for c in type(opt).__mro__ if not c.__module__.startswith(("builtins", "torch"))]
    for pool in pools:
        for value in list(pool.values()):
            value = getattr(value, "__func__", value)  # a method
            if isinstance(value, types.FunctionType) and value.__code__ in codes and value.__closure__:
                found[id(value)] = value
    return list(found.values())


@contextlib.contextmanager
def opaque_compiled_helpers(opt: Any, step: Any) -> Iterator[int]:
    """While tracing ``step``: each torch.compile'd helper it reaches calls as an opaque op."""
    swapped: list[tuple[Any, Any]] = []
    try:
        for wrapper in compiled_wrappers(opt, step):
            names = wrapper.__code__.co_freevars
            if "fn" not in names:
                continue
            cell = wrapper.__closure__[names.index("fn")]
            original = cell.cell_contents
            if getattr(original, "hocompile_opaque", False):
                continue  # swapped already (a nested trace)
            cell.cell_contents = _opaque(original, wrapper)
            swapped.append((cell, original))
        yield len(swapped)
    finally:
        for cell, original in swapped:
            cell.cell_contents = original


def holds_compiled_calls(gm: torch.fx.GraphModule) -> bool:
    return any(n.op == "call_function" and n.target is torch.ops.hocompile_torch.compiled_call.default
               for n in gm.graph.nodes)
