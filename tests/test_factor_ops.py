"""Issue 12 item 3: ``factor_update``, ``two_sided`` and ``inverse_root`` -- ops, references, passes, batching.

Each op's CPU kernel must be bitwise eager's own calls (the spellings the
optimizers use), its fp64 reference must be close to what it computes (an
error a test can fail), its stacked form must agree with the per-matrix one,
and its pass must fire on eager's spelling, decline the look-alikes with a
reason, and leave a graph that computes the same bits.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

from hocompile.ir.graph import print_graph
from hocompile.ops.factor_update import FACTOR_UPDATE, FactorUpdateSpec, factor_update_flops
from hocompile.ops.inverse_root import INVERSE_ROOT, InverseRootSpec, inverse_root_flops
from hocompile.ops.two_sided import TWO_SIDED, TwoSidedSpec, two_sided_flops
from hocompile.optimizers.matrix_roots import inverse_root_eigh, inverse_root_newton
from hocompile.passes import BatchByShape, Canonicalize, FuseFactorUpdate, FuseInverseRoot, FuseTwoSided
from hocompile.targets import Target

ops = torch.ops.hocompile
EPS32 = torch.finfo(torch.float32).eps


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _spd(n: int, gen: torch.Generator) -> torch.Tensor:
    a = torch.randn(n, 2 * n, generator=gen)
    return a @ a.T / (2 * n)


# ------------------------------------------------------------------ the ops against eager's calls


@pytest.mark.parametrize("side", ["left", "right"])
def test_factor_update_is_bitwise_eager(side: str) -> None:
    gen = _gen()
    g = torch.randn(24, 40, generator=gen)
    n = 24 if side == "left" else 40
    factor = _spd(n, gen)
    gram = g @ g.T if side == "left" else g.T @ g
    assert torch.equal(ops.factor_update(factor, g, side, "lerp", 0.05), factor.clone().lerp_(gram, 0.05))
    a, b = (g, g.T) if side == "left" else (g.T, g)
    eager = factor.clone().addmm_(a, b, beta=0.999, alpha=0.001)
    assert torch.equal(ops.factor_update(factor, g, side, "addmm", 0.001, 0.999), eager)


def test_factor_update_reference_and_stack() -> None:
    gen = _gen(1)
    g, factor = torch.randn(3, 32, 48, generator=gen), torch.stack([_spd(32, gen) for _ in range(3)])
    stacked = ops.factor_update(factor, g, "left", "lerp", 0.3)
    for i in range(3):
        one = ops.factor_update(factor[i], g[i], "left", "lerp", 0.3)
        torch.testing.assert_close(stacked[i], one, rtol=0, atol=8 * EPS32 * float(one.abs().max()))
        spec = FactorUpdateSpec(factor=factor[i], g=g[i], side="left", form="lerp", weight=0.3)
        exact = FACTOR_UPDATE.reference(spec)
        # fp32 Gram of k=48 terms: each entry within ~k·eps·Σ|g_i g_j| of exact (Higham's bound).
        bound = 48 * EPS32 * float((g[i].abs() @ g[i].abs().T).max())
        assert float((one.double() - exact).abs().max()) < bound
        assert float((one.double() - exact).abs().max()) > 0  # the check compares fp32 with fp64, not itself


@pytest.mark.parametrize(("left_t", "right_t"), [(True, False), (False, True)])
def test_two_sided_is_bitwise_eager(left_t: bool, right_t: bool) -> None:
    gen = _gen(2)
    x, ql, qr = (
        torch.randn(24, 40, generator=gen),
        torch.randn(24, 24, generator=gen),
        torch.randn(40, 40, generator=gen),
    )
    a, b = (ql.T if left_t else ql), (qr.T if right_t else qr)
    # SOAP: tensordot over dim 0 with Q (projection in) or Qᵀ (back), once per dimension
    eager = torch.tensordot(torch.tensordot(x, a.T, dims=[[0], [0]]), b, dims=[[0], [0]])
    assert torch.equal(ops.two_sided(x, ql, qr, left_t, right_t, "tensordot"), eager)
    assert torch.equal(ops.two_sided(x, ql, qr, left_t, right_t, "left_first"), (a @ x) @ b)
    spec = TwoSidedSpec(
        x=x, left=ql, right=qr, left_transposed=left_t, right_transposed=right_t, association="tensordot"
    )
    err = float(
        (ops.two_sided(x, ql, qr, left_t, right_t, "tensordot").double() - TWO_SIDED.reference(spec)).abs().max()
    )
    assert 0 < err < 64 * EPS32 * float(a.abs().sum(1).max() * x.abs().max() * b.abs().sum(0).max())


@pytest.mark.parametrize("method", ["eigh", "newton"])
def test_inverse_root_is_matrix_roots_and_near_fp64(method: str) -> None:
    gen = _gen(3)
    a = _spd(16, gen)
    eager = inverse_root_newton(a, 4, 1e-3, 25) if method == "newton" else inverse_root_eigh(a, 4, 1e-3)
    ours = ops.inverse_root(a, 4, 1e-3, method, 25 if method == "newton" else 0)
    assert torch.equal(ours, eager)
    spec = InverseRootSpec(a=a, root=4, epsilon=1e-3, method=method, iterations=25)
    exact = INVERSE_ROOT.reference(spec)
    # κ(A + εI) ≤ ~10³ here: an fp32 root is good to ~1e-4 relative; far from 0 (not itself)
    rel = float((ours.double() - exact).abs().max() / exact.abs().max())
    assert 0 < rel < 1e-4, rel
    stacked = ops.inverse_root(torch.stack([a, _spd(16, gen)]), 4, 1e-3, method, 25 if method == "newton" else 0)
    torch.testing.assert_close(stacked[0], ours, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("root", range(1, 9))
def test_newton_cost_counts_the_products_matrix_power_makes(root: int) -> None:
    traced = make_fx(lambda t: torch.linalg.matrix_power(t, root))(torch.eye(3))
    products = sum(n.target is torch.ops.aten.mm.default for n in traced.graph.nodes)
    total, gemm = inverse_root_flops(8, root, "newton", 3)
    assert total == gemm == 3 * (2 + products) * 2 * 8**3  # X T and T^p M, plus the power's products


def test_costs() -> None:
    assert factor_update_flops(4, 6) == 2 * 16 * 6 + 3 * 16
    assert factor_update_flops(4, 6, symmetric=True) == 4 * 5 * 6 + 3 * 16  # the lower triangle and diagonal
    assert two_sided_flops(4, 6) == 2 * 16 * 6 + 2 * 4 * 36


# ------------------------------------------------------------------ the passes on traced spellings


def _trace(fn: Callable[..., Any], *args: torch.Tensor) -> fx.GraphModule:
    """``fn`` as aten calls, canonicalized as the pipeline does before any fuse pass."""
    gm = make_fx(fn, tracing_mode="fake")(*args)
    return Canonicalize()(gm).gm


def _calls(gm: fx.GraphModule, op: Any) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target is op)


def _soap_like(l_: torch.Tensor, r: torch.Tensor, g: torch.Tensor, ql: torch.Tensor, qr: torch.Tensor) -> Any:
    l_new = l_.lerp(g @ g.T, 0.05)
    r_new = r.lerp(g.T @ g, 0.05)
    back = torch.tensordot(torch.tensordot(g, ql.T, dims=[[0], [0]]), qr.T, dims=[[0], [0]])
    proj = torch.tensordot(torch.tensordot(back, ql, dims=[[0], [0]]), qr, dims=[[0], [0]])
    return l_new, r_new, proj


def _shampoo_like(l_: torch.Tensor, r: torch.Tensor, g: torch.Tensor) -> Any:
    l_new = l_.addmm(g, g.T, beta=0.999, alpha=0.001)
    r_new = r.addmm(g.T, g, beta=0.999, alpha=0.001)
    lr = inverse_root_eigh(l_new, 4, 1e-6)
    rr = inverse_root_newton(r_new, 4, 1e-6, 3)
    return lr @ g @ rr, l_new, r_new


def _inputs(m: int, n: int, seed: int = 4) -> list[torch.Tensor]:
    gen = _gen(seed)
    q = [torch.linalg.qr(torch.randn(s, s, generator=gen)).Q for s in (m, n)]
    return [_spd(m, gen), _spd(n, gen), torch.randn(m, n, generator=gen), *q]


def test_passes_fuse_soap_spellings_and_keep_the_bits() -> None:
    args = _inputs(8, 12)
    gm = _trace(_soap_like, *args)
    before = gm(*args)
    assert FuseFactorUpdate()(gm).changed and FuseTwoSided()(gm).changed
    assert _calls(gm, FACTOR_UPDATE.op) == 2 and _calls(gm, TWO_SIDED.op) == 2
    assert _calls(gm, torch.ops.aten.mm.default) == 0, print_graph(gm)
    for got, want in zip(gm(*args), before):
        assert torch.equal(got, want)
    text = print_graph(gm)
    assert "hocompile.factor_update(" in text and "^T @ " in text and ", tensordot)" in text


def test_passes_fuse_shampoo_spellings_and_keep_the_bits() -> None:
    args = _inputs(8, 12)[:3]
    gm = _trace(_shampoo_like, *args)
    before = gm(*args)
    for p in (FuseFactorUpdate(), FuseInverseRoot(), FuseTwoSided()):
        assert p(gm).changed, p.name
    specs = [InverseRootSpec.from_node(n) for n in gm.graph.nodes if n.target is INVERSE_ROOT.op]
    assert [(s.method, s.root, s.iterations) for s in specs] == [("eigh", 4, 0), ("newton", 4, 3)]
    assert _calls(gm, TWO_SIDED.op) == 1 and _calls(gm, FACTOR_UPDATE.op) == 2
    assert _calls(gm, torch.ops.aten.mm.default) == 0, print_graph(gm)
    for got, want in zip(gm(*args), before):
        assert torch.equal(got, want)


def test_kl_shampoo_update_and_matrix_chains_are_declined_with_reasons() -> None:
    """REKLS's ``lerp(L, G C Gᵀ, w)`` is no Gram of one matrix; a product chain of powers is no projection."""

    def kl(l_: torch.Tensor, g: torch.Tensor, c: torch.Tensor) -> Any:
        return l_.lerp((g @ c) @ g.T, 0.05), (c @ c) @ c

    gen = _gen(5)
    gm = _trace(kl, _spd(8, gen), torch.randn(8, 12, generator=gen), _spd(12, gen))
    result = FuseFactorUpdate()(gm)
    assert not result.changed and "not the Gram of one matrix" in result.summary and "KL-Shampoo" in result.summary
    result = FuseTwoSided()(gm)
    assert not result.changed and len(result.declined) == 2, result.declined
    assert any("(8, 12), (8, 12) are not 12x12 and 12x12" in r for r in result.declined), result.declined
    assert any("itself a product" in r for r in result.declined), result.declined


