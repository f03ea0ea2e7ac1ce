"""Newton–Schulz: recognition in every real Muon, numerics against fp64, declines."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import hocompile
from hocompile.capture.group_hypers import STRUCTURAL_KEYS
from hocompile.capture.trace import capture
from hocompile.ops.newton_schulz_math import flops, newton_schulz, reference_fp64
from hocompile.ops.newton_schulz_spec import NewtonSchulzSpec
from hocompile.passes import BatchByShape, Canonicalize, ChooseAlgorithm, FuseNewtonSchulz, run_pipeline
from hocompile.passes.choose_algorithm import decide
from hocompile.targets import Target

from .helpers import NSOnly, UserMuon, emerging_coefficients, emerging_muon, emerging_ns, make_params

NS = torch.ops.hocompile.newton_schulz.default
KJ = [(3.4445, -4.775, 2.0315)] * 5
AVX2_LIKE = Target("avx2-like", {"fp32": 100.0, "bf16": 1.0, "fp16": 1.0})
BF16_FAST = Target("amx-like", {"fp32": 100.0, "bf16": 400.0, "fp16": 1.0})
EMERGING_KINDS = ["simple", "quintic", "polar_express", "cans", "aol", "deepseekv4"]
SHAPES = [(8, 4), (4, 4), (6, 10)]


def _fused(opt: torch.optim.Optimizer, params: list[torch.Tensor]) -> tuple[list[torch.fx.Node], list[str]]:
    for p in params:
        p.grad = torch.randn_like(p)
    gm = capture(opt, STRUCTURAL_KEYS).gm
    gm, records = run_pipeline(gm, (Canonicalize(), FuseNewtonSchulz()))
    ops = [n for n in gm.graph.nodes if n.target is NS]
    leftover = [str(n.target) for n in gm.graph.nodes if "mm" in str(n.target)]
    return ops, leftover


def _coefficients(node: torch.fx.Node) -> list[tuple[float, float, float]]:
    return NewtonSchulzSpec.from_node(node).coefficients


def _input(node: torch.fx.Node) -> torch.Tensor:
    return NewtonSchulzSpec.from_node(node).x_node.meta["val"]


def _assert_coefficients(node: torch.fx.Node, expected: list[tuple[float, float, float]]) -> None:
    got = _coefficients(node)
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert g == pytest.approx(e, rel=1e-12, abs=1e-12)


# ------------------------------------------------------------- recognition


def test_torch_muon_recognised() -> None:
    params = make_params(SHAPES)
    ops, leftover = _fused(torch.optim.Muon(params), params)
    assert len(ops) == len(params) and leftover == []
    for node, p in zip(ops, params):
        _assert_coefficients(node, KJ)
        spec = NewtonSchulzSpec.from_node(node)
        assert spec.transpose == (p.shape[0] > p.shape[1])  # transposed to wide
        assert spec.compute_dtype == torch.bfloat16 and spec.eps_mode == "clamp"


def test_keller_jordan_function_in_a_user_optimizer_recognised() -> None:
    params = make_params(SHAPES + [(2, 6, 4)])  # leading batch dims too
    ops, leftover = _fused(UserMuon(params), params)
    assert len(ops) == len(params) and leftover == []
    for node in ops:
        _assert_coefficients(node, KJ)
        spec = NewtonSchulzSpec.from_node(node)
        assert spec.eps_mode == "add" and spec.eps == 1e-7


@pytest.mark.parametrize("prec", ["medium", "high", "highest"])
@pytest.mark.parametrize("kind", EMERGING_KINDS)
def test_emerging_muon_recognised(kind: str, prec: str) -> None:
    params = make_params(SHAPES)
    opt = emerging_muon(params, coefficient_type=kind, fp32_matmul_prec=prec)
    ops, leftover = _fused(opt, params)
    assert len(ops) == len(params) and leftover == []
    for node in ops:
        _assert_coefficients(node, emerging_coefficients(kind, 5))
        spec = NewtonSchulzSpec.from_node(node)
        assert spec.compute_dtype == (torch.bfloat16 if prec == "medium" else torch.float32)
        assert spec.out_dtype == torch.float32


def test_emerging_batched_baddbmm_path_and_cubic_recognised() -> None:
    params = make_params([(3, 6, 4), (2, 4, 4)])
    ops, leftover = _fused(NSOnly(params, emerging_ns(steps=4, coefficient_type="aol")), params)
    assert len(ops) == 2 and leftover == []
    _assert_coefficients(ops[0], emerging_coefficients("aol", 4))
    cubic = [(1.5, -0.5, 0.0)] * 3
    params = make_params([(8, 4)])
    ops, leftover = _fused(
        NSOnly(params, emerging_ns(steps=3, coefficient_type="custom", custom_coefficient_sets=cubic)), params
    )
    assert len(ops) == 1 and leftover == []
    _assert_coefficients(ops[0], cubic)


def test_heavyball_muon_is_refused_clearly() -> None:
    """heavyball 3.2.1 keeps its state in a dict keyed by params outside `state` (opt.mapping): not
    capturable. (Its torch.compile'd kernels are traced through now; the state is what refuses it.)"""
    import heavyball

    params = make_params([(8, 4)])
    opt = hocompile.compile_optimizer(heavyball.Muon(params, lr=0.02))
    params[0].grad = torch.randn(8, 4)
    before = params[0].clone()
    with pytest.raises(hocompile.CaptureError, match="keys optimizer attribute 'mapping' by tensors"):
        opt.step()
    assert torch.equal(params[0], before)


# ------------------------------------------------------------- declines


def _other_polynomial(G: torch.Tensor) -> torch.Tensor:
    X = G / (G.norm() + 1e-7)
    for _ in range(3):
        A = X @ X.mT
        B = -4.775 * A + 2.0315 * A @ A @ A  # a septic term: not a·X + (b·A + c·A²)·X
        X = 3.4445 * X + B @ X
    return X


def _no_normalisation(G: torch.Tensor) -> torch.Tensor:
    X = G
    for _ in range(3):
        A = X @ X.mT
        X = 3.4445 * X + (-4.775 * A + 2.0315 * A @ A) @ X
    return X


@pytest.mark.parametrize(
    "ns, reason",
    [
        (_other_polynomial, "not followed by a·X + (b·A + c·A²)·X iterations"),
        (_no_normalisation, "X Xᵀ product outside any recognised Newton–Schulz chain"),
    ],
)
def test_declines_with_reason_and_step_stays_correct(ns: Any, reason: str, cache_dir) -> None:
    params = make_params([(4, 8)])
    gm_params = make_params([(4, 8)])
    params[0].grad = torch.randn(4, 8) * 0.1
    gm = capture(NSOnly(params, ns), STRUCTURAL_KEYS).gm
    _, records = run_pipeline(gm, (Canonicalize(), FuseNewtonSchulz()))
    assert records[-1].status == "unchanged"
    assert any(reason in r for r in records[-1].summary.split("; "))
    eager = NSOnly(params, ns)
    compiled = hocompile.compile_optimizer(NSOnly(gm_params, ns), cache_dir=cache_dir)
    gm_params[0].grad = params[0].grad.clone()
    eager.step()
    compiled.step()
    assert torch.equal(params[0], gm_params[0])


# ------------------------------------------------------------- numerics


def eager_ns(x: torch.Tensor, coefficients: list[tuple[float, float, float]], eps: float = 1e-7) -> torch.Tensor:
    """What every maintained eager implementation does: bf16, addmm per iteration."""
    X = x.bfloat16()
    tall = X.size(-2) > X.size(-1)
    if tall:
        X = X.mT
    X = X / X.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
    for a, b, c in coefficients:
        A = X @ X.mT
        B = torch.baddbmm(A, A, A, beta=b, alpha=c) if X.dim() == 3 else torch.addmm(A, A, A, beta=b, alpha=c)
        X = torch.baddbmm(X, B, X, beta=a) if X.dim() == 3 else torch.addmm(X, B, X, beta=a)
    return X.mT if tall else X


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref).norm() / ref.norm()).item()


