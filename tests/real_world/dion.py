"""microsoft/dion ``dion/muon.py`` ``Muon`` (with its ``scalar_opts.adamw_update``), on one device.

The patterns, rewritten in the same shape:

- the group's ``lr`` is a *persistent 0-D tensor*: a float found in the
  group (construction, ``group["lr"] = x``) is ``fill_``-ed into the tensor the
  optimizer keeps for it and the tensor put back; a scheduler that
  ``fill_``s it works too;
- other hyperparameters become tensors every step (``torch.tensor(group["mu"])``);
- ``@torch.compile(fullgraph=True)`` helpers over *lists*: momentum and the
  weight update are ``torch._foreach_*`` ops with tensor scalars;
- same-shaped params are stacked and orthogonalised as one batch with Dion's
  five tuned coefficient triples (a different one per iteration);
- the lr is rescaled from spectral to RMS norm: ``lr * math.sqrt(fan_out / fan_in)``;
- AdamW groups (``algorithm="adamw"``) use an int ``group["step"]`` and tensor
  betas inside a compiled update.

``NS_DTYPE``: the Newton–Schulz compute dtype (bf16 in the original).
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

import torch
from torch import Tensor

NS_DTYPE = torch.bfloat16

NS_COEFFICIENTS = [
    (4.0848, -6.8946, 2.9270),
    (3.9505, -6.3029, 2.6377),
    (3.7418, -5.5913, 2.3037),
    (2.8769, -3.1427, 1.2046),
    (2.8366, -3.0525, 1.2012),
]


@torch.compile(fullgraph=True)
def muon_update_pre_orthogonalize(G: list[Tensor], M: list[Tensor], momentum: Tensor, nesterov: bool) -> list[Tensor]:
    dtype = M[0].dtype
    G = [g.to(dtype=dtype) for g in G]
    torch._foreach_mul_(M, momentum)
    torch._foreach_add_(M, G)
    if nesterov:
        U = torch._foreach_mul(M, momentum)
        torch._foreach_add_(U, G)
    else:
        U = M
    return [u.to(dtype=NS_DTYPE) for u in U]


@torch.compile(fullgraph=True)
def muon_update_post_orthogonalize(X: list[Tensor], U: list[Tensor], base_lr: Tensor, adjusted_lr: Tensor,
                                   weight_decay: Tensor) -> None:
    torch._foreach_mul_(X, 1 - base_lr * weight_decay)
    U = torch._foreach_mul(U, adjusted_lr)
    torch._foreach_sub_(X, U)


@torch.compile(fullgraph=True)
def zeropower_via_newtonschulz5(G: Tensor, epsilon: float = 1e-7) -> Tensor:
    X = G.to(dtype=NS_DTYPE)
    if G.size(-2) > G.size(-1):
        X = X.mT
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + epsilon)
    for a, b, c in NS_COEFFICIENTS:
        A = X @ X.mT
        B = b * A + c * (A @ A)
        X = a * X + B @ X
    if G.size(-2) > G.size(-1):
        X = X.mT
    return X


@torch.compile(fullgraph=True)
def adamw_update(X: Tensor, G: Tensor, M: Tensor, V: Tensor, lr: Tensor, beta1: Tensor, beta2: Tensor,
                 weight_decay: Tensor, step: int, epsilon: float) -> None:
    M.lerp_(G.to(M.dtype), 1 - beta1)
    V.mul_(beta2).addcmul_(G, G, value=1 - beta2)
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    denom = V.sqrt().div_(bias_correction2.sqrt()).add_(epsilon)
    X.mul_(1 - lr * weight_decay)
    X.addcdiv_(M, denom, value=-(lr / bias_correction1))


def adjust_lr_spectral_norm(lr: Tensor, param_shape: torch.Size) -> Tensor:
    """From spectral norm 1 to RMS operator norm 1."""
    fan_out, fan_in = param_shape[-2:]
    return lr * math.sqrt(fan_out / fan_in)


class Muon(torch.optim.Optimizer):
    def __init__(self, params: Any, lr: float = 0.01, mu: float = 0.95, betas: tuple[float, float] = (0.9, 0.95),
                 weight_decay: float = 0.01, epsilon: float = 1e-8, nesterov: bool = False) -> None:
        defaults = dict(lr=lr, mu=mu, beta1=betas[0], beta2=betas[1], weight_decay=weight_decay, epsilon=epsilon,
                        nesterov=nesterov, algorithm="muon", step=0)
        super().__init__(params, defaults)
        self._hyperparam_tensors: dict[int, Tensor] = {}

    def _lr_tensor(self, index: int) -> Tensor:
        """The group's lr as the one 0-D tensor the kernels read; floats found there are copied into it."""
        group = self.param_groups[index]
        value = group["lr"]
        tensor = self._hyperparam_tensors.get(index)
        if value is tensor:
            return tensor
        if tensor is None:
            tensor = torch.empty((), dtype=torch.float32)
            self._hyperparam_tensors[index] = tensor
        if isinstance(value, Tensor):
            tensor.copy_(value)
        else:
            tensor.fill_(value)
        group["lr"] = tensor
        return tensor

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for index, group in enumerate(self.param_groups):
            lr = self._lr_tensor(index)
            group["step"] += 1
            params = [p for p in group["params"] if p.grad is not None]
            if group["algorithm"] == "adamw":
                beta1, beta2 = torch.tensor(group["beta1"]), torch.tensor(group["beta2"])
                for p in params:
                    state = self.state[p]
                    if not state:
                        state["momentum"] = torch.zeros_like(p)
                        state["variance"] = torch.zeros_like(p)
                    adamw_update(p, p.grad, state["momentum"], state["variance"], lr, beta1, beta2,
                                 torch.tensor(group["weight_decay"]), group["step"], group["epsilon"])
                continue
            by_shape: dict[torch.Size, list[Tensor]] = defaultdict(list)
            for p in params:
                by_shape[p.shape].append(p)
            for shape, same in by_shape.items():
                momenta = []
                for p in same:
                    state = self.state[p]
                    if not state:
                        state["momentum"] = torch.zeros_like(p)
                    momenta.append(state["momentum"])
                U = muon_update_pre_orthogonalize([p.grad for p in same], momenta, torch.tensor(group["mu"]),
                                                  group["nesterov"])
                U = list(zeropower_via_newtonschulz5(torch.stack(U), epsilon=group["epsilon"]).unbind(0))
                muon_update_post_orthogonalize(same, U, lr, adjust_lr_spectral_norm(lr, shape),
                                               torch.tensor(group["weight_decay"]))
        return loss
