"""The traced stand-ins are the params: what a step can read of a param, the stand-in answers as the real one.

A step decides on what it reads of its params: ``if not p.requires_grad: continue``,
Megatron's ``p.is_qkv`` (split QKV before Newton–Schulz), ``p.partition_dim``, ``p.expert_tp``.
A fake tensor made for tracing answers ``requires_grad=False`` and has no Python attributes, so
such a step traced with it compiled to nothing, or to the branch a plain tensor takes, silently.

So while tracing:

- ``requires_grad`` and ``is_leaf`` read on a stand-in return the real param's
  (HostScalarMode asks :func:`real_flag`);
- its class: ``isinstance(p, nn.Parameter)`` and ``type(p) is nn.Parameter`` hold as for the
  real param (a fake tensor is a plain Tensor: both branches went the other way);
- every Python attribute of the real param (its ``__dict__``) is set on the stand-in; a
  tensor-valued one (Megatron's ``main_grad``) is an input of the step like the param's state
  (capture_slots.py, slot kind "pattr"): the stand-in holds its traced tensor, written in place as
  the step writes it; one that shares memory with another of the step's tensors without being it
  is refused (a functional graph would update the two independently). A container holding tensors
  is not modelled: it is an :class:`Unmodelled` that refuses any use, naming the attribute and the line;
- an attribute the step sets, rebinds or changes on a param is refused too: the compiled step
  keeps no state on params (keep it in ``state``).

Both flags and the attributes are part of the step's signature (guards.py, fast_guard.py)
and of the parameter class (classes/classify.py): another value recompiles, and two params
that differ in them never share a stamped program.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable, Hashable
from typing import Any

import torch

from ..errors import CaptureError
from .containers import holds_tensors
from .scalars import HOCOMPILE_DIR, TORCH_DIR, user_line

FLAGS = ("requires_grad", "is_leaf")
_CLASSES = (torch.nn.Parameter,)  # classes a stand-in may take on (plain Tensor subclasses, no wrappers)
_GETTERS = {getattr(torch._C.TensorBase, name): name for name in FLAGS}


def real_flag(func: Any, args: tuple[Any, ...], stand_ins: dict[int, torch.Tensor]) -> tuple[bool, Any]:
    """(True, the real param's value) when ``func`` reads ``requires_grad``/``is_leaf`` of a stand-in."""
    name = _GETTERS.get(getattr(func, "__self__", None))
    if name is None or not args or id(args[0]) not in stand_ins:
        return False, None
    return True, getattr(stand_ins[id(args[0])], name)


def real_id(stand_ins: dict[int, torch.Tensor], builtin_id: Callable[[Any], int]) -> Callable[[Any], int]:
    """``id`` while tracing: a stand-in's is the real param's where the user's code asks
    (``id(p) in self.no_decay_ids``), its own where torch or hocompile ask (their bookkeeping)."""
    internal = (TORCH_DIR, HOCOMPILE_DIR)

    def traced_id(obj: Any) -> int:
        ident = builtin_id(obj)
        real = stand_ins.get(ident)
        if real is None or sys._getframe(1).f_code.co_filename.startswith(internal):
            return ident
        return builtin_id(real)

    return traced_id


def refuse_identity_maps(opt: Any, params: set[int]) -> None:
    """A set holding params, or a dict keyed by them, among the optimizer's attributes: the traced step
    looks its stand-ins up there and misses (``if p in self.no_decay``). Refused, naming the place."""
    seen: set[int] = set()
    frontier: list[tuple[str, Any, int]] = [
        (f"opt.{k}", v, 0) for k, v in vars(opt).items() if k not in ("state", "param_groups", "defaults")
    ]
    while frontier:
        path, value, depth = frontier.pop()
        if id(value) in seen or depth > 4 or isinstance(value, torch.Tensor):
            continue
        seen.add(id(value))
        if isinstance(value, (set, frozenset)):
            members: list[Any] = list(value)
            what = "as set members"
        elif isinstance(value, dict):
            members = list(value.keys())
            what = "as dict keys"
            frontier += [(f"{path}[{k!r}]", v, depth + 1) for k, v in value.items() if not isinstance(k, torch.Tensor)]
        elif isinstance(value, (list, tuple)):
            frontier += [(f"{path}[{i}]", v, depth + 1) for i, v in enumerate(value)]
            continue
        else:
            continue
        if any(isinstance(m, torch.Tensor) and id(m) in params for m in members):
            raise CaptureError(
                f"{path} holds the optimizer's params {what}; the traced step runs on stand-ins, so a lookup "
                "there (`p in ...`, `...[p]`) would miss them and the compiled step would take another branch. "
                "Key it by `id(p)` (followed), keep the choice in a param group, in state, or as a param "
                "attribute, or run this optimizer eagerly (fallback='eager')"
            )


def frozen_attributes(p: torch.Tensor) -> tuple[tuple[str, Hashable], ...]:
    """A param's Python attributes as a signature holds them ('' for none: the common case costs one lookup)."""
    attrs = p.__dict__
    if not attrs:
        return ()
    return tuple(sorted((key, _freeze(value)) for key, value in attrs.items()))


def _freeze(value: Any) -> Hashable:
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), tuple(value.stride()), value.dtype, value.device)
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_freeze(v) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple(sorted((repr(k), _freeze(v)) for k, v in value.items())))
    try:
        hash(value)
    except TypeError:
        return ("unhashable", type(value).__name__, id(value))
    return (type(value).__name__, value)