COEFFICIENT_SETS = {"kj": KJ, "cubic": [(1.5, -0.5, 0.0)] * 6} | {
    kind: emerging_coefficients(kind, 5) for kind in ("quintic", "polar_express", "aol", "cans", "deepseekv4")
}
# An fp32 result is ~1e-6 from fp64; where eager's own bf16 error is below that
# (1×n rows are nearly exact), the bound is this floor instead of 1.25× zero.
FLOOR = 1e-5


def _plan_kwargs(m: int, n: int, batch: int, coefficients: Any, precision: str, target: Target) -> dict[str, Any]:
    plan = decide(min(m, n), max(m, n), batch, coefficients, torch.bfloat16, precision, target)
    return dict(
        compute_dtype=plan.compute_dtype, algorithm=plan.algorithm, restarts=plan.restarts, matmul=plan.matmul
    )


@settings(max_examples=40, deadline=None)
@given(
    m=st.sampled_from([1, 3, 8, 17, 32, 48]),
    n=st.sampled_from([1, 5, 8, 16, 33, 64, 96]),
    batch=st.sampled_from([0, 1, 3]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    kind=st.sampled_from(sorted(COEFFICIENT_SETS)),
    plan=st.sampled_from(["auto-avx2", "auto-bf16-fast", "bf16-emulated"]),
    blocks=st.sampled_from([0, 2, 4]),
    seed=st.integers(0, 2**16),
)
@example(m=8, n=8, batch=0, dtype=torch.float32, kind="polar_express", plan="bf16-emulated", blocks=0, seed=87)
def test_op_error_vs_fp64_within_eager_budget(m, n, batch, dtype, kind, plan, blocks, seed) -> None:
    coefficients = COEFFICIENT_SETS[kind]
    shape = (m, n) if batch == 0 else (batch, m, n)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)
    ref = reference_fp64(x, coefficients, 1e-7, transpose=m > n)
    eager_err = _rel(eager_ns(x, coefficients), ref)
    precision, target = {
        "auto-avx2": ("auto", AVX2_LIKE), "auto-bf16-fast": ("auto", BF16_FAST), "bf16-emulated": ("bf16", AVX2_LIKE),
    }[plan]
    kwargs = _plan_kwargs(m, n, max(batch, 1), coefficients, precision, target)
    kwargs["blocks"] = blocks  # symmetric products on blocks: same roundings, other summation order
    out = newton_schulz(x, coefficients, 1e-7, transpose=m > n, out_dtype=torch.bfloat16, **kwargs)
    # A plan in eager's own bf16 rounds where eager does, but its GEMMs may sum in another order
    # than the native kernel: on a rare sample one tie-breaking rounding lands the other way, and
    # aggressive coefficients amplify it (CI found an 8×8 Polar Express case at 1.46x; over 300
    # seeds the ratio's median is 1.000). That plan is held to the distribution test below and,
    # per sample, to SAME_PRECISION_SAMPLE; a plan in another precision keeps the 1.25x bound.
    same_precision = kwargs["compute_dtype"] == torch.bfloat16
    factor = SAME_PRECISION_SAMPLE if same_precision else 1.25
    assert _rel(out, ref) <= max(factor * eager_err, FLOOR), (kwargs, eager_err)


