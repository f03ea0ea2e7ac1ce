"""The self-check's eager runs with bf16 GEMMs in fp32 where the CPU has no bf16 units (runtime/check/gemms.py).

On a CPU without AVX-512-BF16 or AMX, eager's bf16 GEMMs are ~60x slower than fp32 ones, and a
program's first check ran eager's bf16 Muon on two members per class twice: 15 s where the compiled
step takes 0.55 s. The tests force the faster reference on any machine (``slow_half_gemms``) and show
what it may and may not do: a correct fused step passes on it alone, a wrong plan is still caught
(and confirmed on eager's own run), and a program whose bf16 GEMMs are not all planned (bitwise
promised there) or that calls a torch.compile'd helper is checked against eager's own run only.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

import hocompile
from hocompile import SelfCheckWarning
from hocompile.runtime.check import gemms as check_gemms
from hocompile.runtime.check import self_check
from hocompile.runtime.check.gemms import HalfGemmsInFp32

from .helpers import zeropower_via_newtonschulz5
from .test_self_check import SHAPES, _params, _planted, _run, _state_bitwise
from .test_verify import DropLastIteration

BF16 = frozenset({torch.bfloat16})


def _operands(*shapes: tuple[int, ...]) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(*s, generator=gen).bfloat16() for s in shapes]


@pytest.mark.parametrize(
    "name",
    ["mm", "addmm", "addmm_", "bmm", "baddbmm", "baddbmm_", "mv", "addmv", "matmul", "mm_out"],
)
def test_each_gemm_is_the_fp32_product_rounded_once(name: str) -> None:
    a, b, c = _operands((24, 40), (40, 16), (24, 16))
    x, y, z = _operands((3, 24, 40), (3, 40, 16), (3, 24, 16))
    v, w = _operands((40,), (24,))
    calls = {
        "mm": lambda t: torch.mm(a, b),
        "addmm": lambda t: torch.addmm(c, a, b, beta=0.5, alpha=-2.0),
        "addmm_": lambda t: c.clone().addmm_(a, b, beta=0.5, alpha=-2.0),
        "bmm": lambda t: torch.bmm(x, y),
        "baddbmm": lambda t: torch.baddbmm(z, x, y, beta=2.0, alpha=0.25),
        "baddbmm_": lambda t: z.clone().baddbmm_(x, y, beta=2.0, alpha=0.25),
        "mv": lambda t: torch.mv(a, v),
        "addmv": lambda t: torch.addmv(w, a, v, beta=-1.0),
        "matmul": lambda t: a @ b,
        "mm_out": lambda t: torch.mm(a, b, out=torch.empty(0, dtype=torch.bfloat16)),
    }
    exact = calls[name](None)
    mode = HalfGemmsInFp32(BF16)
    with mode:
        emulated = calls[name](None)
    assert mode.calls == 1 and emulated.dtype == torch.bfloat16 and emulated.shape == exact.shape
    # the same products in another summation order: within a unit or two of bf16's last place
    torch.testing.assert_close(emulated.float(), exact.float(), rtol=2 * 2**-8, atol=2 * 2**-8)
    with HalfGemmsInFp32(BF16):  # the out-of-place fp32 computation, rounded once, by construction
        again = calls[name](None)
    assert torch.equal(again, emulated)


def test_other_dtypes_and_mixed_operands_are_left_alone() -> None:
    a, b = torch.randn(8, 8), torch.randn(8, 8)
    mode = HalfGemmsInFp32(BF16)
    with mode:
        assert torch.equal(a @ b, torch.mm(a, b))
        torch.addcmul(a.bfloat16(), a.bfloat16(), b.bfloat16())  # not a GEMM
    assert mode.calls == 0


def test_the_faster_reference_is_taken_only_without_bf16_units(monkeypatch: Any) -> None:
    monkeypatch.setattr(check_gemms, "declared_ratios", lambda: {"fp32": 1.0, "bf16": 0.01, "fp16": 0.01})
    assert check_gemms.slow_half_gemms() == BF16
    monkeypatch.setattr(check_gemms, "declared_ratios", lambda: {"fp32": 1.0, "bf16": 1.9, "fp16": 0.01})
    assert check_gemms.slow_half_gemms() == frozenset()


class _Judgements:
    """Counts the self-check's judgements and the GEMMs run in fp32 for it."""

    def __init__(self, monkeypatch: Any) -> None:
        self.outcomes: list[list[str]] = []
        self.gemms = 0
        monkeypatch.setattr(check_gemms, "slow_half_gemms", lambda: BF16)
        monkeypatch.setattr(self_check, "FREE_SECONDS", 1e9)  # every check due runs, however loaded the machine
        real_compare, judgements = self_check._compare, self

        def compare(*args: Any) -> Any:
            outcome = real_compare(*args)
            judgements.outcomes.append(outcome[0])
            return outcome

        class Counted(HalfGemmsInFp32):
            def __exit__(self, *exc: Any) -> Any:
                judgements.gemms += self.calls
                return super().__exit__(*exc)

        monkeypatch.setattr(self_check, "_compare", compare)
        monkeypatch.setattr(self_check, "HalfGemmsInFp32", Counted)


