"""The op a torch.compile'd helper's call becomes, and its kernels (compiled_helpers.py finds the calls).

``hocompile_torch::compiled_call(tensors, scalars, key)`` calls the user's compiled wrapper as eager
does: its arguments rebuilt from the op's tensors, its host scalars (an int in eager an int again) and
the constants the trace recorded under ``key``; under eager's dispatch-key sets, grad mode and no
torch-function mode (Dynamo guards on all three: otherwise another cache entry, traced otherwise).
Through the dispatcher the kernel clones its arguments (an op neither writes nor returns its inputs);
the lowered step calls it directly instead, on copies of what it writes or in place
(lowering/helper_calls.py). The key is a digest of what the call is, the same in every process.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.utils import _pytree as pytree

from .hyper_params import HyperParam


def eager_int(x: HyperParam) -> bool:
    """Whether eager has an int here (a step counter): the expression's value from the real inputs,
    with Python's own arithmetic, is one."""
    real = x.tracker.real_value(x.expr)
    return isinstance(real, int) and not isinstance(real, bool)


OP_NAME = "hocompile_torch::compiled_call"


@dataclass
class CompiledCall:
    wrapper: Any  # the user's torch.compile'd function (Dynamo's wrapper)
    fn: Any  # the plain Python it wraps
    spec: Any  # of (args, kwargs), tensors taken out
    constants: list[Any]  # the non-tensor leaves, TENSOR_SLOT where a tensor goes (SCALAR_SLOT: a host scalar)
    mutated: list[int] = field(default_factory=list)  # tensor arguments the function writes
    out_spec: Any = None
    outputs: int = 0  # tensors it returns
    out_nones: list[bool] = field(default_factory=list)  # per returned leaf: None (an in-place helper's)
    grad_enabled: bool = False  # the grad mode of the call in the step
    int_scalars: list[bool] = field(default_factory=list)  # per host scalar argument: an int in eager
    build: Any = None  # (tensors, scalars) -> (args, kwargs): _builder's, made on first use


# The dispatch-key sets of a thread outside any op (import time): what eager's calls run under.
_TOP_LEVEL_KEYS = (torch._C._dispatch_tls_local_include_set(), torch._C._dispatch_tls_local_exclude_set())
CALLS: dict[int, CompiledCall] = {}
SCALAR_SLOT = object()  # in CompiledCall.constants: a host scalar argument goes here (the op's ``scalars``)
TENSOR_SLOT = object()  # ... and a tensor argument here (None is pytree's leaf too: an argument left None)


