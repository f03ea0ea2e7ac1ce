"""Keller Jordan's ``muon.py`` (github.com/KellerJordan/Muon), the four classes people import.

Rewritten here in the same shape as the original:

- a free ``newton_schulz5(G, steps)`` with the (3.4445, -4.7750, 2.0315) quintic,
  bf16, transpose-to-wide, ``X / (‖X‖ + 1e-7)``;
- a ``muon_update`` helper: ``lerp_`` momentum, Nesterov as ``grad.lerp_`` (the
  grad is overwritten in place), conv filters viewed as 2-D, ``√max(1, m/n)``;
- an ``adam_update`` helper with a *Python int* ``state["step"]`` and the bias
  corrections computed on the host (``1 - beta ** step``);
- ``p.grad = torch.zeros_like(p)`` for params without a grad ("force
  synchronization");
- the distributed classes pad the param list to a multiple of the world size
  and ``dist.all_gather`` every param after each round (here: one rank).

``NS_DTYPE`` is the Newton–Schulz compute dtype (the original hard-codes bf16);
tests swap it for float64 to get the exact-NS trajectory.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

NS_DTYPE = torch.bfloat16


def newton_schulz5(G: torch.Tensor, steps: int) -> torch.Tensor:
    """Approximate orthogonalisation U Vᵀ of G by a quintic Newton–Schulz iteration."""
    assert G.ndim >= 2
    a, b, c = (3.4445, -4.7750, 2.0315)
    X = G.to(NS_DTYPE)
    if G.size(-2) > G.size(-1):
        X = X.mT
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + 1e-7)  # spectral norm at most 1
    for _ in range(steps):
        gram = X @ X.mT
        poly = b * gram + c * gram @ gram
        X = a * X + poly @ X
    if G.size(-2) > G.size(-1):
        X = X.mT
    return X


def muon_update(
    grad: torch.Tensor, momentum: torch.Tensor, beta: float = 0.95, ns_steps: int = 5, nesterov: bool = True
) -> torch.Tensor:
    momentum.lerp_(grad, 1 - beta)
    update = grad.lerp_(momentum, beta) if nesterov else momentum
    if update.ndim == 4:  # conv filters: orthogonalise the flattened kernel
        update = update.view(len(update), -1)
    update = newton_schulz5(update, steps=ns_steps)
    update *= max(1, grad.size(-2) / grad.size(-1)) ** 0.5
    return update


def adam_update(
    grad: torch.Tensor,
    buf1: torch.Tensor,
    buf2: torch.Tensor,
    step: int,
    betas: tuple[float, float],
    eps: float,
) -> torch.Tensor:
    buf1.lerp_(grad, 1 - betas[0])
    buf2.lerp_(grad.square(), 1 - betas[1])
    m_hat = buf1 / (1 - betas[0] ** step)
    v_hat = buf2 / (1 - betas[1] ** step)
    return m_hat / (v_hat.sqrt() + eps)


def _muon_param_step(opt: torch.optim.Optimizer, p: torch.Tensor, group: dict[str, Any]) -> None:
    if p.grad is None:
        p.grad = torch.zeros_like(p)  # every rank must take part in the gather
    state = opt.state[p]
    if len(state) == 0:
        state["momentum_buffer"] = torch.zeros_like(p)
    update = muon_update(p.grad, state["momentum_buffer"], beta=group["momentum"])
    p.mul_(1 - group["lr"] * group["weight_decay"])
    p.add_(update.reshape(p.shape), alpha=-group["lr"])


def _adam_param_step(opt: torch.optim.Optimizer, p: torch.Tensor, group: dict[str, Any]) -> None:
    if p.grad is None:
        p.grad = torch.zeros_like(p)
    state = opt.state[p]
    if len(state) == 0:
        state["exp_avg"] = torch.zeros_like(p)
        state["exp_avg_sq"] = torch.zeros_like(p)
        state["step"] = 0
    state["step"] += 1
    update = adam_update(p.grad, state["exp_avg"], state["exp_avg_sq"], state["step"], group["betas"], group["eps"])
    p.mul_(1 - group["lr"] * group["weight_decay"])
    p.add_(update, alpha=-group["lr"])


def _gathered_muon_group(opt: torch.optim.Optimizer, group: dict[str, Any]) -> None:
    """Each rank updates every world_size-th param, then all ranks gather the results."""
    params = group["params"]
    world, rank = dist.get_world_size(), dist.get_rank()
    padded = params + [torch.empty_like(params[-1])] * (world - len(params) % world)
    for base in range(len(params))[::world]:
        if base + rank < len(params):
            _muon_param_step(opt, params[base + rank], group)
        dist.all_gather(padded[base : base + world], padded[base + rank])


def _check_groups(param_groups: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Fill each ``use_muon`` group's defaults and reject unknown keys, as the original does."""
    groups = list(param_groups)
    for group in groups:
        assert "use_muon" in group
        if group["use_muon"]:
            group.setdefault("lr", 0.02)
            group.setdefault("momentum", 0.95)
            group.setdefault("weight_decay", 0)
            assert set(group) == {"params", "lr", "momentum", "weight_decay", "use_muon"}
        else:
            group.setdefault("lr", 3e-4)
            group.setdefault("betas", (0.9, 0.95))
            group.setdefault("eps", 1e-10)
            group.setdefault("weight_decay", 0)
            assert set(group) == {"params", "lr", "betas", "eps", "weight_decay", "use_muon"}
    return groups


class SingleDeviceMuon(torch.optim.Optimizer):
    """Muon on one device: only hidden matrices belong here."""

    def __init__(self, params: Any, lr: float = 0.02, weight_decay: float = 0, momentum: float = 0.95) -> None:
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay, momentum=momentum))

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                _muon_param_step(self, p, group)
        return loss


class SingleDeviceMuonWithAuxAdam(torch.optim.Optimizer):
    """One optimizer for the whole model: ``use_muon`` groups get Muon, the rest Adam."""

    def __init__(self, param_groups: Iterable[dict[str, Any]]) -> None:
        super().__init__(_check_groups(param_groups), dict())

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if group["use_muon"]:
                    _muon_param_step(self, p, group)
                else:
                    _adam_param_step(self, p, group)
        return loss


class Muon(torch.optim.Optimizer):
    """Distributed Muon: params of a group are sharded round-robin over ranks and gathered."""

    def __init__(self, params: Any, lr: float = 0.02, weight_decay: float = 0, momentum: float = 0.95) -> None:
        assert isinstance(params, list) and len(params) >= 1 and isinstance(params[0], torch.nn.Parameter)
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay, momentum=momentum))

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            _gathered_muon_group(self, group)
        return loss


class MuonWithAuxAdam(torch.optim.Optimizer):
    """Distributed Muon for ``use_muon`` groups (largest matrices first), Adam on every rank for the rest."""

    def __init__(self, param_groups: Iterable[dict[str, Any]]) -> None:
        groups = _check_groups(param_groups)
        for group in groups:
            if group["use_muon"]:
                group["params"] = sorted(group["params"], key=lambda x: x.size(), reverse=True)
        super().__init__(groups, dict())

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["use_muon"]:
                _gathered_muon_group(self, group)
            else:
                for p in group["params"]:
                    _adam_param_step(self, p, group)
        return loss