SAME_PRECISION_SAMPLE = 1.6  # worst single sample measured: 1.46x (8×8 Polar Express, seed 87)


@pytest.mark.parametrize("kind", ["polar_express", "kj", "quintic"])
def test_bf16_plans_match_eager_in_distribution(kind: str) -> None:
    """Emulated bf16 NS (eager's precision, its own summation order) against eager's native bf16
    over fixed seeds: not worse in distribution (median ratio ~1, 99th percentile ≤ 1.25x)."""
    coefficients = COEFFICIENT_SETS[kind]
    for m, n in [(8, 8), (32, 64)]:
        ratios = []
        for seed in range(100):
            x = torch.randn((m, n), generator=torch.Generator().manual_seed(seed))
            ref = reference_fp64(x, coefficients, 1e-7)
            eager_err = _rel(eager_ns(x, coefficients), ref)
            out = newton_schulz(x, coefficients, 1e-7, compute_dtype=torch.bfloat16, matmul="emulate",
                                out_dtype=torch.bfloat16)
            ratios.append(_rel(out, ref) / eager_err)
        ratios.sort()
        assert ratios[len(ratios) // 2] <= 1.05 and ratios[98] <= 1.25, (m, n, ratios[49], ratios[98], ratios[-1])
        assert ratios[-1] <= SAME_PRECISION_SAMPLE, (m, n, ratios[-1])


@pytest.mark.parametrize("m, n", [(64, 256), (128, 128), (96, 32), (48, 200)])
def test_gram_equals_standard_in_fp32(m: int, n: int) -> None:
    x = torch.randn(m, n)
    ref = reference_fp64(x, KJ, 1e-7, transpose=m > n)
    for restarts in ([], [2]):
        out = newton_schulz(x, KJ, 1e-7, transpose=m > n, compute_dtype=torch.float32, algorithm="gram",
                            restarts=restarts)
        assert _rel(out, ref) < 1e-4


def test_flops_match_design_formulas() -> None:
    m = 768
    for alpha in (1, 3, 4):
        assert flops(m, alpha * m, KJ, "standard") == (20 * alpha + 10) * m**3
        assert flops(m, alpha * m, KJ, "gram", [2]) == (8 * alpha + 28) * m**3
        # Symmetric products on 4 row blocks: (4+1)/(2*4) = 10/16 of X Xᵀ and A².
        symmetric = (2 * alpha + 2) * m**3 * 10 // 16
        assert flops(m, alpha * m, KJ, "standard", blocks=4) == 5 * (2 * alpha * m**3 + symmetric)


def test_symmetric_blocks_chosen_only_where_measured_faster_and_large_enough() -> None:
    sym_fast = Target("cpu", AVX2_LIKE.gflops, symmetric_speedup=1.3)
    assert decide(768, 3072, 1, KJ, torch.bfloat16, "auto", sym_fast).blocks == 4
    assert decide(768, 3072, 1, KJ, torch.bfloat16, "auto", sym_fast).decision().chose["blocks"] == 4
    assert decide(128, 512, 1, KJ, torch.bfloat16, "auto", sym_fast).blocks == 0  # blocks under 64 rows
    assert decide(768, 3072, 1, KJ, torch.bfloat16, "auto", AVX2_LIKE).blocks == 0  # not measured faster


def test_choose_algorithm_decisions() -> None:
    # CPU without a bf16 GEMM: fp32 compute; Gram for wide, standard for square.
    wide = decide(768, 3072, 1, KJ, torch.bfloat16, "auto", AVX2_LIKE)
    square = decide(768, 768, 1, KJ, torch.bfloat16, "auto", AVX2_LIKE)
    assert (wide.algorithm, wide.compute_dtype) == ("gram", torch.float32)
    assert (square.algorithm, square.compute_dtype) == ("standard", torch.float32)
    # A target with a fast bf16 GEMM keeps eager's bf16, natively.
    fast = decide(768, 768, 1, KJ, torch.bfloat16, "auto", BF16_FAST)
    assert (fast.compute_dtype, fast.matmul) == (torch.bfloat16, "native")
    forced = decide(768, 768, 1, KJ, torch.bfloat16, "bf16", AVX2_LIKE)
    assert (forced.compute_dtype, forced.matmul) == (torch.bfloat16, "emulate")
    gm_pass = ChooseAlgorithm(target=AVX2_LIKE, precision="bogus")
    with pytest.raises(ValueError, match="precision must be one of"):
        gm_pass(torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph()))


