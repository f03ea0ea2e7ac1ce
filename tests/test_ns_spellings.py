"""Newton–Schulz as real Muon code spells it: each spelling becomes one op, or is declined by name.

Each spelling below is one orthogonalisation function in the style of a real
implementation (Polar Express, torch.optim.Muon, Keller Jordan, DeepSeek-V4,
hand-rolled addmm/baddbmm code). Each runs inside the same small user Muon
and is checked three ways: (a) exactly one ``hocompile::newton_schulz`` per
matrix, with the coefficients eager applies; (b) over a few steps, the
compiled trajectory is no further from the exact one (the same function in
fp64) than eager's bf16 run is (≤ 1.25×, the error model of
tests/test_newton_schulz.py, on its fixed fp32-plan target); (c) with the NS
passes off, compiled equals eager bit for bit. Programs that are not NS, or
that the op would compute less accurately, stay unfused with a logged reason
naming the node.
"""

from __future__ import annotations

import functools
import inspect
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch

import hocompile
from hocompile.capture.group_hypers import STRUCTURAL_KEYS
from hocompile.capture.trace import capture
from hocompile.ops.newton_schulz_spec import NewtonSchulzSpec
from hocompile.passes import Canonicalize, FuseNewtonSchulz, run_pipeline

from .helpers import EXACT, Pair, emerging_coefficients, make_params
from .test_newton_schulz import AVX2_LIKE, KJ, NS

Coefficients = list[tuple[float, float, float]]
PE = emerging_coefficients("polar_express", 8)  # Polar Express, safety factor folded in
DEEPSEEK_V4 = [KJ[0]] * 8 + [(2.0, -1.5, 0.5)] * 2  # 8 fast steps, 2 stabilising
WIDE_TALL_SQUARE = [(16, 32), (32, 16), (24, 24)]
BATCHED = [(2, 16, 32), (2, 32, 16)]


class SpellingMuon(torch.optim.Optimizer):
    """Muon as users write it: momentum, Nesterov, ``ns`` on the update, a shape scale.

    A spelling that takes ``eps`` gets the group's (a hyperparameter, as in
    torch.optim.Muon); the others hard-code theirs, as Polar Express does.
    """

    def __init__(self, params: Any, ns: Callable[..., torch.Tensor], lr: float = 0.02, eps: float = 1e-7) -> None:
        super().__init__(params, dict(lr=lr, momentum=0.95, eps=eps))
        self.ns = ns
        self.ns_takes_eps = "eps" in inspect.signature(ns).parameters

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - group["momentum"])
                update = p.grad.lerp(buf, group["momentum"])
                update = self.ns(update, eps=group["eps"]) if self.ns_takes_eps else self.ns(update)
                scale = max(1.0, p.size(-2) / p.size(-1)) ** 0.5
                p.add_(update.to(p.dtype), alpha=-group["lr"] * scale)


# ------------------------------------------------------------- the spellings


def polar_express(G: torch.Tensor, dtype: torch.dtype = torch.bfloat16, steps: int = 8) -> torch.Tensor:
    """Polar Express's reference: a safety factor on the norm, one (a, b, c) per step."""
    X = G.to(dtype)
    if G.size(-2) > G.size(-1):
        X = X.mT
    X = X / (X.norm(dim=(-2, -1), keepdim=True) * 1.02 + 1e-7)
    for a, b, c in PE[:steps] + PE[-1:] * (steps - len(PE)):
        A = X @ X.mT
        B = b * A + c * A @ A
        X = a * X + B @ X
    if G.size(-2) > G.size(-1):
        X = X.mT
    return X