def test_a_correct_fused_step_passes_on_the_faster_reference_alone(cache_dir: Any, monkeypatch: Any) -> None:
    judgements = _Judgements(monkeypatch)
    eager = torch.optim.Muon(_params(SHAPES), lr=0.02)
    compiled = hocompile.compile_optimizer(torch.optim.Muon(_params(SHAPES), lr=0.02), cache_dir=cache_dir)
    with warnings.catch_warnings():
        warnings.simplefilter("error", SelfCheckWarning)
        _run(eager, compiled, 3)
    checks = sum(e.self_check.checks for e in compiled.history)
    assert checks >= 3 and judgements.gemms > 0
    assert judgements.outcomes == [[]] * checks  # one judgement a check: no rerun against eager's own bf16
    assert compiled.counters.eager_fallbacks == 0


def test_a_wrong_plan_is_caught_by_the_faster_reference_and_confirmed(cache_dir: Any, monkeypatch: Any) -> None:
    judgements = _Judgements(monkeypatch)
    eager = torch.optim.Muon(_params(SHAPES), lr=0.02)
    compiled = _planted(torch.optim.Muon(_params(SHAPES), lr=0.02), DropLastIteration(), cache_dir)
    with pytest.warns(SelfCheckWarning, match="of its update from eager's"):
        diffs = _run(eager, compiled, 3)
    assert diffs == [0.0] * 3
    _state_bitwise(eager, compiled)
    first, confirmed = judgements.outcomes[:2]
    assert first and confirmed  # seen beside the faster reference, then against eager's own bf16 run


def _products(g: torch.Tensor, lr: float) -> torch.Tensor:
    x = g.bfloat16()
    return (x @ x.mT @ x).float() * lr


@torch.compile(fullgraph=True)
def _compiled_scale(g: torch.Tensor, lr: float) -> torch.Tensor:
    return g * lr  # no matrix products: it runs as the user compiled it, an opaque op of the graph


def _scaled_newton_schulz(g: torch.Tensor, lr: float) -> torch.Tensor:
    return zeropower_via_newtonschulz5(_compiled_scale(g, lr), steps=5).float()  # fused and planned


class Products(torch.optim.Optimizer):
    """An update of bf16 GEMMs (one of the two functions above) applied to every param."""

    def __init__(self, params: Any, update: Any) -> None:
        super().__init__(params, {"lr": 0.1})
        self.update = update

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                p.sub_(self.update(p.grad, group["lr"]))


@pytest.mark.parametrize(
    "update",
    [_products, _scaled_newton_schulz],
    ids=["a-gemm-kept-as-eager-writes-it", "a-torch-compiled-helper"],
)
def test_the_faster_reference_is_not_used_where_it_cannot_stand_for_eager(
    update: Any, cache_dir: Any, monkeypatch: Any
) -> None:
    # An unplanned bf16 GEMM is promised eager's bits, and a compiled step computing it as the faster
    # reference does would match that reference bit for bit while differing from eager's. A
    # torch.compile'd helper under the dispatch mode is compiled anew by Dynamo (fullgraph: refused,
    # and then not compiled for the real step either). Both are checked against eager's own run.
    judgements = _Judgements(monkeypatch)
    shapes = [(24, 40)] * 3
    eager = Products(_params(shapes), update)
    compiled = hocompile.compile_optimizer(Products(_params(shapes), update), cache_dir=cache_dir)
    with warnings.catch_warnings():
        warnings.simplefilter("error", SelfCheckWarning)
        diffs = _run(eager, compiled, 3)
    assert compiled.counters.eager_fallbacks == 0
    if update is _products:
        assert diffs == [0.0] * 3  # nothing planned: bitwise
    else:
        assert "newton_schulz" in compiled.history[-1].final_graph  # every GEMM inside the planned op
    checks = sum(e.self_check.checks for e in compiled.history)
    assert checks >= 2 and judgements.gemms == 0 and judgements.outcomes == [[]] * checks  # runs 1 and 2
