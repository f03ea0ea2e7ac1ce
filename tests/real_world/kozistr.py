"""kozistr/pytorch_optimizer ``optimizer/muon.py``: ``Muon``, ``AdaMuon``, ``AdaGO``.

The library's conventions, rewritten in the same shape:

- a ``BaseOptimizer`` with helpers: ``debias(beta, step) = 1 - math.pow(beta, step)``,
  ``apply_weight_decay`` (decoupled: ``p.mul_(1 - wd * lr)``), ``maximize_gradient``;
- ``init_group`` creates state lazily and ``group["step"]`` is a Python int the
  step bumps (``group["step"] += 1``); groups carry ``use_muon`` flags;
- bias corrections on the host, including ``math.sqrt(debias(beta2, step))``;
- Newton–Schulz written with preallocated buffers and ``torch.addmm`` /
  ``torch.baddbmm(..., out=)``: ``A = 0·A + X Xᵀ`` (``beta=0.0``),
  ``B = b A + c A²``, ``C = a X + B X``, buffers swapped; the norm scaled by a
  safety factor and clamped in place (``x.div_(x.norm().mul_(s).clamp_min_(eps))``);
- ``get_adjusted_lr``: ``0.2 * math.sqrt(max(m, n))`` (Moonlight) or ``√max(1, m/n)``.

AdamW-only ``use_muon=False`` groups are Adam with ``math.sqrt`` bias correction.
AdaGO's step size reads the grad norm on the host: ``min(grad.norm() ** 2, gamma ** 2)``
is a Python comparison of a tensor, and the lr is ``max(eps, ...).item()``.
"""

from __future__ import annotations

import math
from typing import Any

import torch

NS_DTYPE = torch.bfloat16


def zero_power_via_newton_schulz_5(
    g: torch.Tensor,
    num_steps: int = 5,
    eps: float = 1e-7,
    safety_factor: float = 1.0,
    weights: tuple[float, float, float] = (3.4445, -4.7750, 2.0315),
) -> torch.Tensor:
    if g.ndim < 2:
        raise ValueError(f"input must be at least 2-D, got {g.ndim}-D")
    x = g.to(NS_DTYPE)
    transpose = x.size(-2) > x.size(-1)
    if transpose:
        x = x.mT
    x.div_(x.norm(2, dim=(-2, -1), keepdim=True).mul_(safety_factor).clamp_min_(eps))
    mm_fn = torch.baddbmm if x.ndim > 2 else torch.addmm
    x = x.contiguous()
    gram = torch.empty((*x.shape[:-1], x.size(-2)), device=x.device, dtype=x.dtype)
    poly = torch.empty_like(gram)
    nxt = torch.empty_like(x)
    for _ in range(num_steps):
        mm_fn(gram, x, x.mT, beta=0.0, alpha=1.0, out=gram)
        mm_fn(gram, gram, gram, beta=weights[1], alpha=weights[2], out=poly)
        mm_fn(x, poly, x, beta=weights[0], alpha=1.0, out=nxt)
        x, nxt = nxt, x
    return x.mT if transpose else x


def get_adjusted_lr(lr: float, param_shape: tuple[int, ...], use_adjusted_lr: bool = False) -> float:
    fan_out, *rest = param_shape
    fan_in = math.prod(rest)
    if use_adjusted_lr:
        return lr * math.pow(max(1.0, fan_out / fan_in), 0.5)
    return lr * (0.2 * math.sqrt(max(fan_out, fan_in)))


