"""Host-side values a step reads and updates: step counters, Python state, numpy numbers.

Each of these was silently wrong or crashed before (issue "no silent wrong
step"); every test compares against eager bit for bit, since capture keeps
eager's arithmetic (the NS passes are off: ``EXACT``).
"""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch

import hocompile

from .helpers import EXACT, Pair

SHAPES = [(4, 3), (5,), (2, 3, 2)]

FOREACH_FAMILY = {
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=True),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=True),
    "radam": lambda ps: torch.optim.RAdam(ps, lr=1e-2, foreach=True),
    "adamax": lambda ps: torch.optim.Adamax(ps, lr=1e-2, foreach=True),
    "nadam": lambda ps: torch.optim.NAdam(ps, lr=1e-2, foreach=True),  # also a float32 mu_product counter
    "nadam-loop": lambda ps: torch.optim.NAdam(ps, lr=1e-2, foreach=False),
}


@pytest.mark.parametrize("name", sorted(FOREACH_FAMILY))
@pytest.mark.parametrize("eager_first", [False, True], ids=["from-step-0", "after-an-eager-step"])
def test_foreach_step_counters_are_followed(name: str, eager_first: bool, cache_dir) -> None:
    """``torch._foreach_add_(state_steps, 1)`` advances the counter the bias correction reads."""
    pair = Pair(FOREACH_FAMILY[name], SHAPES, cache_dir, **EXACT)
    if eager_first:  # resume from a checkpoint-like state: the counters are not 0
        pair.step()
        pair.compiled.optimizer.load_state_dict(copy.deepcopy(pair.eager.state_dict()))
        for pe, pc in zip(pair.eager_params, pair.compiled_params):
            pc.copy_(pe)
    for _ in range(6):
        pair.step()
    assert pair.max_rel_diff() == 0.0
    pair.assert_state_equal()


def test_counter_updated_by_an_op_not_followed_is_refused(cache_dir) -> None:
    class SquaresItsCounter(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, dict(lr=0.1))

        @torch.no_grad()
        def step(self, closure=None):
            for group in self.param_groups:
                for p in group["params"]:
                    state = self.state[p]
                    if not state:
                        state["t"] = torch.tensor(2.0)
                    state["t"].pow_(2)
                    p.add_(p.grad, alpha=-group["lr"] / state["t"].item())

    pair = Pair(SquaresItsCounter, [(3, 2)], cache_dir)
    for p in pair.compiled_params:
        p.grad = torch.ones_like(p)
    before = [p.clone() for p in pair.compiled_params]
    with pytest.raises(hocompile.CaptureError, match="after updating it with `pow_`"):
        pair.compiled.step()
    torch.testing.assert_close(pair.compiled_params, before, rtol=0, atol=0)
    assert not pair.compiled.state


class GroupCounter(torch.optim.Optimizer):
    """``group["step"] += 1`` with a Python int, read by a bias correction."""

    def __init__(self, params):
        super().__init__(params, dict(lr=0.1, beta=0.9, step=0))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            group["step"] += 1
            correction = 1 - group["beta"] ** group["step"]
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"] / correction)


class StateCounter(torch.optim.Optimizer):
    """``state["step"] = state.get("step", 0) + 1`` and a flag set once."""

    def __init__(self, params):
        super().__init__(params, dict(lr=0.1, beta=0.9))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                state["step"] = state.get("step", 0) + 1
                if "m" not in state:
                    state["m"] = torch.zeros_like(p)
                    state["initialised"] = True
                state["m"].lerp_(p.grad, 1 - group["beta"])
                p.add_(state["m"], alpha=-group["lr"] / (1 - group["beta"] ** state["step"]))


class AttributeCounter(torch.optim.Optimizer):
    """Counters kept as optimizer attributes, an int and a float, and a branch every third step."""

    def __init__(self, params):
        super().__init__(params, dict(lr=0.1, every=3))
        self.t = 0
        self.scale = 1.0

    @torch.no_grad()
    def step(self, closure=None):
        self.t += 1
        self.scale = self.scale * 0.5
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if self.t % group["every"] == 0:
                    p.mul_(0.5)
                p.add_(p.grad, alpha=-group["lr"] * self.t * self.scale)


