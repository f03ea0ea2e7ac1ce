"""A user-written Muon for params with batch dims ``[..., m, n]`` (stacked experts), Keller-Jordan style.

torch.optim.Muon takes only 2-D params; a stacked ``[E, m, n]`` expert weight is
E independent matrices, each orthogonalised on its own (as Megatron's and AMD
Primus' grouped Muon do it). This one follows torch.optim.Muon's update
(Nesterov momentum by default, decoupled weight decay, lr scaled by
``sqrt(max(1, m / n))`` of each matrix, bf16 Newton–Schulz with Keller
Jordan's coefficients) but normalises and multiplies over the last two dims
only, so a 2-D param gets the same kind of update and a 3-D one is E of them.
The grads are left as they are (two optimizers may share them in the benchmark).

It lives under benchmarks/, not in hocompile: it is the kind of code users
paste, which hocompile has to recognise (``tests/helpers.py`` ``UserMuon``).
"""

from __future__ import annotations

from typing import Any

import torch

KJ_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def zeropower_batched(g: torch.Tensor, steps: int, eps: float = 1e-7) -> torch.Tensor:
    """Keller Jordan's quintic Newton–Schulz over the last two dims of ``g`` (any batch dims in front)."""
    assert g.ndim >= 2
    a, b, c = KJ_COEFFICIENTS
    x = g.bfloat16()
    tall = g.size(-2) > g.size(-1)
    if tall:
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + eps)
    for _ in range(steps):
        gram = x @ x.mT
        poly = b * gram + c * gram @ gram
        x = a * x + poly @ x
    if tall:
        x = x.mT
    return x


class BatchedMuon(torch.optim.Optimizer):
    """Muon over ``[..., m, n]`` params: each trailing ``m x n`` matrix is orthogonalised on its own."""

    def __init__(
        self,
        params: Any,
        lr: float = 0.02,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
    ) -> None:
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps)
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim < 2:
                    raise ValueError(f"BatchedMuon takes params of 2 or more dims, got {tuple(p.shape)}")

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if len(state) == 0:
                    state["momentum_buffer"] = torch.zeros_like(p)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - group["momentum"])
                update = p.grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf
                update = zeropower_batched(update, group["ns_steps"])
                scale = max(1.0, p.size(-2) / p.size(-1)) ** 0.5
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(update.to(p.dtype), alpha=-group["lr"] * scale)
        return loss