class Unmodelled:
    """Stands for a param attribute hocompile does not trace (a container of tensors): any use refuses,
    naming it."""

    def __init__(self, what: str) -> None:
        object.__setattr__(self, "_what", what)

    def _refuse(self, *_: Any, **__: Any) -> Any:
        raise CaptureError(
            f"the step uses {object.__getattribute__(self, '_what')}, a param attribute holding tensors"
            f"{user_line()}; hocompile traces params, grads, state, group entries and tensors hung on a param "
            "themselves, not containers of them, so a compiled step would read stale values. Keep them in the "
            "optimizer's state, or run this optimizer eagerly"
        )

    __getattr__ = __bool__ = __len__ = __iter__ = __float__ = __int__ = __index__ = _refuse  # type: ignore[assignment]
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __truediv__ = __rtruediv__ = _refuse
    __matmul__ = __rmatmul__ = __neg__ = __getitem__ = __setitem__ = __call__ = _refuse

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        for arg in [*args, *(kwargs or {}).values()]:
            if isinstance(arg, Unmodelled):
                arg._refuse()
        return NotImplemented


def tensor_attributes(p: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """The tensors hung on a param as Python attributes (``main_grad``), by name: inputs of the step."""
    attrs = p.__dict__
    if not attrs:
        return []
    return sorted((k, v) for k, v in attrs.items() if isinstance(v, torch.Tensor) and not _internal(k))


def refuse_attribute_overlaps(tensors: list[tuple[str, torch.Tensor, bool]]) -> None:
    """Refuse a param's tensor attribute that shares memory with another of the step's tensors
    without being it (``p.flat = p.view(-1)``): the traced graph is functional, so a write through one
    would not be seen through the other. ``tensors``: (where, tensor, is a tensor attribute). Disjoint
    views of one buffer (Megatron's ``main_grad``s, slices of one grad buffer) are independent."""
    spans: dict[int, list[tuple[int, int, str, bool]]] = {}
    for where, t, attribute in tensors:
        if t.device.type == "meta" or not t.numel():
            continue
        try:
            ptr = int(t.untyped_storage().data_ptr())
        except (RuntimeError, NotImplementedError):
            continue
        first = int(t.storage_offset())
        last = first + sum((int(n) - 1) * int(st) for n, st in zip(t.shape, t.stride()))
        begin, end = first * t.element_size(), (last + 1) * t.element_size()
        held = spans.setdefault(ptr, [])
        for b, e, other, other_attribute in held:
            if (attribute or other_attribute) and b < end and begin < e:
                raise CaptureError(
                    f"{where} shares memory with {other} without being the same tensor: the compiled step "
                    "is functional, so a write through one would not reach the other. Make the attribute "
                    "that very tensor, or keep it apart, or run this optimizer eagerly (fallback='eager')"
                )
        held.append((begin, end, where, attribute))


def install(
    stand_in: torch.Tensor, real: torch.Tensor, where: str, traced: Callable[[torch.Tensor], torch.Tensor | None]
) -> dict[str, tuple[Any, Hashable]]:
    """Give ``stand_in`` the real param's Python attributes; what was installed (each value and its frozen
    form, to see in-place changes), to check after the trace. ``traced``: a tensor attribute's traced
    tensor (the input it is, or None where it is none: refused on use)."""
    installed: dict[str, tuple[Any, Hashable]] = {}
    if isinstance(real, torch.nn.Parameter):
        # isinstance(p, nn.Parameter) holds for a tensor flagged _is_param (Parameter's metaclass):
        # the step's `if isinstance(p, nn.Parameter)` takes the real param's branch.
        stand_in._is_param = True  # type: ignore[attr-defined]
        installed["_is_param"] = (True, _freeze(True))
    if type(stand_in) is torch.Tensor and type(real) in _CLASSES:
        try:  # `type(p) is nn.Parameter`: the stand-in's class becomes the param's where Python allows
            stand_in.__class__ = type(real)
        except TypeError:
            pass
    for key, value in real.__dict__.items():
        if isinstance(value, torch.Tensor):
            value = traced(value) if not _internal(key) else None
            if value is None:
                value = Unmodelled(f"{where}.{key}")
        elif holds_tensors(value):  # a deep copy would hand the trace real tensors: baked in as constants
            value = Unmodelled(f"{where}.{key}")
        else:
            try:
                value = copy.deepcopy(value)  # a step that mutates it in place must not touch the real one
            except Exception:  # noqa: BLE001 - a process group, a lock: the object itself
                pass
        setattr(stand_in, key, value)
        installed[key] = (value, _freeze(value))
    return installed


def check_unchanged(stand_in: torch.Tensor, installed: dict[str, tuple[Any, Hashable]], where: str) -> None:
    """Refuse a step that set, replaced or changed a Python attribute of a param while tracing."""
    now = stand_in.__dict__
    for key in sorted(set(now) | set(installed), key=str):
        if key not in installed:
            if not _internal(key):
                raise _changes(where, key, "sets")
            continue
        if key not in now:
            raise _changes(where, key, "deletes")
        (before, frozen), after = installed[key], now[key]
        if after is not before and not _equal(before, after):
            raise _changes(where, key, "changes")
        if not isinstance(after, Unmodelled) and _freeze(after) != frozen:
            raise _changes(where, key, "changes")


def _internal(key: str) -> bool:
    # attributes torch's own tracing puts on tensors (proxies, fake modes), not the step's
    return key.startswith(("_proxy", "proxy", "_fake", "fake_", "_dynamo"))


def _equal(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - a value that cannot compare is taken as changed
        return False


def _changes(where: str, key: str, verb: str) -> CaptureError:
    return CaptureError(
        f"the step {verb} the Python attribute {where}.{key!r}{user_line()}; a compiled step keeps no state "
        "on params, so it would not carry that from one step to the next. Keep it in the optimizer's state"
    )
