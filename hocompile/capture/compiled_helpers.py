"""A helper the user wrapped in ``torch.compile``, called as they compiled it: an opaque op.

Eager runs such a helper (Scion's NS, dion's foreach updates) as Inductor's kernels, which
round differently from its plain Python (measured ~5e-5 apart after one Scion step). Traced
through, the compiled step is the plain Python's arithmetic: fine where hocompile's passes
replace that arithmetic anyway (Newton–Schulz fused and planned, within its budget), not where
the plan keeps eager's (every pass off: there the promise is bitwise).

So the capture swaps each such helper's function, for the length of the trace, for
:func:`_opaque`: a call becomes one ``hocompile_torch::compiled_call`` op whose kernel calls the
user's compiled wrapper itself on clones of its tensor arguments (its Dynamo cache is eager's, its
kernels too), returns its results and the arguments it mutated, and the trace copies those back.
Hyperparameters among its arguments (Lion's ``betas``) are the op's float arguments, lifted to host
scalars like any other: the wrapper gets this step's values, as eager's call does. Its fake kernel
runs the plain Python on fakes for the shapes and to see which arguments it mutates.

Host numbers that are ints in eager (a step counter: ``step + 1``) are ints again when the
wrapper is called. A call is traced through instead (and said, by the warning that names
compiled helpers: executed_files.compiled_helpers_note) where Newton–Schulz fusion is on and the
helper makes matrix products (Scion's NS: fused and planned, within the NS budget), or where the
helper cannot run on fake stand-ins of its arguments.

The op names its call by a digest of what the call is (helper, arguments' layout, constants), the
same in every process and for every member of a parameter class, so such steps stamp per class
(classes/stamp.py) and print alike; the wrapper it stands for is this process's, so a step holding
one is not kept for a warm start (runtime/warm.py). Each call is probed once per trace for its
matrix products and in-place writes (the probe records its branches' guards).
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import os
import types
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from .compiled_calls import (
    CALLS,
    SCALAR_SLOT,
    TENSOR_SLOT,
    CompiledCall,
    call_key,
    compiled_call,
    describe_key,
    eager_int,
)
from .executed_files import dynamo_wrapper_codes
from .hyper_params import HyperParam

_MATMULS = frozenset({"mm", "bmm", "addmm", "baddbmm", "addbmm", "matmul", "mv", "addmv", "dot", "linalg_matrix_power"})

# The helpers the trace under way ran as plain Python after all, each with why (qualname -> why).
_TRACED_THROUGH: contextvars.ContextVar[dict[str, str] | None] = contextvars.ContextVar(
    "hocompile_traced_through", default=None
)


class _Products(TorchDispatchMode):
    """Whether the ops run under it include a matrix product."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = False

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.seen = self.seen or func.overloadpacket.__name__ in _MATMULS
        return func(*args, **(kwargs or {}))


def _writes(t: Tensor) -> int:
    """A count that moves with each in-place write. Under the trace's functionalization (a functorch
    layer, still active here) new tensors are functional wrappers: their writes move the mutation
    counter, not the version counter."""
    if torch._is_functional_tensor(t):
        return int(torch._functionalize_mutation_counter(t))  # type: ignore[attr-defined]
    return t._version


@dataclass(frozen=True)
class _Probe:
    products: bool  # it multiplies matrices
    mutated: list[int]  # the tensor arguments it writes in place (by position among the tensors)


