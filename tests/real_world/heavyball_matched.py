"""A "simple Muon numerically matched to HeavyBall" (heavyball's ``utils.zeropower_via_newtonschulz5``
arithmetic in a plain torch.optim-style class), as found in training repos that want
HeavyBall's numbers without its compiled kernels.

The patterns, rewritten in the same shape:

- Newton–Schulz in the *input* dtype (fp32, no bf16 cast), normalised by
  ``x / clamp(‖G‖, min=eps)`` (a 0-D norm, no keepdim);
- each iteration in Horner form with in-place identity shifts:
  ``y = c S; y.diagonal().add_(b); y = y @ S; y.diagonal().add_(a); x = y @ x``
  — the same polynomial ``a X + b S X + c S² X``, products regrouped;
- Dion's five tuned coefficient triples;
- ``torch.optim``'s ``_to_scalar(lr)`` idiom, ``buf.mul_(m); buf.add_(g)``,
  Nesterov as ``grad.add_(buf * momentum)``;
- 1-D params share the group and simply skip the orthogonalisation
  (``if grad.ndim >= 2``).

``NS_DTYPE``: the Newton–Schulz compute dtype (the input's, fp32, in the original).
"""

from __future__ import annotations

from typing import Any

import torch

NS_DTYPE = torch.float32

COEFFICIENTS = [
    (4.0848, -6.8946, 2.9270),
    (3.9505, -6.3029, 2.6377),
    (3.7418, -5.5913, 2.3037),
    (2.8769, -3.1427, 1.2046),
    (2.8366, -3.0525, 1.2012),
]


def zeropower_via_newtonschulz5(G: torch.Tensor, eps: float = 1e-7) -> torch.Tensor:
    G = G.to(NS_DTYPE, copy=True)
    x = G
    if G.size(-2) > G.size(-1):
        x = x.mT
    x = x / torch.clamp(G.norm(dim=(-2, -1)), min=eps)
    for a, b, c in COEFFICIENTS:
        s = x @ x.mT
        y = c * s
        y.diagonal(dim1=-2, dim2=-1).add_(b)  # c S + b I
        y = y @ s
        y.diagonal(dim1=-2, dim2=-1).add_(a)  # c S² + b S + a I
        x = y @ x
    if G.size(-2) > G.size(-1):
        x = x.mT
    return x


class Muon(torch.optim.Optimizer):
    def __init__(self, params: Any, lr: float = 0.0025, weight_decay: float = 0.0, momentum: float = 0.9,
                 eps: float = 1e-8) -> None:
        if lr < 0.0:
            raise ValueError(f"Learning rate should be >= 0 but is: {lr}")
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay, momentum=momentum, eps=eps))

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr = group["lr"]
            lr = lr.item() if isinstance(lr, torch.Tensor) else lr  # torch.optim's _to_scalar
            momentum, weight_decay = group["momentum"], group["weight_decay"]
            for param in group["params"]:
                grad = param.grad
                if grad is None:
                    continue
                state = self.state[param]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(grad, memory_format=torch.preserve_format)
                buf = state["momentum_buffer"]
                buf.mul_(momentum)
                buf.add_(grad)
                grad.add_(buf * momentum)
                if grad.ndim >= 2:
                    grad = grad.view(grad.shape[0], -1)
                    grad = zeropower_via_newtonschulz5(grad)
                    grad *= max(1, grad.size(-2) / grad.size(-1)) ** 0.5
                param.mul_(1 - lr * weight_decay)
                param.sub_(lr * grad.view(param.shape))
        return loss
