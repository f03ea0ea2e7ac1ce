"""``fused=True``: torch's fused Adam/AdamW/SGD/Adagrad kernels run inside the compiled step.

Captured as opaque ``hocompile_torch::`` ops (hocompile/fused_kernels.py) that run torch's own
kernel, so every step is bitwise eager's ``fused=True`` step: params and every state tensor, over
10 steps with an lr change (a Python float, or a tensor lr filled in place) and a state_dict round
trip, with no recompile after the steady state. GradScaler: tests/test_runtime_robustness.py.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

import hocompile

SHAPES = [(8, 4), (5,), (3, 3, 2)]

CASES: dict[str, Any] = {
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2, fused=True),
    "adam-amsgrad-wd": lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True, weight_decay=0.1, fused=True),
    "adam-maximize": lambda ps: torch.optim.Adam(ps, lr=1e-2, maximize=True, fused=True),
    "adam-tensor-lr": lambda ps: torch.optim.Adam(ps, lr=torch.tensor(1e-2), fused=True),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
    "adamw-amsgrad": lambda ps: torch.optim.AdamW(ps, lr=1e-2, amsgrad=True, fused=True),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=1e-2, fused=True),
    "sgd-nesterov-wd": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, nesterov=True, weight_decay=0.01,
                                                  fused=True),
    "sgd-dampening": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, dampening=0.5, fused=True),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=1e-2, lr_decay=0.01, weight_decay=0.1, fused=True),
}


def _params() -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(*s, generator=gen)) for s in SHAPES]


def _set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    for group in opt.param_groups:
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr


def _state(opt: torch.optim.Optimizer, params: list[torch.nn.Parameter]) -> list[torch.Tensor]:
    return [v for p in params for _, v in sorted(opt.state[p].items()) if isinstance(v, torch.Tensor)]


@pytest.mark.parametrize("name", sorted(CASES))
def test_fused_step_is_bitwise_eager_fused(name: str, cache_dir: Path) -> None:
    eager_params, compiled_params = _params(), _params()
    eager = CASES[name](eager_params)
    compiled = hocompile.compile_optimizer(CASES[name](compiled_params), cache_dir=cache_dir)
    for k in range(10):
        if k == 4:
            for opt in (eager, compiled):
                _set_lr(opt, 5e-3)
        if k == 7:  # deep-copied: torch's load_state_dict keeps same-dtype tensors as they are (aliases)
            compiled.load_state_dict(copy.deepcopy(eager.state_dict()))
        gen = torch.Generator().manual_seed(100 + k)
        for pe, pc in zip(eager_params, compiled_params):
            g = torch.randn(pe.shape, generator=gen)
            pe.grad, pc.grad = g.clone(), g.clone()
        eager.step()
        compiled.step()
        got = compiled_params + _state(compiled, compiled_params)
        for a, b in zip(eager_params + _state(eager, eager_params), got, strict=True):
            assert torch.equal(a, b), f"{name}, step {k}: max diff {(a - b).abs().max()}"
    counters = compiled.counters
    assert counters.eager_fallbacks == 0 and counters.recompiles == [], counters.as_dict()
    code = str(compiled.history[-1].captured.gm.code)
    assert f"hocompile_torch.fused_{name.split('-')[0].replace('adamw', 'adam')}" in code


def test_a_fused_step_is_explained_as_torchs_kernel(cache_dir: Path) -> None:
    params = _params()
    compiled = hocompile.compile_optimizer(torch.optim.AdamW(params, lr=1e-2, fused=True), cache_dir=cache_dir)
    for p in params:
        p.grad = torch.ones_like(p)
    compiled.step()
    assert "fused_adam" in hocompile.explain(compiled)
