"""NewtonSchulzSpec: the named arguments of hocompile::newton_schulz."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch
import torch.fx as fx

from hocompile.capture.group_hypers import STRUCTURAL_KEYS
from hocompile.capture.trace import capture
from hocompile.ir.graph import print_graph
from hocompile.ir.registry import family_of
from hocompile.ops import newton_schulz as ops
from hocompile.ops.newton_schulz_spec import (
    NEWTON_SCHULZ,
    NewtonSchulzSpec,
    check_schema,
    newton_schulz_op,
    schema_mismatches,
)
from hocompile.passes import (
    BatchByShape,
    Canonicalize,
    ChooseAlgorithm,
    ChoosePrecision,
    FuseNewtonSchulz,
    run_pipeline,
)
from tests.test_expect_graphs import AVX2_LIKE, BATCHING


def _muon_graph() -> fx.GraphModule:
    # Tall, wide, square and two of one shape: transposed, batched and unbatched ops.
    params = [torch.zeros(8, 4), torch.zeros(4, 8), torch.zeros(4, 4), torch.zeros(6, 4)]
    opt = torch.optim.Muon(params, lr=0.02, weight_decay=0.1, ns_steps=3)
    gen = torch.Generator().manual_seed(0)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    opt.step()
    gm = capture(opt, STRUCTURAL_KEYS).gm
    passes = (Canonicalize(), FuseNewtonSchulz(), BatchByShape(target=BATCHING), ChooseAlgorithm(target=AVX2_LIKE))
    gm, _ = run_pipeline(gm, passes)
    return gm


def _ns_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    nodes = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is newton_schulz_op()]
    assert nodes, "the Muon graph should contain Newton–Schulz ops"
    return nodes


def _spec(**changes: object) -> NewtonSchulzSpec:
    base = NewtonSchulzSpec(
        x=torch.zeros(4, 8), a=(3.0, 2.0), b=(-4.0, -1.0), c=(2.0, 0.0), eps=1e-7, eps_mode="clamp",
        transpose=False, compute_dtype=torch.bfloat16, out_dtype=torch.float32, algorithm="standard",
        restarts=(), matmul="native",
    )
    return base.replace(**changes)


def test_round_trip_on_captured_muon_graph() -> None:
    gm = _muon_graph()
    before = print_graph(gm)
    nodes = _ns_nodes(gm)
    assert {NewtonSchulzSpec.from_node(n).x_node.meta["val"].dim() for n in nodes} == {2, 3}
    for node in nodes:
        spec = NewtonSchulzSpec.from_node(node)
        assert spec.to_args() == tuple(node.args)
        assert NewtonSchulzSpec.from_args(spec.to_args()) == spec
        assert spec.coefficients == list(zip(node.args[1], node.args[2], node.args[3]))  # type: ignore[call-overload]
        spec.apply(node)
    gm.recompile()
    assert print_graph(gm) == before


def test_round_trip_with_a_schedule() -> None:
    gm = _muon_graph()
    gm, _ = run_pipeline(gm, (ChoosePrecision(target=AVX2_LIKE, schedule=("fp16", "bf16", "bf16")),))
    scheduled = [NewtonSchulzSpec.from_node(n) for n in _ns_nodes(gm)]
    assert all(s.schedule == "fp16*1+bf16*2" for s in scheduled)
    for node, spec in zip(_ns_nodes(gm), scheduled):
        assert len(node.args) == 14 and spec.to_args() == tuple(node.args)


def test_trailing_defaults_positional_named_or_absent() -> None:
    spec = _spec()
    args = spec.to_args()
    assert len(args) == 12  # defaults left out, as the passes always wrote them
    assert NewtonSchulzSpec.from_args(args + (0, "")) == spec
    assert NewtonSchulzSpec.from_args(args, {"blocks": 0}) == spec
    assert NewtonSchulzSpec.from_args(args + (4,)).blocks == 4
    assert NewtonSchulzSpec.from_args(args, {"schedule": "bf16*2"}).to_args()[12:] == (0, "bf16*2")
    assert _spec(blocks=3).to_args()[12:] == (3,)
    assert args[1] == [3.0, 2.0] and isinstance(args[10], list)  # lists, as in the graphs


def test_replace_and_apply_rewrite_the_node() -> None:
    gm = _muon_graph()
    node = _ns_nodes(gm)[0]
    NewtonSchulzSpec.from_node(node).replace(algorithm="gram", restarts=[2]).apply(node)
    spec = NewtonSchulzSpec.from_node(node)
    assert (spec.algorithm, spec.restarts) == ("gram", (2,))
    assert node.args[9] == "gram" and list(node.args[10]) == [2]  # type: ignore[arg-type]


def test_schema_matches_the_dataclass() -> None:
    assert schema_mismatches(NewtonSchulzSpec) == []
    check_schema()
    arguments = newton_schulz_op()._schema.arguments
    fields = dataclasses.fields(NewtonSchulzSpec)
    assert [a.name for a in arguments] == [f.name for f in fields]
    for arg, f in zip(arguments, fields):
        assert arg.has_default_value() == (f.default is not dataclasses.MISSING)
        if arg.has_default_value():
            assert arg.default_value == f.default


def test_schema_drift_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(NewtonSchulzSpec, "op", classmethod(lambda cls: torch.ops.aten.addmm.default))
    assert schema_mismatches(NewtonSchulzSpec)
    with pytest.raises(RuntimeError, match="schema and NewtonSchulzSpec differ"):
        check_schema()


def test_unknown_or_missing_fields_raise_clearly() -> None:
    args = _spec().to_args()
    with pytest.raises(ValueError, match=r"unknown newton_schulz argument\(s\) \['steps'\]"):
        NewtonSchulzSpec.from_args(args, {"steps": 5})
    with pytest.raises(ValueError, match=r"missing required argument\(s\) \['matmul'\]"):
        NewtonSchulzSpec.from_args(args[:11])
    with pytest.raises(ValueError, match="at most 14 arguments"):
        NewtonSchulzSpec.from_args(args + (0, "", "extra"))
    with pytest.raises(ValueError, match="both by position and by name"):
        NewtonSchulzSpec.from_args(args, {"matmul": "emulate"})
    with pytest.raises(TypeError, match=r"no field\(s\) \['steps'\]"):
        _spec().replace(steps=5)
    gm = _muon_graph()
    other = next(n for n in gm.graph.nodes if n.op == "call_function" and n.target is not newton_schulz_op())
    with pytest.raises(ValueError, match="is not a hocompile::newton_schulz call"):
        NewtonSchulzSpec.from_node(other)
    with pytest.raises(TypeError, match="not a graph node"):
        _ = _spec().x_node


def test_fake_takes_the_spec_fields() -> None:
    # The fake restates the schema by hand; a drift would only show when tracing.
    assert tuple(inspect.signature(ops._newton_schulz_fake).parameters) == NewtonSchulzSpec.field_names()
    out = newton_schulz_op()(*_spec(x=torch.empty(4, 8, device="meta")).to_args())
    assert out.shape == (4, 8) and out.dtype == torch.float32 and out.device.type == "meta"


def test_the_family_entry_uses_the_spec() -> None:
    assert family_of(newton_schulz_op()) is NEWTON_SCHULZ and NEWTON_SCHULZ.spec is NewtonSchulzSpec
    assert NEWTON_SCHULZ.name == "newton_schulz"
