"""hocompile.optimizers.Shampoo: eager against an independent float64 loop, its
matrix roots against each other, and the compiled step against eager.

The float64 reference below shares no code with the optimizer: roots come from
an SVD (a float64 eigh above 256), small blocks are preconditioned through the
Kronecker product ``(R̂ ⊗ L̂) vec(M)`` (not two matmuls), and every block is a
separate slice loop over its own dict of factors.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import hocompile
from hocompile.optimizers import (
    Shampoo,
    block_ranges,
    inverse_root_eigh,
    inverse_root_newton,
    matrix_inverse_root,
    newton_residual,
)

F64 = torch.float64


# -- the float64 reference ------------------------------------------------------


def svd_inverse_root(a: torch.Tensor, root: int, epsilon: float) -> torch.Tensor:
    """``(A + εI)^(-1/root)`` of a symmetric PSD matrix via its SVD (U = V), in float64.
    Above 256 a float64 eigh instead: the SVD of a 1024² matrix costs ~10× as much."""
    ridge = a.to(F64) + epsilon * torch.eye(a.shape[0], dtype=F64)
    if a.shape[0] > 256:
        s, u = torch.linalg.eigh(ridge)
    else:
        u, s, _ = torch.linalg.svd(ridge)
    return u @ torch.diag(s.pow(-1.0 / root)) @ u.T


def precondition(m: torch.Tensor, left: torch.Tensor | None, right: torch.Tensor | None) -> torch.Tensor:
    """``L̂ M R̂``; through the Kronecker product for small blocks: vec(L M R) = (Rᵀ ⊗ L) vec(M) (column-major)."""
    rows, cols = m.shape
    eye_l = left if left is not None else torch.eye(rows, dtype=F64)
    eye_r = right if right is not None else torch.eye(cols, dtype=F64)
    if rows * cols <= 4096:
        vec = m.T.reshape(-1)
        return (torch.kron(eye_r.T.contiguous(), eye_l) @ vec).reshape(cols, rows).T
    return eye_l @ m @ eye_r


def reference_shampoo(p0: torch.Tensor, grads: list[torch.Tensor], **cfg: Any) -> torch.Tensor:
    """The parameter after ``len(grads)`` Shampoo steps, in float64 (see hocompile/optimizers/shampoo.py)."""
    lr, (b1, b2), eps = cfg["lr"], cfg.get("betas", (0.9, 0.999)), cfg.get("epsilon", 1e-12)
    wd, freq, start = cfg.get("weight_decay", 0.0), cfg.get("precondition_frequency", 10), cfg.get("start", 1)
    max_dim, graft, geps = cfg.get("max_preconditioner_dim", 1024), cfg.get("grafting", "adam"), 1e-8
    one_sided, override = cfg.get("one_sided", False), cfg.get("exponent_override")
    p = p0.to(F64).clone()
    m = torch.zeros_like(p)
    v = torch.zeros_like(p)
    factors: dict[tuple[str, int, int], torch.Tensor] = {}
    roots: dict[tuple[str, int, int], torch.Tensor] = {}
    for t, g in enumerate(grads, start=1):
        g = g.to(F64)
        m = b1 * m + (1 - b1) * g
        m_hat = m / (1 - b1**t)
        v = b2 * v + (1 - b2) * g * g if b2 < 1 else v + g * g
        bias2 = 1 - b2**t if b2 < 1 else 1.0
        step_dir = m_hat / ((v / bias2).sqrt() + geps) if graft == "adam" else m_hat
        p = p * (1 - lr * wd)
        g2, m2, s2 = (x.reshape(p.shape[0], -1) for x in (g, m_hat, step_dir))  # a 1-D p: one 10×1 block, unused
        update = torch.zeros_like(g2)
        for r0, r1 in [(r, min(r + max_dim, g2.shape[0])) for r in range(0, g2.shape[0], max_dim)]:
            for c0, c1 in [(c, min(c + max_dim, g2.shape[1])) for c in range(0, g2.shape[1], max_dim)]:
                gb = g2[r0:r1, c0:c1]
                sides = {"left": gb @ gb.T, "right": gb.T @ gb}
                if one_sided:
                    del sides["right" if r1 - r0 <= c1 - c0 else "left"]
                root = override or (2 if one_sided else 4)
                for side, outer in sides.items():
                    key = (side, r0, c0)
                    old = factors.get(key, torch.zeros_like(outer))
                    factors[key] = b2 * old + (1 - b2) * outer if b2 < 1 else old + outer
                    if t >= start and (t - start) % freq == 0:
                        roots[key] = svd_inverse_root(factors[key] / bias2, root, eps)
                d = precondition(m2[r0:r1, c0:c1], roots.get(("left", r0, c0)), roots.get(("right", r0, c0)))
                if graft is not None:
                    d = d * (s2[r0:r1, c0:c1].norm() / (d.norm() + 1e-16))
                update[r0:r1, c0:c1] = d
        p = p - lr * (update.reshape(p.shape) if p.dim() > 1 and t >= start else step_dir)
    return p


def run_eager(p0: torch.Tensor, grads: list[torch.Tensor], **cfg: Any) -> torch.Tensor:
    p = torch.nn.Parameter(p0.clone())
    start = cfg.pop("start", 1)
    opt = Shampoo([p], start_preconditioning_step=start, **cfg)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    return p.detach()


def relative_error(got: torch.Tensor, want: torch.Tensor, p0: torch.Tensor) -> float:
    """Error of the total update, relative to the update's size."""
    return float((got.to(F64) - want).norm() / (want - p0.to(F64)).norm())


