"""AdamW / SGD-momentum chains lowered to torch's fused CPU kernels (hocompile/lowering/fused_updates.py).

Opt-in (``HOCOMPILE_FUSED_UPDATES=1``, set for every test here but the default's). Numerics
model: the fused kernels evaluate eager's formulas with the same
hyperparameters (recovered from the graph's host scalars) in one pass; only
rounding differs, so params and state stay within 1e-6 (absolute) of eager
after several steps, an LR schedule included. Chains the kernels do not
implement (amsgrad, maximize, bf16, Adam's L2 weight decay) are not fused
and stay bitwise eager; scalars that are not AdamW's run the graph's own ops.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import hocompile
from hocompile.lowering.fused_updates import adamw_update, sgd_update

SHAPES = [(8, 16), (16, 8), (12, 12), (5,)]
STEPS = 6
ATOL = 1e-6

Factory = Callable[[list[torch.Tensor]], torch.optim.Optimizer]
FUSED: dict[str, Factory] = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=False),
    "adamw-no-decay": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.0, foreach=False),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2, betas=(0.8, 0.99), foreach=False),
    "sgd-nesterov": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3,
                                               foreach=False),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, foreach=False),
    "sgd-dampening": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.2, weight_decay=1e-2,
                                                foreach=False),
}
NOT_FUSED: dict[str, Factory] = {
    "adamw-amsgrad": lambda ps: torch.optim.AdamW(ps, lr=1e-2, amsgrad=True, foreach=False),
    "adamw-maximize": lambda ps: torch.optim.AdamW(ps, lr=1e-2, maximize=True, foreach=False),
    "adam-l2": lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.1, foreach=False),
}


@pytest.fixture(autouse=True)
def _fused_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOCOMPILE_FUSED_UPDATES", "1")


def _params(dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=gen).to(dtype).requires_grad_() for s in SHAPES]


def _run(opt: Any, params: list[torch.Tensor], schedule: bool = True) -> None:
    gen = torch.Generator().manual_seed(1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(getattr(opt, "optimizer", opt), lambda k: 0.9**k)
    for _ in range(STEPS):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
        opt.step()
        if schedule:
            scheduler.step()


def _state(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]


def _pair(factory: Factory, cache_dir: Path, dtype: torch.dtype = torch.float32) -> tuple[Any, ...]:
    eager_params, compiled_params = _params(dtype), _params(dtype)
    eager = factory(eager_params)
    compiled = hocompile.compile_optimizer(factory(compiled_params), cache_dir=cache_dir)
    _run(eager, eager_params)
    _run(compiled, compiled_params)
    return eager, eager_params, compiled, compiled_params


@pytest.mark.parametrize("name", sorted(FUSED))
def test_fused_chain_within_1e6_of_eager(name: str, cache_dir: Path) -> None:
    eager, eager_params, compiled, compiled_params = _pair(FUSED[name], cache_dir)
    lowered = compiled.history[-1].lowered
    assert len(lowered.fused) == len(SHAPES), lowered.fused
    assert ("adamw_update(" if "adam" in name else "sgd_update(") in lowered.source
    assert compiled.counters.compiles == 2  # the first step (state created) and the steady one: no recompiles
    for a, b in zip(eager_params + _state(eager), compiled_params + _state(compiled.optimizer), strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=ATOL)


@pytest.mark.parametrize("name", sorted(NOT_FUSED))
def test_other_chains_are_not_fused_and_stay_bitwise(name: str, cache_dir: Path) -> None:
    eager, eager_params, compiled, compiled_params = _pair(NOT_FUSED[name], cache_dir)
    assert compiled.history[-1].lowered.fused == []
    for a, b in zip(eager_params + _state(eager), compiled_params + _state(compiled.optimizer), strict=True):
        assert torch.equal(a, b)


def test_bf16_params_are_not_fused(cache_dir: Path) -> None:
    """Eager rounds every bf16 intermediate; the kernel computes in fp32: not the same arithmetic."""
    eager, eager_params, compiled, compiled_params = _pair(FUSED["adamw"], cache_dir, torch.bfloat16)
    assert compiled.history[-1].lowered.fused == []
    assert all(torch.equal(a, b) for a, b in zip(eager_params, compiled_params))


def _adamw_tensors() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(2)
    p, g, m = (torch.randn(64, generator=gen) for _ in range(3))
    return [p, g, m, torch.rand(64, generator=gen), torch.tensor(3.0)]


def _adamw_reference(t: list[torch.Tensor], h: list[float]) -> list[torch.Tensor]:
    p, g, m, v, _ = (x.clone() for x in t)
    aten = torch.ops.aten
    new_m = aten.lerp.Scalar(m, g, h[1])
    new_v = aten.addcmul.default(aten.mul.Tensor(v, h[2]), g, g, value=h[3])
    denom = aten.add.Tensor(aten.div.Tensor(aten.sqrt.default(new_v), h[4]), h[5])
    new_p = aten.addcdiv.default(aten.mul.Tensor(p, h[0]), new_m, denom, value=h[6])
    return [new_p, new_m, new_v]


def test_scalars_that_are_not_adamws_run_the_graphs_ops() -> None:
    """Same graph shape, a bias correction AdamW would not use: the kernel must not run."""
    lr, b1, b2, wd, step = 1e-2, 0.9, 0.99, 0.1, 3.0
    adamw = [1 - lr * wd, 1 - b1, b2, 1 - b2, (1 - b2**step) ** 0.5, 1e-8, -lr / (1 - b1**step)]
    for h in (adamw, [*adamw[:4], 1.0, *adamw[5:]]):  # AdamW's, then no second-moment bias correction
        t = _adamw_tensors()
        adamw_update(*t, *h)
        expected = _adamw_reference(_adamw_tensors(), h)
        if h is adamw:
            for a, b in zip(expected, t[:1] + t[2:4]):
                torch.testing.assert_close(b, a, rtol=0, atol=ATOL)
        else:
            assert all(torch.equal(a, b) for a, b in zip(expected, t[:1] + t[2:4]))


def test_sgd_nesterov_alpha_other_than_momentum_runs_the_graphs_ops() -> None:
    gen = torch.Generator().manual_seed(3)
    p, g, buf = (torch.randn(32, generator=gen) for _ in range(3))
    got = [p.clone(), g.clone(), buf.clone()]
    sgd_update(*got, None, 0.9, None, 0.5, -0.1)  # grad.add(buf, alpha=0.5): not SGD's nesterov
    new_buf = buf * 0.9 + g
    new_p = torch.add(p, torch.add(g, new_buf, alpha=0.5), alpha=-0.1)
    assert torch.equal(got[0], new_p) and torch.equal(got[2], new_buf)


@pytest.mark.parametrize("value", [None, "0"])
def test_fused_updates_off_by_default_is_bitwise_eager(
    value: str | None, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if value is None:
        monkeypatch.delenv("HOCOMPILE_FUSED_UPDATES")
    else:
        monkeypatch.setenv("HOCOMPILE_FUSED_UPDATES", value)
    eager, eager_params, compiled, compiled_params = _pair(FUSED["adamw"], cache_dir)
    assert compiled.history[-1].lowered.fused == []
    for a, b in zip(eager_params + _state(eager), compiled_params + _state(compiled.optimizer), strict=True):
        assert torch.equal(a, b)


def test_fused_updates_keyword_overrides_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from hocompile.settings import Settings

    monkeypatch.delenv("HOCOMPILE_FUSED_UPDATES", raising=False)
    assert not Settings.resolve().fused_updates
    assert Settings.resolve(fused_updates=True).fused_updates
    monkeypatch.setenv("HOCOMPILE_FUSED_UPDATES", "1")
    assert Settings.resolve().fused_updates
    assert not Settings.resolve(fused_updates=False).fused_updates
    p = torch.nn.Parameter(torch.randn(4, 4))
    assert hocompile.compile_optimizer(torch.optim.AdamW([p]), fused_updates=False)._settings.fused_updates is False
