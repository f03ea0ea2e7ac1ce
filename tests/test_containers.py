"""Tensors kept in containers: lists, dicts, deques, objects in ``state``, and a lazily built
cache of buffers on the optimizer. Each optimizer below is written in the style of a real one
(SOAP's ``state["GG"] = [L, R]``, a Kron-style dict of factors, a queue of past grads, a
GaLore-style projector object, a Muon that caches scratch buffers per shape); each compiles and
stays bitwise equal to eager over steps with an lr change and a state_dict round trip, with every
pass on and every pass off. Before, each was refused or failed inside the trace.
"""

from __future__ import annotations

import collections
import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

import hocompile

from .helpers import EVERY_PASS_OFF


class ListState(torch.optim.Optimizer):
    """Two-sided preconditioner statistics in a list, created on the first step, updated in place."""

    def __init__(self, params: Any, lr: float = 0.1, beta: float = 0.9) -> None:
        super().__init__(params, {"lr": lr, "beta": beta})

    @torch.no_grad()
    def step(self) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                g, state = p.grad, self.state[p]
                if "GG" not in state:
                    state["GG"] = [torch.zeros(g.shape[0], g.shape[0]), torch.zeros(g.shape[1], g.shape[1])]
                left, right = state["GG"]
                left.lerp_(g @ g.T, 1 - group["beta"])
                right.lerp_(g.T @ g, 1 - group["beta"])
                p.add_(left @ g @ right, alpha=-group["lr"] / (1 + left.norm() * right.norm()))


class DictState(torch.optim.Optimizer):
    """Factors in a dict, replaced (not updated in place) every step."""

    def __init__(self, params: Any, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state.setdefault(p, {})
                if "factors" not in state:
                    state["factors"] = {"m": torch.zeros_like(p), "v": torch.zeros_like(p)}
                f = state["factors"]
                f["m"] = 0.9 * f["m"] + 0.1 * p.grad
                f["v"] = 0.99 * f["v"] + 0.01 * p.grad.square()
                p.addcdiv_(f["m"], f["v"].sqrt() + 1e-8, value=-group["lr"])


class GradQueue(torch.optim.Optimizer):
    """The mean of the last three grads, kept in a deque."""

    def __init__(self, params: Any, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                queue = state.setdefault("past", collections.deque(maxlen=3))
                queue.append(p.grad.clone())
                p.add_(torch.stack(list(queue)).mean(0), alpha=-group["lr"])


@dataclass
class Projector:
    basis: torch.Tensor
    rank: int


class ProjectorState(torch.optim.Optimizer):
    """A low-rank projector object in state (GaLore-style): its basis is refreshed every step."""

    def __init__(self, params: Any, lr: float = 0.1, rank: int = 2) -> None:
        super().__init__(params, {"lr": lr, "rank": rank})

    @torch.no_grad()
    def step(self) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if "proj" not in state:
                    state["proj"] = Projector(torch.eye(p.shape[0])[:, : group["rank"]].clone(), group["rank"])
                proj = state["proj"]
                q, _ = torch.linalg.qr(proj.basis + 0.1 * p.grad[:, : proj.rank])
                proj.basis = q
                p.sub_(q @ (q.T @ p.grad), alpha=group["lr"])


class CachedBuffers(torch.optim.Optimizer):
    """Scratch buffers cached per shape in a dict attribute, filled lazily by the step."""

    def __init__(self, params: Any, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})
        self._scratch: dict[tuple[int, ...], torch.Tensor] = {}

    @torch.no_grad()
    def step(self) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                buf = self._scratch.get(tuple(p.shape))
                if buf is None:
                    buf = self._scratch[tuple(p.shape)] = torch.empty_like(p)
                torch.mul(p.grad, 2.0, out=buf)
                p.add_(buf, alpha=-group["lr"])
                state = self.state[p]
                state["n"] = state.get("n", torch.zeros(())) + 1


def _params(seed: int = 0, many: bool = False) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    # many: enough params of one class that the step is first captured per class (classes/stamp.py)
    shapes = [(6, 4)] * 8 + [(5, 3)] * 4 if many else [(6, 4), (6, 4), (5, 3)]
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]


def _grads(params: list[torch.nn.Parameter], step: int) -> None:
    gen = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)


def _leaves(value: Any) -> list[Any]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [x for v in value.values() for x in _leaves(v)]
    if isinstance(value, (list, tuple, collections.deque)):
        return [x for v in value for x in _leaves(v)]
    if hasattr(value, "__dict__"):
        return [x for v in vars(value).values() for x in _leaves(v)]
    return [value]


def _same(a: Any, b: Any) -> bool:
    la, lb = _leaves(a), _leaves(b)
    if len(la) != len(lb):
        return False
    return all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(la, lb))


