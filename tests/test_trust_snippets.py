"""Issue 30's classes of silently wrong steps, as complete optimizers: bitwise eager or refused.

Each optimizer is run eager and compiled (``fuse-newton-schulz`` off, so every plan keeps eager's
arithmetic) over 10 steps with an lr change half-way and a state_dict round trip into a fresh
compiled wrapper, warm start on and off. A refusal must come before anything is touched.

- a step that skips params by ``requires_grad`` (the stand-ins answered False: 0 ops, a step that
  did nothing);
- a step that reads Python attributes of its params (Megatron's ``is_qkv``, ``partition_dim``);
- host arithmetic on a value read with ``.item()`` (``lr / max(1, rms.item())``: ``1 - lr * wd``
  came out the same double in both traces and was baked in);
- Adam keeping its step counter as a tensor in ``param_groups``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import hocompile
from hocompile import CaptureError

STEPS = 10


class LrOnly(torch.optim.Optimizer):
    """The snippets' shared constructor: one hyperparameter, ``lr``."""

    def __init__(self, params: Any, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})


class SkipFrozen(LrOnly):

    @torch.no_grad()
    def step(self) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if not p.requires_grad or p.grad is None:
                    continue
                p.add_(p.grad, alpha=-group["lr"])


class ReadsAttributes(LrOnly):
    """Splits "QKV" params in three along ``partition_dim`` and normalises each part (Megatron-like)."""


    @torch.no_grad()
    def step(self) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                g = p.grad
                if getattr(p, "is_qkv", False):
                    parts = [x / x.norm() for x in g.chunk(3, dim=getattr(p, "partition_dim", 0))]
                    g = torch.cat(parts, dim=getattr(p, "partition_dim", 0))
                else:
                    g = g / g.norm()
                p.add_(g, alpha=-group["lr"])


class HostArithmetic(LrOnly):

    @torch.no_grad()
    def step(self) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                rms = p.grad.pow(2).mean().sqrt()
                lr = group["lr"] / max(1, rms.item())
                p.mul_(1 - lr * 0.01)
                p.add_(p.grad, alpha=-lr)


class TensorStepAdam(torch.optim.Optimizer):
    """Adam with its step counter a tensor in each param group, incremented in step()."""

    def __init__(self, params: Any, lr: float = 1e-2) -> None:
        super().__init__(params, {"lr": lr, "betas": (0.9, 0.99), "eps": 1e-8})
        for group in self.param_groups:
            group["step"] = torch.tensor(0.0)

    @torch.no_grad()
    def step(self) -> None:  # type: ignore[override]
        for group in self.param_groups:
            group["step"] += 1
            b1, b2 = group["betas"]
            t = group["step"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["m"], st["v"] = torch.zeros_like(p), torch.zeros_like(p)
                st["m"].lerp_(p.grad, 1 - b1)
                st["v"].mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                denom = (st["v"] / (1 - b2**t)).sqrt().add_(group["eps"])
                p.addcdiv_(st["m"], denom, value=-group["lr"] / (1 - b1**t).item())


def _params(kind: type) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(6, 4, generator=gen)) for _ in range(5)]
    if kind is SkipFrozen:
        params[1].requires_grad_(False)
    if kind is ReadsAttributes:
        params[0].is_qkv, params[0].partition_dim = True, 0  # type: ignore[attr-defined]
        params[2].is_qkv, params[2].partition_dim = True, 1  # type: ignore[attr-defined]
    return params


def _run(kind: type, compiled: bool, cache: Path, warm: bool) -> list[torch.Tensor]:
    params = _params(kind)
    opt: Any = kind(params)
    if compiled:
        opt = hocompile.compile_optimizer(
            opt, cache_dir=cache, disable_passes=["fuse-newton-schulz"], warm_start=warm
        )
    gen = torch.Generator().manual_seed(1)
    for k in range(STEPS):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen) * (k + 1)
        if k == STEPS // 2:
            for group in opt.param_groups:
                group["lr"] *= 0.5
            if compiled:  # a state_dict round trip into a fresh wrapper of a fresh optimizer
                state = opt.state_dict()
                fresh = kind(params)
                fresh.load_state_dict(state)
                opt = hocompile.compile_optimizer(
                    fresh, cache_dir=cache, disable_passes=["fuse-newton-schulz"], warm_start=warm
                )
            else:
                state = opt.state_dict()
                opt = kind(params)
                opt.load_state_dict(state)
        opt.step()
    return [p.detach().clone() for p in params]


