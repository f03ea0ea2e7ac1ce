"""state_dict() is the eager optimizer's own format, both ways."""

from __future__ import annotations

import copy

import pytest
import torch

import hocompile

from .helpers import EXACT, make_params

FACTORIES = {
    "muon": lambda ps: torch.optim.Muon(ps, lr=0.02, weight_decay=0.1),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True),
}
SHAPES = [(12, 8), (8, 8)]


def _grads(step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(s, generator=g) for s in SHAPES]


def _run(opt: torch.optim.Optimizer, params: list[torch.Tensor], steps: range) -> None:
    for step in steps:
        for p, g in zip(params, _grads(step)):
            p.grad = g
        opt.step()


@pytest.mark.parametrize("name", sorted(FACTORIES))
@pytest.mark.parametrize("direction", ["eager->compiled", "compiled->eager"])
def test_state_dict_interchange_then_continue(name: str, direction: str, cache_dir) -> None:
    factory = FACTORIES[name]
    ref_params = make_params(SHAPES)
    ref = factory(ref_params)
    _run(ref, ref_params, range(15))  # the uninterrupted run

    first_params = make_params(SHAPES)
    second_params = [p for p in make_params(SHAPES)]
    if direction == "eager->compiled":
        first = factory(first_params)
        second: torch.optim.Optimizer = hocompile.compile_optimizer(
            factory(second_params), cache_dir=cache_dir, **EXACT
        )
    else:
        first = hocompile.compile_optimizer(factory(first_params), cache_dir=cache_dir, **EXACT)
        second = factory(second_params)
    _run(first, first_params, range(5))
    sd = copy.deepcopy(first.state_dict())
    assert set(sd) == {"state", "param_groups"}
    with torch.no_grad():
        for dst, src in zip(second_params, first_params):
            dst.copy_(src)
    second.load_state_dict(sd)
    _run(second, second_params, range(5, 15))
    for a, b in zip(ref_params, second_params):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=0)


def test_compiled_state_dict_equals_eager_format(cache_dir) -> None:
    ps_e, ps_c = make_params(SHAPES), make_params(SHAPES)
    eager, comp = FACTORIES["adamw"](ps_e), hocompile.compile_optimizer(FACTORIES["adamw"](ps_c), cache_dir=cache_dir)
    _run(eager, ps_e, range(3))
    _run(comp, ps_c, range(3))
    se, sc = eager.state_dict(), comp.state_dict()
    assert se["param_groups"] == sc["param_groups"]
    for k in se["state"]:
        assert se["state"][k].keys() == sc["state"][k].keys()
        for key in se["state"][k]:
            torch.testing.assert_close(sc["state"][k][key], se["state"][k][key], rtol=0, atol=0)


def test_default_pipeline_checkpoint_resume_is_exact(cache_dir) -> None:
    """Save a compiled Muon mid-run, load into a fresh compiled one: same as never stopping."""
    factory = FACTORIES["muon"]
    ref_params = make_params(SHAPES)
    ref = hocompile.compile_optimizer(factory(ref_params), cache_dir=cache_dir)
    _run(ref, ref_params, range(15))
    first_params = make_params(SHAPES)
    first = hocompile.compile_optimizer(factory(first_params), cache_dir=cache_dir)
    _run(first, first_params, range(5))
    sd = copy.deepcopy(first.state_dict())
    second_params = [p.clone() for p in first_params]
    second = hocompile.compile_optimizer(factory(second_params), cache_dir=cache_dir)
    second.load_state_dict(sd)
    _run(second, second_params, range(5, 15))
    for a, b in zip(ref_params, second_params):
        torch.testing.assert_close(b, a, rtol=0, atol=0)
