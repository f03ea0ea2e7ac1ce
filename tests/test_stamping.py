"""Class stamping (hocompile/classes/): one trace per parameter class, bitwise the step traced whole.

Every test compares three optimizers fed identical grads: eager, compiled with
stamping (the default) and compiled with ``stamp=False`` (every param traced).
Stamped and whole must be bitwise equal; against eager, bitwise where the passes
keep eager's arithmetic (``EXACT``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch

import hocompile
from hocompile.runtime.fast_guard import FastGuard

from .helpers import EXACT, UserMuon

Factory = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]


def _params(shapes: list[tuple[int, ...]], seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*s, generator=g)) for s in shapes]


# Group 0: 6 + 6 of two shapes; group 1: 4 + 3 and a singleton (every class kind a step meets).
MIXED = [(16, 32), (8,)] * 6 + [(32, 16), (8,)] * 3 + [(32, 16), (24, 24)]


class Trio:
    """Eager, stamped and whole-trace optimizers over copies of the same params."""

    def __init__(self, make: Factory, shapes: list[tuple[int, ...]], **options: Any) -> None:
        self.eager = make(_params(shapes))
        self.stamped = hocompile.compile_optimizer(make(_params(shapes)), **options)
        self.whole = hocompile.compile_optimizer(make(_params(shapes)), stamp=False, **options)
        self.opts = (self.eager, self.stamped, self.whole)

    def params(self, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
        return [p for group in opt.param_groups for p in group["params"]]

    def step(self, seed: int, skip: frozenset[int] = frozenset()) -> None:
        g = torch.Generator().manual_seed(1000 + seed)
        for k, p in enumerate(self.params(self.eager)):
            grad = None if k in skip else torch.randn(p.shape, generator=g)
            for opt in self.opts:
                q = self.params(opt)[k]
                q.grad = None if grad is None else grad.clone()
        for opt in self.opts:
            opt.step()

    def assert_equal(self, eager_bitwise: bool = True) -> None:
        for k, (a, b, c) in enumerate(zip(*(self.params(o) for o in self.opts))):
            assert torch.equal(b, c), f"param {k}: stamped differs from the step traced whole"
            if eager_bitwise:
                assert torch.equal(a, b), f"param {k}: stamped differs from eager"
            sa, sb, sc = (o.state.get(p, {}) for o, p in zip(self.opts, (a, b, c)))
            assert sa.keys() == sb.keys() == sc.keys()
            for key in sa:
                if isinstance(sb[key], torch.Tensor):
                    assert torch.equal(sb[key], sc[key]), f"param {k} state {key!r}"
                    if eager_bitwise:
                        assert torch.equal(sa[key], sb[key]), f"param {k} state {key!r} vs eager"
                else:
                    assert sa[key] == sb[key] == sc[key]


def _mixed_groups(params: list[torch.nn.Parameter]) -> list[dict[str, Any]]:
    return [
        {"params": params[:12], "lr": 1e-2},
        {"params": params[12:], "lr": 3e-3, "weight_decay": 0.0},
    ]


@pytest.mark.parametrize(
    "name, make",
    [
        ("adamw-for-loop", lambda ps: torch.optim.AdamW(_mixed_groups(ps), foreach=False, weight_decay=0.1)),
        ("adamw-foreach", lambda ps: torch.optim.AdamW(_mixed_groups(ps), foreach=True, weight_decay=0.1)),
        ("adam-amsgrad", lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True)),
        ("sgd-nesterov", lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True)),
        ("user-muon", lambda ps: UserMuon([p for p in ps if p.ndim == 2], lr=0.02, weight_decay=0.1)),
    ],
)
def test_stamped_is_bitwise_the_whole_trace_and_eager(name: str, make: Factory) -> None:
    trio = Trio(make, MIXED, **EXACT)
    sched = [torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.5) for o in trio.opts]
    for step in range(10):
        trio.step(step, skip=frozenset({3}) if step == 4 else frozenset())  # a grad missing once
        for s in sched:
            s.step()
    trio.assert_equal()
    stamped = [e for e in trio.stamped.history if e.stamped is not None]
    assert len(stamped) == len(trio.stamped.history), [e.stamp_note for e in trio.stamped.history]
    for counter in ("compiles", "recompiles", "variants", "cache_hits", "eager_fallbacks"):
        assert trio.stamped.counters[counter] == trio.whole.counters[counter], counter
    # state_dict round trip: the eager format, and the compiled step carries on from it
    for opt in trio.opts[1:]:  # a copy: load_state_dict keeps the very tensors where dtype and device match
        opt.load_state_dict(copy.deepcopy(trio.eager.state_dict()))
    trio.step(10)
    trio.assert_equal()


def test_muon_with_its_passes_is_bitwise_the_whole_trace() -> None:
    # Newton–Schulz fused and planned for this CPU: the same plan for both traces, so the same bits.
    trio = Trio(lambda ps: torch.optim.Muon(ps, lr=0.02, weight_decay=0.1), [(16, 32), (32, 16)] * 4)
    for step in range(3):
        trio.step(step)
    trio.assert_equal(eager_bitwise=False)
    entry = trio.stamped.history[-1]
    assert entry.stamped is not None and entry.final_stats["newton-schulz"] == 2  # one per class


class GlobalClipSGD(torch.optim.Optimizer):
    """SGD after a global grad-norm clip: every param's update reads every grad."""

    def __init__(self, params: Any, lr: float = 0.1, max_norm: float = 1.0) -> None:
        super().__init__(params, {"lr": lr, "max_norm": max_norm})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            grads = [p.grad for p in group["params"] if p.grad is not None]
            total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
            scale = torch.clamp(group["max_norm"] / (total + 1e-6), max=1.0)
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad * scale, alpha=-group["lr"])


