"""hocompile::polar and fuse-polar: MOP's ``svd → U @ Vh · S.sum()`` as one op (issue 12)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.fx as fx

import tests.helpers  # noqa: F401  (typing.override for emerging-optimizers)
from hocompile.capture.group_hypers import STRUCTURAL_KEYS
from hocompile.capture.trace import capture
from hocompile.ir.graph import print_graph
from hocompile.ir.registry import family_of, schema_mismatches
from hocompile.ops.polar import POLAR, PolarSpec, gram_eigh_error_bound, polar_gram_eigh, polar_svd
from hocompile.passes import BatchByShape, Canonicalize, Pass, run_pipeline
from hocompile.passes.fuse_polar import FusePolar
from hocompile.runtime import CompiledOptimizer
from hocompile.settings import Settings

EPS32 = torch.finfo(torch.float32).eps
ISSUE_SHAPES = [(256, 1024), (256, 1024), (1024, 256), (512, 512)]


def _mop(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    from emerging_optimizers.orthogonalized_optimizers import MOP

    return MOP(params, lr=0.02)


class PolarSGD(torch.optim.Optimizer):
    """p -= lr · orth(grad), for spelling tests: ``orth`` is any user function of the grad."""

    def __init__(self, params: Any, orth: Callable[[torch.Tensor], torch.Tensor], lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})
        self.orth = orth

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                p.add_(self.orth(p.grad), alpha=-group["lr"])


def _graph(
    opt: torch.optim.Optimizer, passes: tuple[Pass, ...], warm: bool = True
) -> tuple[fx.GraphModule, list[Any]]:
    """The captured step after ``passes``; ``warm``: one eager step first, so state is input, not created."""
    gen = torch.Generator().manual_seed(0)
    for group in opt.param_groups:
        for p in group["params"]:
            p.grad = torch.randn(p.shape, generator=gen)
    if warm:
        opt.step()
    return run_pipeline(capture(opt, STRUCTURAL_KEYS).gm, passes)


def _polar_nodes(gm: fx.GraphModule) -> list[PolarSpec]:
    return [PolarSpec.from_node(n) for n in gm.graph.nodes if family_of(n) is POLAR]


def _with_singular_values(m: int, n: int, kappa: float, seed: int = 0) -> torch.Tensor:
    """fp32 m×n matrix with singular values log-spaced from 1 to 1/κ."""
    gen = torch.Generator().manual_seed(seed)
    k = min(m, n)
    u, _ = torch.linalg.qr(torch.randn(m, k, generator=gen, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(n, k, generator=gen, dtype=torch.float64))
    s = torch.logspace(0, -torch.log10(torch.tensor(float(kappa))).item(), k, dtype=torch.float64)
    return ((u * s) @ v.T).float()


# ------------------------------------------------------------------ the family


def test_family_registered_with_matching_schema() -> None:
    assert family_of(torch.ops.hocompile.polar.default) is POLAR
    assert schema_mismatches(PolarSpec) == []
    spec = PolarSpec.from_args((torch.zeros(2, 3),), {"scale": "nuclear"})
    assert spec.method == "svd" and spec.to_args()[1:] == ("svd", "nuclear")


def test_svd_method_is_eagers_arithmetic_bitwise() -> None:
    x = torch.randn(24, 40, generator=torch.Generator().manual_seed(1))
    u, s, vh = torch.linalg.svd(x, full_matrices=False)
    assert torch.equal(torch.ops.hocompile.polar(x, "svd", "nuclear"), (u @ vh) * s.sum())
    assert torch.equal(torch.ops.hocompile.polar(x), u @ vh)


@pytest.mark.parametrize("method", ["svd", "gram_eigh"])
def test_batched_input_matches_per_matrix_and_restores_threads(method: str) -> None:
    x = torch.randn(3, 16, 48, generator=torch.Generator().manual_seed(2))
    threads = torch.get_num_threads()
    out = torch.ops.hocompile.polar(x, method, "nuclear")
    assert torch.get_num_threads() == threads
    torch.set_num_threads(1)  # one thread: ATen's batched call, the nuclear norm broadcast per matrix
    try:
        single = torch.ops.hocompile.polar(x, method, "nuclear")
    finally:
        torch.set_num_threads(threads)
    for i in range(3):
        ref = polar_svd(x[i].double(), "nuclear")
        for got in (out, single):
            torch.testing.assert_close(got[i].double(), ref, rtol=0, atol=1e-4 * ref.abs().max().item())


def test_gram_eigh_handles_tall_and_rank_deficient() -> None:
    x = _with_singular_values(48, 16, 10.0)
    torch.testing.assert_close(polar_gram_eigh(x, "none"), polar_gram_eigh(x.T.contiguous(), "none").T)
    low_rank = torch.randn(16, 4) @ torch.randn(4, 32)
    out = polar_gram_eigh(low_rank, "none")
    assert torch.isfinite(out).all()
    # A partial isometry on the 4-dim range: 4 singular values 1, the rest 0.
    s = torch.linalg.svdvals(out.double())
    torch.testing.assert_close(s[:4], torch.ones(4, dtype=torch.float64), atol=1e-4, rtol=0)
    assert s[4:].abs().max() < 1e-3


@pytest.mark.parametrize(
    ("shape", "kappa"),
    [(s, k) for s in [(64, 128), (256, 1024)] for k in (1.0, 10.0, 100.0, 1000.0)]
    + [((512, 512), 1.0), ((512, 512), 1000.0)],
)
def test_gram_eigh_error_bound(shape: tuple[int, int], kappa: float) -> None:
    """gram_eigh within eps·(4 + κ²/4) of the fp64 SVD factor; exact svd within 4·eps·κ."""
    x = _with_singular_values(*shape, kappa)
    exact = polar_svd(x.double(), "none")
    gram_error = (polar_gram_eigh(x, "none").double() - exact).abs().max().item()
    svd_error = (polar_svd(x, "none").double() - exact).abs().max().item()
    assert gram_error <= gram_eigh_error_bound(kappa), (gram_error, gram_eigh_error_bound(kappa))
    assert svd_error <= 4 * EPS32 * kappa
    if kappa >= 100:  # the squared condition number shows: gram_eigh is the less accurate one
        assert gram_error > 5 * svd_error


# ------------------------------------------------------------------ the pass


def test_mop_graph_prints_polar_op() -> None:
    gm, records = _graph(_mop([torch.zeros(8, 16), torch.zeros(16, 8)]), (Canonicalize(), FusePolar()))
    text = print_graph(gm)
    lines = [line.strip() for line in text.splitlines() if "polar" in line or "svd" in line]
    assert lines == [
        "t2: fp32[8, 16] = hocompile.polar(t1, svd, scale=nuclear)  # fuse-polar",
        "t7: fp32[16, 8] = hocompile.polar(t6, svd, scale=nuclear)  # fuse-polar",
    ], text
    assert records[-1].summary == "fused 2 polar factor(s) (svd)"


def _orth_linalg(g: torch.Tensor) -> torch.Tensor:
    u, s, vh = torch.linalg.svd(g, full_matrices=False)
    return s.sum(-1) * torch.matmul(u, vh)


def _orth_torch_svd(g: torch.Tensor) -> torch.Tensor:
    u, _, v = torch.svd(g)
    return u @ v.mT


def _orth_square_full(g: torch.Tensor) -> torch.Tensor:
    u, _, vh = torch.linalg.svd(g)
    return torch.mm(u, vh)


@pytest.mark.parametrize(
    ("orth", "shape", "scale"),
    [(_orth_linalg, (6, 10), "nuclear"), (_orth_torch_svd, (10, 6), "none"), (_orth_square_full, (6, 6), "none")],
)
def test_spellings_fuse(orth: Callable[[torch.Tensor], torch.Tensor], shape: tuple[int, int], scale: str) -> None:
    gm, _ = _graph(PolarSGD([torch.zeros(shape)], orth), (Canonicalize(), FusePolar()))
    assert [(s.method, s.scale) for s in _polar_nodes(gm)] == [("svd", scale)]
    text = print_graph(gm)
    assert "_linalg_svd" not in text and "aten.mm" not in text and "aten.sum" not in text, text


def _uses_max_singular_value(g: torch.Tensor) -> torch.Tensor:
    u, s, vh = torch.linalg.svd(g, full_matrices=False)
    return (u @ vh) / s.max()


def _full_matrices_wide(g: torch.Tensor) -> torch.Tensor:
    u, _, vh = torch.linalg.svd(g)
    return u @ vh[: g.shape[0]]


def _reads_u_twice(g: torch.Tensor) -> torch.Tensor:
    u, _, vh = torch.linalg.svd(g, full_matrices=False)
    return u @ vh + u.sum()


def _reads_product_unscaled(g: torch.Tensor) -> torch.Tensor:
    u, s, vh = torch.linalg.svd(g, full_matrices=False)
    o = u @ vh
    return o * s.sum() + o


@pytest.mark.parametrize(
    ("orth", "reason"),
    [
        (_uses_max_singular_value, "singular values read beyond S.sum()"),
        (_full_matrices_wide, "full_matrices=True on a non-square matrix"),
        (_reads_u_twice, "U is read by something other than U @ Vh"),
        (_reads_product_unscaled, "U @ Vh is read unscaled as well"),
    ],
)
def test_declines_with_reason(orth: Callable[[torch.Tensor], torch.Tensor], reason: str) -> None:
    gm, records = _graph(PolarSGD([torch.zeros(6, 10)], orth), (Canonicalize(), FusePolar()))
    assert _polar_nodes(gm) == []
    assert "_linalg_svd" in print_graph(gm)
    assert reason in records[-1].summary, records[-1].summary


def test_bad_method_fails_fast() -> None:
    with pytest.raises(ValueError, match="gram_eigh"):
        FusePolar(method="eigh")


# ------------------------------------------------------------------ batching


def test_issue_params_batch_into_two_groups_with_the_transposed_one() -> None:
    """(256,1024)×2 and (1024,256) share one key, the tall one transposed; (512,512) is its own group."""
    gm, _ = _graph(_mop([torch.zeros(s) for s in ISSUE_SHAPES]), (Canonicalize(), FusePolar()), warm=False)
    specs = _polar_nodes(gm)
    assert POLAR.batch is not None
    keys = [POLAR.batch.key(s) for s in specs]
    assert keys[0] == keys[1] == keys[2] != keys[3]
    # svd stacks tall (LAPACK's faster orientation): the two 256×1024 join transposed; gram_eigh stacks wide.
    assert [POLAR.batch.transposed(s) for s in specs] == [True, True, False, False]
    gram = [s.replace(method="gram_eigh") for s in specs]
    assert [POLAR.batch.transposed(s) for s in gram] == [False, False, True, False]
    assert POLAR.batch.key(gram[0]) not in keys  # methods never share a stack
    gm, records = run_pipeline(gm, (BatchByShape(force=True),))
    inputs = sorted(tuple(s.node_of("x").meta["val"].shape) for s in _polar_nodes(gm))
    assert inputs == [(3, 1024, 256), (512, 512)], records[-1].summary
    assert "aten.permute" in print_graph(gm)


# ------------------------------------------------------------------ compiled MOP


def _compiled_vs_eager(passes: tuple[Pass, ...], shapes: list[tuple[int, int]], steps: int, tmp: Path) -> list[float]:
    """Max-abs param difference after each step of eager MOP and compiled MOP on identical grads."""
    gen = torch.Generator().manual_seed(3)
    start = [torch.randn(s, generator=gen) for s in shapes]
    eager_params = [p.clone() for p in start]
    compiled_params = [p.clone() for p in start]
    eager = _mop(eager_params)
    # The plan's own numerics are measured: a self-check fallback would compare eager with eager.
    settings = Settings.resolve(cache_dir=tmp, self_check=False)
    compiled = CompiledOptimizer(_mop(compiled_params), settings, pipeline=passes)
    diffs = []
    for _ in range(steps):
        for pe, pc in zip(eager_params, compiled_params):
            pe.grad = torch.randn(pe.shape, generator=gen)
            pc.grad = pe.grad.clone()
        eager.step()
        compiled.step()
        diffs.append(max((pe - pc).abs().max().item() for pe, pc in zip(eager_params, compiled_params)))
    assert "hocompile.polar" in compiled.history[-1].final_graph
    return diffs


def test_compiled_mop_is_bitwise_eager_for_20_steps(tmp_path: Path) -> None:
    diffs = _compiled_vs_eager((Canonicalize(), FusePolar()), [(16, 48), (48, 16), (32, 32)], 20, tmp_path)
    assert diffs == [0.0] * 20


def test_compiled_mop_batched_and_gram_eigh_stay_close(tmp_path: Path) -> None:
    shapes = [(16, 48), (16, 48), (48, 16), (32, 32)]
    for method in ("svd", "gram_eigh"):
        passes = (Canonicalize(), FusePolar(method=method), BatchByShape(force=True))
        diffs = _compiled_vs_eager(passes, shapes, 5, tmp_path / method)
        # lr 0.02 · ‖G‖_* ~ 5 per entry per step: relative to that, rounding-level differences only.
        assert max(diffs) < 1e-4, (method, diffs)


def test_in_the_default_pipeline_with_verify(cache_dir: Path) -> None:
    """Where the lead's pipeline will put it (after fuse-newton-schulz): bitwise eager, verify passes."""
    from hocompile.passes import default_pipeline
    from hocompile.targets import resolve_target

    settings = Settings.resolve(cache_dir=cache_dir, verify=3)
    pipeline = default_pipeline(resolve_target("auto", settings.cache_dir, torch.device("cpu")))
    names = [p.name for p in pipeline]
    at = names.index("fuse-newton-schulz") + 1
    pipeline = pipeline if "fuse-polar" in names else pipeline[:at] + (FusePolar(),) + pipeline[at:]
    gen = torch.Generator().manual_seed(4)
    params = [torch.randn(s, generator=gen) for s in [(16, 48), (48, 16), (32, 32)]]
    eager_params = [p.clone() for p in params]
    compiled, eager = CompiledOptimizer(_mop(params), settings, pipeline=pipeline), _mop(eager_params)
    for _ in range(4):
        for p, q in zip(params, eager_params):
            p.grad = torch.randn(p.shape, generator=gen)
            q.grad = p.grad.clone()
        compiled.step()
        eager.step()
    assert all(torch.equal(p, q) for p, q in zip(params, eager_params))
    assert compiled.history[-1].verification.failed == "" and compiled.history[-1].verification.steps > 0
    assert "hocompile.polar" in compiled.history[-1].final_graph
