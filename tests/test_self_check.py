"""The self-check, on by default (hocompile/runtime/check/self_check.py): each compiled program checked
against eager on copies at its steps 1, 2, 4, …; a mismatch falls back to eager loudly, nothing applied.

Wrong programs are planted three ways: a pass that drops a Newton–Schulz iteration (a wrong plan), a
pass that scales one multiplication by 1 + 2^-20 (a wrong elementwise op), and a capture whose
stand-ins lose the params' Python attributes (Megatron's ``is_qkv``: the trace takes the other branch).
Each is caught on the program's first step, warned about by name, and from then on the optimizer is
bitwise its eager twin's: nothing of a wrong step was applied, to sampled or unsampled members.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

import hocompile
from hocompile import SelfCheckWarning
from hocompile.runtime import CompiledOptimizer
from hocompile.runtime.check import self_check
from hocompile.runtime.check.self_check import BUDGET, CHECK_EVERY, FREE_SECONDS, SelfCheck, check_now, due
from hocompile.settings import Settings

from .test_trust_snippets import LrOnly, ReadsAttributes
from .test_verify import AVX2_LIKE, DropLastIteration, PerturbFirstMul, _wrong

SHAPES = [(24, 40)] * 5 + [(40, 24)] * 3  # two classes of several members: a check samples two of each


def _params(shapes: list[tuple[int, ...]], seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*s, generator=gen)) for s in shapes]


def _run(eager: torch.optim.Optimizer, compiled: Any, steps: int, seed: int = 1) -> list[float]:
    """Step both with the same grads; max |Δ| of the params after each step."""
    gen = torch.Generator().manual_seed(seed)
    ep = [p for g in eager.param_groups for p in g["params"]]
    cp = [p for g in compiled.param_groups for p in g["params"]]
    out = []
    for _ in range(steps):
        for a, b in zip(ep, cp):
            g = torch.randn(a.shape, generator=gen)
            a.grad, b.grad = g.clone(), g.clone()
        eager.step()
        compiled.step()
        out.append(max(float((a - b).detach().abs().max()) for a, b in zip(ep, cp)))
    return out


def _state_bitwise(eager: torch.optim.Optimizer, compiled: Any) -> None:
    for ge, gc in zip(eager.param_groups, compiled.param_groups):
        for a, b in zip(ge["params"], gc["params"]):
            assert torch.equal(a, b)
            for key, value in eager.state[a].items():
                if isinstance(value, torch.Tensor):
                    assert torch.equal(value, compiled.state[b][key]), key


def test_schedule_doubles_then_backs_off_to_every_thousand() -> None:
    checked = [n for n in range(1, 3 * CHECK_EVERY + 1) if due(n)]
    assert checked == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1000, 2000, 3000]


def test_a_check_beyond_the_budget_waits_for_the_steps_to_pay_for_it() -> None:
    """Checks costing 2 s a step of 0.1 s: the first runs, the next waits until 1 % of step time + 1 s covers
    the checks so far and one more; it then runs at the first step that can pay, not at the next due step."""
    record, ran, credit = SelfCheck(), [], {}
    for run in range(1, 20001):
        record.runs = run
        credit[run] = BUDGET * record.step_seconds + FREE_SECONDS
        if check_now(record):
            ran.append(run)
            record.checks += 1
            record.each.append(2.0)
            record.seconds += 2.0
        record.step_seconds += 0.1
    assert ran[:1] == [1] and len(ran) > 5
    for k, run in enumerate(ran[1:], start=2):  # the k-th check runs at the first step whose credit covers k
        assert credit[run] >= 2.0 * k > credit[run - 1]
    assert record.postponed >= len(ran) - 1
    assert record.seconds <= BUDGET * record.step_seconds + FREE_SECONDS


def test_correct_programs_pass_silently_and_are_checked(cache_dir: Any, monkeypatch: Any) -> None:
    """torch.optim.Muon (stamped: two members per class) and AdamW: no warning, eager's numerics."""
    # The schedule, not the time budget, is under test here (the budget: the test above): under CI
    # load three checks of 0.2-0.4 s reached FREE_SECONDS and the fourth was postponed.
    monkeypatch.setattr(self_check, "FREE_SECONDS", 1e9)
    for factory in (lambda ps: torch.optim.Muon(ps, lr=0.02), lambda ps: torch.optim.AdamW(ps, lr=1e-2)):
        eager = factory(_params(SHAPES))
        compiled = hocompile.compile_optimizer(factory(_params(SHAPES)), cache_dir=cache_dir)
        with warnings.catch_warnings():
            warnings.simplefilter("error", SelfCheckWarning)
            _run(eager, compiled, 9)
        steady = compiled.history[-1]
        assert steady.stamped is not None and not steady.fallback
        # its runs 1, 2, 4 and 8 (the first step was the first-step program's)
        assert steady.self_check.checks == 4
        # the first check ran the first and last member of each class, the later ones one of each
        assert (steady.self_check.members, steady.self_check.of) == (2, 8)
        assert "self-check: 4 step(s) checked against eager (2 of 8 params on the last" in hocompile.explain(compiled)
        assert compiled.counters.eager_fallbacks == 0


