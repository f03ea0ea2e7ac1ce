"""KellerJordan/modded-nanogpt ``train_gpt.py``: the record-era ``Muon`` and today's ``NorMuonAndAdam``.

``Muon`` (records of early 2025), rewritten in the same shape:

- ``@torch.compile`` batched Keller Jordan NS;
- params grouped by ``numel`` (a 16×32 and a 32×16 matrix share a group) and
  each group holds an ``update_buffer`` tensor and its per-rank views, *in
  the param group dict*;
- each rank orthogonalises its share, flattens it and
  ``dist.all_gather_into_tensor(update_buffer, g, async_op=True)``; the
  *previous* round's updates are applied by a closure (``update_prev``) after
  ``handle.wait()`` — the updates travel in bf16.

(The original's buffer is ``(world_size, numel)``; it is flat here because the
gloo backend the tests run on only gathers into a flat tensor.)

``NorMuonAndAdam`` (the current script): *not* a ``torch.optim.Optimizer``.
Per-param ``ParamConfig`` dataclasses (lr, lr_mul, wd_mul...) looked up by a
``label`` attribute on each param, state in ``param_states``, 0-D CPU tensors
``fill_``-ed per step, ``@torch.compile(dynamic=False, fullgraph=True)``
kernels, grads set to None at the end of ``step``. Its Polar Express writes
into preallocated buffers with ``out=``: tall matrices iterate on ``Xᵀ X`` and
multiply from the right (``addmm(X, X, B, beta=a, out=C)``), the norm carries
a ``(1 + 2e-2)`` safety factor. (Omitted: sharding, mantissa tracking of bf16
params, tied embeddings.)

``NS_DTYPE``: the Newton–Schulz compute dtype (bf16 in the original).
"""

# update_prev() reads the loop's *latest* handle and params on purpose (it applies the previous round).
# ruff: noqa: B023

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

NS_DTYPE = torch.bfloat16


@torch.compile
def zeropower_via_newtonschulz5(G: Tensor, steps: int) -> Tensor:
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


class Muon(torch.optim.Optimizer):
    def __init__(self, params: Any, lr: float = 0.02, momentum: float = 0.95, nesterov: bool = True,
                 ns_steps: int = 5, rank: int = 0, world_size: int = 1) -> None:
        self.rank, self.world_size = rank, world_size
        params = [*params]
        assert all(isinstance(p, Tensor) for p in params)

        def update_buffer(size: int) -> dict[str, Any]:
            flat = torch.empty(world_size * size, dtype=torch.bfloat16)
            views = [flat[i * size : (i + 1) * size] for i in range(world_size)]
            return dict(update_buffer=flat, update_buffer_views=views)

        sizes = sorted({p.numel() for p in params})
        groups = [dict(params=[p for p in params if p.numel() == size], **update_buffer(size)) for size in sizes]
        super().__init__(groups, dict(lr=lr, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps))

    @torch.no_grad()
    def step(self) -> None:  # type: ignore[override]
        for group in self.param_groups:
            lr, momentum, nesterov = group["lr"], group["momentum"], group["nesterov"]
            update_buffer: Tensor = group["update_buffer"]
            views: list[Tensor] = group["update_buffer_views"]
            params: list[Tensor] = group["params"]
            handle = None
            in_flight: list[Tensor] | None = None

            def update_prev() -> None:  # apply the previous round once its gather is done
                if in_flight is None:
                    return
                assert handle is not None
                handle.wait()
                for p_world, g_world in zip(in_flight, views):
                    aspect = max(1, p_world.size(-2) / p_world.size(-1)) ** 0.5
                    p_world.add_(g_world.view_as(p_world), alpha=-lr * aspect)

            for base in range(len(params))[:: self.world_size]:
                if base + self.rank < len(params):
                    p = params[base + self.rank]
                    g = p.grad
                    assert g is not None
                    state = self.state[p]
                    if "momentum_buffer" not in state:
                        state["momentum_buffer"] = torch.zeros_like(g)
                    buf: Tensor = state["momentum_buffer"]
                    buf.lerp_(g, 1 - momentum)
                    g = g.lerp_(buf, momentum) if nesterov else buf
                    g = zeropower_via_newtonschulz5(g, steps=group["ns_steps"]).flatten()
                    g = g.to(update_buffer.dtype)  # a no-op in bf16; the exact-NS run (float64) is gathered in bf16
                else:
                    g = views[self.rank]
                update_prev()
                handle = dist.all_gather_into_tensor(update_buffer, g, async_op=True)
                in_flight = params[base : base + self.world_size]
            update_prev()


