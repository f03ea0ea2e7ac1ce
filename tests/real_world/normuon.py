"""NorMuon (github.com/zichongli5/NorMuon ``normuon.py``): ``SingleDeviceNorMuonWithAuxAdam``.

Keller Jordan's Muon plus a per-row second moment after orthogonalisation,
rewritten in the same shape:

- ``second_momentum_buffer`` is ``zeros_like(p[..., 0:1])`` (one entry per row);
- the orthogonalised update is divided by ``√v + 1e-10`` row-wise and rescaled
  so its Frobenius norm is unchanged (``update.norm`` twice, in place ``add_``);
- ``had_grad = p.grad is not None`` and weight decay only
  ``if group["weight_decay"] and had_grad`` — a Python branch on a float
  hyperparameter's truthiness;
- the Adam half: Python int ``state["step"]``, bias corrections on the host.

``NS_DTYPE``: the Newton–Schulz compute dtype (bf16 in the original).
"""

from __future__ import annotations

from typing import Any

import torch

NS_DTYPE = torch.bfloat16


def zeropower_via_newtonschulz5(G: torch.Tensor, steps: int = 5) -> torch.Tensor:
    assert G.ndim >= 2
    a, b, c = (3.4445, -4.7750, 2.0315)
    X = G.to(NS_DTYPE)
    if G.size(-2) > G.size(-1):
        X = X.mT
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(steps):
        A = X @ X.mT
        B = b * A + c * A @ A
        X = a * X + B @ X
    if G.size(-2) > G.size(-1):
        X = X.mT
    return X


def normuon_update(grad: torch.Tensor, momentum: torch.Tensor, second_momentum: torch.Tensor, beta: float = 0.95,
                   beta2: float = 0.95, ns_steps: int = 5, nesterov: bool = True) -> torch.Tensor:
    momentum.lerp_(grad, 1 - beta)
    update = grad.lerp_(momentum, beta) if nesterov else momentum
    conv_shape = None
    if update.ndim == 4:
        conv_shape = update.shape
        update = update.reshape(update.size(0), -1)
    update = zeropower_via_newtonschulz5(update, steps=ns_steps)
    if conv_shape is not None:
        update = update.reshape(conv_shape)
    norm_before = update.norm(dim=(-2, -1), keepdim=True)
    row_mean_sq = torch.mean(update * update, dim=-1, keepdim=True)
    # (the original lerps the bf16 mean in directly, which needs bf16 params; cast for fp32 ones)
    second_momentum.lerp_(row_mean_sq.to(second_momentum.dtype), 1 - beta2)
    update.mul_(1 / second_momentum.sqrt().add_(1e-10))
    norm_after = update.norm(dim=(-2, -1), keepdim=True)
    update.mul_(norm_before / norm_after.add_(1e-10))  # keep the pre-normalisation norm
    update *= max(1, grad.size(-2) / grad.size(-1)) ** 0.5
    return update


def adam_update(grad: torch.Tensor, buf1: torch.Tensor, buf2: torch.Tensor, step: int,
                betas: tuple[float, float], eps: float) -> torch.Tensor:
    buf1.lerp_(grad, 1 - betas[0])
    buf2.lerp_(grad.square(), 1 - betas[1])
    return (buf1 / (1 - betas[0] ** step)) / ((buf2 / (1 - betas[1] ** step)).sqrt() + eps)


class SingleDeviceNorMuonWithAuxAdam(torch.optim.Optimizer):
    def __init__(self, param_groups: Any) -> None:
        groups = list(param_groups)
        for group in groups:
            assert "use_muon" in group
            if group["use_muon"]:
                for key, value in dict(lr=0.02, momentum=0.95, beta2=0.95, weight_decay=0).items():
                    group.setdefault(key, value)
                assert set(group) == {"params", "lr", "momentum", "beta2", "weight_decay", "use_muon"}
            else:
                for key, value in dict(lr=3e-4, betas=(0.9, 0.95), eps=1e-10, weight_decay=0).items():
                    group.setdefault(key, value)
                assert set(group) == {"params", "lr", "betas", "eps", "weight_decay", "use_muon"}
        super().__init__(groups, dict())

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                had_grad = p.grad is not None
                if not had_grad:
                    p.grad = torch.zeros_like(p)
                state = self.state[p]
                if group["use_muon"]:
                    if len(state) == 0:
                        state["momentum_buffer"] = torch.zeros_like(p)
                        state["second_momentum_buffer"] = torch.zeros_like(p[..., 0:1])
                    update = normuon_update(p.grad, state["momentum_buffer"], state["second_momentum_buffer"],
                                            beta=group["momentum"], beta2=group["beta2"])
                else:
                    if len(state) == 0:
                        state["exp_avg"] = torch.zeros_like(p)
                        state["exp_avg_sq"] = torch.zeros_like(p)
                        state["step"] = 0
                    state["step"] += 1
                    update = adam_update(p.grad, state["exp_avg"], state["exp_avg_sq"], state["step"],
                                         group["betas"], group["eps"])
                if group["weight_decay"] and had_grad:
                    p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(update.reshape(p.shape), alpha=-group["lr"])
        return loss