class BaseOptimizer(torch.optim.Optimizer):
    """The few helpers the library's optimizers share."""

    @staticmethod
    def debias(beta: float, step: int) -> float:
        return 1.0 - math.pow(beta, step)

    @staticmethod
    def apply_weight_decay(p: torch.Tensor, grad: torch.Tensor, lr: float, weight_decay: float,
                           weight_decouple: bool) -> None:
        if weight_decouple:
            p.mul_(1.0 - weight_decay * lr)
        elif weight_decay > 0.0:
            grad.add_(p, alpha=weight_decay)

    @staticmethod
    def maximize_gradient(grad: torch.Tensor, maximize: bool = False) -> None:
        if maximize:
            grad.neg_()

    def _adam_step(self, p: torch.Tensor, group: dict[str, Any]) -> None:
        state, grad = self.state[p], p.grad
        beta1, beta2 = group["betas"]
        bias_correction1 = self.debias(beta1, group["step"])
        bias_correction2_sq = math.sqrt(self.debias(beta2, group["step"]))
        state["exp_avg"].lerp_(grad, weight=1.0 - beta1)
        state["exp_avg_sq"].lerp_(grad.square(), weight=1.0 - beta2)
        de_nom = state["exp_avg_sq"].sqrt().add_(group["eps"]).div_(bias_correction2_sq)
        p.addcdiv_(state["exp_avg"] / bias_correction1, de_nom, value=-group["lr"])

    def _init_group(self, group: dict[str, Any], muon_state: dict[str, Any]) -> None:
        if "step" not in group:
            group["step"] = 0
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if len(state) == 0:
                if group["use_muon"]:
                    state.update({k: make(p) for k, make in muon_state.items()})
                else:
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)


def _fill_groups(params: Any, muon: dict[str, Any], adamw: dict[str, Any]) -> list[dict[str, Any]]:
    groups = list(params)
    for group in groups:
        if "use_muon" not in group:
            raise ValueError("`use_muon` must be set.")
        for key, value in (muon if group["use_muon"] else adamw).items():
            group.setdefault(key, value)
        group.setdefault("weight_decouple", True)
    return groups


class Muon(BaseOptimizer):
    def __init__(self, params: Any, lr: float = 2e-2, momentum: float = 0.95, weight_decay: float = 0.0,
                 nesterov: bool = True, ns_steps: int = 5, use_adjusted_lr: bool = False, adamw_lr: float = 3e-4,
                 adamw_betas: tuple[float, float] = (0.9, 0.95), adamw_wd: float = 0.0, adamw_eps: float = 1e-10,
                 maximize: bool = False) -> None:
        self.maximize = maximize
        muon = dict(lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay, ns_steps=ns_steps,
                    use_adjusted_lr=use_adjusted_lr)
        adamw = dict(lr=adamw_lr, betas=adamw_betas, eps=adamw_eps, weight_decay=adamw_wd)
        super().__init__(_fill_groups(params, muon, adamw), {})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            self._init_group(group, {"momentum_buffer": torch.zeros_like})
            group["step"] += 1
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                self.maximize_gradient(grad, maximize=self.maximize)
                self.apply_weight_decay(p, grad, group["lr"], group["weight_decay"], group["weight_decouple"])
                if not group["use_muon"]:
                    self._adam_step(p, group)
                    continue
                buf = self.state[p]["momentum_buffer"]
                buf.lerp_(grad, weight=1.0 - group["momentum"])
                update = grad.lerp_(buf, weight=group["momentum"]) if group["nesterov"] else buf
                if update.ndim > 2:
                    update = update.view(len(update), -1)
                update = zero_power_via_newton_schulz_5(update, num_steps=group["ns_steps"])
                lr = get_adjusted_lr(group["lr"], p.size(), use_adjusted_lr=group["use_adjusted_lr"])
                p.add_(update.reshape(p.shape), alpha=-lr)
        return loss


