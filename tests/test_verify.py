"""verify=N: each new compiled step is checked against eager (hocompile/runtime/check/verify.py).

Plans are pinned to two CPU targets so the test does not depend on what this
machine measures: one without a bf16 GEMM (fp32 NS, Gram NS for aspect ≥ 2)
and one with a fast bf16 GEMM (eager's bf16, native).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, ClassVar

import pytest
import torch
import torch.fx as fx

import hocompile
from hocompile.ir.decisions import decided, decision_of
from hocompile.ops.newton_schulz_spec import NewtonSchulzSpec
from hocompile.passes import Pass, PassResult, default_pipeline
from hocompile.runtime import CompiledOptimizer
from hocompile.runtime.check import verify as verify_module
from hocompile.settings import Settings
from hocompile.targets import Target

from .helpers import Pair, UserMuon, emerging_muon, make_params


def _algorithms(gm: fx.GraphModule) -> set[tuple[object, object]]:
    """(algorithm, compute) choose-algorithm recorded for each op of the compiled graph."""
    chosen = (decision_of(node, "choose-algorithm") for node, _ in decided(gm.graph))
    return {(d.chose["algorithm"], d.chose["compute"]) for d in chosen if d is not None}

NS = torch.ops.hocompile.newton_schulz.default
AVX2_LIKE = Target("avx2-like", {"fp32": 100.0, "bf16": 1.0, "fp16": 1.0})
BF16_FAST = Target("amx-like", {"fp32": 100.0, "bf16": 400.0, "fp16": 1.0})
SHAPES = [(16, 8), (8, 24), (12, 12)]  # tall (Gram in fp32), wide aspect 3 (Gram in fp32), square


@dataclass(frozen=True)
class DropLastIteration(Pass):
    """A wrong plan: every Newton–Schulz op loses its last iteration."""

    name: ClassVar[str] = "drop-last-iteration"

    def __call__(self, gm: fx.GraphModule) -> PassResult:
        for node in gm.graph.nodes:
            if node.target is NS:
                spec = NewtonSchulzSpec.from_node(node)
                spec.replace(a=spec.a[:-1], b=spec.b[:-1], c=spec.c[:-1]).apply(node)
        gm.recompile()
        return PassResult(gm, True, "dropped one iteration")


@dataclass(frozen=True)
class PerturbFirstMul(Pass):
    """A wrong elementwise op: the first multiplication's result is scaled by 1 + 2^-20."""

    name: ClassVar[str] = "perturb-first-mul"

    def __call__(self, gm: fx.GraphModule) -> PassResult:
        node = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.mul.Tensor)
        with gm.graph.inserting_after(node):
            scaled = gm.graph.call_function(torch.ops.aten.mul.Tensor, (node, 1.0 + 2.0**-20))
        node.replace_all_uses_with(scaled, delete_user_cb=lambda user: user is not scaled)
        scaled.meta["val"] = node.meta.get("val")
        gm.recompile()
        return PassResult(gm, True, "perturbed one multiplication")


def _wrong(target: Target, wrong: Pass) -> tuple[Pass, ...]:
    """The default pipeline with ``wrong`` right after the Newton–Schulz fusion."""
    passes = default_pipeline(target)
    return passes[:2] + (wrong,) + passes[2:]


def _grads(params: list[torch.Tensor], gen: torch.Generator, rank: int = 0) -> list[torch.Tensor]:
    if not rank:
        return [torch.randn(p.shape, generator=gen) for p in params]
    return [torch.randn(p.shape[0], rank, generator=gen) @ torch.randn(rank, p.shape[1], generator=gen) for p in params]


def _twins(shapes: list[tuple[int, ...]]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    return make_params(shapes), make_params(shapes)


# ------------------------------------------------------------ correct plans pass silently


@pytest.mark.parametrize(
    "name, factory",
    [
        ("adamw", lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)),
        ("sgd-nesterov", lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True)),
    ],
)
def test_pointwise_optimizers_verify_bitwise(name: str, factory: Any, cache_dir: Any, caplog: Any) -> None:
    pair = Pair(factory, SHAPES + [(8,)], cache_dir, verify=True)
    with caplog.at_level(logging.INFO, logger="hocompile"):
        for _ in range(5):
            pair.step()
    assert pair.max_rel_diff() == 0.0
    pair.assert_state_equal()
    records = [entry.verification for entry in pair.compiled.history]
    assert [r.steps for r in records] == [1, 3]  # the first step creates state: a second compiled step
    # Every param, grad and state tensor (AdamW: exp_avg, exp_avg_sq, step) compared bitwise.
    tensors = 4 * (2 + len(pair.eager.state[pair.eager_params[0]]))
    assert all(r.exact == tensors and r.budgeted == 0 and r.worst_pointwise == 0.0 and not r.failed for r in records)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert f"compiled step #2, verified step 3/3 against eager: {tensors} tensor(s) bitwise equal" in caplog.text
    assert f"verified 3 step(s) against eager: {tensors} tensor(s) bitwise equal" in hocompile.explain(pair.compiled)


