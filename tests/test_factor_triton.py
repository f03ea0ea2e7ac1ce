"""Issue 12 item 4: the Triton kernels of ``factor_update`` and ``two_sided`` under ``TRITON_INTERPRET=1``.

fp32 only (the interpreter mis-computes bf16 arithmetic), tiles of 16, and
shapes that are not tile multiples (masks, partial tiles). Each kernel is
compared with the CPU op (eager's arithmetic) and with the fp64 reference;
a stack is one launch over the group. On a GPU the same kernels compile
for the device (benchmarks/gpu_check_shampoo.py runs them there).
"""

from __future__ import annotations

import ast
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

from hocompile.lowering.triton import module
from hocompile.lowering.triton.call_group import standalone_text
from hocompile.ops.factor_update import FACTOR_UPDATE, FactorUpdateSpec
from hocompile.ops.two_sided import TWO_SIDED, TwoSidedSpec
from hocompile.passes import BatchByShape, Canonicalize, FuseFactorUpdate, FuseTwoSided
from hocompile.targets import Target

pytest.importorskip("triton")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
interpreted = pytest.mark.skipif(torch.cuda.is_available(), reason="runs CPU tensors in the interpreter")
EPS32 = torch.finfo(torch.float32).eps


def _graph(fn: Any, *args: torch.Tensor, batch: bool = False) -> fx.GraphModule:
    def outputs(*xs: torch.Tensor) -> tuple[torch.Tensor, ...]:  # a tuple, as captured steps return
        result = fn(*xs)
        return tuple(result) if isinstance(result, (tuple, list)) else (result,)

    gm = Canonicalize()(make_fx(outputs, tracing_mode="fake")(*args)).gm
    FuseFactorUpdate()(gm)
    FuseTwoSided()(gm)
    if batch:
        assert BatchByShape(target=Target("test"), force=True)(gm).changed
    return gm


def _run(node: fx.Node, fields: list[str], values: dict[str, torch.Tensor], tmp_path: Path) -> torch.Tensor:
    emitter = _family(node).lowering("triton")
    assert emitter is not None, "the family registers its Triton emitter"
    text, scalars = standalone_text(emitter, node, fields, "interpret")
    ast.parse(text)
    loaded, _ = module.load(text, tmp_path)
    out = torch.empty(node.meta["val"].shape, dtype=node.meta["val"].dtype)
    scalar_values = [torch.tensor(float(s), dtype=torch.float32) for s in scalars]
    return loaded.run(*(values[f] for f in fields), out, *scalar_values, upcast=True)  # type: ignore[no-any-return]


def _family(node: fx.Node) -> Any:
    from hocompile.ir.registry import family_of

    family = family_of(node)
    assert family is not None
    return family


def _op_nodes(gm: fx.GraphModule, op: Any) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.target is op]


def _spd(n: int, gen: torch.Generator) -> torch.Tensor:
    a = torch.randn(n, n + 5, generator=gen)
    return a @ a.T / n