# ------------------------------------------------------------- whole steps


@contextlib.contextmanager
def exact_ns(impl: str) -> Iterator[None]:
    """Swap an implementation's NS for the fp64 evaluation of the same polynomial."""
    mp = pytest.MonkeyPatch()
    if impl == "torch":
        import torch.optim._muon as tm

        mp.setattr(tm, "_zeropower_via_newtonschulz",
                   lambda g, abc, steps, eps: reference_fp64(g, [abc] * steps, eps, transpose=g.size(0) > g.size(1)))
    elif impl == "user":
        from . import helpers

        mp.setattr(helpers, "zeropower_via_newtonschulz5", lambda g, steps: reference_fp64(
            g, KJ[:steps], 1e-7, eps_mode="add", transpose=g.size(-2) > g.size(-1)))
    else:
        from emerging_optimizers.orthogonalized_optimizers import muon_utils

        def exact(x: torch.Tensor, steps: int, coefficient_type: str = "quintic", **_: Any) -> torch.Tensor:
            return reference_fp64(x, emerging_coefficients(coefficient_type, steps), 1e-7,
                                  transpose=x.size(-2) > x.size(-1)).float()

        mp.setattr(muon_utils, "newton_schulz", exact)
    try:
        yield
    finally:
        mp.undo()


FACTORIES = {
    "torch": lambda ps: torch.optim.Muon(ps, lr=0.02, weight_decay=0.1),
    "user": lambda ps: UserMuon(ps, lr=0.02, weight_decay=0.01),
    "emerging": lambda ps: emerging_muon(ps, lr=0.02, weight_decay=0.1, coefficient_type="polar_express"),
}