NS_CASES = [
    ("torch", lambda ps: torch.optim.Muon(ps, lr=0.02, weight_decay=0.1), AVX2_LIKE),
    ("torch", lambda ps: torch.optim.Muon(ps, lr=0.02, weight_decay=0.1), BF16_FAST),
    ("user", lambda ps: UserMuon(ps, lr=0.02, weight_decay=0.01), AVX2_LIKE),
    ("emerging-medium", lambda ps: emerging_muon(ps, lr=0.02), BF16_FAST),
    ("emerging-fp32", lambda ps: emerging_muon(ps, lr=0.02, coefficient_type="polar_express",
                                               fp32_matmul_prec="highest"), AVX2_LIKE),
]


@pytest.mark.parametrize("name, factory, target", NS_CASES, ids=[f"{c[0]}-{c[2].name}" for c in NS_CASES])
def test_newton_schulz_plans_pass_the_budget(name: str, factory: Any, target: Target, cache_dir: Any) -> None:
    params = make_params(SHAPES)
    opt = hocompile.compile_optimizer(factory(params), cache_dir=cache_dir, target=target, verify=3)
    gen = torch.Generator().manual_seed(3)
    for _ in range(4):
        for p, g in zip(params, _grads(params, gen)):
            p.grad = g
        opt.step()
    steady = opt.history[-1]
    assert steady.captured is not None and steady.verification.steps == 3
    record = steady.verification
    assert record.budgeted == len(SHAPES) and record.worst <= record.worst_bound and record.worst_algebra < 1e-9
    # Gram NS is verified too; never planned against an fp32 eager (its rank-deficient error)
    planned_gram = ("gram", "fp32") in _algorithms(steady.captured.gm)
    assert planned_gram == (target is AVX2_LIKE and name != "emerging-fp32")
    assert "within the Newton–Schulz budget" in hocompile.explain(opt)


def test_fp32_eager_on_rank_deficient_grads_stays_in_budget(cache_dir: Any) -> None:
    """Found by verify=: fp32 Gram NS was 12-40x an fp32 eager's error on rank-2 grads; now planned standard."""
    params = make_params(SHAPES)
    factory = NS_CASES[-1][1]  # emerging Muon, fp32 with highest matmul precision
    opt = hocompile.compile_optimizer(factory(params), cache_dir=cache_dir, target=AVX2_LIKE, verify=3)
    gen = torch.Generator().manual_seed(5)
    for _ in range(4):
        for p, g in zip(params, _grads(params, gen, rank=2)):
            p.grad = g
        opt.step()  # raises VerificationError if outside the budget
    steady = opt.history[-1]
    assert steady.verification.steps == 3 and steady.captured is not None
    assert ("gram", "fp32") not in _algorithms(steady.captured.gm)


# ------------------------------------------------------------ wrong plans are caught


@pytest.mark.parametrize("rank", [0, 2], ids=["full-rank", "rank-2"])
def test_dropped_iteration_raises_naming_the_parameter(rank: int, cache_dir: Any) -> None:
    """Caught by the algebra check, so also on rank-deficient grads where eager's own bf16 error is large."""
    params, eager_params = _twins(SHAPES)
    settings = Settings.resolve(cache_dir=cache_dir, verify=True)
    opt = CompiledOptimizer(torch.optim.Muon(params, lr=0.02), settings, _wrong(AVX2_LIKE, DropLastIteration()))
    eager = torch.optim.Muon(eager_params, lr=0.02)
    for p, q, g in zip(params, eager_params, _grads(params, torch.Generator().manual_seed(0), rank)):
        p.grad, q.grad = g, g.clone()
    eager.step()
    with pytest.raises(hocompile.VerificationError) as info:
        opt.step()
    message = str(info.value)
    assert "param_groups[0]['params'][1] (shape 8×24): param: the compiled plan computes another function" in message
    assert "bound 1e-06·‖update‖" in message and "fallback='eager'" in message
    # No half-updated state: the optimizer holds eager's result for the step.
    for p, q in zip(params, eager_params):
        assert torch.equal(p, q)
        assert torch.equal(opt.state[p]["momentum_buffer"], eager.state[q]["momentum_buffer"])


def test_perturbed_elementwise_op_breaks_bitwise_equality(cache_dir: Any) -> None:
    params = make_params(SHAPES)
    settings = Settings.resolve(cache_dir=cache_dir, verify=True)
    opt = CompiledOptimizer(torch.optim.AdamW(params, lr=1e-2), settings, _wrong(AVX2_LIKE, PerturbFirstMul()))
    for p in params:
        p.grad = torch.randn_like(p)
    with pytest.raises(hocompile.VerificationError, match=r"bound: bitwise equal") as info:
        opt.step()
    assert "param_groups[0]['params'][0] (shape 16×8)" in str(info.value)


