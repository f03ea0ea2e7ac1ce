"""Data-dependent host reads split the step (hocompile/capture/host_reads.py): a value the step reads on
the host (``if t > 0``, ``min(t, x)``, ``.item()`` as a Python scale) is computed first, read
once as eager reads it, and the step compiled for it runs; before, each of these was refused.
Every case is bitwise eager over steps whose reads change value and outcome.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import hocompile
from hocompile import CaptureError


class TrustRatio(torch.optim.Optimizer):
    """LARS-style: a 0-d ``if w_norm > 0 and g_norm > 0`` branch picks the trust ratio."""

    def __init__(self, params: Any, lr: float = 0.1, eta: float = 0.01) -> None:
        super().__init__(params, {"lr": lr, "eta": eta})

    @torch.no_grad()
    def step(self) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                w_norm, g_norm = p.norm(), p.grad.norm()
                if w_norm > 0 and g_norm > 0:
                    trust = group["eta"] * w_norm / g_norm
                else:
                    trust = torch.ones(())
                p.add_(p.grad * trust, alpha=-group["lr"])


class ClippedScale(torch.optim.Optimizer):
    """``min(tensor, float)`` in Python: a clip on the grad norm, taken on the host."""

    def __init__(self, params: Any, lr: float = 0.1, clip: float = 2.0) -> None:
        super().__init__(params, {"lr": lr, "clip": clip})

    @torch.no_grad()
    def step(self) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                norm = p.grad.norm()
                scale = min(norm, group["clip"]) / (norm + 1e-12)
                p.add_(p.grad * scale, alpha=-group["lr"])


class ItemScale(torch.optim.Optimizer):
    """``.item()`` used as a Python number: the update divided by the grad's max, on the host."""

    def __init__(self, params: Any, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if "m" not in state:
                    state["m"] = torch.zeros_like(p)
                state["m"].lerp_(p.grad, 0.1)
                peak = state["m"].abs().max().item()
                p.add_(state["m"], alpha=-group["lr"] / max(peak, 1e-8))


class ViewScale(torch.optim.Optimizer):
    """The read is of a view of the param, and the rest uses that view before writing the param:
    the view is handed on (copied: the write would change it under the rest)."""

    def __init__(self, params: Any, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                flat = p.view(-1)
                peak = flat.abs().max().item()
                pull = flat.view_as(p) * (group["lr"] / max(peak, 1e-8))
                p.add_(p.grad, alpha=-group["lr"]).sub_(pull)


class ReadsTwice(torch.optim.Optimizer):
    """One value read twice, and a second read that needs the first."""

    def __init__(self, params: Any, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                peak = p.grad.abs().max()
                a, b = peak.item(), peak.item()
                update = p.grad / max(a + b, 1e-8)
                spread = (update - update.mean()).abs().sum().item()
                p.add_(update, alpha=-group["lr"] / (1.0 + spread))


class CountsByItem(torch.optim.Optimizer):
    """``int(t.item())`` as a loop bound: unbounded outcomes, refused."""

    def __init__(self, params: Any, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                for _ in range(int(p.grad.abs().sum().item()) % 3):
                    p.add_(p.grad, alpha=-group["lr"])


def _params() -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in [(6, 4), (5,), (3, 3)]]


def _run(make: Any, steps: int, cache_dir: Path, **kw: Any) -> hocompile.CompiledOptimizer:
    eager_params, compiled_params = _params(), _params()
    eager = make(eager_params)
    compiled = hocompile.compile_optimizer(make(compiled_params), cache_dir=cache_dir, **kw)
    for step in range(steps):
        gen = torch.Generator().manual_seed(10 + step)
        for pe, pc in zip(eager_params, compiled_params):
            # grads that grow, shrink and vanish: the reads take both sides of every branch
            scale = [0.1, 5.0, 0.0, 1.0][step % 4] if pe.dim() == 1 else 1.0
            pe.grad = torch.randn(pe.shape, generator=gen) * scale
            pc.grad = pe.grad.clone()
        if step == 5:
            for opt in (eager, compiled):
                opt.param_groups[0]["lr"] = 0.05
        eager.step()
        compiled.step()
        for i, (pe, pc) in enumerate(zip(eager_params, compiled_params)):
            assert torch.equal(pe, pc), f"param {i} differs at step {step}"
    assert compiled.counters.eager_fallbacks == 0, hocompile.explain(compiled)
    return compiled


@pytest.mark.parametrize(
    "cls", [TrustRatio, ClippedScale, ItemScale, ViewScale, ReadsTwice], ids=lambda c: c.__name__
)
def test_host_reads_compile_bitwise(cls: type, cache_dir: Path) -> None:
    compiled = _run(cls, 9, cache_dir)
    text = hocompile.explain(compiled)
    assert "split at" in text and "test_host_reads.py" in text, text
    # branch outcomes are variants (bounded), never recompiles
    assert compiled.counters.recompiles == [], compiled.counters


def test_max_of_a_read_is_an_expression_not_a_branch(cache_dir: Path) -> None:
    """``max(peak, 1e-8)``: one program whatever the value; the host evaluates the max."""
    compiled = _run(ItemScale, 9, cache_dir)
    assert compiled.counters.variants == [] and compiled.counters.compiles == 2, compiled.counters
    assert "max(read0, 1e-08)" in hocompile.explain(compiled)


@pytest.mark.parametrize("foreach", [False, True])
def test_adafactor_bitwise_without_variants(foreach: bool, cache_dir: Path) -> None:
    compiled = _run(lambda ps: torch.optim.Adafactor(ps, foreach=foreach), 9, cache_dir)
    assert compiled.counters.variants == [] and compiled.counters.recompiles == [], compiled.counters
    assert "_adafactor.py" in hocompile.explain(compiled)


def test_each_op_runs_once_across_the_split(cache_dir: Path) -> None:
    """Adafactor reads the update's norm after computing the update: the read's program computes
    it once and hands it to the rest of the step (before, the rest computed it again: 0.49x eager)."""
    compiled = _run(torch.optim.Adafactor, 3, cache_dir)
    captured = compiled.history[-1].captured
    assert captured is not None

    def count(gm: torch.fx.GraphModule, name: str) -> int:
        return sum(1 for n in gm.graph.nodes if n.op == "call_function" and name in str(n.target))

    programs = [read.gm for read in captured.reads] + [captured.gm]
    matrices = sum(1 for p in _params() if p.dim() == 2)
    assert sum(count(gm, "aten.mm") for gm in programs) == matrices, [gm.code for gm in programs]
    assert sum(count(gm, "aten.rsqrt") for gm in programs) == len(_params())
    assert count(captured.gm, "aten.rsqrt") == 0, captured.gm.code  # the update comes in as a carry
    assert any(s.kind == "carry" for s in captured.inputs)


class BranchOnFloat(torch.optim.Optimizer):
    """``if float(t) > x``: Python makes float()'s result a plain float, so the branch would be
    taken once at trace time for every later step (before: compiled, silently wrong)."""

    def __init__(self, params: Any, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                scale = 0.5 if float(p.grad.abs().max()) > 1.0 else 2.0
                p.add_(p.grad, alpha=-group["lr"] * scale)


def _assert_refused(cls: type, match: str, cache_dir: Path) -> list[torch.nn.Parameter]:
    """The first step raises CaptureError matching ``match`` and writes nothing; the params."""
    params = _params()
    for p in params:
        p.grad = torch.ones_like(p)
    compiled = hocompile.compile_optimizer(cls(params), cache_dir=cache_dir)
    before = [p.detach().clone() for p in params]
    with pytest.raises(CaptureError, match=match):
        compiled.step()
    assert all(torch.equal(a, b) for a, b in zip(before, params)), "nothing written before the refusal"
    return params


def test_float_of_a_tensor_is_refused_naming_the_line(cache_dir: Path) -> None:
    params = _assert_refused(BranchOnFloat, r"float\(\) on a .*test_host_reads.py:\d+ .*`t.item\(\)`", cache_dir)
    fallback = hocompile.compile_optimizer(BranchOnFloat(params), cache_dir=cache_dir, fallback="eager")
    fallback.step()
    assert fallback.counters.eager_fallbacks == 1


def test_read_used_as_an_int_is_refused(cache_dir: Path) -> None:
    _assert_refused(CountsByItem, r"int\(\)", cache_dir)


def test_square_inplace_is_pow_inplace_bitwise() -> None:
    """The capture traces ``t.square_()`` as ``t.pow_(2)`` (functionalize cannot trace square_)."""
    x = torch.randn(1000, dtype=torch.float32) * 1e3
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        y = x.to(dtype)
        assert torch.equal(y.clone().square_(), y.clone().pow_(2)), dtype


class AveragesAfterT0(torch.optim.Optimizer):
    """ASGD's ``1 / max(1, step - t0)``: the constant wins until the counter passes t0."""

    def __init__(self, params: Any, lr: float = 0.1, t0: int = 3) -> None:
        super().__init__(params, {"lr": lr, "t0": t0, "step": 0})

    @torch.no_grad()
    def step(self) -> None:  # type: ignore[override]
        for group in self.param_groups:
            group["step"] += 1
            mu = 1 / max(1, group["step"] - group["t0"])
            for p in group["params"]:
                p.add_(p.grad, alpha=-group["lr"] * mu)


def test_max_choosing_the_constant_is_still_an_expression(cache_dir: Path) -> None:
    """Both traces pick the constant 1 at step 1; the compiled step must not keep it when the
    counter passes t0 (before the per-trace nudge, it was baked in: wrong from step 5 on)."""
    compiled = _run(AveragesAfterT0, 9, cache_dir)
    assert compiled.counters.recompiles == [] and compiled.counters.variants == [], compiled.counters


def test_reads_of_many_same_shaped_params_are_each_their_own(cache_dir: Path) -> None:
    """Twelve params of one shape would be one parameter class (traced on representatives); each
    member's read is its own value, so such a step is traced whole: bitwise eager."""
    gen = torch.Generator().manual_seed(3)
    init = [torch.randn(4, 3, generator=gen) for _ in range(12)]
    eager_params = [torch.nn.Parameter(t.clone()) for t in init]
    compiled_params = [torch.nn.Parameter(t.clone()) for t in init]
    eager = torch.optim.Adafactor(eager_params)
    compiled = hocompile.compile_optimizer(torch.optim.Adafactor(compiled_params), cache_dir=cache_dir)
    for step in range(4):
        for k, (pe, pc) in enumerate(zip(eager_params, compiled_params)):
            pe.grad = torch.randn(pe.shape, generator=gen) * (k + 1)
            pc.grad = pe.grad.clone()
        eager.step()
        compiled.step()
        assert all(torch.equal(a, b) for a, b in zip(eager_params, compiled_params)), step
    text = hocompile.explain(compiled)
    assert "it reads tensor values on the host, each param its own" in text and "split at 24 host reads" in text