@pytest.mark.parametrize("impl", sorted(FACTORIES))
def test_whole_step_trajectory_at_least_as_accurate_as_eager(impl: str, cache_dir) -> None:
    """20 steps: compiled stays as close to the exact-NS trajectory as eager's bf16 run (≤ 1.25×).

    The target is pinned to the fp32 plan (a CPU without a bf16 GEMM): with the
    measured target a CPU with AMX, or a busy one whose timing favours bf16,
    plans bf16 instead, and two bf16 programs that round differently land
    anywhere from 0.5x to 2.3x of each other's trajectory error (measured for
    emerging's Muon over 40 seeds), so one seed passing there is luck. The bf16
    plans keep the contract per op (test_op_error_vs_fp64_within_eager_budget).
    """
    shapes = [(16, 8), (8, 8), (8, 24)]
    runs: dict[str, list[torch.Tensor]] = {}
    for name in ("eager", "exact", "compiled"):
        params = make_params(shapes)
        opt: torch.optim.Optimizer = FACTORIES[impl](params)
        if name == "compiled":
            opt = hocompile.compile_optimizer(opt, cache_dir=cache_dir, target="cpu-avx2")
        gen = torch.Generator().manual_seed(5)
        with exact_ns(impl) if name == "exact" else contextlib.nullcontext():
            for _ in range(20):
                for p in params:
                    p.grad = torch.randn(p.shape, generator=gen)
                opt.step()
        runs[name] = params
    for e, x, c in zip(runs["eager"], runs["exact"], runs["compiled"]):
        assert (c - x).norm() <= 1.25 * (e - x).norm() + 1e-6
        assert (e - x).norm() > 0  # eager really is the less accurate one here


# ------------------------------------------------------------- batch-by-shape

GPU_LIKE = Target("gpu-like", {"fp32": 100.0, "bf16": 400.0, "fp16": 400.0}, prefers_batched=True)
GPT2_LAYER = [(24, 72), (24, 24), (24, 96), (96, 24)] * 3  # GPT-2's four shapes, scaled by 1/32


def _batched(opt: torch.optim.Optimizer, params: list[torch.Tensor], **kw: Any) -> tuple[list[Any], Any]:
    for p in params:
        p.grad = torch.randn_like(p)
    gm = capture(opt, STRUCTURAL_KEYS).gm
    gm, records = run_pipeline(gm, (Canonicalize(), FuseNewtonSchulz(), BatchByShape(target=GPU_LIKE, **kw)))
    return [n for n in gm.graph.nodes if n.target is NS], records[-1]


@pytest.mark.parametrize("impl", ["torch", "user", "emerging"])
def test_one_newton_schulz_op_per_shape_group(impl: str) -> None:
    params = make_params(GPT2_LAYER)
    factory = {"torch": torch.optim.Muon, "user": UserMuon, "emerging": emerging_muon}[impl]
    ops, record = _batched(factory(params), params)
    # 24x96 and 96x24 share a batch through the transpose: 3 groups of 3, 3, 6
    assert sorted(int(_input(n).shape[0]) for n in ops) == [3, 3, 6]
    assert record.summary == "12 ops in 3 batched op(s)"


def test_batch_cap_splits_groups() -> None:
    params = make_params([(8, 16)] * 5)
    ops, _ = _batched(torch.optim.Muon(params), params, max_batch=2)
    batched = [tuple(_input(n).shape) for n in ops if _input(n).dim() == 3]
    single = [tuple(_input(n).shape) for n in ops if _input(n).dim() == 2]
    assert batched == [(2, 8, 16), (2, 8, 16)] and single == [(8, 16)]  # chunks of 2, 2 and a lone 1


def test_batching_declines_where_a_loop_is_faster() -> None:
    params = make_params([(8, 16)] * 2)
    for p in params:
        p.grad = torch.randn_like(p)
    gm = capture(torch.optim.Muon(params), STRUCTURAL_KEYS).gm
    _, records = run_pipeline(gm, (Canonicalize(), FuseNewtonSchulz(), BatchByShape(target=AVX2_LIKE)))
    assert records[-1].status == "unchanged" and "does not gain from stacking" in records[-1].summary