@pytest.mark.parametrize("warm", [False, True], ids=["warm-start-off", "warm-start-on"])
@pytest.mark.parametrize(
    "kind", [SkipFrozen, ReadsAttributes, HostArithmetic, TensorStepAdam], ids=lambda k: k.__name__
)
def test_bitwise_eager_over_a_schedule_and_a_round_trip(kind: type, warm: bool, tmp_path: Path) -> None:
    want = _run(kind, False, tmp_path, warm)
    got = _run(kind, True, tmp_path, warm)
    for i, (a, b) in enumerate(zip(want, got)):
        assert torch.equal(a, b), (i, (a - b).abs().max().item())


def test_a_changed_attribute_or_flag_recompiles_with_its_name(tmp_path: Path) -> None:
    params = _params(ReadsAttributes)
    opt = hocompile.compile_optimizer(ReadsAttributes(params), cache_dir=tmp_path)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    params[0].partition_dim = 1  # type: ignore[attr-defined]
    opt.step()
    params[3].requires_grad_(False)
    opt.step()
    reasons = " | ".join(opt.counters.recompiles)
    assert "param_groups[0]['params'][0].partition_dim changed 0 -> 1" in reasons, reasons
    assert "param_groups[0]['params'][3].requires_grad changed True -> False" in reasons, reasons


class ReadsTensorList(LrOnly):

    @torch.no_grad()
    def step(self) -> None:  # type: ignore[override]
        for p in self.param_groups[0]["params"]:
            p.add_(p.grads_seen[-1], alpha=-0.1)


class SetsAttribute(LrOnly):

    @torch.no_grad()
    def step(self) -> None:  # type: ignore[override]
        for p in self.param_groups[0]["params"]:
            p.seen = getattr(p, "seen", 0) + 1
            p.add_(p.grad, alpha=-0.1)


@pytest.mark.parametrize(
    ("kind", "words"),
    [(ReadsTensorList, "uses param_groups[0]['params'][0].grads_seen, a param attribute holding tensors"),
     (SetsAttribute, "sets the Python attribute param_groups[0]['params'][0].'seen'")],
    ids=["tensors in an attribute", "sets an attribute"],
)
def test_what_is_not_modelled_is_refused_naming_it_before_anything_changes(
    kind: type, words: str, tmp_path: Path
) -> None:
    params = [torch.nn.Parameter(torch.randn(3, 3)) for _ in range(2)]
    for p in params:
        p.grad = torch.randn(3, 3)
        p.grads_seen = [p.grad.clone()]  # type: ignore[attr-defined]
    before = [p.detach().clone() for p in params]
    opt = hocompile.compile_optimizer(kind(params), cache_dir=tmp_path)
    with pytest.raises(CaptureError, match=words.replace("[", r"\[").replace("]", r"\]").replace(".", r"\.")):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, params))
    assert all(not hasattr(p, "seen") for p in params)


class BoundCollective(LrOnly):
    """All-reduces its grads through a name bound at import (Megatron-style module-level imports)."""


    @torch.no_grad()
    def step(self) -> None:  # type: ignore[override]
        from torch.distributed.distributed_c10d import all_reduce  # not torch.distributed.all_reduce

        for p in self.param_groups[0]["params"]:
            g = p.grad.clone()
            all_reduce(g)
            p.add_(g, alpha=-0.1)


