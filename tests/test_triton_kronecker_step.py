"""Issue 12 item 4: ``factor_update`` and ``two_sided`` launch their Triton kernels inside a Triton step.

hocompile's Shampoo (between refreshes: factor_update ``addmm``, two_sided
``left_first``) and emerging-optimizers SOAP (factor_update ``lerp``,
two_sided ``tensordot``) compiled with ``backend="triton"`` run under
``TRITON_INTERPRET=1`` (no GPU here: the kernels run in Triton's CPU
interpreter, fp32, tiles of 16) beside the same optimizer compiled with
``backend="aten"``, on identical params and grads.

Error model (stated from the kernels' accumulation order, not fitted): each
kernel output element is a dot product of at most ``2n`` fp32 terms
(factor_update: the Gram's rank k ≤ n plus the epilogue's two roundings;
two_sided: m then n terms, the intermediate rounded once), summed in tile
order instead of BLAS order: at most ``2n + 2`` roundings, each within
EPS32 of the magnitude ``max|x|`` (the factors are PSD, so every term is
bounded by the diagonal). A step's error is carried into the next at most
once (EMA/lerp weights ≤ 1), so after ``s`` steps the factors (the
factor_update kernels' own outputs, which nothing downstream feeds back
into) agree within ``s · (2n + 2) · EPS32 · max|F|``.

Everything else passes through library calls (eigh, QR, the inverse root)
whose first-order sensitivity to a factor perturbation is ``κ = λmax /
min(smallest eigengap, λmin)`` of the factor (Davis–Kahan for the
eigenvectors; λmax/λmin bounds the ``(λ + ε)^(-1/p)`` root's), computed
here in fp64 from the aten run's factors: those tensors agree within
``κ · s · (2n + 2) · EPS32 · max|x|``. The inputs keep κ finite and modest:
grads with fixed singular vectors and singular values spread over [1, 3]
(separated eigenvalues), square params (every factor has full rank after
one step; a rank-deficient factor's null-space eigenvectors, and
Shampoo's root there, are decided by rounding alone: κ is infinite).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

import hocompile
import tests.helpers  # noqa: F401  (typing.override for emerging-optimizers on Python 3.11)
from hocompile.optimizers import Shampoo

pytest.importorskip("triton")
soap = pytest.importorskip("emerging_optimizers.soap")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
interpreted = pytest.mark.skipif(torch.cuda.is_available(), reason="runs CPU tensors in the interpreter")

EPS32 = torch.finfo(torch.float32).eps
SHAPES = [(16, 16), (16, 16), (24, 24)]  # 16x16 factors: two params x two sides, one stack of 4
N = max(max(s) for s in SHAPES)
STEPS = 4


def _grad(shape: tuple[int, int], basis: tuple[torch.Tensor, torch.Tensor], step: int) -> torch.Tensor:
    (m, n), (u, v) = shape, basis
    k = min(m, n)
    singular = torch.linspace(1.0, 3.0, k, dtype=torch.float64) * (1.0 + 0.01 * step)
    return ((u[:, :k] * singular) @ v[:, :k].T).float()


def _run(make: Any, cache_dir: Path) -> tuple[Any, Any, list[torch.Tensor], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(*s, generator=gen) for s in SHAPES]
    twins = [p.clone() for p in params]
    bases = [
        (
            torch.linalg.qr(torch.randn(m, m, generator=gen, dtype=torch.float64))[0],
            torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64))[0],
        )
        for m, n in SHAPES
    ]
    aten = hocompile.compile_optimizer(make(params), backend="aten", cache_dir=cache_dir)
    tri = hocompile.compile_optimizer(make(twins), backend="triton", cache_dir=cache_dir)
    for step in range(STEPS):
        for p, q, shape, basis in zip(params, twins, SHAPES, bases):
            g = _grad(shape, basis, step)
            p.grad, q.grad = g.clone(), g.clone()
        aten.step()
        tri.step()
    assert tri.counters.eager_fallbacks == 0
    return aten, tri, params, twins


def _is_factor(name: str) -> bool:
    return name in ("L", "R") or "_factor_" in name  # SOAP's L/R, Shampoo's left/right_factor_<i>


def _conditioning(factor: torch.Tensor) -> float:
    """λmax / min(smallest eigengap, λmin) of a symmetric PSD factor, in fp64."""
    eig = torch.linalg.eigvalsh(factor.double())
    return float(eig[-1] / min(eig.diff().min(), eig[0]))


def _assert_within_model(aten: Any, tri: Any, params: list[torch.Tensor], twins: list[torch.Tensor]) -> None:
    bound = STEPS * (2 * N + 2) * EPS32
    factors = [v for p in params for k, v in aten.state[p].items() if _is_factor(k)]
    assert len(factors) == 2 * len(params), [list(aten.state[p]) for p in params]
    kappa = max(_conditioning(f) for f in factors)
    assert 1.0 < kappa < 1e3, kappa  # finite: the grads keep the spectra separated
    compared = 0
    for p, q in zip(params, twins):
        pairs = [("param", p, q)] + [
            (k, v, tri.state[q][k]) for k, v in aten.state[p].items() if isinstance(v, torch.Tensor) and v.dim() > 0
        ]
        for name, a, t in pairs:
            tol = (1.0 if _is_factor(name) else kappa) * bound * max(a.abs().max().item(), 1e-30)
            diff = (a - t).abs().max().item()
            assert diff <= tol, (name, tuple(a.shape), diff, tol, kappa)
            compared += 1
    assert compared > 3 * len(params), compared  # the factors and the rest of the state were compared


def _kernel_units(tri: Any, op: str) -> list[str]:
    lowered = tri.history[-1].lowered
    assert lowered is not None and lowered.backend == "triton"
    return [u for u in lowered.units if u.startswith("call ") and f": {op} " in u]


@interpreted
def test_shampoo_triton_step_launches_the_kronecker_kernels(cache_dir: Path) -> None:
    def make(ps: list[torch.Tensor]) -> torch.optim.Optimizer:
        # epsilon 1e-3: the inverse roots' regularisation (the default 1e-12 is only rounding there)
        return Shampoo(ps, lr=0.01, precondition_frequency=5, epsilon=1e-3)

    aten, tri, params, twins = _run(make, cache_dir)
    # The last entry is the between-refreshes variant (steps 2..4).
    factor = _kernel_units(tri, "factor_update")
    assert any("addmm: 4 x 16x16" in u and "1 launch" in u for u in factor), factor  # stacked: one launch
    assert any("addmm: 2 x 24x24" in u for u in factor), factor
    assert not any(u.startswith("aten factor_update") for u in tri.history[-1].lowered.units)
    sided = _kernel_units(tri, "two_sided")
    assert sided and all("left_first" in u for u in sided), sided
    families = {k.family for k in tri.history[-1].lowered.kernels}
    assert {"factor_update", "two_sided"} <= families, families
    _assert_within_model(aten, tri, params, twins)


@interpreted
def test_soap_triton_step_launches_the_kronecker_kernels(cache_dir: Path) -> None:
    aten, tri, params, twins = _run(lambda ps: soap.SOAP(ps, lr=0.01, eps=1e-3), cache_dir)
    factor = _kernel_units(tri, "factor_update")
    # SOAP's factor updates stack per param (left with transposed right): one launch for both sides.
    assert sum("lerp: 2 x 16x16" in u and "1 launch" in u for u in factor) == 2, factor
    assert any("lerp: 2 x 24x24" in u for u in factor), factor
    sided = _kernel_units(tri, "two_sided")
    assert sided and all("tensordot" in u for u in sided), sided
    assert not any(u.startswith(("aten factor_update", "aten two_sided")) for u in tri.history[-1].lowered.units)
    _assert_within_model(aten, tri, params, twins)


def test_a_call_the_kernels_cannot_take_stays_an_aten_call_and_says_why() -> None:
    """fp64 is not a kernel dtype: the call is an aten unit whose explain() line gives the reason."""
    from hocompile.lowering.triton.wrapper import generate_wrapper

    def step(factor: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (torch.ops.hocompile.factor_update(factor, g, "left", "lerp", 0.05),)

    gm: fx.GraphModule = make_fx(step, tracing_mode="fake")(
        torch.zeros(16, 16, dtype=torch.float64), torch.zeros(16, 32, dtype=torch.float64)
    )
    plan = generate_wrapper(gm, [None], "interpret", upcast="True")
    declined = [u for u in plan.units if u.startswith("aten factor_update")]
    assert declined and "kept as an aten call" in declined[0] and "float64" in declined[0], plan.units
    assert not any(k.family == "factor_update" for k in plan.kernels)

    fp32: fx.GraphModule = make_fx(step, tracing_mode="fake")(torch.zeros(16, 16), torch.zeros(16, 32))
    plan = generate_wrapper(fp32, [None], "interpret", upcast="True")
    assert any(u.startswith("call 0") for u in plan.units), plan.units
    assert [k.family for k in plan.kernels] == ["factor_update"]
    assert "torch.empty" not in plan.body.split("def launch(")[1]  # cout0 is allocated in buffers()
    # The kernel takes the placeholders as tensors: a captured CUDA graph would bake their addresses in.
    assert not plan.graph_safe
