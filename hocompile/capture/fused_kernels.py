"""torch's fused optimizer kernels (``fused=True``) as opaque functional ops: run as torch runs them.

``torch._fused_adam_``/``_fused_adamw_``/``_fused_sgd_``/``_fused_adagrad_`` mutate lists of
tensors in place. make_fx cannot trace them as they are: functionalize asserts on an empty
mutable list (Adam without amsgrad passes no max_exp_avg_sqs) and SGD's, Adagrad's and the
tensor-lr overloads have no fake kernel. During a capture, HostScalarMode routes each call
here instead: one ``hocompile_torch::`` op that clones the lists it mutates, runs torch's own
kernel on the clones and returns them, and the trace copies the results back. The kernel and
its arithmetic are torch's, so a compiled ``fused=True`` step is bitwise eager's (tests/
test_fused_kernels.py); the clones cost one copy of the lists per step.

The namespace is apart from ``hocompile::`` on purpose: these are not hocompile's ops (no
op family, nothing a pass plans), only torch's kernels made traceable.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

NAMESPACE = "hocompile_torch"

Lists = tuple[list[Tensor], list[Tensor], list[Tensor], list[Tensor], list[Tensor]]


def _clones(*lists: list[Tensor]) -> list[list[Tensor]]:
    return [[t.clone() for t in ts] for ts in lists]


def _empty_likes(*lists: list[Tensor]) -> list[list[Tensor]]:
    return [[torch.empty_like(t) for t in ts] for ts in lists]


@torch.library.custom_op(f"{NAMESPACE}::fused_adam", mutates_args=())
def fused_adam(
    params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor],
    max_exp_avg_sqs: list[Tensor], state_steps: list[Tensor], lr: float, lr_tensor: Tensor | None,
    beta1: float, beta2: float, weight_decay: float, eps: float, amsgrad: bool, maximize: bool,
    decoupled: bool, grad_scale: Tensor | None, found_inf: Tensor | None,
) -> Lists:
    p, g, m, v, mx = _clones(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs)
    kernel = torch._fused_adamw_ if decoupled else torch._fused_adam_
    kernel(
        p, g, m, v, mx, state_steps, lr=lr_tensor if lr_tensor is not None else lr, beta1=beta1, beta2=beta2,
        weight_decay=weight_decay, eps=eps, amsgrad=amsgrad, maximize=maximize, grad_scale=grad_scale,
        found_inf=found_inf,
    )
    return p, g, m, v, mx


@fused_adam.register_fake
def _fused_adam_fake(params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor],
                     max_exp_avg_sqs: list[Tensor], *args: Any) -> Lists:
    p, g, m, v, mx = _empty_likes(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs)
    return p, g, m, v, mx


@torch.library.custom_op(f"{NAMESPACE}::fused_sgd", mutates_args=())
def fused_sgd(
    params: list[Tensor], grads: list[Tensor], momentum_buffers: list[Tensor], weight_decay: float,
    momentum: float, lr: float, lr_tensor: Tensor | None, dampening: float, nesterov: bool, maximize: bool,
    is_first_step: bool, grad_scale: Tensor | None, found_inf: Tensor | None,
) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
    p, g, b = _clones(params, grads, momentum_buffers)
    torch._fused_sgd_(
        p, g, b, weight_decay=weight_decay, momentum=momentum, lr=lr_tensor if lr_tensor is not None else lr,
        dampening=dampening, nesterov=nesterov, maximize=maximize, is_first_step=is_first_step,
        grad_scale=grad_scale, found_inf=found_inf,
    )
    return p, g, b


@fused_sgd.register_fake
def _fused_sgd_fake(params: list[Tensor], grads: list[Tensor], momentum_buffers: list[Tensor],
                    *args: Any) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
    p, g, b = _empty_likes(params, grads, momentum_buffers)
    return p, g, b


@torch.library.custom_op(f"{NAMESPACE}::fused_adagrad", mutates_args=())
def fused_adagrad(
    params: list[Tensor], grads: list[Tensor], state_sums: list[Tensor], state_steps: list[Tensor], lr: float,
    lr_tensor: Tensor | None, lr_decay: float, weight_decay: float, eps: float, maximize: bool,
    grad_scale: Tensor | None, found_inf: Tensor | None,
) -> tuple[list[Tensor], list[Tensor], list[Tensor], list[Tensor]]:
    # Adagrad's kernel also counts its steps (state_steps is mutable in its float-lr overload).
    p, g, s, n = _clones(params, grads, state_sums, state_steps)
    torch._fused_adagrad_(
        p, g, s, n, lr=lr_tensor if lr_tensor is not None else lr, lr_decay=lr_decay, weight_decay=weight_decay,
        eps=eps, maximize=maximize, grad_scale=grad_scale, found_inf=found_inf,
    )
    return p, g, s, n


@fused_adagrad.register_fake
def _fused_adagrad_fake(params: list[Tensor], grads: list[Tensor], state_sums: list[Tensor],
                        state_steps: list[Tensor], *args: Any) -> tuple[list[Tensor], ...]:
    return tuple(_empty_likes(params, grads, state_sums, state_steps))  # type: ignore[return-value]


def _lr(kwargs: dict[str, Any]) -> tuple[float, Tensor | None]:
    lr = kwargs["lr"]
    return (0.0, lr) if isinstance(lr, Tensor) else (lr, None)


def _adam(decoupled: bool) -> Callable[..., tuple[list[list[Tensor]], Any]]:
    def call(args: tuple[Any, ...], kw: dict[str, Any]) -> tuple[list[list[Tensor]], Any]:
        lists = list(args[:6])
        lr, lr_tensor = _lr(kw)
        out = fused_adam(
            *lists, lr, lr_tensor, kw["beta1"], kw["beta2"], kw["weight_decay"], kw["eps"], kw["amsgrad"],
            kw["maximize"], decoupled, kw.get("grad_scale"), kw.get("found_inf"),
        )
        return lists[:5], out
    return call


def _sgd(args: tuple[Any, ...], kw: dict[str, Any]) -> tuple[list[list[Tensor]], Any]:
    lists = list(args[:3])
    lr, lr_tensor = _lr(kw)
    out = fused_sgd(
        *lists, kw["weight_decay"], kw["momentum"], lr, lr_tensor, kw["dampening"], kw["nesterov"], kw["maximize"],
        kw["is_first_step"], kw.get("grad_scale"), kw.get("found_inf"),
    )
    return lists, out


def _adagrad(args: tuple[Any, ...], kw: dict[str, Any]) -> tuple[list[list[Tensor]], Any]:
    lists = list(args[:4])
    lr, lr_tensor = _lr(kw)
    out = fused_adagrad(
        *lists, lr, lr_tensor, kw["lr_decay"], kw["weight_decay"], kw["eps"], kw["maximize"], kw.get("grad_scale"),
        kw.get("found_inf"),
    )
    return lists, out


# torch's in-place kernel -> (the lists it mutates, the functional op's results for them)
KERNELS: dict[Any, Callable[[tuple[Any, ...], dict[str, Any]], tuple[list[list[Tensor]], Any]]] = {
    torch._fused_adam_: _adam(False),
    torch._fused_adamw_: _adam(True),
    torch._fused_sgd_: _sgd,
    torch._fused_adagrad_: _adagrad,
}


def traced_call(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """``func(*args, **kwargs)`` (one of KERNELS) as the functional op, its results copied back in place."""
    mutated, results = KERNELS[func](args, kwargs)
    for targets, values in zip(mutated, results):
        for target, value in zip(targets, values):
            target.copy_(value)


def _raw(fn: Any) -> Any:
    while hasattr(fn, "__wrapped__"):  # torch's step hooks and grad-mode decorators
        fn = fn.__wrapped__
    return fn


def runs_as_is(opt: Any) -> str:
    """Why ``opt``'s step runs as torch runs it, uncompiled ('' where it is compiled): torch's own
    step (not overridden) that is either

    - Adam/AdamW/SGD/Adagrad with fused=True in every group: one fused kernel call over every
      param, nothing for hocompile to improve, and a traced copy of it costs more per step
      (measured: 1,200 params, AdamW, 103 ms compiled against 12 ms eager, after a 51 s compile).
      A class that calls these kernels among code of its own is compiled, the kernels as opaque
      ops (KERNELS);
    - SparseAdam: its step coalesces sparse gradients whose number of entries changes every step
      and writes only the rows they touch; a traced step takes dense tensors of fixed shapes, so
      the honest compiled step is torch's (a dense copy would cost a full-table pass per step).
    """
    step = _raw(type(opt).step)
    if isinstance(opt, torch.optim.SparseAdam) and step is _raw(torch.optim.SparseAdam.step):
        return ("SparseAdam: its step updates only the rows its sparse gradients touch, which a traced "
                "step of fixed shapes cannot express; hocompile runs it as is (eager's step, bit for bit)")
    cls = next((c for c in (torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD, torch.optim.Adagrad)
                if isinstance(opt, c) and step is _raw(c.step)), None)
    groups = getattr(opt, "param_groups", [])
    if cls is None or not groups or not all(g.get("fused") for g in groups):
        return ""
    return (f"fused=True: {type(opt).__name__}'s step is torch's fused kernel, one call for every param; "
            "hocompile runs it as is (eager's step, bit for bit; compiling it would only add work)")
