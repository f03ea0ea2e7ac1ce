"""torch.distributed calls inside a step, while it is traced.

Several Muon implementations all-gather the orthogonalised updates across
ranks inside ``step()`` (``dist.all_gather``, ``all_gather_into_tensor``),
even when run on one rank. A fake-tensor trace cannot run a real collective.
Over a group of one rank every collective is a local copy (or nothing), so that
is what the trace records, and the compiled step equals eager's: a one-rank
world, or a one-rank group inside a larger one (Megatron's tensor-parallel group
at TP 1 in a data-parallel world). Across several ranks the step is refused with
a clear error until a distributed plan (owner ranks, bucketed collectives) exists:
a compiled step must never skip a collective.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .errors import CaptureError

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


def _group_size(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """The ranks the call spans: its group's size (the default group's where it names none)."""
    at = _GROUP_AT[name]
    group = kwargs.get("group", args[at] if len(args) > at else None)
    return int(torch.distributed.get_world_size(group))


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
    """Inside: collectives are local copies on one rank, a CaptureError on several."""
    dist = torch.distributed
    if not dist.is_available() or not dist.is_initialized():
        yield  # eager would fail the same way on a collective; nothing to patch
        return
    saved = {name: getattr(dist, name) for name in _ONE_RANK if hasattr(dist, name)}

    def local(name: str) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            world = _group_size(name, args, kwargs)
            if world != 1:
                raise CaptureError(
                    f"the step calls torch.distributed.{name} across {world} ranks; hocompile does not "
                    "compile collectives across ranks yet (fallback='eager' runs such a step eagerly)"
                )
            _ONE_RANK[name](*args, **kwargs)
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
