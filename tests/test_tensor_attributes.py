"""Tensors hung on a param (Megatron's ``main_grad``) are inputs of the compiled step.

Megatron keeps each param's fp32 gradient in ``p.main_grad``, a slice of one contiguous grad buffer,
and optimizers written for it read that instead of ``p.grad``. The stand-in a step is traced with
holds the attribute's traced tensor (stand_ins.py), the runtime reads the real one afresh each step
(slot kind "pattr") and writes it in place where the step does. Compiled with every pass off, such a
step is bitwise eager's, stamped by class or traced whole; what cannot be modelled is refused
before anything is touched, and the self-check compares the attributes a step writes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import hocompile
from hocompile import CaptureError, SelfCheckWarning

from .helpers import EVERY_PASS_OFF

SHAPE = (16, 8)
COUNT = 4


class MainGradMomentum(torch.optim.Optimizer):
    """Momentum on ``main_grad``, which the step zeroes after use (the grad buffer's next fill)."""

    def __init__(self, params: Any, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if "m" not in st:
                    st["m"] = torch.zeros_like(p)
                st["m"].mul_(0.9).add_(p.main_grad)
                p.add_(st["m"], alpha=-group["lr"])
                p.main_grad.mul_(0.5)


class MainGradClipped(MainGradMomentum):
    """One norm over every param's ``main_grad``: a step that is not per param (traced whole)."""

    @torch.no_grad()
    def step(self) -> None:  # type: ignore[override]
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        total = torch.stack([p.main_grad.norm() for p in params]).norm()
        scale = (1.0 / (total + 1e-6)).clamp(max=1.0)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.main_grad * scale, alpha=-group["lr"])


class RebindsMainGrad(MainGradMomentum):

    @torch.no_grad()
    def step(self) -> None:  # type: ignore[override]
        for p in self.param_groups[0]["params"]:
            p.add_(p.main_grad, alpha=-0.1)
            p.main_grad = torch.zeros_like(p)


def _params(hang: str = "buffer") -> tuple[list[torch.nn.Parameter], torch.Tensor]:
    """Params with ``main_grad``s: slices of one buffer (Megatron's), the grad itself, or fresh tensors."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(SHAPE, generator=gen)) for _ in range(COUNT)]
    numel = SHAPE[0] * SHAPE[1]
    buffer = torch.zeros(COUNT * numel)
    for k, p in enumerate(params):
        p.grad = torch.zeros(SHAPE)
        if hang == "buffer":
            p.main_grad = buffer[k * numel:(k + 1) * numel].view(SHAPE)  # type: ignore[attr-defined]
        elif hang == "grad":
            p.main_grad = p.grad  # type: ignore[attr-defined]
        elif hang == "view of the param":
            p.main_grad = p.detach()  # type: ignore[attr-defined]  (another tensor, the same memory)
        else:
            p.main_grad = torch.zeros(SHAPE)  # type: ignore[attr-defined]
    return params, buffer


def _fill(k: int, params: list[torch.nn.Parameter], hang: str) -> None:
    gen = torch.Generator().manual_seed(100 + k)
    for p in params:
        g = torch.randn(SHAPE, generator=gen)
        if hang == "new each step":
            p.main_grad = g  # type: ignore[attr-defined]  (bound anew: read afresh, no recompile)
        else:
            p.main_grad.copy_(g)  # type: ignore[attr-defined]


def _pair(kind: type, hang: str, cache_dir: Path, **kw: Any) -> tuple[Any, Any, list, list]:
    want, _ = _params(hang)
    got, _ = _params(hang)
    eager = kind(want)
    compiled = hocompile.compile_optimizer(kind(got), cache_dir=cache_dir, **{**EVERY_PASS_OFF, **kw})
    return eager, compiled, want, got


@pytest.mark.parametrize("hang", ["buffer", "grad", "new each step"])
@pytest.mark.parametrize("kind", [MainGradMomentum, MainGradClipped])
def test_a_step_on_main_grad_is_bitwise_eager_and_writes_it_as_eager_does(
    kind: type, hang: str, tmp_path: Path
) -> None:
    eager, compiled, want, got = _pair(kind, hang, tmp_path)
    for k in range(6):
        _fill(k, want, hang)
        _fill(k, got, hang)
        if k == 3:
            for opt in (eager, compiled):
                opt.param_groups[0]["lr"] = 0.05
        eager.step()
        compiled.step()
        for a, b in zip(want, got):
            assert torch.equal(a, b), k
            assert torch.equal(a.main_grad, b.main_grad), k  # type: ignore[attr-defined]
            assert b.main_grad is not b.grad or hang == "grad"  # type: ignore[attr-defined]
    for a, b in zip(want, got):
        for key, value in eager.state[a].items():
            assert torch.equal(value, compiled.state[b][key])
    assert compiled.counters.recompiles == [] or all("state" in r for r in compiled.counters.recompiles)
    assert compiled.counters.eager_fallbacks == 0
    explained = hocompile.explain(compiled)
    if kind is MainGradMomentum:  # per param: one class, each member's main_grad its input
        assert ".main_grad fp32[16, 8]" in explained, explained


def test_main_grads_in_one_buffer_stay_its_slices(tmp_path: Path) -> None:
    """Megatron's buffer keeps its identity: the step writes through each param's slice of it."""
    params, buffer = _params("buffer")
    compiled = hocompile.compile_optimizer(MainGradMomentum(params), cache_dir=tmp_path, **EVERY_PASS_OFF)
    buffer.fill_(2.0)
    compiled.step()
    assert torch.equal(buffer, torch.full_like(buffer, 1.0))  # halved in place, every slice
    assert all(p.main_grad.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()  # type: ignore[attr-defined]
               for p in params)


@pytest.mark.parametrize(
    ("kind", "hang", "words"),
    [(MainGradMomentum, "view of the param",
      r"param_groups\[0\]\['params'\]\[0\]\.main_grad shares memory with param_groups\[0\]\['params'\]\[0\]"),
     (RebindsMainGrad, "buffer", r"changes the Python attribute param_groups\[0\]\['params'\]\[0\]\.'main_grad'")],
    ids=["a view of the param", "rebound by the step"],
)
def test_what_cannot_be_modelled_is_refused_before_anything_changes(
    kind: type, hang: str, words: str, tmp_path: Path
) -> None:
    params, _ = _params(hang)
    for p in params:
        if hang != "view of the param":
            p.main_grad.normal_()  # type: ignore[attr-defined]
    before = [(p.detach().clone(), p.main_grad.clone()) for p in params]  # type: ignore[attr-defined]
    compiled = hocompile.compile_optimizer(kind(params), cache_dir=tmp_path)
    with pytest.raises(CaptureError, match=words):
        compiled.step()
    for (weight, main_grad), p in zip(before, params):
        assert torch.equal(weight, p) and torch.equal(main_grad, p.main_grad)  # type: ignore[attr-defined]


def test_the_self_check_compares_what_a_step_writes_to_main_grad(tmp_path: Path, monkeypatch: Any) -> None:
    """Planted: the compiled step's main_grad writes go to a copy (a lost attribute). Only main_grad
    then differs from eager; the self-check must see it, fall back, and leave eager's result."""
    from hocompile.runtime import stamped

    monkeypatch.setattr(stamped, "_attribute", lambda key: lambda p: getattr(p, key).clone())
    eager, compiled, want, got = _pair(MainGradMomentum, "buffer", tmp_path)
    with pytest.warns(SelfCheckWarning, match=r"main_grad"):
        for k in range(3):
            _fill(k, want, "buffer")
            _fill(k, got, "buffer")
            eager.step()
            compiled.step()
            for a, b in zip(want, got):
                assert torch.equal(a, b) and torch.equal(a.main_grad, b.main_grad), k  # type: ignore[attr-defined]
    assert compiled.counters.eager_fallbacks >= 1


class PlainSGD(MainGradMomentum):

    @torch.no_grad()
    def step(self) -> None:  # type: ignore[override]
        for p in self.param_groups[0]["params"]:
            p.add_(p.grad, alpha=-0.1)


def test_a_view_of_the_param_the_step_never_touches_is_left_alone(tmp_path: Path) -> None:
    """FSDP1's flat params carry views of themselves (``_local_shard``) that optimizers never read."""
    want, got = _params("view of the param")[0], _params("view of the param")[0]
    eager = PlainSGD(want)
    compiled = hocompile.compile_optimizer(PlainSGD(got), cache_dir=tmp_path, fallback="error")
    for k in range(3):
        gen = torch.Generator().manual_seed(k)
        for a, b in zip(want, got):
            a.grad = torch.randn(SHAPE, generator=gen)
            b.grad = a.grad.clone()
        eager.step()
        compiled.step()
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    assert all(b.main_grad.data_ptr() == b.data_ptr() for b in got)  # type: ignore[attr-defined]