def test_fallback_eager_warns_and_runs_eagerly_from_then_on(cache_dir: Any, caplog: Any) -> None:
    params, eager_params = _twins(SHAPES)
    settings = Settings.resolve(cache_dir=cache_dir, verify=True, fallback="eager")
    opt = CompiledOptimizer(torch.optim.Muon(params, lr=0.02), settings, _wrong(BF16_FAST, DropLastIteration()))
    eager = torch.optim.Muon(eager_params, lr=0.02)
    gen = torch.Generator().manual_seed(1)
    with caplog.at_level(logging.WARNING, logger="hocompile"):
        for _ in range(4):
            for p, q, g in zip(params, eager_params, _grads(params, gen)):
                p.grad, q.grad = g, g.clone()
            eager.step()
            opt.step()
            assert all(torch.equal(p, q) for p, q in zip(params, eager_params))
    # Steps 1 and 2 (two compiled steps: state creation, steady state) failed and fell back; 3 and 4 ran eagerly.
    assert opt.counters.eager_fallbacks == 4 and opt.counters.compiles == 2
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and all("param_groups[0]['params'][1] (shape 8×24)" in w for w in warnings)
    report = hocompile.explain(opt)
    assert all(p.eager.startswith("verification against eager failed") for p in report.programs), report


# ------------------------------------------------------------ settings, cost, side effects


def test_verify_setting_and_environment(monkeypatch: Any, cache_dir: Any) -> None:
    assert Settings.resolve().verify == 0
    monkeypatch.setenv("HOCOMPILE_VERIFY", "1")
    assert Settings.resolve().verify == 3  # on: the default number of steps
    assert Settings.resolve(verify=False).verify == 0  # an explicit argument wins
    assert Settings.resolve(verify=5).verify == 5
    monkeypatch.setenv("HOCOMPILE_VERIFY", "7")
    assert Settings.resolve().verify == 7
    monkeypatch.setenv("HOCOMPILE_VERIFY", "off")
    assert Settings.resolve().verify == 0
    monkeypatch.setenv("HOCOMPILE_VERIFY", "sometimes")
    with pytest.raises(ValueError, match="HOCOMPILE_VERIFY must be"):
        Settings.resolve()
    with pytest.raises(ValueError, match="verify must be"):
        Settings.resolve(verify=-1)
    # The environment alone switches a wrong plan's check on.
    monkeypatch.setenv("HOCOMPILE_VERIFY", "1")
    params = make_params([(8, 24)])
    opt = CompiledOptimizer(torch.optim.Muon(params), Settings.resolve(cache_dir=cache_dir),
                            _wrong(AVX2_LIKE, DropLastIteration()))
    params[0].grad = torch.randn(8, 24)
    with pytest.raises(hocompile.VerificationError):
        opt.step()


def test_recompile_limit_setting() -> None:
    assert Settings.resolve().recompile_limit == 8
    assert Settings.resolve(recompile_limit=2).recompile_limit == 2
    for bad in (0, -3, True, 2.5):
        with pytest.raises(ValueError, match="recompile_limit must be a positive int"):
            hocompile.compile_optimizer(torch.optim.SGD(make_params([(2, 2)]), lr=0.1), recompile_limit=bad)


def test_verification_stops_after_n_steps(monkeypatch: Any, cache_dir: Any) -> None:
    calls: list[int] = []
    eager_step = verify_module.eager_step

    def counting(*args: Any) -> Any:
        calls.append(1)
        return eager_step(*args)

    monkeypatch.setattr(verify_module, "eager_step", counting)
    pair = Pair(lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9), [(6, 4)], cache_dir, verify=2)
    for _ in range(8):
        pair.step()
    # Compiled step #1 (creates the momentum) ran once, #2 ran 7 times: verified 1 + 2 steps, then no eager run.
    assert len(calls) == 3
    assert [entry.verification.steps for entry in pair.compiled.history] == [1, 2]
    assert pair.max_rel_diff() == 0.0


class TickingSGD(torch.optim.SGD):
    """SGD that also keeps Python-level counters: a group entry and an optimizer attribute."""

    def __init__(self, params: Any, **kw: Any) -> None:
        super().__init__(params, **kw)
        self.ticks = 0
        for group in self.param_groups:
            group["calls"] = 0

    def step(self, closure: Any = None) -> Any:
        self.ticks += 1
        for group in self.param_groups:
            group["calls"] += 1
        return super().step(closure)


def test_eager_check_runs_on_copies_and_leaves_python_state_alone(cache_dir: Any) -> None:
    params = make_params([(5, 3)])
    inner = TickingSGD(params, lr=0.1, momentum=0.9)
    opt = hocompile.compile_optimizer(inner, cache_dir=cache_dir, verify=True)
    eager_params = make_params([(5, 3)])
    eager = TickingSGD(eager_params, lr=0.1, momentum=0.9)
    for _ in range(4):
        for p, q in zip(params, eager_params):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        opt.step()
        eager.step()
    # The checks ran the eager step 1 + 3 times on copies; only the compiled step's updates remain.
    assert inner.ticks == eager.ticks == 4 and inner.param_groups[0]["calls"] == 4
    assert torch.equal(params[0], eager_params[0])
    assert sum(entry.verification.steps for entry in opt.history) == 4