def torch_style_with_safety(G: torch.Tensor, eps: float, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """torch.optim.Muon's addmm loop with a safety factor and the group's eps (so eps/s is no host scalar)."""
    a, b, c = KJ[0]
    X = G.to(dtype)
    tall = G.size(0) > G.size(1)
    if tall:
        X = X.T
    X = X / X.norm().mul(1.05).clamp_min(eps)
    for _ in range(5):
        A = X @ X.T
        B = torch.addmm(A, A, A, beta=b, alpha=c)
        X = torch.addmm(X, B, X, beta=a)
    return X.T if tall else X


def cubic_clamp_min(G: torch.Tensor, eps: float, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The cubic iteration after ``X / X.norm().clamp_min(eps)``, B never named."""
    X = G.to(dtype)
    if G.size(0) > G.size(1):
        X = X.T
    X = X / X.norm().clamp_min(eps)
    for _ in range(6):
        X = 1.5 * X - 0.5 * (X @ X.T) @ X
    return X.T if G.size(0) > G.size(1) else X


def cast_after_normalising(G: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The norm of the fp32 input, the division already in bf16."""
    X = G.to(dtype) / (G.norm() + 1e-7)
    if G.size(0) > G.size(1):
        X = X.T
    for a, b, c in KJ:
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    return X.T if G.size(0) > G.size(1) else X


def normalise_in_place(G: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``X /= ‖X‖ + eps`` on the bf16 copy, batched with ``...``."""
    X = G.to(dtype)
    if G.size(-2) > G.size(-1):
        X = X.mT
    X /= X.norm(dim=(-2, -1), keepdim=True) + 1e-7
    for a, b, c in KJ:
        A = X @ X.mT
        X = a * X + (b * A + c * A @ A) @ X
    return X.mT if G.size(-2) > G.size(-1) else X


def divide_then_transpose(G: torch.Tensor, eps: float, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Normalise the fp32 update in place, then transpose and cast."""
    G.div_(G.norm(dim=(-2, -1), keepdim=True).clamp_min(eps))
    tall = G.size(-2) > G.size(-1)
    X = (G.mT if tall else G).to(dtype)
    for a, b, c in KJ:
        A = X @ X.mT
        X = a * X + (b * A + c * A @ A) @ X
    return X.mT if tall else X


def fp32_norm_then_cast(G: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The norm accumulated in fp32 and cast back before dividing."""
    X = G.to(dtype)
    if G.size(0) > G.size(1):
        X = X.T
    X = X / (X.float().norm() + 1e-7).to(X.dtype)
    for a, b, c in KJ:
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    return X.T if G.size(0) > G.size(1) else X


def tall_without_transposing(G: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """No transpose: a tall X iterates on Xᵀ X from the right."""
    X = G.to(dtype)
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for a, b, c in KJ:
        if X.size(-2) > X.size(-1):
            A = X.mT @ X
            X = a * X + X @ (b * A + c * A @ A)
        else:
            A = X @ X.mT
            X = a * X + (b * A + c * A @ A) @ X
    return X


def grouped_the_other_way(G: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``B = A X; X = a X + b B + c A B``: A² never formed."""
    X = G.to(dtype)
    tall = G.size(-2) > G.size(-1)
    if tall:
        X = X.mT
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for a, b, c in KJ:
        A = X @ X.mT
        B = A @ X
        X = a * X + b * B + c * A @ B
    return X.mT if tall else X


def addmm_into_empty(G: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """addmm into an uninitialised buffer with beta=0, scalings as ``mul``."""
    a, b, c = KJ[0]
    X = G.to(dtype)
    if G.size(0) > G.size(1):
        X = X.T
    X = X / (X.norm() + 1e-7)
    buf = torch.empty(X.size(0), X.size(0), dtype=X.dtype)
    for _ in range(5):
        A = torch.addmm(buf, X, X.T, beta=0)
        B = torch.addmm(A.mul(b), A, A, alpha=c)
        X = torch.addmm(X.mul(1.0), B, X, beta=a)
    return X.T if G.size(0) > G.size(1) else X


def baddbmm_batched(G: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """A stack through baddbmm, the Gram matrix into ``empty`` with beta=0; tall ones from the right
    (``baddbmm(X, X, B)``, as modded-nanogpt's Polar Express does)."""
    a, b, c = KJ[0]
    X = G.to(dtype)
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    tall = X.size(-2) > X.size(-1)
    side = X.size(-1) if tall else X.size(-2)
    gram = torch.empty(X.size(0), side, side, dtype=X.dtype)
    for _ in range(5):
        A = torch.baddbmm(gram, X.mT, X, beta=0) if tall else torch.baddbmm(gram, X, X.mT, beta=0)
        B = torch.baddbmm(A, A, A, beta=b, alpha=c)
        X = torch.baddbmm(X, X, B, beta=a) if tall else torch.baddbmm(X, B, X, beta=a)
    return X


def horner(G: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Horner form with in-place identity shifts: (c S + b I) S + a I, then one product with X."""
    X = G.to(dtype)
    if G.size(-2) > G.size(-1):
        X = X.mT
    X = X / torch.clamp(X.norm(dim=(-2, -1), keepdim=True), min=1e-7)
    for a, b, c in KJ:
        S = X @ X.mT
        Y = c * S
        Y.diagonal(dim1=-2, dim2=-1).add_(b)
        Y = Y @ S
        Y.diagonal(dim1=-2, dim2=-1).add_(a)
        X = Y @ X
    return X.mT if G.size(-2) > G.size(-1) else X


def deepseek_v4(G: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Ten iterations: eight fast, two that settle the singular values at 1."""
    X = G.to(dtype)
    if G.size(-2) > G.size(-1):
        X = X.mT
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for a, b, c in DEEPSEEK_V4:
        A = X @ X.mT
        X = a * X + (b * A + c * A @ A) @ X
    return X.mT if G.size(-2) > G.size(-1) else X


def _folded(coefficients: Coefficients, s: float) -> Coefficients:
    """A safety factor s on the norm, folded into the first iteration (what the pass does)."""
    (a, b, c), *rest = coefficients
    return [(a / s, b / s**3, c / s**5), *rest]


@dataclass(frozen=True)
class Spelling:
    ns: Callable[..., torch.Tensor]
    coefficients: Coefficients
    shapes: tuple[tuple[int, ...], ...] = tuple(WIDE_TALL_SQUARE)


SPELLINGS = {
    s.ns.__name__: s
    for s in [
        Spelling(polar_express, _folded(PE, 1.02), (*WIDE_TALL_SQUARE, *BATCHED)),
        Spelling(torch_style_with_safety, _folded(KJ, 1.05)),
        Spelling(cubic_clamp_min, [(1.5, -0.5, 0.0)] * 6),
        Spelling(cast_after_normalising, KJ),
        Spelling(normalise_in_place, KJ, (*WIDE_TALL_SQUARE, *BATCHED)),
        Spelling(divide_then_transpose, KJ, (*WIDE_TALL_SQUARE, *BATCHED)),
        Spelling(fp32_norm_then_cast, KJ),
        Spelling(tall_without_transposing, KJ, (*WIDE_TALL_SQUARE, *BATCHED)),
        Spelling(grouped_the_other_way, KJ, (*WIDE_TALL_SQUARE, *BATCHED)),
        Spelling(addmm_into_empty, KJ),
        Spelling(baddbmm_batched, KJ, tuple(BATCHED)),
        Spelling(horner, KJ, (*WIDE_TALL_SQUARE, *BATCHED)),
        Spelling(deepseek_v4, DEEPSEEK_V4, (*WIDE_TALL_SQUARE, *BATCHED)),
    ]
}


def _fused_graph(ns: Callable[..., torch.Tensor], shapes: Any) -> tuple[torch.fx.GraphModule, list[Any]]:
    params = make_params(shapes)
    for p in params:
        p.grad = torch.randn_like(p)
    gm = capture(SpellingMuon(params, ns), STRUCTURAL_KEYS).gm
    return run_pipeline(gm, (Canonicalize(), FuseNewtonSchulz()))


def _assert_coefficients(node: torch.fx.Node, expected: Coefficients) -> None:
    got = NewtonSchulzSpec.from_node(node).coefficients
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert g == pytest.approx(e, rel=1e-12, abs=1e-12)


# ------------------------------------------------------------- (a) one op per matrix


@pytest.mark.parametrize("name", sorted(SPELLINGS))
def test_one_newton_schulz_op_per_matrix(name: str) -> None:
    spelling = SPELLINGS[name]
    gm, records = _fused_graph(spelling.ns, spelling.shapes)
    ops = [n for n in gm.graph.nodes if n.target is NS]
    matmuls = [n.name for n in gm.graph.nodes if re.search(r"\b(b?mm|addmm|baddbmm)\b", str(n.target))]
    assert len(ops) == len(spelling.shapes) and matmuls == [], records[-1].summary
    for node in ops:
        _assert_coefficients(node, spelling.coefficients)
        spec = NewtonSchulzSpec.from_node(node)
        x = spec.x_node.meta["val"]
        assert spec.transpose == (x.shape[-2] > x.shape[-1])  # iterates on the wide side
        assert spec.compute_dtype == torch.bfloat16  # the dtype eager's iterations run in


def test_safety_factor_folds_into_eps_or_scales_the_input() -> None:
    """A constant eps becomes eps/s; a hyperparameter eps stays, and the input is scaled by s instead."""
    gm, _ = _fused_graph(polar_express, [(16, 32)])
    (op,) = [NewtonSchulzSpec.from_node(n) for n in gm.graph.nodes if n.target is NS]
    assert op.eps == pytest.approx(1e-7 / 1.02) and op.eps_mode == "add"
    gm, _ = _fused_graph(torch_style_with_safety, [(16, 32)])
    (op,) = [NewtonSchulzSpec.from_node(n) for n in gm.graph.nodes if n.target is NS]
    scaled = op.x_node
    assert scaled.target is torch.ops.aten.mul.Tensor and scaled.args[1] == 1.05
    assert isinstance(op.eps, torch.fx.Node) and op.eps.op == "placeholder" and op.eps_mode == "clamp"


@pytest.mark.parametrize("steps", [1, 3, 12])
def test_any_number_of_steps(steps: int) -> None:
    gm, _ = _fused_graph(functools.partial(polar_express, steps=steps), [(16, 32), (32, 16)])
    ops = [n for n in gm.graph.nodes if n.target is NS]
    assert len(ops) == 2
    for node in ops:
        _assert_coefficients(node, _folded(PE[:steps] + PE[-1:] * (steps - len(PE)), 1.02))


# ------------------------------------------------------------- (b) error model, (c) bitwise


def _run(spelling: Spelling, ns: Callable[..., torch.Tensor], cache_dir: Any = None) -> tuple[list[torch.Tensor], Any]:
    params = make_params(spelling.shapes)
    opt: torch.optim.Optimizer = SpellingMuon(params, ns)
    if cache_dir is not None:
        opt = hocompile.compile_optimizer(opt, cache_dir=cache_dir, target=AVX2_LIKE)
    gen = torch.Generator().manual_seed(7)
    for _ in range(3):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    return params, opt


@pytest.mark.parametrize("name", sorted(SPELLINGS))
def test_trajectory_within_eager_error(name: str, cache_dir: Any) -> None:
    """Against the same spelling run in fp64, compiled (fp32 plan) is within 1.25× eager's bf16 error."""
    spelling = SPELLINGS[name]
    eager, _ = _run(spelling, spelling.ns)
    exact, _ = _run(spelling, functools.partial(spelling.ns, dtype=torch.float64))
    compiled, opt = _run(spelling, spelling.ns, cache_dir)
    stats = opt.history[-1].final_stats
    assert stats["newton-schulz"] == len(spelling.shapes) and stats["matmuls"] == 0
    for e, x, c in zip(eager, exact, compiled):
        assert (c - x).norm() <= 1.25 * (e - x).norm() + 1e-6
        assert (e - x).norm() > 0


@pytest.mark.parametrize("name", sorted(SPELLINGS))
def test_bitwise_equal_to_eager_with_ns_passes_off(name: str, cache_dir: Any) -> None:
    spelling = SPELLINGS[name]
    pair = Pair(lambda ps: SpellingMuon(ps, spelling.ns), spelling.shapes, cache_dir, target=AVX2_LIKE, **EXACT)
    for _ in range(2):
        pair.step()
    for a, b in zip(pair.eager_params, pair.compiled_params):
        assert torch.equal(a, b)
    pair.assert_state_equal()


# ------------------------------------------------------------- declines


def odd_and_even(G: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Looks like NS but adds an even term, X Xᵀ: not an odd polynomial in X."""
    X = G.to(dtype)
    X = X / (X.norm() + 1e-7)
    for a, b, c in KJ:
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X + 0.01 * A
    return X


def septic(G: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """A degree-7 iteration: B has an A³ term."""
    X = G.to(dtype)
    X = X / (X.norm() + 1e-7)
    for a, b, c in KJ:
        A = X @ X.T
        X = a * X + (b * A + c * A @ A @ A) @ X
    return X


def hyperparameter_safety(G: torch.Tensor, eps: float, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """A safety factor read from the param group: no constant to fold into the coefficients."""
    X = G.to(dtype)
    X = X / (X.norm() * (1 + eps) + 1e-7)
    for a, b, c in KJ:
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    return X


@pytest.mark.parametrize(
    "ns, reason",
    [
        (odd_and_even, r"has a term X·Xᵀ, not an odd power of X"),
        (septic, r"is a product of degree above 5"),
        (hyperparameter_safety, r"safety factor \w+ is a hyperparameter, not a constant"),
        # fp32 Horner is 1.5-2x more accurate than the op's a X + B X: fusing it would break the budget.
        (functools.partial(horner, dtype=torch.float32), r"eager computes \(a·I \+ B\)·X in torch.float32"),
    ],
)
def test_not_newton_schulz_is_left_unfused_with_reason(
    ns: Callable[..., torch.Tensor], reason: str, cache_dir: Any, caplog: pytest.LogCaptureFixture
) -> None:
    shapes = [(24, 24)]
    with caplog.at_level(logging.INFO, logger="hocompile.passes"):
        gm, records = _fused_graph(ns, shapes)
    assert not any(n.target is NS for n in gm.graph.nodes) and records[-1].status == "unchanged"
    logged = [r.getMessage() for r in caplog.records]
    assert any(re.match(rf"fuse-newton-schulz declined: \w+: .*{reason}", m) for m in logged), logged  # names the node
    pair = Pair(lambda ps: SpellingMuon(ps, ns), shapes, cache_dir, target=AVX2_LIKE)
    pair.step()
    for a, b in zip(pair.eager_params, pair.compiled_params):
        assert torch.equal(a, b)  # nothing fused: the compiled step is eager's own ops
