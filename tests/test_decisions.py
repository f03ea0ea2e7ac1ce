"""Structured decisions (hocompile/ir/decisions.py): passes record dataclasses, reports render them,
the cache key hashes their choices only. Plans are made for table targets, so no GPU is needed."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch
import torch.fx as fx

import hocompile
from hocompile.capture.group_hypers import STRUCTURAL_KEYS
from hocompile.capture.trace import capture
from hocompile.ir import decisions as decisions_module
from hocompile.ir.decisions import (
    DECISION,
    EAGER_DTYPE,
    Alternative,
    Decision,
    decided,
    decision_of,
    decisions_of,
    eager_dtype,
    record,
)
from hocompile.ir.graph import decisions, print_graph
from hocompile.lowering.aten import cache_key
from hocompile.lowering.reinplace import REINPLACED
from hocompile.passes import default_pipeline, run_pipeline
from hocompile.targets import Target, resolve_target

from .toy_family import ToyRowNormSGD

WIDE, SQUARE, SMALL = (64, 256), (96, 96), (16, 64)
AVX2_LIKE = Target("cpu", {"fp32": 100.0, "bf16": 1.0, "fp16": 1.0}, symmetric_speedup=1.25)


def _muon(shapes: list[tuple[int, int]]) -> torch.optim.Optimizer:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape)) for shape in shapes]
    opt = torch.optim.Muon(params, lr=0.02, weight_decay=0.1)
    for p in params:
        p.grad = torch.randn_like(p)
        opt.state[p]["momentum_buffer"] = torch.randn_like(p)
    return opt


def _planned(opt: torch.optim.Optimizer, target: Target, **options: object) -> tuple[fx.GraphModule, str]:
    """The graph after the default pipeline for ``target``, and the pipeline's identity."""
    with torch.no_grad():
        captured = capture(opt, STRUCTURAL_KEYS)
    pipeline = default_pipeline(target, **options)  # type: ignore[arg-type]
    gm, _ = run_pipeline(captured.gm, pipeline)
    return gm, ";".join(p.identity() for p in pipeline)


def _ns_nodes(gm: fx.GraphModule) -> dict[tuple[int, ...], fx.Node]:
    """Newton–Schulz calls by the shape of their input."""
    ns = torch.ops.hocompile.newton_schulz.default
    return {tuple(n.args[0].meta["val"].shape): n for n in gm.graph.nodes if n.target is ns}


# ----------------------------------------------------------------- the dataclass


def test_render_choices_key_and_one_decision_per_pass() -> None:
    decision = Decision(
        "choose-algorithm",
        {"algorithm": "gram", "compute": "fp32", "restarts": (2,)},
        "gram fp32 restart [2]",
        predicted_s=0.0201,
        alternatives=(Alternative("standard", 0.0362),),
        why="no fast bf16 GEMM here",
    )
    assert decision.render() == (
        "choose-algorithm: gram fp32 restart [2], 20.1 ms predicted (vs standard 36.2 ms), no fast bf16 GEMM here"
    )
    assert decision.choices_key() == "choose-algorithm(algorithm='gram',compute='fp32',restarts=(2,))"
    faster = dataclasses.replace(decision, predicted_s=1e-9, alternatives=(Alternative("standard", 2e-9),))
    assert faster.choices_key() == decision.choices_key()  # predictions never enter the key
    assert "1 ns predicted" in faster.render()
    with pytest.raises(TypeError):
        decision.chose["algorithm"] = "standard"  # type: ignore[index]  # shared between batched nodes

    node = fx.Graph().placeholder("x")
    later = Decision("choose-precision", {"schedule": "fp32*5"}, "fp32*5")
    record(node, decision)
    record(node, later)
    record(node, dataclasses.replace(decision, label="again"))  # a pass run twice replaces its own
    assert [d.pass_name for d in decisions_of(node)] == ["choose-precision", "choose-algorithm"]
    assert decision_of(node, "choose-algorithm").label == "again"  # type: ignore[union-attr]
    node.meta[DECISION] = "choose-algorithm: gram fp32"  # the old prose is refused, not rendered
    with pytest.raises(TypeError, match="not a tuple of Decision"):
        decisions_of(node)


def test_eager_dtype_is_a_declared_typed_key() -> None:
    node = fx.Graph().placeholder("x")
    assert eager_dtype(node, torch.float32) is torch.float32  # choose-algorithm did not run
    node.meta[EAGER_DTYPE] = "bf16"
    with pytest.raises(TypeError, match="not a torch.dtype"):
        eager_dtype(node, torch.float32)


def test_passes_read_only_declared_meta_keys() -> None:
    """Every ``meta["hocompile.…"]`` the package reads or writes is a declared constant."""
    declared = {decisions_module.DECISION, decisions_module.EAGER_DTYPE, "hocompile.origin", "hocompile.role"}
    declared.add(REINPLACED)
    root = Path(hocompile.__file__).parent
    pattern = re.compile(r"meta(?:\[|\.get\(|\.setdefault\(|\.pop\()\s*\"(hocompile\.[\w.]+)\"")
    used = {key for path in root.rglob("*.py") for key in pattern.findall(path.read_text())}
    assert used <= declared, sorted(used - declared)


# ----------------------------------------------------------------- the passes


