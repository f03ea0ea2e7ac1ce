"""Inputs hocompile refuses, with the group, index, shape and reason.

Run before anything is traced or mutated, so a refused step leaves params
and optimizer state exactly as they were.
"""

from __future__ import annotations

import inspect

import torch

from ..errors import (
    CaptureError,
    UnsupportedParameterError,  # noqa: F401  (defined there, re-exported here)
)


def _needs_matrices(opt: torch.optim.Optimizer) -> tuple[bool, bool]:
    """(is a matrix optimizer, requires exactly 2-D): torch.optim.Muon's own rule, which it
    checks only in __init__ (a param group added later would fail inside its step).

    Nothing is decided from a class's *name*: real Muon classes step biases and
    embeddings with their own AdamW. A step that orthogonalises a param it
    cannot fails in its own code while tracing, which refuses with its message.
    """
    muon = getattr(torch.optim, "Muon", None)
    if muon is not None and isinstance(opt, muon):
        return True, True
    return False, False


def _refuse_optimizer(opt: torch.optim.Optimizer) -> None:
    """Optimizer configurations whose step cannot be traced, refused by name."""
    kind = type(opt).__name__
    step = type(opt).step
    step = getattr(step, "__wrapped__", step)
    closure = inspect.signature(step).parameters.get("closure")
    if closure is not None and closure.default is inspect.Parameter.empty:
        raise CaptureError(
            f"{kind}.step requires a closure: it re-evaluates the loss inside the step (LBFGS's line "
            "search and inner iterations), which a compiled step cannot replay; run it eagerly"
        )
    if isinstance(opt, torch.optim.SparseAdam):
        raise CaptureError(
            f"{kind} overrides SparseAdam.step: a step of sparse gradients cannot be traced (torch's own "
            "SparseAdam.step runs as is under compile_optimizer; otherwise run this one eagerly)"
        )


def validate(opt: torch.optim.Optimizer) -> None:
    _refuse_optimizer(opt)
    matrices, exactly_2d = _needs_matrices(opt)
    kind = type(opt).__name__
    device: tuple[torch.device, str] | None = None
    for g, group in enumerate(opt.param_groups):
        for i, p in enumerate(group["params"]):
            where = f"param_groups[{g}]['params'][{i}] (shape {tuple(p.shape)}, {str(p.dtype).replace('torch.', '')})"

            def refuse(reason: str, where: str = where) -> UnsupportedParameterError:
                return UnsupportedParameterError(f"hocompile cannot step {where}: {reason}")

            if p.grad is None:
                continue  # skipped exactly as eager does
            if p.is_complex():
                raise refuse("complex parameters are not supported")
            if not p.is_floating_point():
                raise refuse("integer and bool parameters have no gradient step")
            if p.grad.layout != torch.strided:
                raise refuse(f"its gradient is {p.grad.layout} (sparse gradients are not supported)")
            if p.grad.shape != p.shape:
                raise refuse(f"its gradient has shape {tuple(p.grad.shape)}")
            if matrices and (p.ndim != 2 if exactly_2d else p.ndim < 2):
                need = "2-D" if exactly_2d else "at least 2-D"
                raise refuse(
                    f"{kind} orthogonalizes matrices and needs {need} parameters; "
                    "optimize this one with AdamW or similar"
                )
            if device is None:
                device = (p.device, where)
            elif p.device != device[0] or p.grad.device != p.device:
                raise refuse(
                    f"it is on {p.device} (grad on {p.grad.device}) but {device[1]} is on {device[0]}; "
                    "all parameters of one compiled optimizer must share a device"
                )
