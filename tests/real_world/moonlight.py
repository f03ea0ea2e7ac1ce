"""Moonshot AI's Moonlight ``examples/toy_train.py`` Muon (github.com/MoonshotAI/Moonlight).

The patterns it brings, rewritten in the same shape:

- the Newton–Schulz helper is decorated with a bare ``@torch.compile``, is
  2-D only (``X.T``, ``X.norm()`` over the whole matrix);
- one param group holds both kinds of params; which update a param gets is a
  *bool in its optimizer state* (``state[p]["use_muon"]``) set in ``__init__``;
- classic momentum ``buf.mul_(momentum).add_(g)`` and Nesterov as ``g.add(buf, alpha=momentum)``;
- the Muon lr is matched to AdamW's update RMS: ``lr * 0.2 * math.sqrt(max(A, B))``
  (a ``math.sqrt`` of shapes, not of a hyperparameter);
- the AdamW half keeps a Python int ``state["step"]`` and folds the bias
  corrections into the lr: ``-lr / (bc1 / bc2 ** 0.5)``;
- updates go through ``p.data``.

``NS_DTYPE``: the Newton–Schulz compute dtype (bf16 in the original).
"""

from __future__ import annotations

import math
from typing import Any

import torch

NS_DTYPE = torch.bfloat16


@torch.compile
def zeropower_via_newtonschulz5(G: torch.Tensor, steps: int) -> torch.Tensor:
    assert len(G.shape) == 2
    a, b, c = (3.4445, -4.7750, 2.0315)
    X = G.to(NS_DTYPE)
    if G.size(0) > G.size(1):
        X = X.T
    X = X / (X.norm() + 1e-7)
    for _ in range(steps):
        A = X @ X.T
        B = b * A + c * A @ A
        X = a * X + B @ X
    if G.size(0) > G.size(1):
        X = X.T
    return X


class Muon(torch.optim.Optimizer):
    """Muon for ``muon_params`` (2-D), AdamW for ``adamw_params``, one param group, one lr."""

    def __init__(
        self,
        lr: float = 1e-3,
        wd: float = 0.1,
        muon_params: Any = None,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        adamw_params: Any = None,
        adamw_betas: tuple[float, float] = (0.9, 0.95),
        adamw_eps: float = 1e-8,
    ) -> None:
        defaults = dict(
            lr=lr, wd=wd, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps,
            adamw_betas=adamw_betas, adamw_eps=adamw_eps,
        )
        muon_params = list(muon_params)
        adamw_params = list(adamw_params) if adamw_params is not None else []
        super().__init__(muon_params + adamw_params, defaults)
        for p in muon_params:
            assert p.ndim == 2, p.ndim
            self.state[p]["use_muon"] = True
        for p in adamw_params:
            self.state[p]["use_muon"] = False

    def adjust_lr_for_muon(self, lr: float, param_shape: torch.Size) -> float:
        rows, cols = param_shape[:2]
        # scale so the update RMS matches AdamW's (the Moonlight paper's 0.2 * sqrt(max dim))
        return lr * (0.2 * math.sqrt(max(rows, cols)))

    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, wd, momentum = group["lr"], group["wd"], group["momentum"]
            for p in [p for p in group["params"] if self.state[p]["use_muon"]]:
                g = p.grad
                if g is None:
                    continue
                if g.ndim > 2:
                    g = g.view(g.size(0), -1)
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(g)
                buf = state["momentum_buffer"]
                buf.mul_(momentum).add_(g)
                g = g.add(buf, alpha=momentum) if group["nesterov"] else buf
                u = zeropower_via_newtonschulz5(g, steps=group["ns_steps"])
                p.data.mul_(1 - lr * wd)
                p.data.add_(u, alpha=-self.adjust_lr_for_muon(lr, p.shape))

            beta1, beta2 = group["adamw_betas"]
            eps = group["adamw_eps"]
            for p in [p for p in group["params"] if not self.state[p]["use_muon"]]:
                g = p.grad
                if g is None:
                    continue
                state = self.state[p]
                if "step" not in state:
                    state["step"] = 0
                    state["moment1"] = torch.zeros_like(g)
                    state["moment2"] = torch.zeros_like(g)
                state["step"] += 1
                step = state["step"]
                buf1, buf2 = state["moment1"], state["moment2"]
                buf1.lerp_(g, 1 - beta1)
                buf2.lerp_(g.square(), 1 - beta2)
                g = buf1 / (eps + buf2.sqrt())
                scale = (1 - beta1**step) / (1 - beta2**step) ** 0.5
                p.data.mul_(1 - lr * wd)
                p.data.add_(g, alpha=-lr / scale)
        return loss