class AdaMuon(BaseOptimizer):
    """Muon with an Adam-like second moment on the orthogonalised update, RMS-matched to AdamW."""

    def __init__(self, params: Any, lr: float = 2e-2, betas: tuple[float, float] = (0.9, 0.95),
                 weight_decay: float = 0.0, ns_steps: int = 5, use_adjusted_lr: bool = False,
                 adamw_lr: float = 3e-4, adamw_betas: tuple[float, float] = (0.9, 0.999), adamw_wd: float = 0.0,
                 eps: float = 1e-10, maximize: bool = False) -> None:
        self.maximize = maximize
        muon = dict(lr=lr, betas=betas, weight_decay=weight_decay, ns_steps=ns_steps,
                    use_adjusted_lr=use_adjusted_lr, eps=eps)
        adamw = dict(lr=adamw_lr, betas=adamw_betas, weight_decay=adamw_wd, eps=eps)
        super().__init__(_fill_groups(params, muon, adamw), {})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            self._init_group(group, {"m": torch.zeros_like, "v": lambda p: torch.zeros_like(p.flatten())})
            group["step"] += 1
            beta1, beta2 = group["betas"]
            bias_correction2 = self.debias(beta2, group["step"])
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                self.maximize_gradient(grad, maximize=self.maximize)
                self.apply_weight_decay(p, grad, group["lr"], group["weight_decay"], group["weight_decouple"])
                if not group["use_muon"]:
                    self._adam_step(p, group)
                    continue
                m, v = self.state[p]["m"], self.state[p]["v"]
                m.lerp_(grad, weight=1.0 - beta1)
                update = m.clone()
                if update.ndim > 2:
                    update = update.view(len(update), -1)
                update = zero_power_via_newton_schulz_5(update, num_steps=group["ns_steps"]).flatten()
                v.mul_(beta2).addcmul_(update, update, value=1.0 - beta2)
                update.div_((v / bias_correction2).sqrt_().add_(group["eps"]))
                update = update.reshape(p.size())
                update.mul_(0.2 * math.sqrt(p.numel())).div_(update.norm().add_(group["eps"]))
                lr = get_adjusted_lr(group["lr"], p.size(), use_adjusted_lr=group["use_adjusted_lr"])
                p.add_(update, alpha=-lr)
        return loss


class AdaGO(BaseOptimizer):
    """AdaGrad-style step size on orthogonal updates: the step reads the grad norm on the host."""

    def __init__(self, params: Any, lr: float = 5e-2, momentum: float = 0.95, weight_decay: float = 0.0,
                 gamma: float = 10.0, eps: float = 5e-4, v: float = 1e-6, nesterov: bool = False, ns_steps: int = 5,
                 use_adjusted_lr: bool = False, adamw_lr: float = 3e-4, adamw_betas: tuple[float, float] = (0.9, 0.95),
                 adamw_wd: float = 0.0, adamw_eps: float = 1e-10, maximize: bool = False) -> None:
        self.maximize = maximize
        muon = dict(lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay, ns_steps=ns_steps,
                    gamma=gamma, eps=eps, v=v, use_adjusted_lr=use_adjusted_lr)
        adamw = dict(lr=adamw_lr, betas=adamw_betas, eps=adamw_eps, weight_decay=adamw_wd)
        super().__init__(_fill_groups(params, muon, adamw), {})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            v0 = group.get("v", 0.0)
            self._init_group(group, {
                "momentum_buffer": torch.zeros_like,
                "v": lambda p, v0=v0: torch.tensor(v0, dtype=p.dtype, device=p.device),
            })
            group["step"] += 1
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                self.maximize_gradient(grad, maximize=self.maximize)
                self.apply_weight_decay(p, grad, group["lr"], group["weight_decay"], group["weight_decouple"])
                if not group["use_muon"]:
                    self._adam_step(p, group)
                    continue
                buf, v = self.state[p]["momentum_buffer"], self.state[p]["v"]
                buf.lerp_(grad, weight=1.0 - group["momentum"])
                v.add_(min(grad.norm(p=2.0).pow(2), group["gamma"] ** 2))
                update = grad.lerp_(buf, weight=group["momentum"]) if group["nesterov"] else buf
                if update.ndim > 2:
                    update = update.view(len(update), -1)
                update = zero_power_via_newton_schulz_5(update, num_steps=group["ns_steps"])
                lr = get_adjusted_lr(group["lr"], p.size(), use_adjusted_lr=group["use_adjusted_lr"])
                step_size = max(group["eps"], lr * min(grad.norm(2), group["gamma"]) / v).item()
                p.add_(update.reshape(p.shape), alpha=-step_size)
        return loss
