"""The op-family registry, driven by a family hocompile does not know: tests/toy_family.py.

Every layer that touches a ``hocompile::`` op (printer, graph_stats,
batch-by-shape, the aten lowering, the verify reference, plan/explain) must
handle ``hocompile::toy_row_normalize`` through its registry entry alone.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
import torch.fx as fx

import hocompile
from hocompile.capture.group_hypers import STRUCTURAL_KEYS
from hocompile.capture.trace import capture
from hocompile.ir.graph import graph_stats, print_graph
from hocompile.ir.registry import Input, OpSpec, family_of, register, registered_calls, unregister
from hocompile.ops.newton_schulz_spec import NEWTON_SCHULZ
from hocompile.passes import BatchByShape, run_pipeline
from hocompile.runtime.check.reference_step import Float64Run
from tests.test_expect_graphs import BATCHING
from tests.toy_family import TOY, ToyRowNormalizeSpec, ToyRowNormSGD

TOY_OP = torch.ops.hocompile.toy_row_normalize.default
SHAPES = [(4, 6), (4, 6), (4, 6), (5, 3)]  # three calls that batch, one alone
LR = 0.1


def _params() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(shape, generator=gen) for shape in SHAPES]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    return params


def _copies(params: list[torch.Tensor]) -> list[torch.Tensor]:
    copies = [p.detach().clone() for p in params]
    for c, p in zip(copies, params):
        c.grad = p.grad.clone()  # type: ignore[union-attr]
    return copies


def _captured() -> fx.GraphModule:
    return capture(ToyRowNormSGD(_params(), lr=LR), STRUCTURAL_KEYS).gm


def _toy_calls(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is TOY_OP]


def _eager(params: list[torch.Tensor]) -> list[torch.Tensor]:
    ToyRowNormSGD(params, lr=LR).step()
    return params


# ---------------------------------------------------------------- printer and stats


def test_printer_renders_the_toy_op_through_its_describe() -> None:
    text = print_graph(_captured())
    assert "hocompile.toy_row_normalize(g0_0, alpha=1.0, eps=1e-07)  # capture" in text, text
    assert "fp32[4, 6]" in text and "f32[" not in text  # one dtype vocabulary


def test_graph_stats_count_calls_per_family() -> None:
    stats = graph_stats(_captured())
    assert stats["toy-row-normalize"] == 4 and stats["hocompile ops"] == 4
    assert stats["newton-schulz"] == 0  # every registered family has its key; explain reads this one


# ---------------------------------------------------------------- batch-by-shape


def test_batch_by_shape_stacks_the_three_same_shaped_toy_calls() -> None:
    gm, records = run_pipeline(_captured(), (BatchByShape(force=True),))
    assert records[0].status == "changed", records
    calls = _toy_calls(gm)
    shapes = sorted(tuple(ToyRowNormalizeSpec.from_node(n).node_of("x").meta["val"].shape) for n in calls)
    assert shapes == [(3, 4, 6), (5, 3)]  # one batched call of three, the odd shape alone
    stacked = ToyRowNormalizeSpec.from_node(next(n for n in calls if n.meta["val"].dim() == 3)).node_of("x")
    assert stacked.target is torch.ops.aten.stack.default and len(stacked.args[0]) == 3  # type: ignore[arg-type]
    assert graph_stats(gm)["toy-row-normalize"] == 2


def test_batch_by_shape_declines_on_a_target_that_does_not_prefer_stacks() -> None:
    gm, records = run_pipeline(_captured(), (BatchByShape(),))  # Target("unset"): prefers_batched False
    assert records[0].status != "changed" and len(_toy_calls(gm)) == 4


def test_stack_cap_without_a_stack_bytes_rule_counts_inputs_and_output() -> None:
    # A 4x6 fp32 call adds 96 B of input and 96 B of output: 400 B holds two of them.
    gm, _ = run_pipeline(_captured(), (BatchByShape(force=True, max_stack_bytes=400),))
    shapes = sorted(tuple(n.meta["val"].shape) for n in _toy_calls(gm))
    assert shapes == [(2, 4, 6), (4, 6), (5, 3)]


def test_compiled_batched_step_matches_eager(cache_dir: Path) -> None:
    params = _params()
    expected = _eager(_copies(params))
    opt = hocompile.compile_optimizer(
        ToyRowNormSGD(params, lr=LR), target=BATCHING, backend="aten", cache_dir=cache_dir
    )
    opt.step()
    final = _entry(opt).captured.gm  # the final graph (the aten lowering added only write-backs)
    assert graph_stats(final)["toy-row-normalize"] == 2, print_graph(final)  # really batched
    for p, e in zip(params, expected):
        assert torch.equal(p, e)  # the same kernel on each row


# ---------------------------------------------------------------- aten lowering and fp64 reference


def test_aten_lowering_matches_eager_and_the_fp64_reference(cache_dir: Path) -> None:
    params = _params()
    before = _copies(params)
    expected = _eager(_copies(params))
    opt = hocompile.compile_optimizer(ToyRowNormSGD(params, lr=LR), backend="aten", cache_dir=cache_dir)
    opt.step()
    source = _entry(opt).lowered.source
    # The lowering calls the op's kernel directly (no dispatcher round trip), named after it.
    assert "toy_row_normalize(" in source and "torch.ops.hocompile.toy_row_normalize" not in source
    for p, e, b in zip(params, expected, before):
        assert torch.equal(p, e)  # same kernel on the same inputs: bitwise
        reference = b.double() - LR * TOY.reference(ToyRowNormalizeSpec(x=b.grad, alpha=1.0, eps=1e-7))
        torch.testing.assert_close(p.double(), reference, rtol=0, atol=1e-6)


@pytest.mark.parametrize("nominal", [False, True])
def test_verify_reference_evaluates_the_toy_by_its_family_reference(nominal: bool) -> None:
    # The toy's kernel computes in fp32 whatever its input: widening its input to fp64 and
    # running the kernel would be ~1e-7 off. The family's reference is exact in both modes.
    gm = _captured()
    params = _params()
    inputs = [t for p in params for t in (p.double(), p.grad.double())]  # type: ignore[union-attr]
    outputs = Float64Run(gm, nominal).run(*inputs, -LR)
    for out, p in zip(outputs, params):
        g = p.grad.double()  # type: ignore[union-attr]
        exact = p.double() - LR * g / g.norm(dim=-1, keepdim=True)
        assert out.dtype == torch.float64
        torch.testing.assert_close(out, exact, rtol=0, atol=1e-14)


def test_verify_passes_on_the_toy_family(cache_dir: Path) -> None:
    params = _params()
    expected = _eager(_copies(params))
    opt = hocompile.compile_optimizer(ToyRowNormSGD(params, lr=LR), backend="aten", cache_dir=cache_dir, verify=1)
    opt.step()  # raises VerificationError if the reference of the toy op were wrong
    for p, e in zip(params, expected):
        assert torch.equal(p, e)


# ---------------------------------------------------------------- registry basics


@dataclasses.dataclass(frozen=True)
class _MissingEps(OpSpec):
    qualname: ClassVar[str] = "hocompile::toy_row_normalize"
    x: Input
    alpha: float


@dataclasses.dataclass(frozen=True)
class _WrongType(OpSpec):
    qualname: ClassVar[str] = "hocompile::toy_row_normalize"
    x: Input
    alpha: int
    eps: float


@pytest.mark.parametrize(("spec", "problem"), [(_MissingEps, "names"), (_WrongType, "alpha: schema type float")])
def test_register_refuses_a_spec_that_does_not_match_the_schema(spec: type[OpSpec], problem: str) -> None:
    bad = dataclasses.replace(TOY, spec=spec)
    with pytest.raises(RuntimeError, match=f"schema and {spec.__name__} differ: {problem}"):
        register(bad)
    assert family_of(TOY_OP) is TOY  # the refused entry replaced nothing


def test_family_of_is_none_for_anything_not_registered() -> None:
    gm = _captured()
    for node in gm.graph.nodes:
        expected = TOY if node.target is TOY_OP else None
        assert family_of(node) is expected, node.format_node()
    assert family_of(torch.ops.aten.add.Tensor) is None
    assert family_of([1, 2]) is None  # unhashable targets are never ops
    assert family_of(NEWTON_SCHULZ.op) is NEWTON_SCHULZ


def test_unregister_removes_the_family_everywhere() -> None:
    gm = _captured()
    unregister(TOY_OP)
    try:
        assert family_of(TOY_OP) is None and registered_calls(gm.graph) == []
        assert "toy-row-normalize" not in graph_stats(gm)
        assert "hocompile.toy_row_normalize(g0_0, 1.0, 1e-07)" in print_graph(gm)  # plain positional args
        gm, records = run_pipeline(gm, (BatchByShape(force=True),))
        assert records[0].status != "changed" and len(_toy_calls(gm)) == 4
    finally:
        register(TOY)
    assert family_of(TOY_OP) is TOY and len(registered_calls(gm.graph)) == 4


# ---------------------------------------------------------------- plan() and explain()


def test_plan_and_explain_show_the_family_title_and_cost(cache_dir: Path) -> None:
    # Batched on BATCHING: [3, 4, 6] and [5, 3] calls, 4 FLOP per element: 4 * (72 + 15) = 348.
    report = hocompile.plan(ToyRowNormSGD(_params(), lr=LR), target=BATCHING)
    opt = hocompile.compile_optimizer(ToyRowNormSGD(_params(), lr=LR), target=BATCHING, cache_dir=cache_dir)
    opt.step()
    for text in (report, hocompile.explain(opt)):
        assert TOY.title in text, text
        assert "348 FLOP" in text, text


def _entry(opt: hocompile.CompiledOptimizer) -> Any:
    (entry,) = opt.history  # one compiled step
    assert entry.captured is not None and entry.lowered is not None
    return entry