def test_eigh_root_with_the_spectrum_read_elsewhere_is_declined() -> None:
    def root_and_trace(a: torch.Tensor) -> Any:
        vals, vecs = torch.linalg.eigh(a)
        s = vals.clamp_min(0.0).add(1e-6).pow(-0.25)
        return (vecs * s.unsqueeze(-2)) @ vecs.T, vals.sum()

    gm = _trace(root_and_trace, _spd(8, _gen(6)))
    result = FuseInverseRoot()(gm)
    assert not result.changed and "not clamped at 0 and read only there" in result.summary


# ------------------------------------------------------------------ batching


def test_left_and_right_updates_of_one_size_share_a_stack() -> None:
    """A (6, 8) and an (8, 6) param: L of the first and R of the second are 6x6 Grams of rank 8."""

    def two(l0: torch.Tensor, g0: torch.Tensor, r1: torch.Tensor, g1: torch.Tensor) -> Any:
        return l0.lerp(g0 @ g0.T, 0.1), r1.lerp(g1.T @ g1, 0.1)

    gen = _gen(7)
    args = [_spd(6, gen), torch.randn(6, 8, generator=gen), _spd(6, gen), torch.randn(8, 6, generator=gen)]
    gm = _trace(two, *args)
    eager = gm(*args)
    FuseFactorUpdate()(gm)
    result = BatchByShape(target=Target("test"), force=True)(gm)
    assert result.changed and _calls(gm, FACTOR_UPDATE.op) == 1, print_graph(gm)
    (batched,) = [n for n in gm.graph.nodes if n.target is FACTOR_UPDATE.op]
    assert tuple(batched.meta["val"].shape) == (2, 6, 6) and FactorUpdateSpec.from_node(batched).side == "left"
    for got, want in zip(gm(*args), eager):
        torch.testing.assert_close(got, want, rtol=0, atol=16 * EPS32 * float(want.abs().max()))