def _arguments(
    call: CompiledCall, tensors: list[Tensor], scalars: list[float]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    it = iter(tensors)
    # An int in eager (a step counter) is an int again: the op's float list carries it exactly (< 2**53).
    sc = iter(int(v) if is_int else v for v, is_int in zip(scalars, call.int_scalars))
    leaves = [next(it) if c is TENSOR_SLOT else next(sc) if c is SCALAR_SLOT else c for c in call.constants]
    args, kwargs = pytree.tree_unflatten(leaves, call.spec)
    return args, kwargs


def _builder(call: CompiledCall) -> Any:
    """``(tensors, scalars) -> (args, kwargs)`` for ``call``, as Python made once per call record: pytree's
    unflatten costs ~5 us a call, a fifth of a small helper's (Lion's update of 64x64: ~25 us)."""
    if call.build is None:
        consts: list[Any] = []
        leaves, counts = iter(call.constants), [0, 0]

        def expr(spec: Any) -> str | None:
            if spec.is_leaf():
                c = next(leaves)
                if c is TENSOR_SLOT or c is SCALAR_SLOT:
                    kind = int(c is SCALAR_SLOT)
                    i, counts[kind] = counts[kind], counts[kind] + 1
                    return f"t[{i}]" if not kind else f"int(s[{i}])" if call.int_scalars[i] else f"s[{i}]"
                consts.append(c)
                return f"c[{len(consts) - 1}]"
            kids = [expr(spec.child(k)) for k in range(spec.num_children)]
            if any(k is None for k in kids):
                return None
            if spec.type is tuple:
                return "(" + "".join(f"{k}, " for k in kids) + ")"
            if spec.type is list:
                return "[" + ", ".join(map(str, kids)) + "]"
            if spec.type is dict:
                keys = [len(consts) + i for i in range(len(spec.context))]
                consts.extend(spec.context)
                return "{" + ", ".join(f"c[{i}]: {k}" for i, k in zip(keys, kids)) + "}"
            return "None" if spec.type is type(None) else None  # another container: pytree's unflatten

        code = expr(call.spec)
        if code is None:
            call.build = lambda t, s: _arguments(call, t, s)
        else:
            make = eval(f"lambda c: lambda t, s: {code}")  # noqa: S307 - our own text, from the spec's structure
            call.build = make(consts)
    return call.build


def _run(
    call: CompiledCall, fn: Any, tensors: list[Tensor], scalars: list[float], as_eager: bool = False, clone: str = "all"
) -> list[Tensor]:
    """Call ``fn`` as the step calls the helper. ``clone``: which tensor arguments it gets copies of:
    "all" (the op's kernel: an op neither writes nor returns its inputs), "written" (those it writes: a
    direct call), "none" (it writes the step's own tensors, as in eager: lowering/helper_calls.py)."""
    written = set(call.mutated)
    clones = [
        t.clone() if clone == "all" or (clone == "written" and i in written) else t for i, t in enumerate(tensors)
    ]
    args, kwargs = _builder(call)(clones, scalars)
    # As eager calls it: Dynamo guards on the grad mode and on each tensor's dispatch keys as seen
    # through the thread's include/exclude sets, which an op's kernel runs with autograd excluded
    # from. A cache entry of its own per call site reached Dynamo's recompile limit first, after
    # which the helper ran as plain Python (aten's bits, not eager's).
    keys = torch._C._ForceDispatchKeyGuard(*_TOP_LEVEL_KEYS) if as_eager else contextlib.nullcontext()
    modes = _no_function_modes() if as_eager and torch._C._len_torch_function_stack() else contextlib.nullcontext()
    with keys, modes, torch.set_grad_enabled(call.grad_enabled):
        out = fn(*args, **kwargs)
    if isinstance(out, Tensor) and _one_tensor(call):
        leaves = [out]  # as the trace saw it: one tensor (pytree's flatten costs a few us)
    else:
        every, out_spec = pytree.tree_flatten(out)
        if not all(isinstance(x, Tensor) or x is None for x in every):
            raise TypeError(f"{getattr(call.fn, '__qualname__', call.fn)} returns something other than tensors")
        leaves = [x for x in every if x is not None]
        call.out_spec, call.outputs = out_spec, len(leaves)
        call.out_nones = [x is None for x in every]
    taken: set[int] = {id(c) for c in clones}
    results = []
    for x in leaves:  # its outputs alias none of its inputs, nor each other (the graph sees fresh values)
        results.append(x.clone() if id(x) in taken else x)
        taken.add(id(x))
    return results + [clones[i] for i in call.mutated]


@contextlib.contextmanager
def _no_function_modes() -> Iterator[None]:
    """Without the torch-function modes on the stack (the self-check's recorder, judgement_modes.py),
    as an op's kernel runs: Dynamo guards on that stack, and a call under a mode recompiled the
    helper (another cache entry, traced under the mode) instead of running eager's kernels."""
    popped = [torch._C._pop_torch_function_stack() for _ in range(torch._C._len_torch_function_stack())]
    try:
        yield
    finally:
        for mode in reversed(popped):
            torch._C._push_on_torch_function_stack(mode)


def call_key(record: CompiledCall) -> int:
    """The op's key: a digest of what the call is (the helper, where it is defined, the arguments'
    structure and constants, what it writes, the grad mode), so the same step gives the same graph,
    printed graph and cache key in every process. A different wrapper of the same description (the
    function compiled twice) takes the next free key."""
    fn = inspect.unwrap(record.fn)
    code = getattr(fn, "__code__", None)
    where = f"{os.path.basename(code.co_filename)}:{code.co_firstlineno}" if code else ""
    shown = {id(TENSOR_SLOT): "<tensor>", id(SCALAR_SLOT): "<scalar>"}
    constants = [shown.get(id(c)) or repr(c) for c in record.constants]
    text = repr((getattr(fn, "__qualname__", repr(fn)), where, str(record.spec), constants, record.mutated,
                 record.int_scalars, record.grad_enabled))
    key = int(hashlib.sha256(text.encode()).hexdigest()[:12], 16)
    while key in CALLS and CALLS[key].wrapper is not record.wrapper:
        key += 1
    CALLS.setdefault(key, record)
    return key


def describe_key(key: int) -> str:
    """``name#digest`` of an op key: how graphs print it."""
    call = CALLS.get(key)
    name = getattr(call.fn, "__qualname__", "?") if call is not None else "?"
    return f"{name}#{key:012x}"


@torch.library.custom_op(OP_NAME, mutates_args=())
def compiled_call(tensors: list[Tensor], scalars: list[float], key: int) -> list[Tensor]:
    call = CALLS[key]
    return _run(call, call.wrapper, tensors, scalars, as_eager=True)


def _one_tensor(call: CompiledCall) -> bool:
    """Whether the helper returned one tensor, not in a container (None is pytree's leaf too)."""
    return call.out_spec is not None and call.out_spec.is_leaf() and call.out_nones == [False]


def call_directly(tensors: list[Tensor], scalars: list[float], key: int) -> list[Tensor]:
    """The op's kernel without the dispatcher (~60 us a call), copying only what the helper writes."""
    call = CALLS[key]
    return _run(call, call.wrapper, tensors, scalars, as_eager=True, clone="written")


def call_in_place(tensors: list[Tensor], scalars: list[float], key: int) -> list[Tensor]:
    """The helper writes the step's own tensors, as eager's call does (lowering/helper_calls.py says when).
    :func:`_run`'s work in short where the call returns one tensor (most updates), a few us a call less."""
    call = CALLS[key]
    if call.build is None or not _one_tensor(call):
        return _run(call, call.wrapper, tensors, scalars, as_eager=True, clone="none")
    args, kwargs = call.build(tensors, scalars)
    modes = _no_function_modes() if torch._C._len_torch_function_stack() else contextlib.nullcontext()
    with torch._C._ForceDispatchKeyGuard(*_TOP_LEVEL_KEYS), modes, torch.set_grad_enabled(call.grad_enabled):
        out = call.wrapper(*args, **kwargs)
    if not isinstance(out, Tensor):
        raise TypeError(f"{getattr(call.fn, '__qualname__', call.fn)} returned {type(out).__name__}, not a tensor")
    if any(out is t for t in tensors):
        out = out.clone()  # the graph takes it for a fresh value
    return [out, *(tensors[i] for i in call.mutated)]


def written_arguments(key: int) -> tuple[list[int], int]:
    """(the tensor arguments a call writes, by position; how many tensors it returns before them)."""
    call = CALLS[key]
    return list(call.mutated), call.outputs


@compiled_call.register_fake
def _compiled_call_fake(tensors: list[Tensor], scalars: list[float], key: int) -> list[Tensor]:
    call = CALLS[key]
    return _run(call, call.fn, tensors, scalars)
