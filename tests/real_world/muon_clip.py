"""MuonClip: Muon plus Kimi K2's QK-Clip (Kimi K2 tech report; NVIDIA Megatron-LM
``megatron/core/optimizer/qk_clip.py``; the community ``MuonClip`` optimizers).

The pattern, rewritten in the same shape: after the Muon update, every
attention head whose largest pre-softmax logit (recorded by the forward pass
into a tensor the optimizer holds) exceeds a threshold τ has its query and key
rows scaled down by ``(τ / max_logit) ** α`` and ``** (1 - α)``. The logit is
read on the host with ``.item()`` and compared in a Python ``if`` — a value that
depends on data, per head, per step.

``NS_DTYPE``: the Newton–Schulz compute dtype (bf16, Keller Jordan's NS).
"""

from __future__ import annotations

from typing import Any

import torch

NS_DTYPE = torch.bfloat16


def newton_schulz5(G: torch.Tensor, steps: int = 5) -> torch.Tensor:
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


class MuonClip(torch.optim.Optimizer):
    """Muon for every matrix; QK-Clip on ``w_q`` / ``w_k`` from ``max_logits`` (one entry per head)."""

    def __init__(self, params: Any, w_q: torch.Tensor, w_k: torch.Tensor, max_logits: torch.Tensor,
                 lr: float = 0.02, momentum: float = 0.95, weight_decay: float = 0.0,
                 clip_threshold: float = 100.0, clip_alpha: float = 0.5) -> None:
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay))
        self.w_q, self.w_k = w_q, w_k
        self.max_logits = max_logits  # written by the attention forward pass
        self.clip_threshold, self.clip_alpha = clip_threshold, clip_alpha

    @torch.no_grad()
    def _clip_qk(self) -> None:
        heads = self.max_logits.numel()
        q_rows, k_rows = self.w_q.size(0) // heads, self.w_k.size(0) // heads
        for h in range(heads):
            logit = self.max_logits[h].item()
            if logit > self.clip_threshold:
                gamma = self.clip_threshold / logit
                self.w_q[h * q_rows : (h + 1) * q_rows].mul_(gamma**self.clip_alpha)
                self.w_k[h * k_rows : (h + 1) * k_rows].mul_(gamma ** (1 - self.clip_alpha))

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
                if not state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - group["momentum"])
                update = newton_schulz5(p.grad.lerp_(buf, group["momentum"]))
                update *= max(1, p.size(-2) / p.size(-1)) ** 0.5
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(update, alpha=-group["lr"])
        self._clip_qk()
        return loss