def test_chained_projections_batch_by_generation_without_a_cycle() -> None:
    """SOAP per param: back-project exp_avg, project it in again, then back-project the update. Stacking
    the first and last calls (same shapes and flags) would make a cycle; the generation keeps them apart.
    Each generation stacks across the two params (the middle one reads the first one's stack)."""

    def soap_like(x0: torch.Tensor, x1: torch.Tensor, ql: torch.Tensor, qr: torch.Tensor) -> Any:
        outs = []
        for x in (x0, x1):
            back = torch.tensordot(torch.tensordot(x, ql.T, dims=[[0], [0]]), qr.T, dims=[[0], [0]])
            proj = torch.tensordot(torch.tensordot(back, ql, dims=[[0], [0]]), qr, dims=[[0], [0]])
            outs.append(torch.tensordot(torch.tensordot(proj * 0.5, ql.T, dims=[[0], [0]]), qr.T, dims=[[0], [0]]))
        return tuple(outs)

    args = _inputs(6, 10)[2:]
    args = [args[0], args[0] * 2.0, args[1], args[2]]
    gm = _trace(soap_like, *args)
    eager = gm(*args)
    assert FuseTwoSided()(gm).changed and _calls(gm, TWO_SIDED.op) == 6
    assert BatchByShape(target=Target("test"), force=True)(gm).changed
    # one stack per generation, across the two params
    assert _calls(gm, TWO_SIDED.op) == 3, print_graph(gm)
    assert sorted(n.meta["val"].dim() for n in gm.graph.nodes if n.target is TWO_SIDED.op) == [3, 3, 3]
    gm.graph.lint()
    for got, want in zip(gm(*args), eager):
        torch.testing.assert_close(got, want, rtol=0, atol=64 * EPS32 * float(want.abs().max()))