def test_choose_algorithm_and_precision_record_fields() -> None:
    gm, _ = _planned(_muon([WIDE, SQUARE, SMALL]), AVX2_LIKE)
    nodes = _ns_nodes(gm)
    wide = decision_of(nodes[WIDE], "choose-algorithm")
    assert wide is not None
    assert dict(wide.chose) == {"algorithm": "gram", "compute": "fp32", "restarts": (), "matmul": "native", "blocks": 0}
    assert wide.why == "no fast bf16 GEMM here"  # Muon's eager NS runs in bf16
    (standard,) = wide.alternatives
    assert standard.name == "standard" and standard.predicted_s > wide.predicted_s  # type: ignore[operator]
    assert eager_dtype(nodes[WIDE], torch.float32) is torch.bfloat16
    square = decision_of(nodes[SQUARE], "choose-algorithm")
    assert square is not None and square.chose["algorithm"] == "standard"

    precision = decision_of(nodes[WIDE], "choose-precision")
    assert precision is not None and precision.applied
    assert precision.chose == {"schedule": "fp32*5"} and precision.predicted_error is not None
    (eager,) = precision.alternatives
    assert eager.name == "bf16*5" and eager.why_not == "eager's precision"
    small = decision_of(nodes[SMALL], "choose-precision")  # below the calibrated shapes
    assert small is not None and not small.applied and small.chose == {} and "calibrated shapes" in small.why


def test_schedule_recorded_but_not_applied_says_why() -> None:
    gm, _ = _planned(_muon([(768, 768)]), resolve_target("sm90", None), kernel_formats=frozenset({"bf16"}))
    (node,) = _ns_nodes(gm).values()
    precision = decision_of(node, "choose-precision")
    assert precision is not None and precision.chose["schedule"].startswith("fp8_e4m3")  # type: ignore[union-attr]
    assert not precision.applied and "no kernels for" in precision.not_applied
    assert "recorded, not applied" in precision.render()


def test_explicit_schedule_in_gram_switches_to_standard() -> None:
    gm, _ = _planned(_muon([WIDE]), AVX2_LIKE, schedule=("fp8_e4m3",) + ("fp16",) * 4)
    (node,) = _ns_nodes(gm).values()
    assert decision_of(node, "choose-algorithm").chose["algorithm"] == "gram"  # type: ignore[union-attr]
    precision = decision_of(node, "choose-precision")
    assert precision is not None
    assert dict(precision.chose) == {"schedule": "fp8_e4m3*1+fp16*4", "algorithm": "standard"}
    assert precision.predicted_s is None and precision.why.startswith("explicit schedule")


# ----------------------------------------------------------------- the reports


def test_print_graph_plan_and_explain_render_decisions(tmp_path: Path) -> None:
    opt = _muon([WIDE])
    gm, _ = _planned(opt, AVX2_LIKE)
    (node,) = _ns_nodes(gm).values()
    rendered = "; ".join(d.render() for d in decisions_of(node))
    assert rendered in print_graph(gm)
    (summary,) = decisions(gm)
    assert summary == f"hocompile.newton_schulz fp32[64, 256]: {rendered}"
    assert "predicted" not in print_graph(gm, predictions=False)
    assert summary in hocompile.plan(opt, target=AVX2_LIKE)

    compiled = hocompile.compile_optimizer(opt, target=AVX2_LIKE, cache_dir=tmp_path)
    compiled.step()
    report = hocompile.explain(compiled)
    assert f"    {summary}" in report
    assert "Newton–Schulz orthogonalisation (hocompile.newton_schulz) x1: " in report
    assert "predicted on cpu" in report


def test_a_family_defined_in_tests_shows_title_and_cost(tmp_path: Path) -> None:
    params = [torch.nn.Parameter(torch.randn(8, 16)) for _ in range(2)]
    opt = ToyRowNormSGD(params)
    for p in params:
        p.grad = torch.randn_like(p)
    # On a batching target: one [2, 8, 16] call, 4 FLOP and 2 fp32 accesses per element (tests/toy_family.py).
    batched = "toy row normalisation (hocompile.toy_row_normalize) x1: 1.02 kFLOP, 2.05 kB read and written"
    assert batched in hocompile.plan(opt, target="sm90")
    compiled = hocompile.compile_optimizer(opt, target=AVX2_LIKE, cache_dir=tmp_path)  # a loop of two calls
    compiled.step()
    report = hocompile.explain(compiled)
    assert "toy row normalisation (hocompile.toy_row_normalize) x2: 1.02 kFLOP, 2.05 kB read and written" in report
    assert "predicted" not in report.split("toy row normalisation")[1]  # no GEMM: no rate applies


# ----------------------------------------------------------------- the cache key


def test_cache_key_hashes_choices_not_predictions() -> None:
    opt = _muon([WIDE, SQUARE])
    gm, identity = _planned(opt, AVX2_LIKE)
    # Recalibrated: every rate 3x faster. Every prediction changes, the plan does not.
    faster = dataclasses.replace(AVX2_LIKE, gflops={k: 3 * v for k, v in AVX2_LIKE.gflops.items()})
    gm_fast, identity_fast = _planned(opt, faster)
    before = [d.predicted_s for _, ds in decided(gm.graph) for d in ds]
    after = [d.predicted_s for _, ds in decided(gm_fast.graph) for d in ds]
    assert before != after and print_graph(gm) != print_graph(gm_fast)
    assert cache_key(gm, identity) == cache_key(gm_fast, identity_fast)
    # A different choice (bf16 as fast as fp32 here: eager's bf16 kept) changes the key.
    bf16_fast = dataclasses.replace(AVX2_LIKE, gflops={"fp32": 100.0, "bf16": 400.0, "fp16": 1.0})
    gm_bf16, identity_bf16 = _planned(opt, bf16_fast)
    assert decision_of(next(iter(_ns_nodes(gm_bf16).values())), "choose-algorithm").chose["compute"] == "bf16"  # type: ignore[union-attr]
    assert cache_key(gm_bf16, identity_bf16) != cache_key(gm, identity)
