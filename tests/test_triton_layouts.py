"""Layouts in the Triton step: every operand a kernel indexes by address is read as laid out.

The root cause of the divergence that kept ``distributed="replicated"`` off
the Triton backend: pointwise kernels take their operands from a pointer
table and index them as row-major memory, and only members of a stacked
Newton–Schulz result were marked as read transposed. Anything else that was
not row-major was read in the wrong element order, silently:

- what an aten call inside the step made, such as dist-ownership's readers of
  a gathered transposed result (``slice -> view -> permute`` of the gather
  buffer: every rank that received a tall matrix's update applied it
  scrambled, while its owner, reading its own stacked result, was right);
- strided inputs: a transposed or sliced grad, a param that is a transposed
  view.

Now an aten-made operand is read in the layout its fake value has (row-major
or transposed) and laid out so at run time if it is not; strided inputs run
on contiguous copies (lowering/triton/fence.py). The first tests are the
regression tests (each fails before the fix); the property test runs the
Triton step (interpreter) against the aten step over random mixes of shapes
and layouts.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import hocompile

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="runs CPU tensors in the interpreter")

EPS32 = torch.finfo(torch.float32).eps


class GatheredSGD(torch.optim.Optimizer):
    """Reads each update the way dist-ownership's readers read a gathered tall result: the grads
    of a shape stored in one buffer in the memory order of their transposes (``stack``: an aten
    call, as the gather is), then ``slice -> view -> permute`` back to the param's shape: a view
    that is not row-major, made inside the step, read by the update kernel."""

    def __init__(self, params: list[torch.nn.Parameter], lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: object = None) -> None:
        for group in self.param_groups:
            by_shape: dict[tuple[int, ...], list[torch.nn.Parameter]] = {}
            for p in group["params"]:
                by_shape.setdefault(tuple(p.shape), []).append(p)
            for (rows, cols), params in by_shape.items():
                gathered = torch.stack([p.grad.mT for p in params]).view(-1)
                for k, p in enumerate(params):
                    received = gathered[k * p.numel() : (k + 1) * p.numel()].view(cols, rows).permute(1, 0)
                    p.add_(received, alpha=-group["lr"])


class TransposedSGD(torch.optim.Optimizer):
    """``p -= lr * grad.mT`` on square params: the kernel's operand is a transposed view."""

    def __init__(self, params: list[torch.nn.Parameter], lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: object = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                p.add_(p.grad.mT, alpha=-group["lr"])


def _compiled_pair(make: Any, initial: list[torch.Tensor], cache_dir: Any, **kw: Any) -> tuple[Any, ...]:
    aten_params = [torch.nn.Parameter(t.clone()) for t in initial]
    tri_params = [torch.nn.Parameter(t.clone()) for t in initial]
    aten = hocompile.compile_optimizer(make(aten_params), backend="aten", cache_dir=cache_dir, **kw)
    tri = hocompile.compile_optimizer(make(tri_params), backend="triton", cache_dir=cache_dir, **kw)
    return aten, aten_params, tri, tri_params


def _pointwise_bound(p: torch.Tensor, update: torch.Tensor) -> torch.Tensor:
    """``p - lr * u`` computed by two programs: each rounds the product and the sum (or fuses them),
    so they differ by at most two fp32 roundings of those magnitudes."""
    return 2 * EPS32 * (p.abs() + update.abs())


@pytest.mark.parametrize(
    ("make", "shapes"),
    [(GatheredSGD, [(40, 24), (40, 24), (24, 40)]), (TransposedSGD, [(16, 16), (24, 24)])],
    ids=["gathered-slice-view-permute", "transposed-grad"],
)
def test_a_kernel_reads_an_operand_an_aten_call_made_transposed(make: Any, shapes: Any, cache_dir: Any) -> None:
    gen = torch.Generator().manual_seed(0)
    initial = [torch.randn(*s, generator=gen) for s in shapes]
    aten, aten_params, tri, tri_params = _compiled_pair(make, initial, cache_dir)
    bounds = [torch.zeros(s) for s in shapes]
    for _ in range(2):
        grads = [torch.randn(*s, generator=gen) for s in shapes]
        for params in (aten_params, tri_params):
            for p, g in zip(params, grads):
                p.grad = g.clone()
        aten.step()
        tri.step()
        for a, t, g, bound in zip(aten_params, tri_params, grads, bounds):
            bound += _pointwise_bound(a.detach(), 0.1 * g)  # a difference carried from a step stays
            assert bool(((a - t).abs() <= bound).all()), (tuple(a.shape), (a - t).abs().max().item())
    assert tri.history[-1].lowered.backend == "triton"


# ----------------------------------------------------------------- the property test

SIZES = [8, 16, 17, 24, 33, 40]  # the interpreter's tiles are 16: multiples and not
PARAM_LAYOUTS = ["dense", "transposed", "view"]
GRAD_LAYOUTS = ["dense", "transposed", "strided", "view"]


def _laid_out(value: torch.Tensor, layout: str, flat: torch.Tensor, offset: int) -> torch.Tensor:
    """``value``'s numbers in ``layout``: row-major, a transposed view, every other column of a
    wider tensor, or a view into ``flat`` at ``offset`` (a DDP bucket, an FSDP flat param)."""
    rows, cols = value.shape
    if layout == "transposed":
        return value.mT.contiguous().mT
    if layout == "strided":
        wide = torch.zeros(rows, 2 * cols)
        wide[:, ::2] = value
        return wide[:, ::2]
    if layout == "view":
        view = flat[offset : offset + value.numel()].view(rows, cols)
        view.copy_(value)
        return view
    return value.clone()


@st.composite
def layouts(draw: Any) -> list[tuple[tuple[int, int], str, str]]:
    """1-3 matrices, each maybe with its transposed twin (batch-by-shape joins them transposed)."""
    mats: list[tuple[tuple[int, int], str, str]] = []
    for _ in range(draw(st.integers(1, 3))):
        shape = (draw(st.sampled_from(SIZES)), draw(st.sampled_from(SIZES)))
        twins = [shape, shape[::-1]] if draw(st.booleans()) and shape[0] != shape[1] else [shape]
        for s in twins:
            mats.append((s, draw(st.sampled_from(PARAM_LAYOUTS)), draw(st.sampled_from(GRAD_LAYOUTS))))
    return mats


def _placed(values: list[torch.Tensor], layouts_: list[str]) -> list[torch.Tensor]:
    flat = torch.zeros(sum(v.numel() for v in values) + 3)  # offsets not multiples of anything
    out, offset = [], 3
    for value, layout in zip(values, layouts_):
        out.append(_laid_out(value, layout, flat, offset))
        offset += value.numel()
    return out


@settings(max_examples=1, deadline=None)  # each example is an interpreted Triton step: 5-18 s of CI
@given(mats=layouts())
@example(mats=[((40, 24), "transposed", "transposed"), ((24, 40), "view", "strided"), ((17, 17), "dense", "view")])
def test_triton_step_matches_aten_over_shapes_and_layouts(mats: list[tuple[tuple[int, int], str, str]]) -> None:
    import tempfile

    gen = torch.Generator().manual_seed(len(mats))
    shapes = [s for s, _, _ in mats]
    initial = [torch.randn(*s, generator=gen) for s in shapes]
    lr, steps = 0.02, 2
    with tempfile.TemporaryDirectory() as cache_dir:
        optimizers, param_sets = [], []
        for backend in ("aten", "triton"):
            params = [torch.nn.Parameter(t) for t in _placed(initial, [p for _, p, _ in mats])]
            opt = torch.optim.Muon(params, lr=lr, weight_decay=0.1)
            optimizers.append(
                hocompile.compile_optimizer(opt, backend=backend, precision="fp32", cache_dir=cache_dir)
            )
            param_sets.append(params)
        for step in range(1, steps + 1):
            grads = [torch.randn(*s, generator=gen) for s in shapes]
            for params in param_sets:
                for p, g in zip(params, _placed(grads, [g for _, _, g in mats])):
                    p.grad = g
            for opt in optimizers:
                opt.step()
            for (m, n), a, t in zip(shapes, *param_sets):
                # fp32 Newton–Schulz in both, summed in another order; torch.optim.Muon rounds its
                # result to bf16, so each step's update may differ by one bf16 ulp of |O| < 2
                # (2^-7), scaled by lr * sqrt(max(1, m/n)); momentum does not depend on params, so
                # steps add up. Plus the update's own fp32 roundings.
                bound = step * lr * max(1.0, m / n) ** 0.5 * 2**-7 + 4 * EPS32 * a.detach().abs().max().item()
                worst = (a - t).abs().max().item()
                assert worst <= bound, (step, (m, n), mats, worst, bound)
        assert optimizers[1].history[-1].lowered.backend == "triton"
        assert optimizers[1].counters.recompiles == []
