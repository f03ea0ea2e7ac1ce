"""Step graphs as plain data: what the warm start (runtime/warm.py) keeps on disk.

An FX graph does not pickle with what hocompile needs from it: op overloads
are not picklable, and pickling a GraphModule keeps its code but drops every
node's ``meta`` (roles, decisions, fake values) that the lowering and
explain() read. :func:`encode` turns a graph into nested tuples of
primitives (ops by their schema name, callables by module and name, fake
values by shape, strides, dtype and device) and :func:`decode` builds the
same graph again, its values fake tensors on their own device, so lowering
it gives the module lowering the original gave.
"""

from __future__ import annotations

import importlib
import operator
from typing import Any

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

from ..capture.inplace_foreach import EAGER_INPLACE
from .graph import ORIGIN, ROLE

# The node meta keys a decoded graph keeps (everything else is the tracer's own).
_KEPT = (ROLE, ORIGIN, "hocompile.decision", "hocompile.eager_dtype", EAGER_INPLACE)


class CodecError(ValueError):
    """A graph holds something this codec cannot write down (then nothing is kept on disk)."""


def _target(target: Any) -> Any:
    if isinstance(target, str):
        return ("str", target)
    if isinstance(target, torch._ops.OpOverload):
        return ("op", target._schema.name, target._overloadname)
    if target is operator.getitem:
        return ("getitem",)
    module, name = getattr(target, "__module__", None), getattr(target, "__qualname__", None)
    if module and name and "<" not in name:
        return ("py", module, name)
    raise CodecError(f"cannot encode the call target {target!r}")


def _resolve(spec: Any) -> Any:
    kind = spec[0]
    if kind == "str":
        return spec[1]
    if kind == "op":
        namespace, name = spec[1].split("::", 1)
        packet = getattr(getattr(torch.ops, namespace), name)
        return getattr(packet, spec[2])
    if kind == "getitem":
        return operator.getitem
    obj: Any = importlib.import_module(spec[1])
    for part in spec[2].split("."):
        obj = getattr(obj, part)
    return obj


def _arg(a: Any) -> Any:
    if isinstance(a, fx.Node):
        return ("node", a.name)
    if isinstance(a, (list, tuple)):
        return ("list" if isinstance(a, list) else "tuple", tuple(_arg(x) for x in a))
    if isinstance(a, dict):
        return ("dict", tuple((k, _arg(v)) for k, v in a.items()))
    if isinstance(a, torch.dtype):
        return ("dtype", str(a).removeprefix("torch."))
    if isinstance(a, torch.device):
        return ("device", str(a))
    if isinstance(a, (torch.memory_format, torch.layout)):
        return ("torch", str(a).removeprefix("torch."))
    if a is None or isinstance(a, (bool, int, float, str)):
        return ("value", a)
    raise CodecError(f"cannot encode the argument {a!r}")


def _unarg(spec: Any, nodes: dict[str, fx.Node]) -> Any:
    kind, value = spec
    if kind == "node":
        return nodes[value]
    if kind in ("list", "tuple"):
        items = [_unarg(x, nodes) for x in value]
        return items if kind == "list" else tuple(items)
    if kind == "dict":
        return {k: _unarg(v, nodes) for k, v in value}
    if kind in ("dtype", "torch"):
        return getattr(torch, value)
    if kind == "device":
        return torch.device(value)
    return value


def _val(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return ("tensor", tuple(v.shape), tuple(v.stride()), str(v.dtype).removeprefix("torch."), str(v.device))
    if isinstance(v, (list, tuple)):
        return ("seq", tuple(_val(x) for x in v))
    if v is None or isinstance(v, (bool, int, float)):
        return ("value", v)
    raise CodecError(f"cannot encode the value {type(v).__name__}")


def _unval(spec: Any, mode: FakeTensorMode) -> Any:
    if spec[0] == "tensor":
        _, shape, stride, dtype, device = spec
        with mode:
            return torch.empty_strided(shape, stride, dtype=getattr(torch, dtype), device=torch.device(device))
    if spec[0] == "seq":
        return [_unval(x, mode) for x in spec[1]]
    return spec[1]


def encode(gm: fx.GraphModule) -> dict[str, Any]:
    """``gm``'s nodes, kept meta and tensor constants as picklable data."""
    nodes = []
    for n in gm.graph.nodes:
        meta = {k: n.meta[k] for k in _KEPT if k in n.meta}
        if "val" in n.meta:
            meta["val"] = _val(n.meta["val"])
        nodes.append((n.op, n.name, _target(n.target), _arg(n.args), _arg(n.kwargs), meta))
    attrs = {str(n.target): getattr(gm, str(n.target)) for n in gm.graph.nodes if n.op == "get_attr"}
    return {"nodes": nodes, "attrs": attrs}


def decode(data: dict[str, Any]) -> fx.GraphModule:
    graph = fx.Graph()
    by_name: dict[str, fx.Node] = {}
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    for op, name, target, args, kwargs, meta in data["nodes"]:
        resolved = _resolve(target)
        if op == "output":
            node = graph.output(_unarg(args, by_name)[0])
        else:
            node = graph.create_node(op, resolved, _unarg(args, by_name), _unarg(kwargs, by_name), name=name)
        node.meta.update({k: v for k, v in meta.items() if k != "val"})
        if "val" in meta:
            node.meta["val"] = _unval(meta["val"], mode)
        by_name[name] = node
    return fx.GraphModule(dict(data["attrs"]), graph)
