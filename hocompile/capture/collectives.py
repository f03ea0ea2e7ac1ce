"""torch.distributed calls inside a step, while it is traced.

Several Muon implementations all-gather the orthogonalised updates across
ranks inside ``step()`` (``dist.all_gather``, ``all_gather_into_tensor``),
even when run on one rank, and Megatron's tensor-parallel Newton–Schulz
all-gathers the shards (``muon_tp_mode="duplicated"``) or all-reduces X·Xᵀ
(``"distributed"``) on plain tensors. A fake-tensor trace cannot run a real
collective, and a compiled step must never drop one:

- over a group of one rank (a one-rank world, or Megatron's TP group at TP 1
  in a data-parallel world) a collective is a local copy (or nothing), and
  that is what the trace records;
- across several ranks, ``all_gather``, ``all_gather_into_tensor`` and
  ``all_reduce`` (sum, max, min, product) are recorded as the functional
  collectives torch.compile uses (``_c10d_functional.*`` + ``wait_tensor``),
  their results written where eager's call writes them. The compiled step
  issues them in the step's order; every rank compares its sequence before the
  first step (distributed/check.py). Anything else across ranks, or a step
  whose collectives span several process groups, is refused naming the call.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..errors import CaptureError

# name -> what it does on one rank (the tensors are the caller's)
_ONE_RANK: dict[str, Callable[..., Any]] = {
    "all_gather": lambda outputs, tensor, *a, **k: outputs[0].copy_(tensor),
    "all_gather_into_tensor": lambda output, tensor, *a, **k: output.copy_(tensor.reshape(output.shape)),
    "_all_gather_base": lambda output, tensor, *a, **k: output.copy_(tensor.reshape(output.shape)),
    "reduce_scatter": lambda output, inputs, *a, **k: output.copy_(inputs[0]),
    "reduce_scatter_tensor": lambda output, tensor, *a, **k: output.copy_(tensor.reshape(output.shape)),
    "all_reduce": lambda tensor, *a, **k: None,
    "broadcast": lambda tensor, *a, **k: None,
    "barrier": lambda *a, **k: None,
}


# where each call takes its process group, positionally (torch.distributed's signatures)
_GROUP_AT = {
    "all_gather": 2, "all_gather_into_tensor": 2, "_all_gather_base": 2, "reduce_scatter": 3,
    "reduce_scatter_tensor": 3, "all_reduce": 2, "broadcast": 2, "barrier": 0,
}


def _group(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The process group the call names (None: the default group)."""
    at = _GROUP_AT[name]
    return kwargs.get("group", args[at] if len(args) > at else None)