class CountScaledSGD(torch.optim.Optimizer):
    """An update scaled by the number of params: the same program for every param, but not for any count."""

    def __init__(self, params: Any, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            live = [p for p in group["params"] if p.grad is not None]
            for p in live:
                p.add_(p.grad, alpha=-group["lr"] / len(live))


@pytest.mark.parametrize(
    "make, why",
    [(lambda ps: GlobalClipSGD(ps), "mixes params"), (lambda ps: CountScaledSGD(ps), "how many params")],
    ids=["global-norm-clip", "count-dependent"],
)
def test_a_step_that_is_not_one_program_per_param_is_traced_whole(make: Factory, why: str) -> None:
    trio = Trio(make, [(8, 8)] * 6)
    for step in range(3):
        trio.step(step)
    trio.assert_equal()
    entry = trio.stamped.history[-1]
    assert entry.stamped is None and why in entry.stamp_note
    assert why in hocompile.explain(trio.stamped)


def test_overlapping_params_are_traced_whole() -> None:
    base = torch.nn.Parameter(torch.randn(5, 8))
    views = [torch.nn.Parameter(base.detach()[i : i + 2]) for i in range(4)]  # each shares a row with the next
    opt = hocompile.compile_optimizer(torch.optim.SGD(views, lr=0.1, momentum=0.9))
    for p in views:
        p.grad = torch.ones_like(p)
    opt.step()
    assert opt.history[-1].stamped is None and "share memory" in opt.history[-1].stamp_note


def _expert_views(experts: int = 8) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A MoE's [E, m, n] experts as torch.optim.Muon users hand them over: per-expert views of
    the weight (Muon refuses 3-D params), each with the matching view of the grad."""
    w = torch.nn.Parameter(torch.randn(experts, 48, 128, generator=torch.Generator().manual_seed(0)) * 0.02)
    w.grad = torch.zeros_like(w)
    views = [w.detach()[e] for e in range(experts)]
    for e, v in enumerate(views):
        v.grad = w.grad[e]
    return w, views


def _expert_steps(
    stamp: bool | None, compiled: bool = True, disable: tuple[str, ...] = ()
) -> tuple[torch.Tensor, torch.optim.Optimizer]:
    w, views = _expert_views()
    opt = torch.optim.Muon(views, lr=0.02, weight_decay=0.01)
    if compiled:
        opt = hocompile.compile_optimizer(opt, stamp=stamp, disable_passes=disable)
    for k in range(3):
        w.grad.copy_(torch.randn(w.shape, generator=torch.Generator().manual_seed(k)))
        opt.step()
    return w.detach().clone(), opt


def test_disjoint_views_of_one_base_are_stamped_bitwise_the_whole_trace() -> None:
    """Per-expert views do not alias: one class of 8 members (explain() lists it), every step
    bitwise the step traced whole, and (NS passes off: eager's arithmetic on every kind of CPU; on
    one without bf16 units the default plan computes fp32) eager's."""
    stamped, opt = _expert_steps(None)
    whole, _ = _expert_steps(False)
    assert torch.equal(stamped, whole)
    eager, _ = _expert_steps(None, compiled=False)
    assert torch.equal(_expert_steps(None, disable=("fuse-newton-schulz",))[0], eager)
    assert opt.history[-1].stamped is not None, opt.history[-1].stamp_note
    (program,) = [p for p in hocompile.explain(opt).programs if p.number == len(opt.history)]
    (described,) = program.classes
    assert program.stamped and described.startswith("group 0, 8 params fp32[48, 128]"), program


class EveryOtherStep(torch.optim.Optimizer):
    """Momentum that a Python counter per param switches on every other step (a branch per member)."""

    def __init__(self, params: Any, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                state["n"] = state.get("n", 0) + 1
                if state["n"] % 2 == 0:
                    p.add_(p.grad, alpha=-group["lr"])
                else:
                    p.add_(p.grad, alpha=-2 * group["lr"])


def test_members_at_different_counts_take_their_own_branch() -> None:
    trio = Trio(lambda ps: EveryOtherStep(ps), [(8, 8)] * 5)
    trio.step(0)
    trio.step(1, skip=frozenset({2}))  # member 2 falls one count behind the others
    for step in range(2, 6):
        trio.step(step)
    trio.assert_equal()


def test_explain_lists_the_classes_and_the_list_mode() -> None:
    trio = Trio(lambda ps: torch.optim.AdamW(ps, foreach=False), [(16, 32), (8,)] * 5)
    trio.step(0)
    trio.step(1)
    text = hocompile.explain(trio.stamped)
    assert "2 parameter class(es), 10 params" in text
    assert "c0: group 0, 5 params fp32[16, 32]" in text
    assert "over lists of members" in text
    assert all(p.list_mode for p in trio.stamped.history[-1].stamped.programs)


def test_fast_guard_sees_what_the_signature_sees() -> None:
    ps = _params([(4, 4)] * 3)
    for p in ps:
        p.grad = torch.ones_like(p)
    opt = torch.optim.Adam(ps)
    compiled = hocompile.compile_optimizer(opt)
    compiled.step()
    compiled.step()
    guard = compiled._fast
    assert isinstance(guard, FastGuard) and guard.holds(opt)
    ps[1].grad = torch.ones(4, 4).t()  # other strides: the guard is stricter than the signature
    assert not guard.holds(opt)
    ps[1].grad = torch.ones(4, 4)
    assert guard.holds(opt)
    opt.state[ps[2]]["exp_avg"] = torch.zeros(2, 2)  # a state tensor replaced by another shape
    assert not guard.holds(opt)
    opt.state[ps[2]]["exp_avg"] = torch.zeros(4, 4)
    assert guard.holds(opt)
    opt.state[ps[0]] = {}  # a param's state reset
    assert not guard.holds(opt)
