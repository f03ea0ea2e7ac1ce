"""Refused inputs: a clear message naming group, index and shape, and nothing mutated."""

from __future__ import annotations

import copy
import logging

import pytest
import torch

import hocompile
from hocompile import CaptureError, UnsupportedParameterError


def _snapshot(opt: torch.optim.Optimizer) -> tuple[list[torch.Tensor], dict]:
    params = [p.detach().clone() for g in opt.param_groups for p in g["params"]]
    return params, copy.deepcopy(opt.state_dict()["state"])


def _assert_unchanged(opt: torch.optim.Optimizer, snap: tuple[list[torch.Tensor], dict]) -> None:
    params, state = snap
    for before, p in zip(params, [p for g in opt.param_groups for p in g["params"]]):
        assert torch.equal(before, p.detach()) if p.device.type != "meta" else True
    now = opt.state_dict()["state"]
    assert now.keys() == state.keys()
    for k in state:
        for key in state[k]:
            assert torch.equal(now[k][key], state[k][key])


def _warm(opt: torch.optim.Optimizer, params: list[torch.Tensor]) -> None:
    """Two good steps first, so there is state that must survive the bad one."""
    for _ in range(2):
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()


def test_sparse_grad(cache_dir) -> None:
    w, e = torch.randn(6, 4), torch.randn(10, 4)
    opt = hocompile.compile_optimizer(torch.optim.SGD([w, e], lr=0.1, momentum=0.9), cache_dir=cache_dir)
    _warm(opt, [w, e])
    snap = _snapshot(opt)
    w.grad = torch.randn_like(w)
    e.grad = torch.sparse_coo_tensor(torch.tensor([[1, 3]]), torch.randn(2, 4), (10, 4))
    with pytest.raises(UnsupportedParameterError, match=r"param_groups\[0\]\['params'\]\[1\] \(shape \(10, 4\), "
                       r"float32\): its gradient is torch.sparse_coo \(sparse gradients are not supported\)"):
        opt.step()
    _assert_unchanged(opt, snap)


def test_complex_param(cache_dir) -> None:
    w, z = torch.randn(4, 4), torch.randn(3, dtype=torch.complex64)
    opt = hocompile.compile_optimizer(torch.optim.AdamW([{"params": [w]}, {"params": [z]}]), cache_dir=cache_dir)
    _warm(opt, [w])
    snap = _snapshot(opt)
    w.grad, z.grad = torch.randn_like(w), torch.randn_like(z)
    with pytest.raises(UnsupportedParameterError, match=r"param_groups\[1\]\['params'\]\[0\] \(shape \(3,\), "
                       r"complex64\): complex parameters are not supported"):
        opt.step()
    _assert_unchanged(opt, snap)


def test_integer_param(cache_dir) -> None:
    w = torch.randn(4, 4)
    opt = hocompile.compile_optimizer(torch.optim.SGD([w], lr=0.1), cache_dir=cache_dir)
    _warm(opt, [w])
    counts = torch.zeros(5, dtype=torch.int64)
    opt.add_param_group({"params": [counts]})
    counts.grad = torch.ones(5, dtype=torch.int64)
    snap = _snapshot(opt)
    w.grad = torch.randn_like(w)
    with pytest.raises(UnsupportedParameterError, match=r"param_groups\[1\]\['params'\]\[0\] \(shape \(5,\), int64\): "
                       r"integer and bool parameters have no gradient step"):
        opt.step()
    _assert_unchanged(opt, snap)


def test_one_dimensional_param_given_to_muon(cache_dir) -> None:
    w, bias = torch.randn(8, 4), torch.randn(8)
    opt = hocompile.compile_optimizer(torch.optim.Muon([w], lr=0.02), cache_dir=cache_dir)
    _warm(opt, [w])
    opt.add_param_group({"params": [bias]})  # Muon only checks shapes in __init__
    snap = _snapshot(opt)
    w.grad, bias.grad = torch.randn_like(w), torch.randn_like(bias)
    with pytest.raises(UnsupportedParameterError, match=r"param_groups\[1\]\['params'\]\[0\] \(shape \(8,\), "
                       r"float32\): Muon orthogonalizes matrices and needs 2-D parameters"):
        opt.step()
    _assert_unchanged(opt, snap)


