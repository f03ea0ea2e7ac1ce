"""Capture: one functional graph per step, whatever the optimizer's Python does."""

from __future__ import annotations

import torch

from hocompile.capture.group_hypers import STRUCTURAL_KEYS
from hocompile.capture.hyper_params import HyperParam
from hocompile.capture.trace import capture
from hocompile.ir.graph import InputSlot, verify

from .helpers import UserMuon, emerging_muon, make_params


def _count(gm, name: str) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target.__name__.split(".")[0] == name)


def test_emerging_optimizers_muon_is_one_graph() -> None:
    """Dynamo splits this optimizer into 14 graphs; dispatch-level capture gives one."""
    params = make_params([(8, 4), (4, 4), (6, 4)])
    opt = emerging_muon(params, lr=0.02)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    captured = capture(opt, STRUCTURAL_KEYS)
    verify(captured.gm)
    # quintic default: 5 iterations x 3 matmuls (X X^T, A A, B X) per matrix, all in one graph
    matmuls = sum(_count(captured.gm, n) for n in ("mm", "addmm", "bmm", "baddbmm"))
    assert matmuls == 3 * 5 * 3
    assert {s.kind for s in captured.inputs} == {"param", "grad", "state"}


def test_first_step_graph_creates_state_as_outputs() -> None:
    params = make_params([(4, 4)])
    opt = torch.optim.AdamW(params)
    params[0].grad = torch.randn(4, 4)
    captured = capture(opt, STRUCTURAL_KEYS)
    assigned = {a.slot.key for a in captured.outputs if a.mode == "assign"}
    assert assigned == {"exp_avg", "exp_avg_sq", "step"}
    assert opt.state == {}  # capture created nothing real


def test_user_muon_mutating_grad_writes_grad_back() -> None:
    params = make_params([(6, 4)])
    opt = UserMuon(params)
    params[0].grad = torch.randn(6, 4)
    captured = capture(opt, STRUCTURAL_KEYS)
    copies = {a.slot for a in captured.outputs if a.mode == "copy"}
    assert InputSlot.grad(0, 0) in copies  # grad.lerp_ in Keller Jordan's code


def test_capture_restores_the_optimizer() -> None:
    params = make_params([(4, 4)])
    opt = torch.optim.Muon(params, lr=0.02)
    params[0].grad = torch.randn(4, 4)
    groups_before = [dict(g) for g in opt.param_groups]
    capture(opt, STRUCTURAL_KEYS)
    assert [dict(g) for g in opt.param_groups] == groups_before
    assert not any(isinstance(v, HyperParam) for g in opt.param_groups for v in g.values())
    assert type(opt.param_groups[0]["lr"]) is float
    assert opt.param_groups[0]["params"][0] is params[0]
    assert len(opt.state) == 0


def test_matmul_precision_changes_inside_the_step_are_noted() -> None:
    params = make_params([(8, 4)])
    opt = emerging_muon(params, lr=0.02, fp32_matmul_prec="medium")
    params[0].grad = torch.randn(8, 4)
    captured = capture(opt, STRUCTURAL_KEYS)
    assert any("ran under float32 matmul precision 'medium'" in note for note in captured.notes)
    products = [n for n in captured.gm.graph.nodes if "mm" in str(n.target)]
    assert products and all(n.meta.get("hocompile.matmul_precision") == "medium" for n in products)
    assert torch.get_float32_matmul_precision() == "highest"  # restored by the optimizer itself
