"""A schedule-free-style optimizer (Defazio et al.'s SGD variant, written here in our own words):
Python numbers the step rewrites in its groups (``lr_max = max(lr, lr_max)``, a running
``weight_sum``, a step count ``k`` with a warmup branch), a ``z`` sequence in state, ``y``/``x``
interpolations, and ``train()``/``eval()`` moving the params between them outside the step.

Before, the max() of the lifted ``lr_max`` recursed (its real value was the traced stand-in itself):
a RecursionError surfaced as a tracing failure. Now: bitwise eager over 10 steps with a warmup,
an eval()/train() round trip and an lr change; the only recompile is the warmup branch flipping.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

import hocompile


class ScheduleFreeSGD(torch.optim.Optimizer):
    def __init__(self, params: Any, lr: float = 0.1, momentum: float = 0.9, warmup_steps: int = 0) -> None:
        super().__init__(params, {"lr": lr, "momentum": momentum, "warmup_steps": warmup_steps, "k": 0,
                                  "train_mode": False, "weight_sum": 0.0, "lr_max": -1.0})

    @torch.no_grad()
    def _move(self, to_train: bool) -> None:
        for group in self.param_groups:
            if group["train_mode"] != to_train:
                beta = group["momentum"]
                for p in group["params"]:
                    if "z" in self.state[p]:  # x -> y going to train mode, y -> x going to eval mode
                        p.lerp_(self.state[p]["z"], 1 - beta if to_train else 1 - 1 / beta)
                group["train_mode"] = to_train

    def train(self, mode: bool = True) -> None:
        self._move(mode)

    def eval(self) -> None:
        self._move(False)

    @torch.no_grad()
    def step(self) -> None:  # type: ignore[override]
        for group in self.param_groups:
            assert group["train_mode"], "call train() before stepping"
            k, beta = group["k"], group["momentum"]
            lr = group["lr"] * ((k + 1) / group["warmup_steps"] if k < group["warmup_steps"] else 1.0)
            lr_max = group["lr_max"] = max(lr, group["lr_max"])
            weight = lr_max**2
            weight_sum = group["weight_sum"] = group["weight_sum"] + weight
            ckp1 = weight / weight_sum if weight_sum else 0.0
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "z" not in state:
                    state["z"] = p.clone()
                z = state["z"]
                p.lerp_(z, ckp1)  # y <- (1 - c) y + c z
                p.add_(p.grad, alpha=lr * (beta * (1 - ckp1) - 1))
                z.sub_(p.grad, alpha=lr)
            group["k"] = k + 1


def _params() -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(*s, generator=gen)) for s in [(8, 4), (5,), (3, 3)]]


def test_schedule_free_is_bitwise_eager_through_warmup_eval_and_lr_changes(cache_dir: Path) -> None:
    eager_params, compiled_params = _params(), _params()
    eager = ScheduleFreeSGD(eager_params, lr=0.05, warmup_steps=3)
    compiled = hocompile.compile_optimizer(ScheduleFreeSGD(compiled_params, lr=0.05, warmup_steps=3),
                                           cache_dir=cache_dir)
    for opt in (eager, compiled):
        opt.train()
    for k in range(10):
        if k == 5:  # evaluate, then back to training: params move outside the step
            for opt in (eager, compiled):
                opt.eval()
            assert all(torch.equal(a, b) for a, b in zip(eager_params, compiled_params))
            for opt in (eager, compiled):
                opt.train()
        if k == 6:
            for opt in (eager, compiled):
                opt.param_groups[0]["lr"] = 0.02
        gen = torch.Generator().manual_seed(100 + k)
        for pe, pc in zip(eager_params, compiled_params):
            g = torch.randn(pe.shape, generator=gen)
            pe.grad, pc.grad = g.clone(), g.clone()
        eager.step()
        compiled.step()
        for pe, pc in zip(eager_params, compiled_params):
            assert torch.equal(pe, pc), f"step {k}: {(pe - pc).abs().max()}"
            assert torch.equal(eager.state[pe]["z"], compiled.state[pc]["z"])
        assert {key: v for key, v in eager.param_groups[0].items() if key != "params"} == {
            key: v for key, v in compiled.param_groups[0].items() if key != "params"
        }
    counters = compiled.counters
    assert counters.eager_fallbacks == 0
    # k < warmup_steps flips once (a guard on the host counter k); lr changes never recompile
    assert len(counters.recompiles) <= 1 and all("guard failed" in r for r in counters.recompiles), counters.recompiles
