"""Optimizer wrappers of training stacks, found by shape (hocompile/runtime/wrappers.py): no Megatron
here (tests/test_megatron_wrapped.py runs Megatron's own classes)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import hocompile
from hocompile.runtime import CompiledOptimizer


class Wrapper:
    """Like Megatron's FP32Optimizer: not an optimizer, holds one as ``.optimizer``, its own step."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.prepared = 0

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def step(self) -> None:
        self.prepared += 1  # the stack's own work around the inner step
        self.optimizer.step()


class Chained:
    """Like Megatron's ChainedOptimizer: a list of wrappers (or raw optimizers), and an ``optimizer``
    property that refuses to answer when there are several."""

    def __init__(self, chained: list[Any]) -> None:
        self.chained_optimizers = chained

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        raise AssertionError("more than one optimizer")

    def step(self) -> None:
        for o in self.chained_optimizers:
            o.step()


def _params(seed: int) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(16, 32, generator=gen)) for _ in range(2)]


def _built(seed: int = 0) -> tuple[Chained, list[torch.nn.Parameter]]:
    muon, adamw = _params(seed), _params(seed + 1)
    chained = Chained([Wrapper(torch.optim.Muon(muon, lr=0.02)), torch.optim.AdamW(adamw, lr=1e-3)])
    return chained, muon + adamw


def test_a_chain_of_wrappers_is_compiled_in_place_and_steps_as_eager() -> None:
    eager, eager_params = _built()
    wrapper, params = _built()
    inner = wrapper.chained_optimizers[0].optimizer
    # NS passes off: eager's arithmetic on every kind of CPU (without bf16 units the plan is fp32)
    assert hocompile.compile_optimizer(wrapper, disable_passes=["fuse-newton-schulz"]) is wrapper
    assert isinstance(wrapper.chained_optimizers[0].optimizer, CompiledOptimizer)
    assert isinstance(wrapper.chained_optimizers[1], CompiledOptimizer)
    assert wrapper.chained_optimizers[0].optimizer.param_groups is inner.param_groups  # shared, not copied
    for step in range(3):
        for a, b in zip(eager_params, params):
            a.grad = b.grad = torch.randn(a.shape, generator=torch.Generator().manual_seed(step))
        eager.step()
        wrapper.step()
    assert all(torch.equal(a, b) for a, b in zip(eager_params, params))
    assert wrapper.chained_optimizers[0].prepared == 3  # the wrapper's own step ran, around the compiled one
    text = hocompile.explain(wrapper)
    assert text.startswith("Chained: 2 optimizer(s) compiled inside") and "[0] hocompile: torch.optim.Muon" in text
    assert "[1] hocompile: torch.optim.adamw.AdamW" in text


def test_nothing_changes_when_one_inner_optimizer_cannot_be_compiled() -> None:
    wrapper, _ = _built()
    wrapper.chained_optimizers[1] = hocompile.compile_optimizer(wrapper.chained_optimizers[1])
    first = wrapper.chained_optimizers[0].optimizer
    with pytest.raises(TypeError, match=r"Chained's chained_optimizers\[1\]: this optimizer is already compiled"):
        hocompile.compile_optimizer(wrapper)
    assert wrapper.chained_optimizers[0].optimizer is first  # not half-compiled


def test_a_chain_holding_something_else_is_refused_naming_it() -> None:
    with pytest.raises(TypeError, match=r"Chained.chained_optimizers\[0\] is a str"):
        hocompile.compile_optimizer(Chained(["adam"]))


def test_an_object_that_is_neither_is_refused_as_before() -> None:
    with pytest.raises(TypeError, match="lacks a step"):
        hocompile.compile_optimizer(object())  # type: ignore[call-overload]
