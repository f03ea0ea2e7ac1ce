"""The Polar Express paper's reference ``polar_express`` (Amsel, Persson, Musco, Gower,
arXiv:2505.16932, github.com/NoahAmsel/PolarExpress) as dropped into Muon optimizers.

The patterns, rewritten in the same shape:

- eight coefficient triples, the first seven divided by a safety factor
  (``a / 1.01, b / 1.01**3, c / 1.01**5``) at import time, the last one repeated
  when more steps are asked for (``coeffs[:steps] + repeat(coeffs[-1], ...)``);
- the norm gets the safety factor too: ``X / (‖X‖ * 1.01 + 1e-7)``;
- ``@torch.compile`` on the function, and the result cast back to the input dtype.

The optimizer around it is a Keller-Jordan-style single-device Muon whose
group carries ``ns_steps``.

``NS_DTYPE``: the Newton–Schulz compute dtype (bf16 in the original).
"""

from __future__ import annotations

from itertools import repeat
from typing import Any

import torch

NS_DTYPE = torch.bfloat16

_COEFFICIENTS = [
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
    (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
    (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
    (1.875, -1.25, 0.375),  # the limit: later iterations use it unchanged
]
# Safety factor: every polynomial but the last is made to tolerate σ up to 1.01.
COEFFICIENTS = [(a / 1.01, b / 1.01**3, c / 1.01**5) for a, b, c in _COEFFICIENTS[:-1]] + [_COEFFICIENTS[-1]]


@torch.compile
def polar_express(G: torch.Tensor, steps: int = 5) -> torch.Tensor:
    assert G.ndim >= 2
    X = G.to(NS_DTYPE)
    if G.size(-2) > G.size(-1):
        X = X.mT
    X = X / (X.norm(dim=(-2, -1), keepdim=True) * 1.01 + 1e-7)
    schedule = COEFFICIENTS[:steps] + list(repeat(COEFFICIENTS[-1], steps - len(COEFFICIENTS)))
    for a, b, c in schedule:
        A = X @ X.mT
        B = b * A + c * A @ A
        X = a * X + B @ X
    if G.size(-2) > G.size(-1):
        X = X.mT
    return X.to(G.dtype)


class PolarExpressMuon(torch.optim.Optimizer):
    def __init__(self, params: Any, lr: float = 0.02, weight_decay: float = 0.0, momentum: float = 0.95,
                 ns_steps: int = 5) -> None:
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay, momentum=momentum, ns_steps=ns_steps))

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
                update = polar_express(p.grad.lerp_(buf, group["momentum"]), steps=group["ns_steps"])
                update *= max(1, p.size(-2) / p.size(-1)) ** 0.5
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(update, alpha=-group["lr"])
        return loss