# -- NorMuonAndAdam -----------------------------------------------------------------

# Polar Express, num_iters=5, safety_factor=2e-2, cushion=2.
POLAR_EXPRESS = [
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
]


@torch.compile(dynamic=False, fullgraph=True)
def polar_express(grad_chunk: Tensor, momentum_buffer: Tensor, momentum_t: Tensor) -> Tensor:
    """Nesterov momentum in fp32, then Polar Express in bf16 into preallocated buffers."""
    momentum = momentum_t.to(grad_chunk.dtype)
    momentum_buffer.lerp_(grad_chunk, 1 - momentum)
    g = grad_chunk.lerp_(momentum_buffer, momentum)
    X = g.to(NS_DTYPE)
    is_tall = g.size(-2) > g.size(-1)
    X = X / (X.norm(dim=(-2, -1), keepdim=True) * (1 + 2e-2) + 1e-6)
    X = X.contiguous()
    fma = torch.baddbmm if X.ndim > 2 else torch.addmm
    side = X.size(-1) if is_tall else X.size(-2)
    A = torch.empty((*X.shape[:-2], side, side), dtype=X.dtype)
    B = torch.empty_like(A)
    C = torch.empty_like(X)
    for a, b, c in POLAR_EXPRESS:
        if is_tall:
            torch.matmul(X.mT, X, out=A)  # the small Gram matrix Xᵀ X
            fma(A, A, A, beta=b, alpha=c, out=B)
            fma(X, X, B, beta=a, out=C)  # a X + X B
        else:
            torch.matmul(X, X.mT, out=A)
            fma(A, A, A, beta=b, alpha=c, out=B)
            fma(X, B, X, beta=a, out=C)  # a X + B X
        X, C = C, X
    return X


@torch.compile(dynamic=False, fullgraph=True)
def normuon_variance_reduction(v_chunk: Tensor, second_momentum: Tensor, beta2: float, red_dim: int) -> Tensor:
    v_mean = v_chunk.float().square().mean(dim=red_dim, keepdim=True)
    red_size = v_chunk.size(red_dim)
    v_norm = v_mean.sum(dim=(-2, -1), keepdim=True).mul_(red_size).sqrt_()
    second_momentum.lerp_(v_mean.to(second_momentum.dtype), 1 - beta2)
    step_size = second_momentum.clamp_min(1e-10).rsqrt_()
    v_norm_new = ((v_mean * red_size) * step_size.float().square()).sum(dim=(-2, -1), keepdim=True).sqrt_()
    return v_chunk.mul_((step_size * (v_norm / v_norm_new.clamp_min_(1e-10))).type_as(v_chunk))


@torch.compile(dynamic=False, fullgraph=True)
def cautious_wd_and_update(p: Tensor, update: Tensor, wd_t: Tensor, lr_t: Tensor) -> None:
    update = update.float()
    mask = (update * p) >= 0
    p.copy_(p - p * mask * wd_t * lr_t - update * lr_t)


