"""A family lowered to Triton from a test file only: the toy op's emitter is defined here.

``hocompile::toy_row_normalize`` (tests/toy_family.py) gets a Triton emitter
(a small row-normalise kernel) through ``registry.register_lowering``; no
hocompile module knows the op. ToyRowNormSGD's step then lowers to Triton
(under the interpreter on CPU) with the toy calls as registered op groups,
and matches eager. Without the emitter the same step still lowers: each
toy call is an aten call unit.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import hocompile
from hocompile.ir.registry import register_lowering
from hocompile.lowering.triton.code import TL_DTYPE, CodeWriter, KernelSource
from hocompile.lowering.triton.op_groups import GroupCode, GroupNames, OpGroup, Workspace

from .toy_family import TOY, ToyRowNormSGD

pytest.importorskip("triton")


def generate_toy_kernel(batch: int, m: int, n: int, dtype: torch.dtype, out: torch.dtype, alpha: float) -> KernelSource:
    """alpha · x / max(‖row‖, eps) on [batch, m, n]: one program per row, the row in one block."""
    name = f"toy_row_normalize_b{batch}_{m}x{n}"
    block = max(16, 1 << (n - 1).bit_length())  # the interpreter wants blocks of at least 16
    w = CodeWriter()
    w.line(f"# kernel {name}: family toy_row_normalize; from tests/test_registry_triton.py")
    w.line("@triton.jit")
    w.line(f"def {name}(x_ptr, out_ptr, eps_ptr, ALPHA: tl.constexpr, N: tl.constexpr, BLOCK: tl.constexpr):")
    with w.indent():
        w.line("row = tl.program_id(0).to(tl.int64)")
        w.line("cols = tl.arange(0, BLOCK)")
        w.line("mask = cols < N")
        w.line("x = tl.load(x_ptr + row * N + cols, mask=mask, other=0.0).to(tl.float32)")
        w.line("norm = tl.sqrt(tl.sum(x * x, axis=0))")
        w.line("denom = tl.maximum(norm, tl.load(eps_ptr))")
        w.line(f"tl.store(out_ptr + row * N + cols, (x * (ALPHA / denom)).to({TL_DTYPE[out]}), mask=mask)")
    w.line()
    w.line()
    w.line(f"def launch_{name}(x, out, eps):")
    with w.indent():
        w.line(f"{name}[({batch * m},)](x, out, eps, ALPHA={alpha!r}, N={n}, BLOCK={block})")
    return KernelSource(name, "toy_row_normalize", (batch, m, n, dtype, out, alpha), "test", w.text())


class ToyEmitter:
    """The toy family's GroupEmitter: the workspace in the input dtype, no norm partials, one launch."""

    def workspace(self, group: OpGroup) -> Workspace:
        return Workspace(group.feeds[0].meta["val"].dtype)

    def scalars(self, group: OpGroup) -> list[Any]:
        return [group.spec.eps]

    def emit(self, group: OpGroup, names: GroupNames) -> GroupCode:
        spec = group.spec
        dtype = self.workspace(group).dtype
        kernel = generate_toy_kernel(group.batch, group.m, group.n, dtype, group.out_dtype, float(spec.alpha))
        line = f"{kernel.launcher}({names.x}, {names.out}, {names.scalar(spec.eps)})"
        summary = f"toy group {group.index}: {group.batch} x {group.m}x{group.n}, 1 launch"
        return GroupCode([kernel], [], [line], 1, summary)


@pytest.fixture
def toy_emitter() -> Iterator[None]:
    register_lowering(TOY.op, "triton", ToyEmitter())
    try:
        yield
    finally:
        TOY.lowerings.pop("triton", None)


def _params() -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    # two 4x16 batch together; a 16x4 one stays a single call
    return [torch.nn.Parameter(torch.randn(shape)) for shape in ((4, 16), (4, 16), (16, 4))]


def _eager_vs_triton(cache_dir: Path, steps: int = 2) -> Any:
    params = _params()
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    eager = ToyRowNormSGD(params, lr=0.1)
    tri = hocompile.compile_optimizer(ToyRowNormSGD(twins, lr=0.1), backend="triton", cache_dir=cache_dir)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p, q in zip(params, twins):
            p.grad = torch.randn(p.shape, generator=gen)
            q.grad = p.grad.clone()
        eager.step()
        tri.step()
    for p, q in zip(params, twins):
        torch.testing.assert_close(q, p)  # sums in another order: fp32 tolerance, not bitwise
    lowered = tri.history[-1].lowered
    assert lowered is not None and lowered.backend == "triton"
    return tri, lowered


def test_toy_family_lowers_through_its_registered_triton_emitter(cache_dir: Path, toy_emitter: None) -> None:
    tri, lowered = _eager_vs_triton(cache_dir)
    assert {k.family for k in tri.kernels()} == {"pointwise", "toy_row_normalize", "writeback"}
    toy_units = [u for u in lowered.units if u.startswith("toy group")]
    assert toy_units == ["toy group 0: 2 x 4x16, 1 launch", "toy group 1: 1 x 16x4, 1 launch"], lowered.units
    assert "torch.ops.hocompile.toy_row_normalize" not in lowered.source  # no aten fallback left
    assert lowered.graphed is False  # cuda_graphs off: the plain runnable


def test_toy_family_without_a_triton_emitter_is_an_aten_call(cache_dir: Path) -> None:
    assert TOY.lowering("triton") is None
    tri, lowered = _eager_vs_triton(cache_dir)
    assert {k.family for k in tri.kernels()} == {"pointwise", "writeback"}
    assert lowered.source.count("torch.ops.hocompile.toy_row_normalize.default(") == 2, lowered.source
    assert sum(u.startswith("aten ") for u in lowered.units) >= 2, lowered.units


def test_feeding_kernels_store_only_what_someone_reads(toy_emitter: None) -> None:
    """The identity regions feeding the toy groups store into the workspace and nothing else."""
    from hocompile.capture.trace import capture
    from hocompile.lowering.triton.wrapper import generate_wrapper
    from hocompile.passes import default_pipeline, run_pipeline
    from hocompile.settings import Settings
    from hocompile.targets import gpu_target

    params = _params()
    opt = ToyRowNormSGD(params, lr=0.1)
    for p in params:
        p.grad = torch.zeros_like(p)
    with torch.no_grad():
        captured = capture(opt, Settings().structural_keys)
    gm, _ = run_pipeline(captured.gm, default_pipeline(gpu_target("sm90"), force_batch=True), frozenset(), None)
    placeholders = {s: i for i, s in enumerate(captured.inputs)}
    copy_into = [placeholders[a.slot] if a.mode == "copy" else None for a in captured.outputs]
    plan = generate_wrapper(gm, copy_into, "interpret", upcast="True")
    feeding = [k for k in plan.kernels if k.family == "pointwise" and "_ws_" in k.name]
    assert feeding and all(k.source.count("tl.store(") == 1 for k in feeding), [k.source for k in feeding]
    assert "part0" not in plan.body  # the toy asked for no norm partials
    assert plan.launches == 2 + 2 + 2 + 1  # feeds, toy groups, updates (one 4x16 pair fused), the commit
    assert "torch.empty" not in plan.body.split("def launch(")[1]  # launch() allocates nothing