# Shapes: a wide and a tall matrix, a conv-like 3-D weight (viewed as 6×12), a bias.
SHAPES = [(8, 16), (24, 12), (6, 4, 3), (10,)]


def grads_for(shape: tuple[int, ...], steps: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen) for _ in range(steps)]


@pytest.mark.parametrize(
    "cfg",
    [
        dict(grafting="adam"),
        dict(grafting="sgd", weight_decay=0.1),
        dict(grafting=None),
        dict(grafting="adam", one_sided=True),
        dict(grafting="adam", betas=(0.0, 1.0)),  # plain sums (AdaGrad-style factors)
        dict(grafting="adam", exponent_override=2, epsilon=1e-6),
    ],
    ids=["adam", "sgd-wd", "no-graft", "one-sided", "sum-factors", "p2"],
)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_eager_matches_float64_reference(shape: tuple[int, ...], cfg: dict[str, Any]) -> None:
    """20 steps, preconditioning from step 3, refresh every 5. Bound: 1e-4 of the total
    update. Why: the state is float32 (u = 6e-8); an fp32 eigh root of a factor with
    eigenvalue ratio κ is off by ~n·u·κ^(1/p) relative (measured ≤ 8e-5 for κ ≤ 1e4,
    n ≤ 256, see test_newton_matches_eigh), and grafting rescales each step to a norm
    accurate to ~u. Measured here: ≤ 2e-5.

    Why from step 3: by then every factor here has full rank. With a rank-deficient
    factor and ε = 1e-12 there is no float32 answer to compare: its null-space
    eigenvalues are rounding noise (~n·u·λmax) instead of 0, so their inverse roots
    differ from float64's ε^(-1/4) by orders of magnitude, and the next gradient's
    component in that null space is scaled by them (measured: 0.3–0.7 relative
    error after one such step). That is Shampoo with ε = 1e-12, not an error of ours."""
    cfg = dict(lr=0.01, precondition_frequency=5, start=3, **cfg)
    p0 = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    grads = grads_for(shape, 20, seed=2)
    got = run_eager(p0, grads, **cfg)
    want = reference_shampoo(p0, grads, **cfg)
    assert relative_error(got, want, p0) < 1e-4


def spd(n: int, condition: float, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=F64))
    return (q * torch.logspace(0, -math.log10(condition), n, dtype=F64)) @ q.T


def rank_deficient(n: int, rank: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(n, rank, generator=gen, dtype=F64)
    a = g @ g.T
    return a / a.norm()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.to(F64) - b.to(F64)).norm() / b.to(F64).norm())