def _planted(optimizer: torch.optim.Optimizer, wrong: Any, cache_dir: Any, **kw: Any) -> CompiledOptimizer:
    settings = Settings.resolve(cache_dir=cache_dir, target=AVX2_LIKE, **kw)
    return CompiledOptimizer(optimizer, settings, _wrong(AVX2_LIKE, wrong))


@pytest.mark.parametrize("stamp", [True, False])
def test_a_wrong_plan_falls_back_loudly_with_nothing_applied(stamp: bool, cache_dir: Any) -> None:
    eager = torch.optim.Muon(_params(SHAPES), lr=0.02)
    compiled = _planted(torch.optim.Muon(_params(SHAPES), lr=0.02), DropLastIteration(), cache_dir, stamp=stamp)
    with pytest.warns(SelfCheckWarning, match=r"params'\]\[\d\].* of its update from eager's") as caught:
        diffs = _run(eager, compiled, 6)
    assert diffs == [0.0] * 6  # every step, sampled members or not, is eager's own
    _state_bitwise(eager, compiled)
    assert "run eagerly" in str(caught[0].message) and "self_check=False" in str(caught[0].message)
    assert all(e.fallback.startswith("self-check against eager failed") for e in compiled.history)
    assert "self-check FAILED on step 1" in hocompile.explain(compiled)


def test_a_wrong_elementwise_op_is_caught_bitwise(cache_dir: Any) -> None:
    eager = torch.optim.AdamW(_params(SHAPES), lr=1e-2)
    compiled = _planted(torch.optim.AdamW(_params(SHAPES), lr=1e-2), PerturbFirstMul(), cache_dir)
    with pytest.warns(SelfCheckWarning, match="differs where the plan keeps eager's arithmetic"):
        diffs = _run(eager, compiled, 4)
    assert diffs == [0.0] * 4
    _state_bitwise(eager, compiled)


def _tagged(seed: int) -> list[torch.nn.Parameter]:
    params = _params([(24, 8)] * 6 + [(8, 8)] * 2, seed)
    for p in params[:6]:
        p.is_qkv = True  # type: ignore[attr-defined]
    return params


def test_a_lost_attribute_is_caught(cache_dir: Any, monkeypatch: Any) -> None:
    """Stand-ins that lose the params' Python attributes (the class of bug issue 30 found in Megatron)."""
    from hocompile.capture import stand_ins

    monkeypatch.setattr(stand_ins, "install", lambda stand_in, real, where, traced: {})
    eager = ReadsAttributes(_tagged(0))  # Megatron-like: a param tagged is_qkv is normalised per third
    compiled = hocompile.compile_optimizer(ReadsAttributes(_tagged(0)), cache_dir=cache_dir)
    with pytest.warns(SelfCheckWarning, match="differs where the plan keeps eager's arithmetic"):
        diffs = _run(eager, compiled, 4)
    assert diffs == [0.0] * 4


def test_turned_off_by_argument_and_environment(cache_dir: Any, monkeypatch: Any) -> None:
    """Off, the planted wrong plan runs as planned: the check was what caught it."""
    for kw, env in (({"self_check": False}, None), ({}, "0")):
        if env is not None:
            monkeypatch.setenv("HOCOMPILE_SELF_CHECK", env)
        eager = torch.optim.Muon(_params(SHAPES), lr=0.02)
        compiled = _planted(torch.optim.Muon(_params(SHAPES), lr=0.02), DropLastIteration(), cache_dir, **kw)
        with warnings.catch_warnings():
            warnings.simplefilter("error", SelfCheckWarning)
            diffs = _run(eager, compiled, 3)
        assert min(diffs) > 1e-4
        assert all(e.self_check.checks == 0 for e in compiled.history)


class NoisyCounting(LrOnly):
    """Python state and the random stream: a counter attribute, a tensor step in the group, noise."""

    def __init__(self, params: Any) -> None:
        super().__init__(params, lr=0.1)
        self.calls = 0
        for group in self.param_groups:
            group["step"] = torch.tensor(0.0)

    @torch.no_grad()
    def step(self) -> None:  # type: ignore[override]
        self.calls += 1
        for group in self.param_groups:
            group["step"] += 1
            for p in group["params"]:
                noise = torch.randn(p.shape) * 1e-3
                p.add_(p.grad + noise, alpha=-group["lr"] / group["step"].item())