def test_a_collective_the_trace_cannot_follow_is_refused_naming_it(tmp_path: Path) -> None:
    """Never dropped, never replayed blindly: a c10d op reached through another name is refused (one rank:
    eager's all-reduce is the identity there, so a dropped one would even have passed a comparison)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        p = torch.nn.Parameter(torch.randn(3, 3))
        p.grad = torch.randn(3, 3)
        before = p.detach().clone()
        opt = hocompile.compile_optimizer(BoundCollective([p]), cache_dir=tmp_path / "cache")
        with pytest.raises(CaptureError, match=r"collective c10d::allreduce_ through a name hocompile does not"):
            opt.step()
        assert torch.equal(p.detach(), before)
    finally:
        dist.destroy_process_group()


class CountsTags(LrOnly):

    @torch.no_grad()
    def step(self) -> None:  # type: ignore[override]
        for p in self.param_groups[0]["params"]:
            p.add_(p.grad, alpha=-0.1 * len(p.tags))


def test_an_attribute_changed_in_place_recompiles(tmp_path: Path) -> None:
    """The fast guard compares a param's attributes as a dict (the same objects short-circuit); a list
    attribute appended to in place is compared as the signature holds it, so it cannot slip through."""
    params = [torch.nn.Parameter(torch.ones(2)) for _ in range(2)]
    twins = [torch.nn.Parameter(torch.ones(2)) for _ in range(2)]
    for p in params + twins:
        p.grad, p.tags = torch.ones(2), ["a"]  # type: ignore[attr-defined]
    opt, eager = hocompile.compile_optimizer(CountsTags(params), cache_dir=tmp_path), CountsTags(twins)
    opt.step()
    eager.step()
    params[0].tags.append("b")  # type: ignore[attr-defined]
    twins[0].tags.append("b")  # type: ignore[attr-defined]
    opt.step()
    eager.step()
    assert opt.counters.recompiles == ["param_groups[0]['params'][0].tags changed ['a'] -> ['a', 'b']"]
    assert all(torch.equal(p, q) for p, q in zip(params, twins))


class LooksParamsUp(torch.optim.Optimizer):
    """Per-param choices kept beside the param groups: a set of params, a dict keyed by them, a set of ids."""

    def __init__(self, params: Any, how: str) -> None:
        params = list(params)
        super().__init__(params, {"lr": 0.1})
        self.how = how
        self.no_decay = {params[0]} if how == "set" else None
        self.names = {p: f"w{i}" for i, p in enumerate(params)} if how == "dict" else None
        self.no_decay_ids = {id(params[0])}

    @torch.no_grad()
    def step(self) -> None:  # type: ignore[override]
        for p in self.param_groups[0]["params"]:
            if self.how == "set":
                decay = p not in self.no_decay
            elif self.how == "dict":
                decay = self.names[p] != "w0"
            else:
                decay = id(p) not in self.no_decay_ids
            if decay:
                p.mul_(0.5)
            p.add_(p.grad, alpha=-0.1)


@pytest.mark.parametrize("how", ["set", "dict", "id"])
def test_params_looked_up_by_identity_are_followed_or_refused(how: str, tmp_path: Path) -> None:
    """``id(p)`` of a traced param is the real one's; a set or dict holding the params themselves
    cannot be answered by stand-ins, so it is refused naming the attribute (it was a silently
    skipped decay, or a RuntimeError from comparing tensors in the signature)."""
    params, twins = ([torch.nn.Parameter(torch.ones(2)) for _ in range(2)] for _ in range(2))
    for p in params + twins:
        p.grad = torch.ones(2)
    LooksParamsUp(twins, how).step()
    opt = hocompile.compile_optimizer(LooksParamsUp(params, how), cache_dir=tmp_path)
    if how == "id":
        opt.step()
        assert all(torch.equal(p, q) for p, q in zip(params, twins))
        return
    where = {"set": r"opt\.no_decay holds the optimizer's params as set members",
             "dict": r"opt\.names holds the optimizer's params as dict keys"}[how]
    with pytest.raises(CaptureError, match=where):
        opt.step()
    assert all(torch.equal(p.detach(), torch.ones(2)) for p in params)