def test_params_on_mixed_devices(cache_dir) -> None:
    w, m = torch.randn(4, 4), torch.empty(4, 4, device="meta")
    opt = hocompile.compile_optimizer(torch.optim.SGD([w, m], lr=0.1, momentum=0.9), cache_dir=cache_dir)
    _warm(opt, [w])
    snap = _snapshot(opt)
    w.grad, m.grad = torch.randn_like(w), torch.empty_like(m)
    with pytest.raises(UnsupportedParameterError, match=r"param_groups\[0\]\['params'\]\[1\] \(shape \(4, 4\), "
                       r"float32\): it is on meta .* but param_groups\[0\]\['params'\]\[0\] .* is on cpu"):
        opt.step()
    _assert_unchanged(opt, snap)


class ItemReadingSGD(torch.optim.SGD):
    """Halves the grad as many times as its norm, read on the host, says: a data-dependent loop
    count, not compilable (a read that feeds a branch or arithmetic is: tests/test_host_reads.py)."""

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    for _ in range(int(p.grad.norm().item())):
                        p.grad.mul_(0.5)
        return super().step(closure)


def test_data_dependent_step_raises_clearly_and_mutates_nothing(cache_dir) -> None:
    w = torch.randn(4, 4)
    opt = hocompile.compile_optimizer(ItemReadingSGD([w], lr=0.1, momentum=0.9), cache_dir=cache_dir)
    snap = _snapshot(opt)
    w.grad = torch.randn_like(w)
    grad_before = w.grad.clone()
    with pytest.raises(CaptureError, match=r"a tensor's value read on the host.*not bounded"):
        opt.step()
    _assert_unchanged(opt, snap)
    assert torch.equal(w.grad, grad_before)
    assert opt.param_groups[0]["lr"] == 0.1 and type(opt.param_groups[0]["lr"]) is float


def test_explicit_eager_fallback_is_logged_and_correct(cache_dir, caplog) -> None:
    w = torch.randn(4, 4)
    ref = w.clone()
    eager = ItemReadingSGD([ref], lr=0.1, momentum=0.9)
    opt = hocompile.compile_optimizer(ItemReadingSGD([w], lr=0.1, momentum=0.9), cache_dir=cache_dir, fallback="eager")
    with caplog.at_level(logging.WARNING, logger="hocompile"):
        for _ in range(3):
            g = torch.randn(4, 4)
            w.grad, ref.grad = g.clone(), g.clone()
            opt.step()
            eager.step()
    assert torch.equal(w, ref)
    assert opt.counters.eager_fallbacks == 3
    assert any("running ItemReadingSGD eagerly" in r.getMessage() for r in caplog.records)
    assert any(program.eager for program in hocompile.explain(opt).programs)


def test_untracked_hyperparameter_math_is_an_error(cache_dir) -> None:
    import numpy as np

    class SqrtLR(torch.optim.SGD):
        @torch.no_grad()
        def step(self, closure=None):  # type: ignore[override]
            for group in self.param_groups:
                for p in group["params"]:
                    p.add_(p.grad, alpha=-float(np.sqrt(group["lr"])))  # numpy drops the tracking

    w = torch.randn(4, 4)
    opt = hocompile.compile_optimizer(SqrtLR([w], lr=0.01), cache_dir=cache_dir)
    w.grad = torch.randn_like(w)
    before = w.clone()
    with pytest.raises(CaptureError, match="depends on a hyperparameter but was computed outside"):
        opt.step()
    assert torch.equal(w, before)