def test_batched_step_matches_unbatched(cache_dir) -> None:
    """Stacking changes only GEMM shapes (one bmm for a loop of mm), which CPUs may round
    differently (measured with AMX: 1 of 2,304 elements off by 4.8e-5 relative), so the check
    is the numerics contract, not equality. Against the exact (fp64 NS) trajectory, each plan
    stays within 1.25x eager's bf16 error, and the batched plan within 1.25x the unbatched one's:
    both compute in fp32 on eager's bf16-rounded input, so their error is mostly that shared
    rounding (~10x below eager's) and agrees to ~1%. Measured: perturbing every batched NS
    output by 5e-5 relative leaves the ratio at 1.00; dropping an iteration makes it ~250x,
    swapping two batch elements ~1,400x."""
    batching = Target("avx2-batching", dict(AVX2_LIKE.gflops), prefers_batched=True)
    runs: dict[str, list[torch.Tensor]] = {}
    for name, target in [("eager", None), ("exact", None), ("unbatched", AVX2_LIKE), ("batched", batching)]:
        params = make_params(GPT2_LAYER)
        opt: torch.optim.Optimizer = torch.optim.Muon(params, lr=0.02)
        if target is not None:
            opt = hocompile.compile_optimizer(opt, cache_dir=cache_dir, target=target)
        gen = torch.Generator().manual_seed(3)
        with exact_ns("torch") if name == "exact" else contextlib.nullcontext():
            for _ in range(5):
                for p in params:
                    p.grad = torch.randn(p.shape, generator=gen)
                opt.step()
        if target is not None:
            assert ("3 batched op(s)" in hocompile.explain(opt)) == target.prefers_batched
        runs[name] = params
    for e, x, a, b in zip(runs["eager"], runs["exact"], runs["unbatched"], runs["batched"]):
        eager_err, unbatched_err, batched_err = ((r - x).norm().item() for r in (e, a, b))
        assert max(unbatched_err, batched_err) <= 1.25 * eager_err, (unbatched_err, batched_err, eager_err)
        assert batched_err <= 1.25 * unbatched_err + 1e-6, (batched_err, unbatched_err)


def test_max_batch_setting_caps_groups() -> None:
    params = [torch.nn.Parameter(torch.empty(32, 64)) for _ in range(12)]
    opt = torch.optim.Muon(params, lr=0.02)
    for p in params:
        p.grad = torch.empty_like(p)
        opt.state[p]["momentum_buffer"] = torch.empty_like(p)
    # Traced whole, batch-by-shape stacks the twelve calls; stamped, the plan reports the stacks the
    # class's members would run in, under the same caps.
    whole = {"target": "sm90", "stamp": False}
    assert "12 ops in 1 batched op(s)" in hocompile.plan(opt, **whole)
    assert "12 ops in 3 batched op(s)" in hocompile.plan(opt, **whole, max_batch=5)  # 5 + 5 + 2
    assert "12 ops in 2 batched op(s)" in hocompile.plan(opt, **whole, max_stack_bytes=6 * 32 * 64 * 4 * 2)
    assert "x12 = 19.7 MFLOP, 19.9 ns predicted, in 1 stack(s) of 12 at most" in hocompile.plan(opt, target="sm90")
    assert "in 3 stack(s) of 5 at most" in hocompile.plan(opt, target="sm90", max_batch=5)
    assert "in 2 stack(s) of 6 at most" in hocompile.plan(opt, target="sm90", max_stack_bytes=6 * 32 * 64 * 4 * 2)
    with pytest.raises(ValueError, match="max_batch must be a positive int"):
        hocompile.compile_optimizer(opt, max_batch=0)


@pytest.mark.parametrize("eps_mode", ["clamp", "add"])
def test_native_half_normalisation_rounds_like_normalize(eps_mode: str) -> None:
    """The native bf16 path normalises without an fp32 copy, with normalize()'s roundings (bit for bit)."""
    from hocompile.ops.newton_schulz_math import _normalize_native, normalize

    gen = torch.Generator().manual_seed(0)
    for scale in (1e-6, 1e-2, 1.0, 1e3):
        for shape in ((64, 256), (100, 37), (3, 300, 40)):
            xh = (torch.randn(shape, generator=gen) * scale).bfloat16()
            fast = _normalize_native(xh, 1e-7, eps_mode)
            reference = normalize(xh.float(), 1e-7, eps_mode, torch.bfloat16).bfloat16()
            assert torch.equal(fast, reference)
