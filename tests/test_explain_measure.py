"""explain(opt, measure=True): per registered op family, its measured time next to the prediction.

The measurement runs the compiled step on copies of the current params, grads and state;
the optimizer must be left exactly as it was.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch

import hocompile
import tests.helpers  # noqa: F401  (typing.override for emerging-optimizers on Python 3.11)

soap = pytest.importorskip("emerging_optimizers.soap")


def _snapshot(opt: Any, params: list[torch.nn.Parameter]) -> list[torch.Tensor]:
    tensors = [p.detach().clone() for p in params]
    tensors += [v.clone() for p in params for v in opt.state[p].values() if isinstance(v, torch.Tensor)]
    return tensors


def test_measure_shows_each_family_and_leaves_the_optimizer_alone(cache_dir: Any) -> None:
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(*s, generator=gen)) for s in [(8, 16), (16, 8)]]
    opt = hocompile.compile_optimizer(soap.SOAP(params, lr=0.01), cache_dir=cache_dir)
    for _ in range(3):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    before = _snapshot(opt.optimizer, params)
    counters = opt.counters.as_dict()
    report = hocompile.explain(opt, measure=True)
    after = _snapshot(opt.optimizer, params)
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    assert opt.counters.as_dict() == counters
    steady = report.split("compiled step #2")[1]
    for op in ("power_qr", "rayleigh_order"):
        (line,) = [ln for ln in steady.splitlines() if f"(hocompile.{op})" in ln]
        assert re.search(r"[\d.]+ (µs|us|ms|s) measured$", line), line
    match = re.search(r"measured: ([\d.]+ \S+) per step on copies", steady)
    assert match, steady
    assert "measured" not in hocompile.explain(opt)  # only when asked


def test_measure_says_why_it_could_not(cache_dir: Any) -> None:
    params = [torch.nn.Parameter(torch.randn(8, 16))]
    opt = hocompile.compile_optimizer(soap.SOAP(params, lr=0.01), cache_dir=cache_dir)
    for _ in range(2):
        params[0].grad = torch.randn(8, 16)
        opt.step()
    opt.zero_grad()
    report = hocompile.explain(opt, measure=True)
    assert "not measured, a grad is None now: call explain(measure=True) after backward()" in report