@interpreted
@pytest.mark.parametrize(("side", "form"), [("left", "lerp"), ("right", "lerp"), ("left", "addmm"), ("right", "addmm")])
def test_factor_update_kernel_matches_the_op_and_fp64(side: str, form: str, tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(0)
    g = torch.randn(20, 37, generator=gen)  # 20 and 37: neither a multiple of the 16-tiles
    factor = _spd(20 if side == "left" else 37, gen)
    ops = torch.ops.hocompile
    for weight in (0.05, 0.7):  # both branches of ATen's lerp formula
        node = _factor_node(factor, g, side, form, weight)
        got = _run(node, ["factor", "g"], {"factor": factor, "g": g}, tmp_path)
        cpu = ops.factor_update(factor, g, side, form, weight, 0.9)
        assert torch.equal(got, got.mT), "lower tiles mirrored: exactly symmetric"
        scale = float(cpu.abs().max())
        torch.testing.assert_close(got, cpu, rtol=0, atol=8 * EPS32 * scale)
        spec = FactorUpdateSpec(factor=factor, g=g, side=side, form=form, weight=weight, beta=0.9)
        exact = FACTOR_UPDATE.reference(spec)
        err = float((got.double() - exact).abs().max())
        assert 0 < err < 8 * EPS32 * scale, err  # an fp32 result, not an fp64 one, and as good as the CPU's
        assert err <= 4 * float((cpu.double() - exact).abs().max()) + EPS32 * scale


def _factor_node(factor: torch.Tensor, g: torch.Tensor, side: str, form: str, weight: float) -> fx.Node:
    def update(f: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        a, b = (x, x.T) if side == "left" else (x.T, x)
        return f.lerp(a @ b, weight) if form == "lerp" else f.addmm(a, b, beta=0.9, alpha=weight)

    (node,) = _op_nodes(_graph(update, factor, g), FACTOR_UPDATE.op)
    return node


@interpreted
def test_a_stacked_factor_update_is_one_launch_over_the_group(tmp_path: Path) -> None:
    """L of a (20, 37) param and R of a (37, 20) param share one 20x20 rank-37 stack (the right one transposed)."""

    def two(l0: torch.Tensor, g0: torch.Tensor, r1: torch.Tensor, g1: torch.Tensor) -> Any:
        return l0.lerp(g0 @ g0.T, 0.1), r1.lerp(g1.T @ g1, 0.1)

    gen = torch.Generator().manual_seed(1)
    args = [_spd(20, gen), torch.randn(20, 37, generator=gen), _spd(20, gen), torch.randn(37, 20, generator=gen)]
    gm = _graph(two, *args, batch=True)
    (node,) = _op_nodes(gm, FACTOR_UPDATE.op)
    code = _family(node).lowering("triton").emit(node, _names(["factor", "g"]))
    assert code.launches == 1 and len(code.kernels) == 1 and "_b2_20x37" in code.kernels[0].name
    stacked = {"factor": torch.stack([args[0], args[2].T]), "g": torch.stack([args[1], args[3].T])}
    got = _run(node, ["factor", "g"], stacked, tmp_path)
    for i, (f, g, side) in enumerate(((args[0], args[1], "left"), (args[2], args[3], "right"))):
        cpu = torch.ops.hocompile.factor_update(f, g, side, "lerp", 0.1)
        torch.testing.assert_close(got[i], cpu, rtol=0, atol=8 * EPS32 * float(cpu.abs().max()))


def _names(fields: list[str]) -> Any:
    from hocompile.lowering.triton.call_group import CallNames

    return CallNames({f: f for f in fields}, "out", "c0_", lambda s: "s", "True", "interpret")


@interpreted
@pytest.mark.parametrize(
    ("left_t", "right_t", "tensordot"), [(True, False, True), (False, True, True), (False, False, False)]
)
def test_two_sided_kernels_match_the_op_and_fp64(left_t: bool, right_t: bool, tensordot: bool, tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(2)
    x, ql, qr = (
        torch.randn(18, 35, generator=gen),
        torch.randn(18, 18, generator=gen),
        torch.randn(35, 35, generator=gen),
    )

    def project(x: torch.Tensor, ql: torch.Tensor, qr: torch.Tensor) -> torch.Tensor:
        a, b = (ql.T if left_t else ql), (qr.T if right_t else qr)
        if tensordot:
            return torch.tensordot(torch.tensordot(x, a.T, dims=[[0], [0]]), b, dims=[[0], [0]])
        return (a @ x) @ b

    (node,) = _op_nodes(_graph(project, x, ql, qr), TWO_SIDED.op)
    spec = TWO_SIDED.spec_of(node)
    assert (spec.left_transposed, spec.right_transposed) == (left_t, right_t)
    got = _run(node, ["x", "left", "right"], {"x": x, "left": ql, "right": qr}, tmp_path)
    association = "tensordot" if tensordot else "left_first"
    cpu = torch.ops.hocompile.two_sided(x, ql, qr, left_t, right_t, association)
    # |A| |X| |B| bounds each entry's rounding; two fp32 products in sequence
    scale = float(((ql.abs() @ x.abs()) @ qr.abs()).max())
    torch.testing.assert_close(got, cpu, rtol=0, atol=64 * EPS32 * scale)
    ref = TWO_SIDED.reference(TwoSidedSpec(x, ql, qr, left_t, right_t, association))
    err = float((got.double() - ref).abs().max())
    assert 0 < err < 64 * EPS32 * scale, err


@interpreted
def test_a_stacked_two_sided_is_two_launches_over_the_group(tmp_path: Path) -> None:
    def two(x0: torch.Tensor, x1: torch.Tensor, ql: torch.Tensor, qr: torch.Tensor) -> Any:
        return [torch.tensordot(torch.tensordot(x, ql, dims=[[0], [0]]), qr, dims=[[0], [0]]) for x in (x0, x1)]

    gen = torch.Generator().manual_seed(3)
    args = [torch.randn(17, 20, generator=gen), torch.randn(17, 20, generator=gen)]
    args += [torch.randn(17, 17, generator=gen), torch.randn(20, 20, generator=gen)]
    (node,) = _op_nodes(_graph(two, *args, batch=True), TWO_SIDED.op)
    code = _family(node).lowering("triton").emit(node, _names(["x", "left", "right"]))
    assert code.launches == 2 and all("_b2_" in k.name for k in code.kernels)
    stacked = {"x": torch.stack(args[:2]), "left": torch.stack([args[2]] * 2), "right": torch.stack([args[3]] * 2)}
    got = _run(node, ["x", "left", "right"], stacked, tmp_path)
    for i in range(2):
        cpu = torch.ops.hocompile.two_sided(args[i], args[2], args[3], True, False, "tensordot")
        scale = float(((args[2].abs().T @ args[i].abs()) @ args[3].abs()).max())
        torch.testing.assert_close(got[i], cpu, rtol=0, atol=64 * EPS32 * scale)