def _round_trip(opt: Any, cls: type, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    fresh = cls(params)
    fresh.load_state_dict(copy.deepcopy(opt.state_dict()))
    return fresh


CASES = [ListState, DictState, GradQueue, ProjectorState, CachedBuffers]


@pytest.mark.parametrize("passes", ["default", "off", "many params"])
@pytest.mark.parametrize("cls", CASES, ids=lambda c: c.__name__)
def test_containers_bitwise_eager(cls: type, passes: str, cache_dir: Path) -> None:
    """"many params": a class of eight, where the step is first tried per class. A step that creates
    containers is traced whole (before, the class program left other members' containers wrong)."""
    many = passes == "many params"
    eager_params, compiled_params = _params(many=many), _params(many=many)
    eager = cls(eager_params)
    kw = {"disable_passes": EVERY_PASS_OFF} if passes == "off" else {}
    compiled = hocompile.compile_optimizer(cls(compiled_params), cache_dir=cache_dir, **kw)
    for step in range(8):
        if step == 4:  # an lr change, and a state_dict round trip into fresh optimizers (both: torch's
            # load_state_dict rebuilds containers its own way, a deque without its maxlen)
            eager, compiled = _round_trip(eager, cls, eager_params), _round_trip(compiled, cls, compiled_params)
            compiled = hocompile.compile_optimizer(compiled, cache_dir=cache_dir, **kw)
            for opt in (eager, compiled):
                opt.param_groups[0]["lr"] = 0.05
        _grads(eager_params, step)
        _grads(compiled_params, step)
        eager.step()
        compiled.step()
        for pe, pc in zip(eager_params, compiled_params):
            assert torch.equal(pe, pc), f"{cls.__name__} step {step}: params differ"
            assert set(eager.state[pe]) == set(compiled.state[pc])
            for key in eager.state[pe]:
                assert _same(eager.state[pe][key], compiled.state[pc][key]), f"state[{key!r}] at step {step}"
    assert compiled.counters.compiles >= 1 and compiled.counters.eager_fallbacks == 0, hocompile.explain(compiled)


class GrowingHistory(torch.optim.Optimizer):
    """Appends every grad to a list, forever: each step is a new structure."""

    def __init__(self, params: Any, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                history = self.state[p].setdefault("history", [])
                history.append(p.grad.clone())
                p.add_(sum(history) / len(history), alpha=-group["lr"])


def test_growing_container_runs_eagerly_naming_it(cache_dir: Path) -> None:
    """A container that grows every step cannot be one compiled step: each structure compiles
    once, until the recompile limit; then the step runs eagerly, the message naming the list.
    Every step, compiled or not, stays bitwise eager."""
    eager_params, compiled_params = _params(), _params()
    eager = GrowingHistory(eager_params)
    compiled = hocompile.compile_optimizer(GrowingHistory(compiled_params), cache_dir=cache_dir, recompile_limit=2)
    with pytest.warns(UserWarning, match="recompile limit"):
        for step in range(6):
            _grads(eager_params, step)
            _grads(compiled_params, step)
            eager.step()
            compiled.step()
            for pe, pc in zip(eager_params, compiled_params):
                assert torch.equal(pe, pc), f"step {step}"
    assert compiled.counters.eager_fallbacks >= 1
    assert "'history' changed a list holding" in compiled.counters.recompiles[-1]


class GroupBuffers(torch.optim.Optimizer):
    """Per-group scratch kept in the group itself: a list of buffers, one per param, made by the step."""

    def __init__(self, params: Any, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self) -> None:  # type: ignore[override]
        for group in self.param_groups:
            if "bufs" not in group:
                group["bufs"] = [torch.zeros_like(p) for p in group["params"]]
            for p, buf in zip(group["params"], group["bufs"]):
                buf.mul_(0.9).add_(p.grad)
                p.add_(buf, alpha=-group["lr"])


def test_tensors_in_a_group_container(cache_dir: Path) -> None:
    eager_params, compiled_params = _params(), _params()
    eager = GroupBuffers(eager_params)
    compiled = hocompile.compile_optimizer(GroupBuffers(compiled_params), cache_dir=cache_dir)
    for step in range(5):
        _grads(eager_params, step)
        _grads(compiled_params, step)
        eager.step()
        compiled.step()
        assert all(torch.equal(a, b) for a, b in zip(eager_params, compiled_params)), step
        assert _same(eager.param_groups[0]["bufs"], compiled.param_groups[0]["bufs"])
    assert compiled.counters.eager_fallbacks == 0 and compiled.counters.recompiles == []


class SharedViews(torch.optim.Optimizer):
    """Views of one flat buffer kept in a list: each view's writes are the buffer's."""

    def __init__(self, params: Any, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})
        flat = torch.zeros(sum(p.numel() for p in self.param_groups[0]["params"]))
        self.flat = flat
        self.views = list(torch.split(flat, [p.numel() for p in self.param_groups[0]["params"]]))

    @torch.no_grad()
    def step(self) -> None:  # type: ignore[override]
        for p, view in zip(self.param_groups[0]["params"], self.views):
            view.add_(p.grad.flatten())
            p.add_(view.view_as(p), alpha=-self.param_groups[0]["lr"])
        self.flat.mul_(0.5)


def test_a_container_view_of_another_input_is_refused(cache_dir: Path) -> None:
    params = _params()
    _grads(params, 0)
    compiled = hocompile.compile_optimizer(SharedViews(params), cache_dir=cache_dir)
    before = [p.detach().clone() for p in params]
    with pytest.raises(hocompile.CaptureError, match="shares memory with"):
        compiled.step()
    assert all(torch.equal(a, b) for a, b in zip(before, params))