@pytest.mark.parametrize("root", [2, 4])
@pytest.mark.parametrize("n", [16, 64, 200])
def test_newton_matches_eigh(n: int, root: int) -> None:
    """Coupled Newton (30 iterations, fp32) against eigh (fp32) and the fp64 SVD root.
    Well-conditioned SPD (κ = 1e3, ε = 1e-12): ≤ 5e-5 relative Frobenius (measured ≤ 2.6e-5).
    Rank n/4, ε = 1e-4·||A|| (eigenvalue ratio 1e4): ≤ 3e-4 (measured ≤ 1e-4): fp32's
    error grows with the ratio, which ε bounds."""
    for a, eps, bound in ((spd(n, 1e3, n), 1e-12, 5e-5), (rank_deficient(n, n // 4, n), 1e-4, 3e-4)):
        a32 = a.float()
        exact = svd_inverse_root(a, root, eps)
        newton = inverse_root_newton(a32, root, eps, iterations=30)
        eigh = inverse_root_eigh(a32, root, eps)
        assert rel(newton, eigh) < bound
        assert rel(newton, exact) < bound and rel(eigh, exact) < bound
        assert newton_residual(a32, newton, root, eps) < 1e2 * bound
        assert torch.equal(newton, newton.T)


def test_eigh_failure_retries_in_float64_then_keeps_previous(monkeypatch: pytest.MonkeyPatch) -> None:
    a = spd(12, 10.0, 0).float()
    previous = torch.full((12, 12), 7.0)
    real_eigh = torch.linalg.eigh
    calls: list[torch.dtype] = []

    def fails_in_float32(x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        calls.append(x.dtype)
        if x.dtype != F64:
            raise torch.linalg.LinAlgError("did not converge")
        return real_eigh(x, *args, **kwargs)

    monkeypatch.setattr(torch.linalg, "eigh", fails_in_float32)
    got = matrix_inverse_root(a, 4, 1e-12, "eigh", previous)
    assert calls == [torch.float32, F64] and got.dtype == torch.float32
    assert rel(got, svd_inverse_root(a.double(), 4, 1e-12)) < 1e-6

    def always_fails(x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        raise torch.linalg.LinAlgError("did not converge")

    monkeypatch.setattr(torch.linalg, "eigh", always_fails)
    assert matrix_inverse_root(a, 4, 1e-12, "eigh", previous) is previous


@pytest.mark.parametrize("method", ["eigh", "newton"])
def test_non_finite_factor_keeps_previous_root(method: str) -> None:
    a = spd(8, 10.0, 1).float()
    a[0, 0] = float("inf")
    previous = torch.eye(8)
    assert torch.equal(matrix_inverse_root(a, 4, 1e-12, method, previous), previous)


def test_blocking_2048x64_two_blocks() -> None:
    """max_preconditioner_dim=1024 splits the 2048 rows in two 1024×64 blocks, each with its own
    L (1024²) and R (64²); the result equals two separate 1024×64 params bit for bit (every block
    op reads the same rows) and the float64 per-block reference to 1e-4. Each L has rank 64:
    ε = 1e-3 keeps its null space out of the comparison (see test_eager_matches_float64_reference)."""
    cfg: dict[str, Any] = dict(lr=0.01, precondition_frequency=1, max_preconditioner_dim=1024, epsilon=1e-3)
    p0 = torch.randn(2048, 64, generator=torch.Generator().manual_seed(3))
    # One step: 1024² eighs dominate (~0.3 s each here); blocking across steps is
    # test_blocks_match_reference's job.
    grads = grads_for((2048, 64), 1, seed=4)
    p = torch.nn.Parameter(p0.clone())
    opt = Shampoo([p], **cfg)
    halves = [torch.nn.Parameter(p0[:1024].clone()), torch.nn.Parameter(p0[1024:].clone())]
    separate = Shampoo(halves, **cfg)
    for g in grads:
        p.grad = g.clone()
        halves[0].grad, halves[1].grad = g[:1024].clone(), g[1024:].clone()
        opt.step()
        separate.step()
    shapes = {k: tuple(v.shape) for k, v in opt.state[p].items() if "factor" in k or "root" in k}
    assert shapes == {
        f"{side}_{kind}_{b}": (n, n)
        for b in (0, 1)
        for side, n in (("left", 1024), ("right", 64))
        for kind in ("factor", "root")
    }
    assert torch.equal(p.detach(), torch.cat([h.detach() for h in halves]))
    assert relative_error(p.detach(), reference_shampoo(p0, grads, **cfg), p0) < 1e-4


@settings(max_examples=12, deadline=None)
@given(
    rows=st.integers(1, 40),
    cols=st.integers(1, 40),
    max_dim=st.integers(3, 24),
    one_sided=st.booleans(),
)
def test_blocks_match_reference(rows: int, cols: int, max_dim: int, one_sided: bool) -> None:
    assert [i for a, b in block_ranges(rows, max_dim) for i in range(a, b)] == list(range(rows))
    # Blocks as thin as 24×1 stay rank-deficient: ε = 0.1 (see test_eager_matches_float64_reference).
    cfg: dict[str, Any] = dict(
        lr=0.01, precondition_frequency=3, max_preconditioner_dim=max_dim, one_sided=one_sided, epsilon=0.1
    )
    p0 = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows * 41 + cols))
    grads = grads_for((rows, cols), 6, seed=max_dim)
    assert relative_error(run_eager(p0, grads, **cfg), reference_shampoo(p0, grads, **cfg), p0) < 1e-4


@pytest.mark.parametrize("grafting", ["adam", "sgd"])
def test_grafting_sets_each_blocks_step_norm(grafting: str) -> None:
    """One step from zero state, lr = 1: each block moves by exactly the grafted step's norm
    (Adam at step 1: g/(|g| + ε); SGD with β₁ = 0: g), in a direction that is not the grafted one."""
    p0 = torch.randn(12, 20, generator=torch.Generator().manual_seed(5))
    g = torch.randn(12, 20, generator=torch.Generator().manual_seed(6))
    got = run_eager(p0, [g], lr=1.0, betas=(0.0, 0.999), grafting=grafting, max_preconditioner_dim=8)
    graft = g / (g.abs() + 1e-8) if grafting == "adam" else g
    step = p0 - got
    for r0, r1 in block_ranges(12, 8):
        for c0, c1 in block_ranges(20, 8):
            block, graft_block = step[r0:r1, c0:c1], graft[r0:r1, c0:c1]
            assert block.norm() == pytest.approx(float(graft_block.norm()), rel=1e-5)
            assert rel(block, graft_block) > 1e-2  # Shampoo's direction, not the grafted one


def test_bfloat16_param_keeps_float32_factors() -> None:
    """A bf16 param steps with float32 factors and roots. Its update follows float32 Shampoo's
    from the same bf16 start (cosine > 0.99; measured 0.9999): each step rounds p to 8 bits. From
    step 2, when both factors have full rank: before that, bf16's rounding of the momentum
    leaks into R's null space, which ε = 1e-12 amplifies (cosine 0.4 at step 1)."""
    p0 = torch.randn(16, 24, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    grads = [g.to(torch.bfloat16) for g in grads_for((16, 24), 4, seed=9)]
    cfg: dict[str, Any] = dict(lr=0.1, precondition_frequency=1)
    p = torch.nn.Parameter(p0.clone())
    opt = Shampoo([p], start_preconditioning_step=2, **cfg)
    for g in grads:
        p.grad = g
        opt.step()
    assert p.dtype == torch.bfloat16 and opt.state[p]["left_root_0"].dtype == torch.float32
    got = p.detach().float() - p0.float()
    want = run_eager(p0.float(), [g.float() for g in grads], start=2, **cfg) - p0.float()
    assert float(torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0)) > 0.99


# -- compiled against eager -----------------------------------------------------


def tiny_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8))


def train(opt: torch.optim.Optimizer, model: torch.nn.Module, steps: int) -> None:
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    gen = torch.Generator().manual_seed(7)
    for _ in range(steps):
        x, y = torch.randn(64, 16, generator=gen), torch.randn(64, 8, generator=gen)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        sched.step()


def compiled_matches_eager(cfg: dict[str, Any], cache_dir: Any, steps: int) -> Any:
    """Train eager and compiled Shampoo side by side; every param and state tensor must be
    bit-identical (the compiled step runs eager's aten ops in eager's order with eager's
    host scalars). Returns the compiled optimizer."""
    eager_model, compiled_model = tiny_model(), tiny_model()
    eager = Shampoo(eager_model.parameters(), lr=0.01, precondition_frequency=5, **cfg)
    compiled = hocompile.compile_optimizer(
        Shampoo(compiled_model.parameters(), lr=0.01, precondition_frequency=5, **cfg), cache_dir=cache_dir
    )
    train(eager, eager_model, steps)
    train(compiled, compiled_model, steps)
    for a, b in zip(eager_model.parameters(), compiled_model.parameters()):
        assert torch.equal(a, b)
        for key, value in eager.state[a].items():
            assert torch.equal(value, compiled.state[b][key]), key
    assert compiled.counters.eager_fallbacks == 0
    return compiled


@pytest.mark.parametrize(
    "cfg",
    [
        # 6 Newton iterations (unconverged): parity does not need convergence, and each
        # iteration is 4 more traced matmuls per root (capture time, 8 traces).
        dict(root_method="newton", newton_iterations=6, epsilon=1e-4, weight_decay=0.01),
        dict(root_method="eigh", max_preconditioner_dim=8, grafting="sgd", one_sided=True),
    ],
    ids=["newton-wd", "blocked-one-sided"],
)
def test_compiled_equals_eager_bitwise(cfg: dict[str, Any], cache_dir: Any) -> None:
    """20 steps, refresh every 5, cosine lr schedule. (The default configuration, eigh with
    Adam grafting, runs 100 steps in test_100_steps_compile_each_variant_once.)"""
    compiled_matches_eager(cfg, cache_dir, steps=20)


def test_100_steps_compile_each_variant_once(cache_dir: Any) -> None:
    """Default Shampoo (eigh, Adam grafting), refresh every 5, cosine schedule, 100 steps: bitwise
    equal to eager, and three variants (the first step, which creates the state; the steps between
    refreshes; the refresh), each compiled once; the other 97 steps are cache hits. The refresh
    is another outcome of a branch on the host step counter: a variant, not a recompile.
    """
    opt = compiled_matches_eager({}, cache_dir, steps=100)
    counters = opt.counters
    assert counters.compiles == 3 and counters.cache_hits == 97
    assert counters.recompiles == []
    assert len(counters.variants) == 1 and "% 5 == 0" in counters.variants[0], counters.variants
    assert "compiles 3, recompiles 0" in hocompile.explain(opt)