@pytest.mark.parametrize("factory", [GroupCounter, StateCounter, AttributeCounter], ids=lambda f: f.__name__)
def test_python_state_the_step_updates_is_replayed(factory, cache_dir) -> None:
    pair = Pair(factory, [(4, 3), (2, 5)], cache_dir)
    for _ in range(8):
        pair.step()
    assert pair.max_rel_diff() == 0.0
    eager, compiled = pair.eager.state_dict(), pair.compiled.state_dict()
    assert compiled["param_groups"] == eager["param_groups"]
    for key, values in eager["state"].items():
        for name, value in values.items():
            if not isinstance(value, torch.Tensor):
                assert compiled["state"][key][name] == value and type(compiled["state"][key][name]) is type(value)
    for attribute in ("t", "scale"):
        assert getattr(pair.compiled.optimizer, attribute, None) == getattr(pair.eager, attribute, None)
    # a branch on the counter is a guard: at most one program per outcome
    assert len(pair.compiled.counters.recompiles) <= 1
    assert "replayed on the host after each step" in hocompile.explain(pair.compiled)


def test_python_state_that_cannot_be_replayed_is_refused(cache_dir) -> None:
    class KeepsHistory(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, dict(lr=0.1))
            self.history: list[int] = []

        @torch.no_grad()
        def step(self, closure=None):
            self.history = self.history + [1]
            for p in self.param_groups[0]["params"]:
                p.add_(p.grad, alpha=-self.param_groups[0]["lr"])

    class LoopsOverItsCounter(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, dict(lr=0.1))
            self.k = 0

        @torch.no_grad()
        def step(self, closure=None):
            self.k += 1
            for p in self.param_groups[0]["params"]:
                for _ in range(min(self.k, 3)):
                    p.add_(p.grad, alpha=-self.param_groups[0]["lr"])

    for factory, message in [(KeepsHistory, "sets optimizer attribute 'history' to a list"),
                             (LoopsOverItsCounter, "used as an int")]:
        pair = Pair(factory, [(3, 2)], cache_dir)
        for p in pair.compiled_params:
            p.grad = torch.ones_like(p)
        before = [p.clone() for p in pair.compiled_params]
        with pytest.raises(hocompile.CaptureError, match=message):
            pair.compiled.step()
        torch.testing.assert_close(pair.compiled_params, before, rtol=0, atol=0)
        untouched = vars(pair.compiled.optimizer)
        assert untouched.get("k", 0) == 0 and untouched.get("history") in (None, [])
        # and with fallback="eager" the same optimizer steps like eager
        pair = Pair(factory, [(3, 2)], cache_dir, fallback="eager")
        for _ in range(4):
            pair.step()
        assert pair.max_rel_diff() == 0.0


def test_numpy_hyperparameters_are_numbers(cache_dir) -> None:
    """np.float32 lr / weight decay: no recompiles, eager's own (numpy) host arithmetic."""
    pair = Pair(lambda ps: torch.optim.AdamW(ps, lr=np.float32(1e-2), weight_decay=np.float32(0.1)), SHAPES, cache_dir)
    for step in range(8):
        for opt in (pair.eager, pair.compiled):
            opt.param_groups[0]["lr"] = np.float32(1e-2 * 0.9**step)
        pair.step()
    assert pair.max_rel_diff() == 0.0
    assert pair.compiled.counters.recompiles == []
    assert "g0.lr" in hocompile.explain(pair.compiled)


def test_all_grads_none_does_what_eager_does(cache_dir) -> None:
    pair = Pair(lambda ps: torch.optim.AdamW(ps, lr=1e-2), SHAPES, cache_dir)
    before = [p.clone() for p in pair.compiled_params]
    pair.compiled.step()  # no grads at all: nothing to do, no error
    torch.testing.assert_close(pair.compiled_params, before, rtol=0, atol=0)
    assert pair.compiled.counters.compiles == 0
    counter = Pair(GroupCounter, [(3, 2)], cache_dir)
    counter.eager.step()
    counter.compiled.step()  # a custom step may still tick its counter: eager's step runs
    assert counter.compiled.param_groups[0]["step"] == counter.eager.param_groups[0]["step"] == 1


def test_hooks_run_in_eager_order(cache_dir) -> None:
    orders: list[list[str]] = []
    for compiled in (False, True):
        order: list[str] = []
        params = [torch.randn(3, 2)]
        opt: torch.optim.Optimizer = torch.optim.SGD(params, lr=0.1)
        if compiled:
            opt = hocompile.compile_optimizer(opt, cache_dir=cache_dir)
        opt.register_step_pre_hook(lambda o, a, k, order=order: order.append("pre"))
        opt.register_step_post_hook(lambda o, a, k, order=order: order.append("post"))

        def closure(order=order, params=params):
            order.append("closure")
            params[0].grad = torch.ones_like(params[0])
            return 1.0

        assert opt.step(closure) == 1.0
        orders.append(order)
    assert orders[0] == orders[1] == ["pre", "closure", "post"]