def _group_size(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """The ranks the call spans: its group's size (the default group's where it names none)."""
    return int(torch.distributed.get_world_size(_group(name, args, kwargs)))


def _group_name(group: Any) -> str:
    """The name functional collectives take for ``group`` (None: the default group)."""
    from torch.distributed._functional_collectives import _resolve_group_name

    return str(_resolve_group_name(group if group is not None else torch.distributed.group.WORLD))  # type: ignore[arg-type]


def _gathered(tensor: torch.Tensor, world: int, group: Any) -> torch.Tensor:
    """``world`` copies of ``tensor``, rank by rank along a new leading dim: the functional gather."""
    funcol = torch.ops._c10d_functional
    flat = funcol.wait_tensor(funcol.all_gather_into_tensor(tensor.contiguous(), world, _group_name(group)))
    return flat.view(world, *tensor.shape)


def _reduce_op(op: Any) -> str:
    ops = torch.distributed.ReduceOp
    for known, text in ((ops.SUM, "sum"), (ops.MAX, "max"), (ops.MIN, "min"), (ops.PRODUCT, "product")):
        if op == known:
            return text
    return ""


def _all_gather(a: dict[str, Any]) -> None:
    outputs, tensor = a["tensor_list"], a["tensor"]
    gathered = _gathered(tensor, len(outputs), a["group"])
    for rank, out in enumerate(outputs):
        out.copy_(gathered[rank])


def _all_gather_into_tensor(a: dict[str, Any]) -> None:
    output, tensor = a["output_tensor"], a["input_tensor"]
    world = output.numel() // max(1, tensor.numel())
    output.copy_(_gathered(tensor, world, a["group"]).reshape(output.shape))


def _all_reduce(a: dict[str, Any]) -> None:
    funcol = torch.ops._c10d_functional
    tensor = a["tensor"]
    tensor.copy_(funcol.wait_tensor(funcol.all_reduce(tensor, _reduce_op(a["op"]), _group_name(a["group"]))))


# name -> the call recorded as functional collectives across several ranks, given its bound arguments
_ACROSS: dict[str, Callable[[dict[str, Any]], None]] = {
    "all_gather": _all_gather,
    "all_gather_into_tensor": _all_gather_into_tensor,
    "_all_gather_base": _all_gather_into_tensor,
    "all_reduce": _all_reduce,
}


def _across_refusal(name: str, a: dict[str, Any], world: int) -> str:
    """Why this call across ``world`` ranks is not recorded ('' where it is); ``a``: its bound arguments."""
    if name not in _ACROSS:
        return f"hocompile compiles all_gather, all_gather_into_tensor and all_reduce across ranks, not {name}"
    if name == "all_reduce" and not _reduce_op(a["op"]):
        return f"its reduction {a['op']} is not one of sum, max, min, product"
    if name == "all_gather":
        outputs, tensor = a["tensor_list"], a["tensor"]
        if not isinstance(tensor, torch.Tensor) or not isinstance(outputs, list) or len(outputs) != world or any(
            not isinstance(o, torch.Tensor) or o.shape != tensor.shape or o.dtype != tensor.dtype for o in outputs
        ):
            return "its output list is not one tensor of the input's shape and dtype per rank"
    elif name != "all_reduce":
        output, tensor = a["output_tensor"], a["input_tensor"]
        if output.dtype != tensor.dtype or output.numel() != world * tensor.numel():
            return "its output is not the input's dtype and world times its size"
    return ""


class _Done:
    """What an ``async_op=True`` collective returns: its work is already done."""

    def wait(self, *args: Any, **kwargs: Any) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def get_future(self) -> torch.futures.Future[None]:
        done: torch.futures.Future[None] = torch.futures.Future()
        done.set_result(None)
        return done


@contextlib.contextmanager
def traced_collectives() -> Iterator[None]:
    """Inside: collectives are local copies on one rank and functional collectives across several (the
    module docstring says which); any other is a CaptureError naming it."""
    dist = torch.distributed
    if not dist.is_available() or not dist.is_initialized():
        yield  # eager would fail the same way on a collective; nothing to patch
        return
    saved = {name: getattr(dist, name) for name in _ONE_RANK if hasattr(dist, name)}

    def local(name: str) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            world = _group_size(name, args, kwargs)
            if world == 1:
                _ONE_RANK[name](*args, **kwargs)
            else:
                bound = inspect.signature(saved[name]).bind(*args, **kwargs)
                bound.apply_defaults()
                why = _across_refusal(name, bound.arguments, world)
                if why:
                    raise CaptureError(
                        f"the step calls torch.distributed.{name} across {world} ranks: {why} "
                        "(fallback='eager' runs such a step eagerly)"
                    )
                _ACROSS[name](bound.arguments)
            return _Done() if kwargs.get("async_op") else None

        return run

    try:
        for name in saved:
            setattr(dist, name, local(name))
        yield
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def refuse_untraced_collectives(gm: torch.fx.GraphModule, opt: Any) -> None:
    """A c10d collective the trace recorded as an op on the process group itself: called through a
    name bound before tracing (``from torch.distributed import all_reduce``), so not followed above.
    Replayed from a graph it would not be the step's collective: refuse, naming it."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and getattr(node.target, "namespace", "") == "c10d":
            name = getattr(node.target, "__name__", str(node.target)).split(".")[0]
            raise CaptureError(
                f"{type(opt).__name__}.step calls the collective c10d::{name} through a name hocompile does not "
                "follow (bound before tracing, e.g. `from torch.distributed import all_reduce`); a compiled step "
                "must never drop or replay a collective blindly. Call it as torch.distributed.<name>, use "
                "torch.distributed._functional_collectives, or run this optimizer eagerly (fallback='eager')"
            )


def collective_launches(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """The functional collectives ``gm`` issues, in graph order (their ``wait_tensor``\ s left out);
    each names its process group last."""
    wait = torch.ops._c10d_functional.wait_tensor.default
    return [
        node for node in gm.graph.nodes
        if node.op == "call_function" and str(node.target).startswith("_c10d_functional.") and node.target is not wait
    ]


def refuse_several_groups(gm: torch.fx.GraphModule, opt: Any) -> None:
    """The step's functional collectives span one process group: every rank compares the sequence it
    issues over that group before the first step (distributed/check.py), which one group makes a
    single comparison every rank of it joins. Several groups (Megatron's TP and expert-TP groups in
    one step) are refused, naming them."""
    names = {str(node.args[-1]) for node in collective_launches(gm)}
    if len(names) > 1:
        raise CaptureError(
            f"{type(opt).__name__}.step issues collectives over {len(names)} process groups "
            f"({', '.join(sorted(names))}); hocompile compiles a step's collectives over one group "
            "(fallback='eager' runs it eagerly)"
        )