@torch.compile(dynamic=False, fullgraph=True)
def adam_update_step(p: Tensor, g: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, beta1: float, beta2: float,
                     eps: float, step_size_t: Tensor, eff_wd_t: Tensor) -> None:
    exp_avg.mul_(beta1).add_(g, alpha=1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    update = exp_avg.div(exp_avg_sq.sqrt().add_(eps)).mul_(step_size_t)
    mask = (update * p) > 0
    update.addcmul_(p, mask, value=eff_wd_t)
    p.add_(other=update, alpha=-1.0)


@dataclass
class ParamConfig:
    label: str
    optim: str  # "adam" | "normuon"
    lr: float
    lr_mul: float = 1.0
    wd_mul: float = 1.0
    weight_decay: float = 0.0
    adam_betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-10
    momentum: float = 0.95
    beta2: float = 0.95


class NorMuonAndAdam:
    """NorMuon for projection matrices, Adam for the rest, configured per param by its ``label``."""

    def __init__(self, named_params: Any, param_table: dict[str, dict[str, Any]], adam_defaults: dict[str, Any],
                 normuon_defaults: dict[str, Any]) -> None:
        self.param_cfgs: dict[Tensor, ParamConfig] = {}
        self.param_states: dict[Tensor, dict[str, Any]] = {}
        for _, param in named_params:
            entry = param_table[param.label]
            defaults = adam_defaults if entry["optim"] == "adam" else normuon_defaults
            cfg = ParamConfig(param.label, entry["optim"], lr=defaults["lr"], weight_decay=defaults["weight_decay"],
                              lr_mul=entry.get("lr_mul", 1.0), wd_mul=entry.get("wd_mul", 1.0))
            if cfg.optim == "adam":
                cfg.adam_betas = tuple(entry.get("adam_betas", cfg.adam_betas))  # type: ignore[assignment]
                cfg.eps = adam_defaults["eps"]
                self.param_states[param] = dict(step=0, exp_avg=torch.zeros_like(param),
                                                exp_avg_sq=torch.zeros_like(param))
            else:
                cfg.lr_mul *= max(1.0, param.size(-2) / param.size(-1)) ** 0.5
                cfg.momentum, cfg.beta2 = normuon_defaults["momentum"], normuon_defaults["beta2"]
                bank = (1, *param.shape)  # a bank of one matrix
                factored = (1, param.size(-2), 1) if param.size(-2) >= param.size(-1) else (1, 1, param.size(-1))
                self.param_states[param] = dict(momentum_buffer=torch.zeros(bank),
                                                second_momentum_buffer=torch.zeros(factored))
            self.param_cfgs[param] = cfg
        self._step_size_t = torch.tensor(0.0, dtype=torch.float32)
        self._eff_wd_t = torch.tensor(0.0, dtype=torch.float32)
        self._eff_lr_t = torch.tensor(0.0, dtype=torch.float32)
        self._momentum_t = torch.tensor(0.0, dtype=torch.float32)

    def _adam_update(self, param: Tensor, cfg: ParamConfig) -> None:
        beta1, beta2 = cfg.adam_betas
        lr = cfg.lr * cfg.lr_mul
        state = self.param_states[param]
        state["step"] += 1
        t = state["step"]
        bias1, bias2 = 1 - beta1**t, 1 - beta2**t
        self._step_size_t.fill_(lr * (bias2**0.5 / bias1))
        self._eff_wd_t.fill_(lr * lr * cfg.weight_decay * cfg.wd_mul)
        adam_update_step(param, param.grad, state["exp_avg"], state["exp_avg_sq"], beta1, beta2, cfg.eps,
                         self._step_size_t, self._eff_wd_t)

    def _normuon_update(self, param: Tensor, cfg: ParamConfig) -> None:
        state = self.param_states[param]
        grad_chunk = param.grad.view(1, *param.shape).float()
        self._momentum_t.fill_(cfg.momentum)
        self._eff_lr_t.fill_(cfg.lr_mul * cfg.lr)
        self._eff_wd_t.fill_(cfg.wd_mul * cfg.weight_decay * cfg.lr)
        v_chunk = polar_express(grad_chunk, state["momentum_buffer"], self._momentum_t)
        red_dim = -1 if param.size(-2) >= param.size(-1) else -2
        v_chunk = normuon_variance_reduction(v_chunk, state["second_momentum_buffer"], cfg.beta2, red_dim)
        cautious_wd_and_update(param.data.view(1, *param.shape), v_chunk, self._eff_wd_t, self._eff_lr_t)

    @torch.no_grad()
    def step(self, do_adam: bool = True) -> None:
        for param, cfg in self.param_cfgs.items():
            if param.grad is None or (cfg.optim == "adam" and not do_adam):
                continue
            if cfg.optim == "adam":
                self._adam_update(param, cfg)
            else:
                self._normuon_update(param, cfg)
        for param, cfg in self.param_cfgs.items():
            if cfg.optim == "adam" and not do_adam:
                continue  # Adam params accumulate grads over two steps
            param.grad = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        for param in self.param_cfgs:
            param.grad = None

    def state_dict(self) -> dict[str, Any]:
        return {"param_states": {id(p): s for p, s in self.param_states.items()}}