def test_steady_state_after_an_eager_fallback_step_is_not_a_recompile(cache_dir) -> None:
    class DataDependentInit(torch.optim.Optimizer):
        """Its first step uses a tensor's value as an int (cannot be compiled); later steps can."""

        def __init__(self, params):
            super().__init__(params, dict(lr=0.1))

        @torch.no_grad()
        def step(self, closure=None):
            for p in self.param_groups[0]["params"]:
                state = self.state[p]
                if not state:
                    state["scale"] = torch.full_like(p, 1.0 / (1.0 + int(p.grad.abs().max().item())))
                p.add_(p.grad * state["scale"], alpha=-self.param_groups[0]["lr"])

    pair = Pair(DataDependentInit, [(3, 2)], cache_dir, fallback="eager")
    for _ in range(4):
        pair.step()
    assert pair.max_rel_diff() == 0.0
    assert pair.compiled.counters.eager_fallbacks == 1
    assert pair.compiled.counters.recompiles == []


class MathBiasCorrection(torch.optim.Optimizer):
    """``math.sqrt`` / ``math.pow`` of hyperparameters and an int step, as real Adam-style code writes them."""

    def __init__(self, params):
        super().__init__(params, dict(lr=0.1, betas=(0.9, 0.99)))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                state = self.state[p]
                state["step"] = state.get("step", 0) + 1
                if "m" not in state:
                    state["m"], state["v"] = torch.zeros_like(p), torch.zeros_like(p)
                state["m"].lerp_(p.grad, 1 - beta1)
                state["v"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                correction = math.sqrt(1 - math.pow(beta2, state["step"])) / (1 - beta1 ** state["step"])
                p.addcdiv_(state["m"], state["v"].sqrt().add_(1e-8), value=-group["lr"] * correction)


def test_math_functions_of_host_scalars_are_followed(cache_dir) -> None:
    pair = Pair(MathBiasCorrection, [(4, 3), (5,)], cache_dir)
    for step in range(6):
        for opt in (pair.eager, pair.compiled):
            opt.param_groups[0]["lr"] = 0.1 * 0.8**step
        pair.step()
    assert pair.max_rel_diff() == 0.0
    assert pair.compiled.counters.recompiles == []
    assert "math.sqrt(" in hocompile.explain(pair.compiled)


@pytest.mark.parametrize("name, foreach", [("sgd", False), ("sgd", True), ("adamw", False)])  # torch: no foreach AdamW
def test_tensor_learning_rate_is_a_live_input(name: str, foreach: bool, cache_dir) -> None:
    """torch.optim accepts ``lr=torch.tensor(...)``; schedules update it in place or replace it."""
    make = {
        "sgd": lambda ps: torch.optim.SGD(ps, lr=torch.tensor(0.1), momentum=0.9, foreach=foreach),
        "adamw": lambda ps: torch.optim.AdamW(ps, lr=torch.tensor(0.01), foreach=foreach),
    }[name]
    pair = Pair(make, SHAPES, cache_dir)
    for step in range(6):
        for opt in (pair.eager, pair.compiled):
            if step % 2:
                opt.param_groups[0]["lr"].fill_(0.05 * 0.9**step)  # in place
            else:
                opt.param_groups[0]["lr"] = torch.tensor(0.05 * 0.9**step)  # a new tensor
        pair.step()
    assert pair.max_rel_diff() == 0.0
    pair.assert_state_equal()
    assert pair.compiled.counters.recompiles == []


def test_torch_compiled_helpers_are_traced_through(cache_dir) -> None:
    """An NS function and an update wrapped in torch.compile run as plain Python in the capture."""

    @torch.compile(backend="eager")
    def scaled_sign(g: torch.Tensor) -> torch.Tensor:
        return torch.sign(g) * g.abs().mean()

    class SignSGD(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, dict(lr=0.1))

        @torch.no_grad()
        def step(self, closure=None):
            for p in self.param_groups[0]["params"]:
                p.add_(scaled_sign(p.grad), alpha=-self.param_groups[0]["lr"])

    pair = Pair(SignSGD, SHAPES, cache_dir, **EXACT)
    for _ in range(3):
        pair.step()
    assert pair.max_rel_diff() == 0.0  # backend="eager": the helper's arithmetic is aten's in both


def test_data_dependent_int_names_its_line_and_falls_back_for_that_step(cache_dir) -> None:
    """A value read on the host used as an int (a repeat count): its outcomes are unbounded, refused.
    (A read that feeds a branch or arithmetic compiles: tests/test_host_reads.py.)"""

    class RepeatsByNorm(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, dict(lr=0.1))

        @torch.no_grad()
        def step(self, closure=None):
            for p in self.param_groups[0]["params"]:
                for _ in range(int(p.grad.norm().item()) % 3):  # a data-dependent loop count
                    p.add_(p.grad, alpha=-self.param_groups[0]["lr"])

    pair = Pair(RepeatsByNorm, [(3, 2)], cache_dir)
    for p in pair.compiled_params:
        p.grad = torch.ones_like(p)
    where = r"int\(\) .*read0.*test_host_state\.py:\d+ \(`for _ in range\(int\(p\.grad\.norm\(\)\.item\(\)\)"
    with pytest.raises(hocompile.CaptureError, match=where):
        pair.compiled.step()
    pair = Pair(RepeatsByNorm, [(3, 2)], cache_dir, fallback="eager")
    for _ in range(3):
        pair.step()
    assert pair.max_rel_diff() == 0.0
    assert "test_host_state.py:" in hocompile.explain(pair.compiled)


def test_an_object_that_is_not_an_optimizer(cache_dir) -> None:
    """Has step(), param_groups and state like an optimizer: compiles; lacking them: says what is missing."""

    class PlainSGD:
        def __init__(self, params, lr=0.1):
            self.param_groups = [{"params": list(params), "lr": lr}]
            self.state: dict = {}

        @torch.no_grad()
        def step(self):
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.add_(p.grad, alpha=-group["lr"])

    pair = Pair(PlainSGD, [(3, 2), (4,)], cache_dir)
    for _ in range(3):
        pair.step()
    assert pair.max_rel_diff() == 0.0
    with pytest.raises(TypeError, match="lacks a step\\(\\) method, param_groups"):
        hocompile.compile_optimizer(object())  # type: ignore[arg-type]


def test_python_branch_on_a_tensor_compiles_one_variant_per_outcome(cache_dir) -> None:
    """``min(tensor, x)`` reads the tensor on the host like .item() does: before, refused naming its
    line; now the step is split at the read (host_reads.py), one variant per outcome, bitwise eager."""

    class ClampsOnNorm(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, dict(lr=0.1, gamma=0.5))

        @torch.no_grad()
        def step(self, closure=None):
            for group in self.param_groups:
                group["step"] = group.get("step", 0) + 1
                for p in group["params"]:
                    scale = min(p.grad.norm(), group["gamma"])
                    p.add_(p.grad * scale, alpha=-group["lr"])

    pair = Pair(ClampsOnNorm, [(3, 2)], cache_dir)
    for k in range(6):
        for p_e, p_c in zip(pair.eager_params, pair.compiled_params):  # norms above and below gamma
            g = torch.randn(p_e.shape, generator=pair.gen) * (1.0 if k % 2 else 0.01)
            p_e.grad, p_c.grad = g.clone(), g.clone()
        pair.eager.step()
        pair.compiled.step()
    assert pair.max_rel_diff() == 0.0
    counters = pair.compiled.counters
    assert counters.recompiles == [] and counters.eager_fallbacks == 0, counters
    assert "split at 1 host read" in hocompile.explain(pair.compiled)


def test_a_new_group_key_is_the_steady_state_not_a_recompile(cache_dir) -> None:
    class CreatesGroupStep(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, dict(lr=0.1, beta=0.9))

        @torch.no_grad()
        def step(self, closure=None):
            for group in self.param_groups:
                group["step"] = group.get("step", 0) + 1
                for p in group["params"]:
                    p.add_(p.grad, alpha=-group["lr"] / (1 - group["beta"] ** group["step"]))

    pair = Pair(CreatesGroupStep, [(3, 2)], cache_dir)
    for step in range(5):
        for opt in (pair.eager, pair.compiled):
            opt.param_groups[0]["lr"] = 0.1 / (step + 1)
        pair.step()
    assert pair.max_rel_diff() == 0.0
    assert pair.compiled.counters.recompiles == []


def test_not_optimizer_like_runs_eagerly_with_fallback(cache_dir) -> None:
    class StepsTwo:
        def __init__(self, a, b):
            self.optimizers = [a, b]

        def step(self):
            for opt in self.optimizers:
                opt.step()

    params = [torch.randn(3, 2), torch.randn(4)]
    for p in params:
        p.grad = torch.ones_like(p)
    combined = StepsTwo(torch.optim.SGD(params[:1], lr=0.1), torch.optim.AdamW(params[1:], lr=0.1))
    with pytest.raises(TypeError, match="StepsTwo lacks param_groups"):
        hocompile.compile_optimizer(combined, cache_dir=cache_dir)
    opt = hocompile.compile_optimizer(combined, cache_dir=cache_dir, fallback="eager")
    before = [p.clone() for p in params]
    opt.step()
    assert all(not torch.equal(a, b) for a, b in zip(params, before))
    assert "StepsTwo lacks param_groups" in hocompile.explain(opt).runs_eagerly
