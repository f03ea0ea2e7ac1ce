"""Hyperparameters are runtime inputs: schedules never recompile."""

from __future__ import annotations

import math

import pytest
import torch

from .helpers import EXACT, Pair


@pytest.mark.parametrize(
    "factory, keys",
    [
        (lambda ps: torch.optim.Muon(ps, lr=0.02, weight_decay=0.1), ("lr", "momentum", "weight_decay")),
        (lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1), ("lr", "betas", "weight_decay", "eps")),
        (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3),
         ("lr", "momentum", "weight_decay")),
    ],
)
@pytest.mark.parametrize("exact", [True, False], ids=["exact", "default-pipeline"])
def test_changing_hyperparameters_every_step_never_recompiles(factory, keys, exact, cache_dir) -> None:
    pair = Pair(factory, [(12, 8), (8, 8)], cache_dir, **(EXACT if exact else {}))
    for step in range(50):
        scale = 1.0 + 0.5 * math.sin(step)
        for opt in (pair.eager, pair.compiled):
            for group in opt.param_groups:
                for key in keys:
                    if key == "lr":
                        group[key] = 0.01 * scale
                    elif key == "momentum":
                        group[key] = 0.9 + 0.05 * math.cos(step)
                    elif key == "betas":
                        group[key] = (0.85 + 0.1 * scale / 1.5, 0.99 + 0.005 * scale)
                    elif key == "weight_decay":
                        group[key] = 0.05 * scale
                    elif key == "eps":
                        group[key] = 1e-8 * scale
        pair.step()
    assert pair.compiled.counters.recompiles == []
    assert pair.compiled.counters.compiles == 2  # first step + steady state (lazily created state)
    if exact or "momentum" not in keys or "betas" in keys:
        assert pair.max_rel_diff() <= 1e-6
    else:  # Muon with NS fused and planned in fp32: close to eager's bf16 NS, not bitwise
        assert pair.max_rel_diff() <= 5e-2


def test_lr_scheduler_on_compiled_optimizer(cache_dir) -> None:
    pair = Pair(lambda ps: torch.optim.Muon(ps, lr=0.02, weight_decay=0.1), [(12, 8), (8, 8)], cache_dir, **EXACT)
    scheds = [
        torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=50)
        for opt in (pair.eager, pair.compiled)
    ]
    lrs = []
    for _ in range(50):
        pair.step()
        for s in scheds:
            s.step()
        lrs.append(pair.compiled.param_groups[0]["lr"])
    assert len(set(lrs)) > 40  # the schedule really moved lr (and momentum, OneCycle cycles it)
    assert pair.compiled.counters.recompiles == []
    assert pair.max_rel_diff() == 0.0


def test_a_scheduler_made_before_the_wrap_sees_the_compiled_step(cache_dir) -> None:
    """The scheduler watches the inner optimizer's step; the compiled step records the call as that
    step would, so the scheduler's first step() does not warn of a step that was taken."""
    import warnings

    import hocompile

    p = torch.nn.Parameter(torch.randn(12, 8))
    p.grad = torch.randn(12, 8)
    inner = torch.optim.Muon([p], lr=0.02)
    sched = torch.optim.lr_scheduler.StepLR(inner, step_size=1, gamma=0.5)
    opt = hocompile.compile_optimizer(inner, cache_dir=cache_dir)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the warning, if any, fails the test
        opt.step()
        sched.step()
    assert opt.param_groups[0]["lr"] == 0.01


def test_branch_on_hyperparameter_is_a_guard(cache_dir) -> None:
    """AdamW skips decay when weight_decay == 0: crossing that recompiles, with the reason."""
    pair = Pair(lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1), [(6, 4)], cache_dir)
    for step in range(6):
        if step == 3:
            for opt in (pair.eager, pair.compiled):
                opt.param_groups[0]["weight_decay"] = 0.0
        pair.step()
    assert pair.compiled.counters.recompiles == ["guard failed: (g0.weight_decay != 0) is True no longer holds"]
    assert pair.max_rel_diff() <= 1e-6


def test_structural_option_change_recompiles_with_reason(cache_dir) -> None:
    pair = Pair(lambda ps: torch.optim.Muon(ps, lr=0.02), [(6, 4)], cache_dir, **EXACT)
    pair.step()
    pair.step()
    for opt in (pair.eager, pair.compiled):
        opt.param_groups[0]["nesterov"] = False
    pair.step()
    assert pair.compiled.counters.recompiles == ["param_groups[0]['nesterov'] changed True -> False"]
    assert pair.max_rel_diff() == 0.0


def test_optimizer_attribute_change_recompiles(cache_dir) -> None:
    """emerging-optimizers keeps options like nesterov on the optimizer object."""
    from .helpers import emerging_muon

    pair = Pair(lambda ps: emerging_muon(ps, lr=0.02), [(6, 4)], cache_dir, **EXACT)
    pair.step()
    pair.step()
    for opt in (pair.eager, pair.compiled.optimizer):
        opt.nesterov = not opt.nesterov
    pair.step()
    assert len(pair.compiled.counters.recompiles) == 1
    assert pair.compiled.counters.recompiles[0].startswith("optimizer attribute 'nesterov' changed")
    assert pair.max_rel_diff() == 0.0
