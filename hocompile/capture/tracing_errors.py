"""What a tracing failure tells the user: the construct (their file:line) and the reason, in words
they would search for (capture.py raises these; every failure is a CaptureError)."""

from __future__ import annotations

import traceback

import torch

from ..errors import CaptureError
from .host_state import HostSlot
from .scalars import user_line


def tracing_error(opt: torch.optim.Optimizer, exc: Exception, lifted: frozenset[HostSlot]) -> CaptureError:
    """The CaptureError for ``exc``, raised while make_fx traced ``opt``'s step."""
    hint = ""
    if "dynamo-optimized" in str(exc):
        hint = (
            " (the step calls torch.compile'd functions, which cannot be traced; heavyball: "
            "set heavyball.utils.compile_mode = None to trace its plain Python)"
        )
    elif "convert all Tensors to FakeTensors" in str(exc):
        hint = (
            " (the step uses tensors hocompile does not substitute: it substitutes params, grads, "
            "tensors in `state`, tensor attributes and tensor values of param_groups; not tensors inside "
            "lists or other containers (e.g. views of a buffer kept in a group), a sub-optimizer's own "
            "state, or tensors captured elsewhere)"
        )
    elif "data-dependent" in str(exc):
        where = user_line(traceback.extract_tb(exc.__traceback__))
        hint = (
            f" (the step branches on a tensor's value in Python{where}; "
            "a data-dependent host read cannot be compiled; fallback='eager' runs such a step eagerly)"
        )
    elif any(group.get("fused") for group in opt.param_groups):
        # torch's fused Adam/AdamW/SGD/Adagrad kernels are traced as opaque ops (fused_kernels.py);
        # another class's fused kernel, or a new overload, is not.
        return CaptureError(
            f"{type(opt).__name__} uses fused=True, and its fused kernel could not be traced (hocompile "
            "traces torch's fused Adam, AdamW, SGD and Adagrad kernels); construct it with fused=False, or "
            f"pass fallback='eager' to keep the fused kernel (tracing failed: {type(exc).__name__}: "
            f"{str(exc)[:200]})"
        )
    elif lifted and isinstance(exc, TypeError):
        names = ", ".join(s.describe() for s in sorted(lifted, key=repr))
        hint = (
            f" (the step updates {names} itself, so hocompile makes it a host input; a counter that "
            "is used as an int, e.g. in range() or as an index, cannot be compiled)"
        )
    elif "alias annotations" in str(exc):
        hint = (
            " (a custom operator the step calls returns a view of an input, `Tensor(a) -> Tensor(a)` "
            "in its schema, which functionalize cannot trace: register it without aliasing outputs, "
            "or pass fallback='eager')"
        )
    at = user_line(traceback.extract_tb(exc.__traceback__))  # the user's line, unless the hint has it
    return CaptureError(
        f"tracing {type(opt).__name__}.step failed{'' if at in hint else at}: {type(exc).__name__}: {exc}{hint}"
    )


def check_state_substitutable(opt: torch.optim.Optimizer) -> None:
    """The trace hands the step a state of stand-ins by assigning ``opt.state``: a read-only
    ``state`` property (a wrapper exposing another optimizer's state) cannot take it."""
    prop = next((vars(c)["state"] for c in type(opt).__mro__ if "state" in vars(c)), None)
    if isinstance(prop, property) and prop.fset is None:
        raise CaptureError(
            f"{type(opt).__name__}.state is a read-only property: hocompile substitutes the optimizer's "
            "`state` dict while it traces the step, and cannot here. Compile the optimizer whose state "
            "it exposes, give the property a setter that stores the dict, or pass fallback='eager'"
        )
