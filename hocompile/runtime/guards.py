"""What a compiled step assumed, checked before every step.

The signature covers everything that changes the traced program: which
params exist and have grads, their shapes, dtypes, devices and layouts, the
optimizer state's tensors, and the structural (non-hyperparameter) options of
every group. Hyperparameter *values* are not in it: they are runtime inputs.
Branches taken on hyperparameter values are separate guards (see scalars.py).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any

import torch

from ..capture.container_trace import container_attributes
from ..capture.containers import flatten, holds_tensors
from ..capture.group_hypers import is_hyperparameter
from ..capture.host_state import HostSlot
from ..capture.stand_ins import frozen_attributes

TensorSig = tuple[tuple[int, ...], torch.dtype, torch.device, torch.layout]


@dataclass(frozen=True)
class ParamSig:
    ident: int
    param: TensorSig
    grad: TensorSig | None
    state: tuple[tuple[str, Any], ...]  # (key, TensorSig or frozen Python value)
    # What the step may read of the param besides its data (stand_ins.py): requires_grad and its
    # Python attributes (Megatron's is_qkv, partition_dim, ...), each a branch of the traced program.
    requires_grad: bool = True
    attributes: tuple[tuple[str, Any], ...] = ()


@dataclass(frozen=True)
class GroupSig:
    options: tuple[tuple[str, Any], ...]  # structural values; ("hyper", n) for hyperparameters
    params: tuple[ParamSig, ...]


@dataclass(frozen=True)
class Signature:
    attributes: tuple[tuple[str, Any], ...]  # the optimizer's public attributes (emerging's `nesterov`...)
    groups: tuple[GroupSig, ...]


# Attributes that are data, not options: they change without changing the program.
_NOT_OPTIONS = frozenset({"state", "param_groups", "defaults"})


def _tensor_sig(t: torch.Tensor) -> TensorSig:
    # torch.Size is a tuple and torch.device hashes: no conversion (this runs for every
    # tensor of every step; converting cost 25 % of a 21-param AdamW step's overhead).
    return (t.shape, t.dtype, t.device, t.layout)


def _freeze(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return ("tensor",) + _tensor_sig(value)
    if holds_tensors(value) or isinstance(value, collections.deque):
        # its structure and each leaf's signature (containers.py): a rebuilt deque
        # or object is the same program, a grown one is not
        leaves, spec, _ = flatten(value)
        return ("container", spec.signature(), tuple(_tensor_sig(t) for t in leaves))
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    if isinstance(value, dict):  # keys frozen too, ordered by repr: tensors as keys cannot be compared
        return ("dict", tuple(sorted(((_freeze(k), _freeze(v)) for k, v in value.items()), key=repr)))
    if isinstance(value, (set, frozenset)):  # in a fixed order: a signature's repr is the same in every process
        return ("set", tuple(sorted((_freeze(v) for v in value), key=repr)))
    try:
        hash(value)
    except TypeError:
        return ("unhashable", type(value).__name__, id(value))
    return value


# Stands for the value of a Python number the step itself updates: a host input
# of the compiled step (host_state.py), not part of what selects the program.
_HOST = ("host",)


def signature(
    opt: torch.optim.Optimizer,
    structural: frozenset[str],
    lifted: frozenset[HostSlot] = frozenset(),
    coarse: bool = False,
) -> Signature:
    """``coarse``: every Python number counts as a host input (masked). A step that could
    not be captured is remembered under that, so a counter the step bumps does not make
    hocompile retry (and fail) the capture on every step."""
    groups: list[GroupSig] = []
    for g, group in enumerate(opt.param_groups):
        params: list[ParamSig] = []
        for i, p in enumerate(group["params"]):
            grad = p.grad
            state = opt.state.get(p, {})
            frozen = ((k, state_value(k, g, i, v, lifted, coarse)) for k, v in state.items())
            grad_sig = None if grad is None else _tensor_sig(grad)
            params.append(
                ParamSig(id(p), _tensor_sig(p), grad_sig, tuple(sorted(frozen)), p.requires_grad, frozen_attributes(p))
            )
        groups.append(GroupSig(group_options(g, group, structural, lifted, coarse), tuple(params)))
    return Signature(attributes(opt, lifted, coarse), tuple(groups))


def _masked(slot: HostSlot, value: Any, lifted: frozenset[HostSlot], coarse: bool) -> Any:
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    return _HOST if slot in lifted or (coarse and number) else _freeze(value)


def state_value(key: str, g: int, i: int, value: Any, lifted: frozenset[HostSlot], coarse: bool = False) -> Any:
    """One state entry as the signature holds it."""
    if isinstance(value, torch.Tensor):  # the common case, without building a HostSlot
        return ("tensor",) + _tensor_sig(value)
    return _masked(HostSlot("state", key, g, i), value, lifted, coarse)


def attributes(opt: torch.optim.Optimizer, lifted: frozenset[HostSlot], coarse: bool = False) -> tuple[Any, ...]:
    """The optimizer's public attributes as the signature holds them, and the containers of
    tensors it keeps in private ones (a cache of buffers: its structure is the program's)."""
    container_keys = container_attributes(opt)
    return tuple(
        sorted(
            (k, _masked(HostSlot("attr", k), v, lifted, coarse))
            for k, v in vars(opt).items()
            if (not k.startswith("_") and k not in _NOT_OPTIONS) or k in container_keys
        )
    )


def group_options(
    g: int, group: dict[str, Any], structural: frozenset[str], lifted: frozenset[HostSlot], coarse: bool = False
) -> tuple[tuple[str, Any], ...]:
    """One param group's options (all but its params) as the signature holds them."""
    options: list[tuple[str, Any]] = []
    for key, value in group.items():
        if key == "params":
            continue
        if _masked(HostSlot("group", key, g), value, lifted, coarse) is _HOST:
            options.append((key, _HOST))
        elif is_hyperparameter(key, value, structural):
            options.append((key, ("hyper", len(value) if isinstance(value, (tuple, list)) else 0)))
        else:
            options.append((key, _freeze(value)))
    return tuple(sorted(options, key=lambda kv: kv[0]))


def describe_change(old: Signature, new: Signature) -> str:
    """The first difference between two signatures, in the user's terms."""
    if old.attributes != new.attributes:
        da, db = dict(old.attributes), dict(new.attributes)
        for key in sorted(set(da) | set(db)):
            if da.get(key) != db.get(key):
                return f"optimizer attribute {key!r} changed {_show(da.get(key))} -> {_show(db.get(key))}"
    if len(old.groups) != len(new.groups):
        return f"number of param groups changed {len(old.groups)} -> {len(new.groups)}"
    for g, (a, b) in enumerate(zip(old.groups, new.groups)):
        if a.options != b.options:
            da, db = dict(a.options), dict(b.options)
            for key in sorted(set(da) | set(db), key=str):
                if da.get(key) != db.get(key):
                    return f"param_groups[{g}][{key!r}] changed {_show(da.get(key))} -> {_show(db.get(key))}"
        if len(a.params) != len(b.params):
            return f"param_groups[{g}] has {len(b.params)} params, was {len(a.params)}"
        for i, (pa, pb) in enumerate(zip(a.params, b.params)):
            where = f"param_groups[{g}]['params'][{i}]"
            if pa.ident != pb.ident:
                return f"{where} is a different tensor"
            if pa.param != pb.param:
                return f"{where} changed {_show_t(pa.param)} -> {_show_t(pb.param)}"
            if (pa.grad is None) != (pb.grad is None):
                return f"{where}.grad " + ("became None" if pb.grad is None else "is no longer None")
            if pa.grad != pb.grad:
                return f"{where}.grad changed {_show_t(pa.grad)} -> {_show_t(pb.grad)}"
            if pa.requires_grad != pb.requires_grad:
                return f"{where}.requires_grad changed {pa.requires_grad} -> {pb.requires_grad}"
            if pa.attributes != pb.attributes:
                da, db = dict(pa.attributes), dict(pb.attributes)
                key = next(k for k in sorted(set(da) | set(db)) if da.get(k) != db.get(k))
                return f"{where}.{key} changed {_show_attribute(da.get(key))} -> {_show_attribute(db.get(key))}"
            if pa.state != pb.state:
                ka, kb = {k for k, _ in pa.state}, {k for k, _ in pb.state}
                if ka != kb:
                    return f"state of {where} keys changed {sorted(ka)} -> {sorted(kb)}"
                for (key, va), (_, vb) in zip(pa.state, pb.state):
                    if va != vb and isinstance(va, tuple) and va[:1] == ("container",):
                        return f"state of {where}: {key!r} changed {_show_container(va)} -> {_show_container(vb)}"
                return f"state of {where} changed shape, dtype or value"
    return "guards differ"


def _show(value: Any) -> str:
    if isinstance(value, tuple) and value[:1] == ("container",):
        return _show_container(value)
    if isinstance(value, tuple) and value[:1] == ("tensor",) and len(value) == 5:
        return f"a tensor {_show_t(value[1:])}"
    if isinstance(value, tuple) and value[:1] == ("hyper",):
        return "a float hyperparameter"
    if isinstance(value, tuple) and value == _HOST:
        return "a number the step updates"
    return repr(value)


def _show_attribute(frozen: Any) -> str:
    """A param attribute as stand_ins.frozen_attributes holds it, written as the user wrote it."""
    if frozen is None:
        return "(not set)"
    if not isinstance(frozen, tuple) or len(frozen) < 2:
        return repr(frozen)
    kind, rest = frozen[0], frozen[1:]
    if kind in ("list", "tuple"):
        items = ", ".join(_show_attribute(v) for v in rest[0])
        return f"[{items}]" if kind == "list" else f"({items}{',' if len(rest[0]) == 1 else ''})"
    if kind == "dict":
        return "{" + ", ".join(f"{k}: {_show_attribute(v)}" for k, v in rest[0]) + "}"
    if kind == "tensor":
        return f"a tensor {tuple(rest[0])}"
    if kind == "unhashable":
        return f"a {rest[0]} object"
    return repr(rest[0])


def _show_container(frozen: Any) -> str:
    kind, count = frozen[1][0], len(frozen[2])
    return f"a {kind} holding {count} tensor{'s' if count != 1 else ''}"


def _show_t(sig: TensorSig | None) -> str:
    if sig is None:
        return "None"
    shape, dtype, device, layout = sig
    extra = "" if layout == torch.strided else f" {layout}"
    return f"{tuple(shape)} {str(dtype).replace('torch.', '')} on {device}{extra}"
