"""karpathy/nanochat: ``nanochat/optim.py`` ``MuonAdamW`` and ``nanochat/muon.py`` ``DistMuon``.

``MuonAdamW`` (the current single-GPU optimizer), rewritten in the same shape:

- groups carry ``kind="adamw"|"muon"``; a Muon group holds same-shaped
  matrices that are *stacked* (``torch.stack``) and updated as one batch, the
  result copied back with ``torch._foreach_copy_``; the group's momentum and
  factored second moment live in the *first* param's state;
- hyperparameters reach the math through 0-D float32 CPU tensors held as
  optimizer attributes and ``fill_``-ed from the group every step (nanochat's
  way to keep ``torch.compile`` from recompiling), including the int step;
- both updates are ``@torch.compile(dynamic=False, fullgraph=True)`` functions;
- the Muon kernel: Nesterov momentum with a tensor weight, MuonEq row
  equilibration, Polar Express (coefficient list ``[:ns_steps]``, safety
  factor ``‖X‖ * 1.01 + 1e-6``, a tall branch iterating on ``Xᵀ X`` with
  ``X @ B``), Muon+ renormalisation to √min(m, n), NorMuon variance
  reduction, cautious weight decay.

``DistMuon`` (the earlier distributed Muon): params grouped by shape with a
``zero_buffer`` *tensor in each param group*; grads are averaged with async
``dist.reduce_scatter`` (``ReduceOp.AVG``), each rank updates the params it
owns and async ``dist.all_gather``s them back; ``@torch.compile`` Keller Jordan NS.

``NS_DTYPE`` plays nanochat's ``COMPUTE_DTYPE``: bf16 here, float64 for the exact trajectory.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

NS_DTYPE = torch.bfloat16

# Polar Express, num_iters=5, safety_factor=2e-2, cushion=2 (Amsel et al., arXiv:2505.16932).
POLAR_EXPRESS = [
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
]


@torch.compile(dynamic=False, fullgraph=True)
def adamw_step_fused(
    p: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor,
    step_t: Tensor, lr_t: Tensor, beta1_t: Tensor, beta2_t: Tensor, eps_t: Tensor, wd_t: Tensor,
) -> None:
    p.mul_(1 - lr_t * wd_t)
    exp_avg.lerp_(grad, 1 - beta1_t)
    exp_avg_sq.lerp_(grad.square(), 1 - beta2_t)
    bias1 = 1 - beta1_t**step_t
    bias2 = 1 - beta2_t**step_t
    denom = (exp_avg_sq / bias2).sqrt() + eps_t
    p.add_(exp_avg / denom, alpha=-(lr_t / bias1))


@torch.compile(dynamic=False, fullgraph=True)
def muon_step_fused(
    grads: Tensor, params: Tensor, momentum_buffer: Tensor, second_momentum: Tensor,
    momentum_t: Tensor, lr_t: Tensor, wd_t: Tensor, beta2_t: Tensor, ns_steps: int, red_dim: int,
) -> None:
    momentum = momentum_t.to(grads.dtype)
    momentum_buffer.lerp_(grads, 1 - momentum)
    g = grads.lerp_(momentum_buffer, momentum)

    X = g.to(NS_DTYPE)
    # MuonEq: every row rescaled to the mean row norm before orthogonalising
    target = X.float().norm(dim=(-2, -1), keepdim=True) / (X.size(-2) ** 0.5)
    row_norm = X.float().norm(dim=-1, keepdim=True).clamp_min(1e-6)
    X = X * (target / row_norm).to(X.dtype)

    X = X / (X.norm(dim=(-2, -1), keepdim=True) * 1.01 + 1e-6)
    if g.size(-2) > g.size(-1):  # tall: iterate on the small Xᵀ X, multiply from the right
        for a, b, c in POLAR_EXPRESS[:ns_steps]:
            A = X.mT @ X
            B = b * A + c * (A @ A)
            X = a * X + X @ B
    else:
        for a, b, c in POLAR_EXPRESS[:ns_steps]:
            A = X @ X.mT
            B = b * A + c * (A @ A)
            X = a * X + B @ X
    g = X.to(params.dtype)

    # Muon+: snap the Frobenius norm to that of a semi-orthogonal matrix
    g = g * (min(g.size(-2), g.size(-1)) ** 0.5 / g.float().norm(dim=(-2, -1), keepdim=True).clamp_min(1e-6)).to(
        g.dtype
    )

    # NorMuon: per-row (or per-column) second moment, update norm preserved
    beta2 = beta2_t.to(g.dtype)
    v_mean = g.float().square().mean(dim=red_dim, keepdim=True)
    red_size = g.size(red_dim)
    v_norm = (v_mean.sum(dim=(-2, -1), keepdim=True) * red_size).sqrt()
    second_momentum.lerp_(v_mean.to(second_momentum.dtype), 1 - beta2)
    step_size = second_momentum.clamp_min(1e-10).rsqrt()
    v_norm_new = ((v_mean * red_size) * step_size.float().square()).sum(dim=(-2, -1), keepdim=True).sqrt()
    g = g * (step_size * (v_norm / v_norm_new.clamp_min(1e-10))).to(g.dtype)

    # cautious weight decay: decay only where the update agrees with the weight
    lr = lr_t.to(g.dtype)
    wd = wd_t.to(g.dtype)
    mask = (g * params) >= 0
    params.sub_(lr * g + lr * wd * params * mask)


def _scalar() -> Tensor:
    return torch.tensor(0.0, dtype=torch.float32, device="cpu")


class MuonAdamW(torch.optim.Optimizer):
    """Muon for the ``kind="muon"`` groups (same-shaped matrices), fused AdamW for ``kind="adamw"``."""

    def __init__(self, param_groups: list[dict[str, Any]]) -> None:
        super().__init__(param_groups, defaults={})
        self._adamw_step_t, self._adamw_lr_t, self._adamw_beta1_t = _scalar(), _scalar(), _scalar()
        self._adamw_beta2_t, self._adamw_eps_t, self._adamw_wd_t = _scalar(), _scalar(), _scalar()
        self._muon_momentum_t, self._muon_lr_t = _scalar(), _scalar()
        self._muon_wd_t, self._muon_beta2_t = _scalar(), _scalar()

    def _step_adamw(self, group: dict[str, Any]) -> None:
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if not state:
                state["step"] = 0
                state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg_sq"] = torch.zeros_like(p)
            state["step"] += 1
            self._adamw_step_t.fill_(state["step"])
            self._adamw_lr_t.fill_(group["lr"])
            self._adamw_beta1_t.fill_(group["betas"][0])
            self._adamw_beta2_t.fill_(group["betas"][1])
            self._adamw_eps_t.fill_(group["eps"])
            self._adamw_wd_t.fill_(group["weight_decay"])
            adamw_step_fused(
                p, p.grad, state["exp_avg"], state["exp_avg_sq"], self._adamw_step_t, self._adamw_lr_t,
                self._adamw_beta1_t, self._adamw_beta2_t, self._adamw_eps_t, self._adamw_wd_t,
            )

    def _step_muon(self, group: dict[str, Any]) -> None:
        params: list[Tensor] = group["params"]
        if not params:
            return
        first = params[0]
        state = self.state[first]  # the whole group's buffers live with its first param
        shape = first.shape
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros(len(params), *shape, dtype=first.dtype)
        if "second_momentum_buffer" not in state:
            factored = (len(params), *shape[:-1], 1) if shape[-2] >= shape[-1] else (len(params), 1, shape[-1])
            state["second_momentum_buffer"] = torch.zeros(factored, dtype=first.dtype)
        red_dim = -1 if shape[-2] >= shape[-1] else -2
        stacked_grads = torch.stack([p.grad for p in params])
        stacked_params = torch.stack(params)
        self._muon_momentum_t.fill_(group["momentum"])
        self._muon_beta2_t.fill_(group["beta2"] if group["beta2"] is not None else 0.0)
        self._muon_lr_t.fill_(group["lr"] * max(1.0, shape[-2] / shape[-1]) ** 0.5)
        self._muon_wd_t.fill_(group["weight_decay"])
        muon_step_fused(
            stacked_grads, stacked_params, state["momentum_buffer"], state["second_momentum_buffer"],
            self._muon_momentum_t, self._muon_lr_t, self._muon_wd_t, self._muon_beta2_t,
            group["ns_steps"], red_dim,
        )
        torch._foreach_copy_(params, list(stacked_params.unbind(0)))

    @torch.no_grad()
    def step(self) -> None:  # type: ignore[override]
        for group in self.param_groups:
            if group["kind"] == "adamw":
                self._step_adamw(group)
            elif group["kind"] == "muon":
                self._step_muon(group)
            else:
                raise ValueError(f"unknown optimizer kind: {group['kind']}")


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


class DistMuon(torch.optim.Optimizer):
    """Muon that averages its own grads (reduce_scatter) and replicates its own results (all_gather)."""

    def __init__(self, params: Any, lr: float = 0.02, momentum: float = 0.95, nesterov: bool = True,
                 ns_steps: int = 5) -> None:
        params = list(params)
        assert all(p.ndim == 2 for p in params), "Muon expects 2D parameters only"
        groups = []
        for shape in sorted({p.shape for p in params}):  # sorted: the same order on every rank
            same = [p for p in params if p.shape == shape]
            groups.append(dict(params=same, zero_buffer=torch.zeros_like(same[0])))
        super().__init__(groups, dict(lr=lr, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps))

    @torch.no_grad()
    def step(self) -> None:  # type: ignore[override]
        rank, world = dist.get_rank(), dist.get_world_size()
        assert all(p.grad is not None for group in self.param_groups for p in group["params"])
        reduce_futures = []
        for group in self.param_groups:
            params, zero = group["params"], group["zero_buffer"]
            for base in range(0, len(params), world):
                owner = base + rank
                inputs = [p.grad for p in params[base : base + world]]
                inputs += [zero] * (world - len(inputs))
                output = params[owner].grad if owner < len(params) else torch.empty_like(zero)
                # (nanochat keeps work.get_future(); gloo's reduce_scatter work has no future, wait() is the same)
                reduce_futures.append(dist.reduce_scatter(output, inputs, op=dist.ReduceOp.AVG, async_op=True))
        gather_futures = []
        index = 0
        for group in self.param_groups:
            params, zero = group["params"], group["zero_buffer"]
            for base in range(0, len(params), world):
                owner = base + rank
                reduce_futures[index].wait()
                index += 1
                if owner < len(params):
                    p = params[owner]
                    g = p.grad
                    state = self.state[p]
                    if "momentum_buffer" not in state:
                        state["momentum_buffer"] = torch.zeros_like(g)
                    buf = state["momentum_buffer"]
                    buf.lerp_(g, 1.0 - group["momentum"])
                    g = g.lerp_(buf, group["momentum"]) if group["nesterov"] else buf
                    g = zeropower_via_newtonschulz5(g, steps=group["ns_steps"])
                    p.add_(g, alpha=-group["lr"] * max(1.0, p.size(-2) / p.size(-1)) ** 0.5)
                source = params[owner] if owner < len(params) else zero
                outputs = params[base : base + world]
                outputs += [torch.empty_like(zero) for _ in range(world - len(outputs))]
                gather_futures.append(dist.all_gather(outputs, source, async_op=True).get_future())
        torch.futures.collect_all(gather_futures).wait()
