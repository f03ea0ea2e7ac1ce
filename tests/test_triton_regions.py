"""Regions and launch order on the Triton backend: steps whose fused kernels would wait for themselves.

Found by ``gpu_check.py --smoke`` running the Shampoo family on the Triton backend (what
``backend="auto"`` picks on a GPU): the compile failed with ``ScheduleError`` for two of them.

- PolarGrad scales its polar factor by ``sum(O * G)``, a product of the Newton–Schulz result and
  its own input: the elementwise nodes around the NS joined one region, which fed the NS and read
  its result. A region is now never joined across a call that both depends on it and feeds it
  (regions.py).
- REKLS's regions of different params read each other through aten calls: fused across params,
  the groups waited for each other. Groups on such a cycle now launch one member at a time
  (wrapper.py, schedule.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import hocompile
from hocompile.ops.newton_schulz_math import newton_schulz

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="runs CPU tensors in the interpreter")


class ScaledPolar(torch.optim.Optimizer):
    """PolarGrad's shape of update: ``O = NS(m)``, then ``p -= lr * O * sum(O * m)``."""

    def __init__(self, params: list[torch.nn.Parameter], lr: float = 0.02) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: object = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if not state:
                    state["m"] = torch.zeros_like(p)
                m = state["m"].lerp_(p.grad, 0.1)
                o = newton_schulz(m, [(3.4445, -4.775, 2.0315)] * 3, 1e-7)
                p.add_(o * (o * m).sum(), alpha=-group["lr"])


def _steps(make: Any, backend: str, shapes: list[tuple[int, int]], cache: Path, steps: int = 2) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(*s, generator=gen)) for s in shapes]
    opt = hocompile.compile_optimizer(make(params), backend=backend, precision="fp32", cache_dir=cache)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    if backend == "triton":
        assert opt.history[-1].lowered.backend == "triton"
    return [p.detach() for p in params]


def _relative(got: list[torch.Tensor], want: list[torch.Tensor], start: list[torch.Tensor]) -> float:
    return max(((g - w).norm() / (w - s).norm()).item() for g, w, s in zip(got, want, start))


def test_a_region_that_reads_the_newton_schulz_result_and_its_input(cache_dir: Path) -> None:
    shapes = [(16, 24), (16, 16)]
    start = _steps(ScaledPolar, "aten", shapes, cache_dir, steps=0)
    aten = _steps(ScaledPolar, "aten", shapes, cache_dir)
    tri = _steps(ScaledPolar, "triton", shapes, cache_dir)
    # fp32 NS in both, summed in another order: the update agrees to fp32 rounding amplified by
    # three NS iterations (well below 1e-4 of its size here; a wrong step is off by O(1)).
    assert _relative(tri, aten, start) < 1e-4


def test_fused_groups_that_wait_for_each_other_launch_per_member(cache_dir: Path) -> None:
    import tests.helpers  # noqa: F401  (typing.override for emerging-optimizers on Python 3.11)

    pytest.importorskip("emerging_optimizers")
    from emerging_optimizers.soap import REKLS

    from . import test_triton_kronecker_step as kron

    # eps 1e-3 as test_triton_kronecker_step's SOAP: with 1e-8, step 1's update is the sign of
    # rounding noise (benchmarks/gpu_check_shampoo.py says why); grads with separated spectra.
    aten, tri, params, twins = kron._run(lambda ps: REKLS(ps, lr=0.01, eps=1e-3), cache_dir)
    units = tri.history[-1].lowered.units
    kernels = [u.split(":")[0] for u in units if u.startswith("pw_")]
    assert len(kernels) > len(set(kernels)), units  # a fused kernel launched once per member
    # That test's error model, on what does not depend on the sign eigh gives each eigenvector
    # (REKLS keeps its moments in the eigenbasis, recomputed by eigh every step: a flipped
    # eigenvector flips a row of them, and the update not at all): the params and the factors.
    bound = kron.STEPS * (2 * kron.N + 2) * kron.EPS32
    factors = [(p, q, k) for p, q in zip(params, twins) for k in aten.state[p] if kron._is_factor(k)]
    kappa = max(kron._conditioning(aten.state[p][k]) for p, _, k in factors)
    assert len(factors) == 2 * len(params) and 1.0 < kappa < 1e3, kappa
    for p, q, k in factors:
        a, t = aten.state[p][k], tri.state[q][k]
        assert (a - t).abs().max() <= bound * a.abs().max(), (k, tuple(a.shape))
    for p, q in zip(params, twins):
        assert (p - q).abs().max() <= kappa * bound * p.abs().max(), tuple(p.shape)
