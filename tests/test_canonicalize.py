"""canonicalize removes a copy only when layout and aliasing let nothing tell.

A ``clone`` in a traced step is often what makes a permuted value contiguous
for the ``view``/``_unsafe_view`` after it (``x.mT.flatten()``,
``x.T.reshape(-1)``, ``x.permute(...).reshape(...)``); dropping it made the
compiled step fail with "view size is not compatible with input tensor's size
and stride". A copy one of whose views is returned, or that feeds
``_unsafe_view``, must stay too: without it an output or a reader the write-back
scheduler cannot see aliases an input. With the NS passes off the compiled step
runs eager's own ops, so every comparison here is bitwise.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hocompile.capture.group_hypers import STRUCTURAL_KEYS
from hocompile.capture.trace import capture
from hocompile.passes import Canonicalize

from .helpers import EXACT, Pair, make_params

Update = Callable[[torch.Tensor], torch.Tensor]
# A nominal target: with the NS passes off it changes nothing in the program,
# and it spares each compile the seconds of measuring this CPU's GEMM rates.
EXACT_NOMINAL: dict[str, Any] = {**EXACT, "target": "cpu-avx2"}


class ReshapedUpdate(torch.optim.Optimizer):
    """p -= lr * reshape_back(update(grad)): the update goes through a layout change."""

    def __init__(self, params: Any, update: Update, lr: float = 0.1) -> None:
        super().__init__(params, dict(lr=lr))
        self.update = update

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(self.update(p.grad).reshape(p.shape), alpha=-group["lr"])


UPDATES: dict[str, tuple[Update, tuple[int, ...]]] = {
    "mT.flatten": (lambda g: (g * 2).mT.flatten(), (3, 5)),
    "T.reshape": (lambda g: (g * 2).T.reshape(-1), (3, 5)),
    "mT.contiguous.view": (lambda g: (g * 2).mT.contiguous().view(-1), (3, 5)),
    "permute.reshape": (lambda g: (g * 2).permute(2, 0, 1).reshape(4, 6), (2, 3, 4)),
    "batched-mT.reshape": (lambda g: (g * 2).mT.reshape(2, -1), (2, 3, 5)),
    "expand.reshape": (lambda g: (g[:1] * 2).expand(3, 5).reshape(-1) + g.flatten(), (3, 5)),
}


def _assert_bitwise_over_steps(pair: Pair, steps: int = 3) -> None:
    for _ in range(steps):
        pair.step()
    for a, b in zip(pair.eager_params, pair.compiled_params):
        torch.testing.assert_close(b, a, rtol=0, atol=0)
    pair.assert_state_equal()


@pytest.mark.parametrize("name", list(UPDATES))
def test_copy_that_makes_a_view_possible_is_kept(name: str, cache_dir: Path) -> None:
    update, shape = UPDATES[name]
    pair = Pair(lambda ps: ReshapedUpdate(ps, update), [shape, shape], cache_dir, **EXACT_NOMINAL)
    _assert_bitwise_over_steps(pair)


def test_layout_copy_survives_canonicalize_and_plain_copy_does_not() -> None:
    """The contiguous clone before ``_unsafe_view`` stays; a same-layout clone still goes."""
    params = make_params([(3, 5)])
    opt = ReshapedUpdate(params, lambda g: g.clone().mul(2).mT.flatten())
    params[0].grad = torch.randn(3, 5)
    gm = Canonicalize()(capture(opt, STRUCTURAL_KEYS).gm).gm
    clones = [n for n in gm.graph.nodes if n.target is torch.ops.aten.clone.default]
    assert [n.kwargs.get("memory_format") for n in clones] == [torch.contiguous_format]
    assert next(iter(clones[0].users)).target is torch.ops.aten._unsafe_view.default


class FlatHistory(torch.optim.Optimizer):
    """Keeps a flat copy of the first grad as state; it must not alias the grad."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if "first_grad" not in state:
                    state["first_grad"] = p.grad.clone().view(-1)
                p.add_(state["first_grad"].view(p.shape), alpha=-group["lr"])


def test_copy_whose_view_is_returned_is_kept(cache_dir: Path) -> None:
    """``grad.clone().view(-1)`` as new state: without the clone the state is a view of the grad."""
    pair = Pair(lambda ps: FlatHistory(ps, dict(lr=0.1)), [(4, 3)], cache_dir, **EXACT_NOMINAL)
    pair.step()
    for p in pair.eager_params + pair.compiled_params:
        p.grad.zero_()  # zero_grad(set_to_none=False) writes into the same grad tensor
    pair.assert_state_equal()
    _assert_bitwise_over_steps(pair, steps=2)


class ReadsOldParamLate(torch.optim.Optimizer):
    """Reads a copy of p through ``_unsafe_view`` after p is final: the copy must stay.

    Users do not spell ``_unsafe_view``, but traces do (reshape, matmul), and
    its schema claims a fresh result: the write-back scheduler, which copies p
    back as soon as its last reader ran, does not count readers behind it.
    """

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if "acc" not in state:
                    state["acc"] = torch.zeros(p.numel())
                old = torch.ops.aten._unsafe_view(p.clone(), [-1])
                p.add_(p.grad, alpha=-group["lr"])
                state["acc"].add_(old)


def test_copy_feeding_unsafe_view_is_kept(cache_dir: Path) -> None:
    pair = Pair(lambda ps: ReadsOldParamLate(ps, dict(lr=0.1)), [(4, 3)], cache_dir, **EXACT_NOMINAL)
    pair.step()  # state created
    _assert_bitwise_over_steps(pair, steps=2)


_LAYOUT_OPS = ["mT", "permute", "transpose01", "flatten", "reshape-split", "contiguous-view", "clone"]


def _apply(op: str, x: torch.Tensor, seed: int) -> torch.Tensor:
    if op == "mT":
        return x.mT
    if op == "permute":
        dims = random.Random(seed).sample(range(x.dim()), x.dim())  # host-side: the step is traced
        return x.permute(*dims)
    if op == "transpose01":
        return x.transpose(0, 1)
    if op == "flatten":  # rank stays >= 2 so every op applies to every result
        return x.flatten(0, 1) if x.dim() > 2 else x.flatten().reshape(x.shape[1], x.shape[0])
    if op == "reshape-split":  # split the first dim back off (or fold it in): changes the rank
        return x.reshape(x.shape[0], -1) if x.dim() > 2 else x.reshape(1, *x.shape)
    if op == "contiguous-view":
        return x.contiguous().view(x.shape[-1], -1)
    return x.clone()


@settings(max_examples=40, deadline=None)
@given(
    shape=st.sampled_from([(3, 5), (4, 1), (2, 3, 4), (3, 1, 5), (1, 6)]),
    ops=st.lists(st.sampled_from(_LAYOUT_OPS), min_size=1, max_size=4),
    seed=st.integers(0, 1000),
)
def test_layout_chains_match_eager_bitwise(
    shape: tuple[int, ...], ops: list[str], seed: int, tmp_path_factory: pytest.TempPathFactory
) -> None:
    def update(g: torch.Tensor) -> torch.Tensor:
        x = g * 2
        for i, op in enumerate(ops):
            x = _apply(op, x, seed + i)
        return x.reshape(-1) + 1

    pair = Pair(lambda ps: ReshapedUpdate(ps, update), [shape], tmp_path_factory.mktemp("cache"), **EXACT_NOMINAL)
    _assert_bitwise_over_steps(pair, steps=2)