def test_checks_leave_python_state_and_the_random_stream_alone(cache_dir: Any, monkeypatch: Any) -> None:
    """Each step starts from one random state for both: the check's own draws must not shift the real step's."""
    monkeypatch.setattr(self_check, "FREE_SECONDS", 1e9)  # every check due runs, however loaded the machine
    eager = NoisyCounting(_params(SHAPES))
    compiled = hocompile.compile_optimizer(NoisyCounting(_params(SHAPES)), cache_dir=cache_dir)
    gen = torch.Generator().manual_seed(1)
    ep, cp = eager.param_groups[0]["params"], compiled.param_groups[0]["params"]
    for step in range(5):
        for a, b in zip(ep, cp):
            g = torch.randn(a.shape, generator=gen)
            a.grad, b.grad = g.clone(), g.clone()
        torch.manual_seed(100 + step)
        eager.step()
        torch.manual_seed(100 + step)
        compiled.step()
        assert all(torch.equal(a, b) for a, b in zip(ep, cp))
    assert compiled.optimizer.calls == eager.calls == 5  # type: ignore[attr-defined]
    assert torch.equal(compiled.param_groups[0]["step"], eager.param_groups[0]["step"])
    assert sum(e.self_check.checks for e in compiled.history) >= 3


BIG = [(2304, 1824), (64,), (24, 40)]  # 4.2M elements: past check_slices.SLICE_FROM


def _views(monkeypatch: Any) -> list[dict[Any, slice]]:
    """The rows of every view a check builds, in order (a spy on check_view.View)."""
    from hocompile.runtime.check import view as check_view

    views: list[dict[Any, slice]] = []
    real_init = check_view.View.__init__

    def spy(self: Any, keep: Any, rows: Any = None) -> None:
        views.append(dict(rows or {}))
        real_init(self, keep, rows)

    monkeypatch.setattr(check_view.View, "__init__", spy)
    return views


def test_a_huge_elementwise_member_is_first_checked_on_its_leading_rows(cache_dir: Any, monkeypatch: Any) -> None:
    """AdamW's first-step and steady programs each check the 4.2M-element member on a slice first, then
    whole; every step bitwise eager's. The slice is what the first check compared (a spy on the view)."""
    views = _views(monkeypatch)
    eager = torch.optim.AdamW(_params(BIG), lr=1e-2, foreach=False)
    compiled = hocompile.compile_optimizer(torch.optim.AdamW(_params(BIG), lr=1e-2, foreach=False),
                                           cache_dir=cache_dir)
    monkeypatch.setattr(self_check, "FREE_SECONDS", 1e9)  # every check due runs (the budget: next test)
    assert _run(eager, compiled, 4) == [0.0] * 4
    _state_bitwise(eager, compiled)
    first, steady = compiled.history[0].self_check, compiled.history[-1].self_check
    assert first.checks == 1 and first.sliced == 1, first
    assert steady.checks == 2 and steady.sliced == 0, steady  # its second check: whole
    assert [len(v) for v in views] == [1, 1, 0], views
    (rows,) = views[0].values()
    assert rows.stop * 1824 <= 1 << 17
    assert "1 of them on leading rows" in first.describe()


def test_a_whole_check_after_a_sliced_one_waits_for_the_steps_to_pay_for_it(cache_dir: Any, monkeypatch: Any) -> None:
    """The steady program's first check ran on rows; its second, on the whole 4.2M-element member, is
    budgeted as a whole check (the sliced one's time times the elements it left out), not as another
    sliced one: it waits for credit. (At Qwen3's 155M-element embedding that check took 14 s, run at
    the program's second step.) After that first check, the free allowance is set to three times its
    time: a second sliced check would fit, a whole one's estimate does not (decided by the ratio, not
    by how fast this machine is)."""
    eager = torch.optim.AdamW(_params(BIG), lr=1e-2, foreach=False)
    compiled = hocompile.compile_optimizer(torch.optim.AdamW(_params(BIG), lr=1e-2, foreach=False),
                                           cache_dir=cache_dir)
    assert _run(eager, compiled, 2) == [0.0] * 2
    steady = compiled.history[-1].self_check
    assert steady.checks == 1 and steady.sliced == 1, steady
    assert steady.whole_over_checked > 30, steady
    monkeypatch.setattr(self_check, "FREE_SECONDS", 3 * steady.each[-1])
    assert _run(eager, compiled, 2, seed=2) == [0.0] * 2
    assert steady.checks == 1 and steady.pending and steady.postponed == 1, steady


