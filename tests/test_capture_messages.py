"""Failures a user meets while hocompile traces their step: each names their construct and the reason."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import hocompile


def _params() -> list[torch.nn.Parameter]:
    params = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(5))]
    for p in params:
        p.grad = torch.randn_like(p)
    return params


class _Inner(torch.optim.SGD):
    pass


class StateView(torch.optim.Optimizer):
    """A wrapper whose ``state`` is a read-only view of the optimizer it wraps."""

    def __init__(self, params: Any) -> None:
        self.inner = _Inner(params, lr=0.1, momentum=0.9)
        self.param_groups = self.inner.param_groups
        self.defaults = self.inner.defaults
        self._optimizer_step_pre_hooks: dict[int, Any] = {}
        self._optimizer_step_post_hooks: dict[int, Any] = {}

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.inner.state

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        self.inner.step()


def test_a_read_only_state_property_is_named(cache_dir: Path) -> None:
    params = _params()
    before = [p.detach().clone() for p in params]
    opt = hocompile.compile_optimizer(StateView(params), cache_dir=cache_dir)
    with pytest.raises(hocompile.CaptureError, match=r"StateView.state is a read-only property"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, params))
    # fallback="eager" runs it as written
    ok = hocompile.compile_optimizer(StateView(params), cache_dir=cache_dir, fallback="eager")
    ok.step()
    assert not torch.equal(before[0], params[0])


class Broken(torch.optim.Optimizer):
    def __init__(self, params: Any) -> None:
        super().__init__(params, {"lr": 0.1})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for p in self.param_groups[0]["params"]:
            p.add_(p.grad @ torch.ones(7, 7), alpha=-0.1)  # a shape error in the user's own line


def test_a_tracing_failure_names_the_users_line(cache_dir: Path) -> None:
    opt = hocompile.compile_optimizer(Broken(_params()), cache_dir=cache_dir)
    with pytest.raises(hocompile.CaptureError, match=r"failed at .*test_capture_messages.py:\d+ \(`p.add_\(p.grad @"):
        opt.step()
