"""``fused=True``: torch's fused Adam/AdamW/SGD/Adagrad kernels.

torch.optim's own fused step is one kernel call over every param: it runs as torch runs it
(``counters.as_is``, an explain() line). A class that calls the kernels among its own code (here:
subclasses whose ``step`` is their own) is compiled, the kernels captured as opaque
``hocompile_torch::`` ops (hocompile/capture/fused_kernels.py) that run torch's own kernel: every step is
bitwise eager's, params and every state tensor, over 10 steps with an lr change (a Python float,
or a tensor lr filled in place) and a state_dict round trip, with no recompile after the steady
state. GradScaler: tests/test_runtime_robustness.py.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

import hocompile

SHAPES = [(8, 4), (5,), (3, 3, 2)]

def _own_step(cls: type) -> type:
    """``cls`` with a step of its own (that calls torch's): compiled, not run as is."""

    class OwnStep(cls):  # type: ignore[misc, valid-type]
        def step(self, closure: Any = None) -> Any:
            return super().step(closure)

    OwnStep.__name__ = f"Own{cls.__name__}"
    return OwnStep


Adam, AdamW, SGD, Adagrad = (_own_step(c) for c in (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD,
                                                    torch.optim.Adagrad))

CASES: dict[str, Any] = {
    "adam": lambda ps: Adam(ps, lr=1e-2, fused=True),
    "adam-amsgrad-wd": lambda ps: Adam(ps, lr=1e-2, amsgrad=True, weight_decay=0.1, fused=True),
    "adam-maximize": lambda ps: Adam(ps, lr=1e-2, maximize=True, fused=True),
    "adam-tensor-lr": lambda ps: Adam(ps, lr=torch.tensor(1e-2), fused=True),
    "adamw": lambda ps: AdamW(ps, lr=1e-2, fused=True),
    "adamw-amsgrad": lambda ps: AdamW(ps, lr=1e-2, amsgrad=True, fused=True),
    "sgd": lambda ps: SGD(ps, lr=1e-2, fused=True),
    "sgd-nesterov-wd": lambda ps: SGD(ps, lr=1e-2, momentum=0.9, nesterov=True, weight_decay=0.01,
                                                  fused=True),
    "sgd-dampening": lambda ps: SGD(ps, lr=1e-2, momentum=0.9, dampening=0.5, fused=True),
    "adagrad": lambda ps: Adagrad(ps, lr=1e-2, lr_decay=0.01, weight_decay=0.1, fused=True),
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


def test_a_compiled_fused_step_is_explained_as_torchs_kernel(cache_dir: Path) -> None:
    params = _params()
    compiled = hocompile.compile_optimizer(AdamW(params, lr=1e-2, fused=True), cache_dir=cache_dir)
    for p in params:
        p.grad = torch.ones_like(p)
    compiled.step()
    assert "fused_adam" in hocompile.explain(compiled)


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
    lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, fused=True),
], ids=["adamw", "sgd"])
def test_torchs_own_fused_step_runs_as_is(make: Any, cache_dir: Path) -> None:
    eager_params, compiled_params = _params(), _params()
    eager, compiled = make(eager_params), hocompile.compile_optimizer(make(compiled_params), cache_dir=cache_dir)
    for k in range(3):
        for pe, pc in zip(eager_params, compiled_params):
            pe.grad = torch.full_like(pe, 0.1 * (k + 1))
            pc.grad = pe.grad.clone()
        eager.step()
        compiled.step()
    assert all(torch.equal(a, b) for a, b in zip(eager_params, compiled_params))
    assert compiled.counters.as_is == 3 and compiled.counters.compiles == 0
    assert "run as is: fused=True" in hocompile.explain(compiled)


def test_sparse_adam_runs_as_is_and_a_subclass_stepping_its_own_way_is_refused(cache_dir: Path) -> None:
    # An nn.Embedding(sparse=True)'s gradient: the rows it touches change every step.
    eager_table, compiled_table = torch.randn(10, 4), torch.randn(10, 4)
    compiled_table.copy_(eager_table)
    eager = torch.optim.SparseAdam([eager_table], lr=1e-2)
    compiled = hocompile.compile_optimizer(torch.optim.SparseAdam([compiled_table], lr=1e-2), cache_dir=cache_dir)
    for rows in ([1, 3], [0, 3, 7, 9], [5]):
        grad = torch.sparse_coo_tensor(torch.tensor([rows]), torch.randn(len(rows), 4), (10, 4),
                                       check_invariants=True)
        eager_table.grad, compiled_table.grad = grad, grad.clone()
        eager.step()
        compiled.step()
    assert torch.equal(eager_table, compiled_table)
    assert compiled.counters.as_is == 3 and compiled.counters.compiles == 0
    assert "run as is: SparseAdam" in hocompile.explain(compiled)
    assert "run as is: SparseAdam" in hocompile.plan(torch.optim.SparseAdam([torch.randn(3, 2)]))

    class OwnSparseAdam(torch.optim.SparseAdam):
        def step(self, closure: Any = None) -> Any:
            return super().step(closure)

    table = torch.randn(10, 4)
    table.grad = torch.sparse_coo_tensor(torch.tensor([[2]]), torch.randn(1, 4), (10, 4), check_invariants=True)
    before = table.clone()
    with pytest.raises(hocompile.CaptureError, match="OwnSparseAdam overrides SparseAdam.step"):
        hocompile.compile_optimizer(OwnSparseAdam([table], lr=1e-2), cache_dir=cache_dir).step()
    assert torch.equal(table, before)