def _probe(fn: Any, args: Any, kwargs: Any) -> _Probe | None:
    """Run ``fn`` on stand-ins of its tensor arguments (shape, strides, dtype; fake, outside the trace
    and its modes): does it multiply matrices, and which tensor arguments does it write? (The op's own
    kernels cannot tell: they run below autograd's in-place tracking.) None: it failed on its own here."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import _disable_current_modes

    try:
        with _disable_current_modes(), torch._C.DisableTorchFunction(), FakeTensorMode():
            def stand_in(t: Tensor) -> Tensor:
                shape, stride = tuple(int(x) for x in t.shape), tuple(int(x) for x in t.stride())
                return torch.empty_strided(shape, stride, dtype=t.dtype, device=t.device)

            fakes = pytree.tree_map_only(Tensor, stand_in, (args, kwargs))
            tensors = [x for x in pytree.tree_leaves(fakes) if isinstance(x, Tensor)]
            versions = [_writes(t) for t in tensors]
            with _Products() as products:
                fn(*fakes[0], **fakes[1])
        return _Probe(products.seen, [i for i, (t, v) in enumerate(zip(tensors, versions)) if _writes(t) != v])
    except Exception:  # noqa: BLE001 - not ours to judge: the real trace raises it if it is real
        return None


# Per trace: probes already run, by what decides their answer (a step calls one helper per param).
_PROBES: contextvars.ContextVar[dict[Any, _Probe | None] | None] = contextvars.ContextVar(
    "hocompile_probes", default=None
)


def _cached_probe(fn: Any, args: Any, kwargs: Any, leaves: list[Any], spec: Any) -> _Probe | None:
    """:func:`_probe`, once per trace for each helper, argument layout, constant and host-scalar
    expression: the same expressions take the same branches (the first probe recorded their guards)."""
    cache = _PROBES.get()

    def part(x: Any) -> Any:
        if isinstance(x, Tensor):
            return ("tensor", tuple(x.shape), x.stride(), x.dtype, x.device)
        if isinstance(x, HyperParam):
            return ("scalar", x.expr)
        return ("constant", repr(x))

    try:
        key = (id(fn), str(spec), tuple(part(x) for x in leaves))
        hash(key)
    except TypeError:  # an unhashable shape (symbolic): not cached
        return _probe(fn, args, kwargs)
    if cache is None:
        return _probe(fn, args, kwargs)
    if key not in cache:
        cache[key] = _probe(fn, args, kwargs)
    return cache[key]


def _opaque(fn: Any, wrapper: Any, keep_products: bool) -> Any:
    name = getattr(fn, "__qualname__", repr(fn))

    def call(*args: Any, **kwargs: Any) -> Any:
        leaves, spec = pytree.tree_flatten((args, kwargs))
        why, probe = "", _cached_probe(fn, args, kwargs, leaves, spec)
        if probe is None:
            why = "it could not be run on stand-ins alone"
        elif keep_products and probe.products:
            why = "its matrix products are fused and planned"
        if why:
            traced = _TRACED_THROUGH.get()
            if traced is not None:
                code = getattr(inspect.unwrap(fn), "__code__", None)
                where = f"{os.path.basename(code.co_filename)}:{code.co_firstlineno}: " if code else ""
                traced.setdefault(name, where + why)
            return fn(*args, **kwargs)
        tensors = [x for x in leaves if isinstance(x, Tensor)]
        scalars = [x for x in leaves if isinstance(x, HyperParam)]
        constants = [TENSOR_SLOT if isinstance(x, Tensor) else SCALAR_SLOT if isinstance(x, HyperParam) else x
                     for x in leaves]
        assert probe is not None
        record = CompiledCall(
            wrapper, fn, spec, constants, mutated=probe.mutated, grad_enabled=torch.is_grad_enabled(),
            int_scalars=[eager_int(x) for x in scalars],
        )
        key = call_key(record)
        record = CALLS[key]  # (the same call made before: one record, filled by the fake run below)
        outs = compiled_call(tensors, scalars, key)
        for i, value in zip(record.mutated, outs[record.outputs:]):
            tensors[i].copy_(value)
        returned = iter(outs[: record.outputs])
        return pytree.tree_unflatten([None if none else next(returned) for none in record.out_nones], record.out_spec)

    call.__wrapped__ = fn  # type: ignore[attr-defined]
    call.hocompile_opaque = True  # type: ignore[attr-defined]
    return call


_NOT_USERS = ("builtins", "torch", "numpy", "math", "typing", "collections", "functools", "os", "sys", "hocompile")


def compiled_wrappers(opt: Any, step: Any) -> list[Any]:
    """torch.compile'd functions the step can reach by name: its module's globals (the module of the
    function under its decorators too: ``@torch.no_grad()`` wraps it in torch's), the class's
    attributes and the optimizer's (a helper passed in, ``self.ns``)."""
    codes = dynamo_wrapper_codes()
    found: dict[int, Any] = {}
    pools = [vars(opt)]
    fn, seen = step, 0
    while fn is not None and seen < 8:  # the step's own module, under its decorators (@torch.no_grad())
        pools.append(getattr(fn, "__globals__", {}))
        fn, seen = getattr(fn, "__wrapped__", None), seen + 1
    pools += [vars(c) for c in type(opt).__mro__ if not c.__module__.startswith(("builtins", "torch"))]
    # ... and one module further: ``update_functions.calculate_adam_update(...)`` (SOAP)
    pools += [
        vars(m) for pool in list(pools) for m in list(pool.values())
        if isinstance(m, types.ModuleType) and not m.__name__.startswith(_NOT_USERS)
    ]
    for pool in pools:
        for value in list(pool.values()):
            value = getattr(value, "__func__", value)  # a method
            if isinstance(value, types.FunctionType) and value.__code__ in codes and value.__closure__:
                found[id(value)] = value
    return list(found.values())


@contextlib.contextmanager
def opaque_compiled_helpers(opt: Any, step: Any, keep_products: bool, traced: dict[str, str]) -> Iterator[int]:
    """While tracing ``step``: each torch.compile'd helper it reaches calls as an opaque op, except
    (``keep_products``: Newton–Schulz fusion is on) one that multiplies matrices. ``traced`` collects
    the helpers traced through after all, with why."""
    swapped: list[tuple[Any, Any]] = []
    token, probes = _TRACED_THROUGH.set(traced), _PROBES.set({})
    try:
        for wrapper in compiled_wrappers(opt, step):
            names = wrapper.__code__.co_freevars
            if "fn" not in names:
                continue
            cell = wrapper.__closure__[names.index("fn")]
            original = cell.cell_contents
            if getattr(original, "hocompile_opaque", False):
                continue  # swapped already (a nested trace)
            cell.cell_contents = _opaque(original, wrapper, keep_products)
            swapped.append((cell, original))
        yield len(swapped)
    finally:
        _TRACED_THROUGH.reset(token)
        _PROBES.reset(probes)
        for cell, original in swapped:
            cell.cell_contents = original


def opaque_names(gm: torch.fx.GraphModule) -> set[str]:
    """The helpers the graph calls as opaque ops, by qualified name."""
    op = torch.ops.hocompile_torch.compiled_call.default
    calls = [CALLS.get(n.args[2]) for n in gm.graph.nodes if n.op == "call_function" and n.target is op]
    return {getattr(c.fn, "__qualname__", repr(c.fn)) for c in calls if c is not None}


def name_compiled_calls(gm: torch.fx.GraphModule) -> None:
    """Tag each compiled_call node with its helper's name and key digest, for the printed graph."""
    from ..ir.graph import COMPILED_HELPER

    op = torch.ops.hocompile_torch.compiled_call.default
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is op:
            n.meta[COMPILED_HELPER] = describe_key(n.args[2])


def holds_compiled_calls(gm: torch.fx.GraphModule) -> bool:
    return any(n.op == "call_function" and n.target is torch.ops.hocompile_torch.compiled_call.default
               for n in gm.graph.nodes)