def test_a_wrong_elementwise_op_seen_on_a_slice_is_settled_whole(cache_dir: Any, monkeypatch: Any) -> None:
    """The slice sees the planted error; the check on the whole member confirms it (a slice alone never
    fails a program), the warning names it and nothing of the wrong step is applied."""
    views = _views(monkeypatch)
    eager = torch.optim.AdamW(_params(BIG), lr=1e-2, foreach=False)
    compiled = _planted(torch.optim.AdamW(_params(BIG), lr=1e-2, foreach=False), PerturbFirstMul(), cache_dir)
    with pytest.warns(SelfCheckWarning, match=r"params'\]\[0\] differs where the plan keeps eager's arithmetic"):
        diffs = _run(eager, compiled, 2)
    assert diffs == [0.0] * 2
    _state_bitwise(eager, compiled)
    assert [len(v) for v in views[:2]] == [1, 0]  # on the slice, then whole
    assert compiled.history[0].self_check.sliced == 0 and compiled.history[0].self_check.failed


def test_a_program_that_is_not_elementwise_is_checked_whole(cache_dir: Any, monkeypatch: Any) -> None:
    """Muon's NS is not elementwise: a member over the slicing size is checked whole on the first check
    too. The size is lowered to this member's: a 2304x1824 Muon (eager's NS in bf16) took 340 s on a
    CPU without bf16 units, to show the same."""
    from hocompile.runtime.check import slices as check_slices
    from hocompile.runtime.check.slices import elementwise

    shape = (96, 64)
    monkeypatch.setattr(check_slices, "SLICE_FROM", 96 * 64)
    monkeypatch.setattr(check_slices, "SLICE_TO", 16 * 64)
    views = _views(monkeypatch)
    compiled = hocompile.compile_optimizer(torch.optim.Muon(_params([shape]), lr=0.02), cache_dir=cache_dir)
    _run(torch.optim.Muon(_params([shape]), lr=0.02), compiled, 2)
    assert all(e.self_check.checks >= 1 and e.self_check.sliced == 0 for e in compiled.history)
    assert all(not v for v in views), views  # no check ran on rows
    # the control: at this size an elementwise program's first check is on rows
    adamw = hocompile.compile_optimizer(torch.optim.AdamW(_params([shape]), lr=1e-2), cache_dir=cache_dir)
    _run(torch.optim.AdamW(_params([shape]), lr=1e-2), adamw, 1)
    assert adamw.history[0].self_check.sliced == 1
    assert all(not elementwise(e.captured.gm) for e in compiled.history if e.captured is not None)


def test_a_check_that_fails_before_its_probes_run_leaves_torch_compile_alone(cache_dir: Any, monkeypatch: Any) -> None:
    """The probes run eager under Dynamo's ``force_eager`` stance. ``torch.compiler.set_stance`` sets
    the stance when built, not when entered: a probe built but never run (an error while copying the
    params) once left every later ``torch.compile`` in the process silently eager (CI, a later test
    file's backend never called). The stance is set only while a probe runs."""
    from hocompile.runtime.check import view as check_view
    from hocompile.runtime.check.judgement_modes import Rounding

    run, failed = check_view.View.run, []

    def copies_fail_under_probes(self: Any, opt: Any, body: Any, modes: Any = None) -> Any:
        if modes and any(isinstance(m, Rounding) for m in modes):
            failed.append(1)
            raise RuntimeError("planted: copying the params failed")
        return run(self, opt, body, modes)

    monkeypatch.setattr(check_view.View, "run", copies_fail_under_probes)
    compiled = _planted(torch.optim.Muon(_params(SHAPES), lr=0.02), DropLastIteration(), cache_dir)
    with warnings.catch_warnings():  # the planted plan differs from eager: its probes run, and fail
        warnings.simplefilter("ignore")
        _run(torch.optim.Muon(_params(SHAPES), lr=0.02), compiled, 2)
    assert failed, "no probe ran, so this test tests nothing"
    assert torch._dynamo.eval_frame._stance.stance == "default"
    calls: list[int] = []

    def backend(gm: Any, inputs: Any) -> Any:
        calls.append(1)
        return gm.forward

    torch._dynamo.reset()
    assert float(torch.compile(lambda t: (t * 2).sum(), backend=backend)(torch.ones(3))) == 6.0
    assert calls == [1]


def test_checks_in_two_threads_leave_the_stance_as_they_found_it() -> None:
    """Ranks as threads check at once. Nested as A in, B in, A out, B out: with one set_stance per
    block, B restored the force_eager it found on entering, and the process stayed eager for good
    (test_dist_ddp.py's expert tests, once)."""
    import threading

    from hocompile.runtime.check.judgement_modes import force_eager

    def stance() -> str:
        return torch._dynamo.eval_frame._stance.stance  # type: ignore[attr-defined]

    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    seen: list[str] = []

    def a() -> None:
        with force_eager():
            a_in.set()
            b_in.wait(5)
        a_out.set()

    def b() -> None:
        a_in.wait(5)
        with force_eager():
            b_in.set()
            a_out.wait(5)
            seen.append(stance())  # A has left: B's block is still eager

    threads = [threading.Thread(target=a), threading.Thread(target=b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert seen == ["force_eager"]
    assert stance() == "default"
