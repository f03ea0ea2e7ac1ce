"""Shared test helpers: paired eager/compiled optimizers fed identical grads."""

from __future__ import annotations

import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import typing_extensions

import hocompile
from hocompile.passes import Pass, PassResult, default_pipeline
from hocompile.passes.stack_calls import StackCalls
from hocompile.passes.stack_members import StackMembers

# emerging-optimizers 0.3.0 imports typing.override (Python >= 3.12).
if not hasattr(typing, "override"):
    typing.override = typing_extensions.override  # type: ignore[attr-defined]


@dataclass(frozen=True)
class PerturbLastAdd(Pass):
    """A wrong plan where it keeps eager's arithmetic: the graph's last addition scaled by 1 + 2^-20 (after
    every collective and reduction of a step that ends with its update)."""

    name: ClassVar[str] = "perturb-last-add"

    def __call__(self, gm: torch.fx.GraphModule) -> PassResult:
        adds = [n for n in gm.graph.nodes if n.target is torch.ops.aten.add.Tensor]
        if not adds:
            return PassResult(gm, False, "no add")
        node = adds[-1]
        with gm.graph.inserting_after(node):
            scaled = gm.graph.call_function(torch.ops.aten.mul.Tensor, (node, 1.0 + 2.0**-20))
        node.replace_all_uses_with(scaled, delete_user_cb=lambda user: user is not scaled)
        scaled.meta["val"] = node.meta.get("val")
        gm.recompile()
        return PassResult(gm, True, "perturbed the last addition")


def zeropower_via_newtonschulz5(G: torch.Tensor, steps: int) -> torch.Tensor:
    """Keller Jordan's reference NS, as users paste it into their optimizers."""
    assert G.ndim >= 2
    a, b, c = (3.4445, -4.7750, 2.0315)
    X = G.bfloat16()
    if G.size(-2) > G.size(-1):
        X = X.mT
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(steps):
        A = X @ X.mT
        B = b * A + c * A @ A
        X = a * X + B @ X
    if G.size(-2) > G.size(-1):
        X = X.mT
    return X


class UserMuon(torch.optim.Optimizer):
    """A user-written Muon in the style of Keller Jordan's muon.py."""

    def __init__(self, params: Any, lr: float = 0.02, weight_decay: float = 0.0, momentum: float = 0.95) -> None:
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay, momentum=momentum, ns_steps=5))

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if len(state) == 0:
                    state["momentum_buffer"] = torch.zeros_like(p)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - group["momentum"])
                update = p.grad.lerp_(buf, group["momentum"])
                update = zeropower_via_newtonschulz5(update, group["ns_steps"])
                update *= max(1, p.size(-2) / p.size(-1)) ** 0.5
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(update.reshape(p.shape), alpha=-group["lr"])


def emerging_muon(params: Any, **kw: Any) -> torch.optim.Optimizer:
    from emerging_optimizers.orthogonalized_optimizers import Muon

    return Muon(params, **kw)


# Compile without the Newton–Schulz passes: the compiled step then runs eager's
# own aten ops and must be bit-identical (tests of capture and runtime mechanics).
EXACT: dict[str, Any] = {"disable_passes": ("fuse-newton-schulz", "choose-algorithm")}

# Every pass a single-process CPU step can meet: the default pipeline's, stack-members (added
# for stamped steps, passes/pipeline.stamped_pipeline) and stack-calls (for steps traced whole,
# passes/pipeline.step_pipeline). With all off the compiled step is eager's
# own arithmetic, bit for bit: the documented promise the corpus, sweep and Scion tests check.
EVERY_PASS_OFF: dict[str, Any] = {
    "disable_passes": (
        *(p.name for p in default_pipeline(hocompile.Target("cpu-avx2"))), StackMembers.name, StackCalls.name
    )
}


def make_params(
    shapes: Sequence[tuple[int, ...]], seed: int = 0, dtype: torch.dtype = torch.float32
) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g, dtype=dtype) for s in shapes]


class Pair:
    """An eager optimizer and a compiled copy, stepped with identical grads."""

    def __init__(
        self,
        factory: Callable[[Any], torch.optim.Optimizer],
        shapes: Sequence[tuple[int, ...]],
        cache_dir: Any,
        groups: Callable[[list[torch.Tensor]], Any] | None = None,
        **compile_kw: Any,
    ) -> None:
        self.eager_params = make_params(shapes)
        self.compiled_params = [p.clone() for p in self.eager_params]
        wrap = groups or (lambda ps: ps)
        self.eager = factory(wrap(self.eager_params))
        inner = factory(wrap(self.compiled_params))
        self.compiled = hocompile.compile_optimizer(inner, cache_dir=cache_dir, **compile_kw)
        self.gen = torch.Generator().manual_seed(1)

    def step(self, none_grads: Sequence[int] = ()) -> None:
        for i, (pe, pc) in enumerate(zip(self.eager_params, self.compiled_params)):
            if i in none_grads:
                pe.grad = pc.grad = None
                continue
            g = torch.randn(pe.shape, generator=self.gen, dtype=pe.dtype)
            pe.grad, pc.grad = g.clone(), g.clone()
        self.eager.step()
        self.compiled.step()

    def max_rel_diff(self) -> float:
        worst = 0.0
        for a, b in zip(self.eager_params, self.compiled_params):
            worst = max(worst, ((a - b).abs().max() / a.abs().max().clamp_min(1e-30)).item())
        return worst

    def assert_state_equal(self) -> None:
        for pe, pc in zip(self.eager_params, self.compiled_params):
            se, sc = self.eager.state.get(pe, {}), self.compiled.state.get(pc, {})
            assert se.keys() == sc.keys()
            for k in se:
                if isinstance(se[k], torch.Tensor):
                    torch.testing.assert_close(sc[k], se[k], rtol=0, atol=0)


class NSOnly(torch.optim.Optimizer):
    """p -= lr * NS(grad) with a given NS function: isolates one NS implementation."""

    def __init__(self, params: Any, ns: Callable[[torch.Tensor], torch.Tensor], lr: float = 0.02) -> None:
        super().__init__(params, dict(lr=lr))
        self.ns = ns

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(self.ns(p.grad).to(p.dtype), alpha=-group["lr"])


def emerging_ns(**kw: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    from emerging_optimizers.orthogonalized_optimizers import muon_utils

    return lambda g: muon_utils.newton_schulz(g, **kw)


def emerging_coefficients(kind: str, steps: int) -> list[tuple[float, float, float]]:
    from emerging_optimizers.orthogonalized_optimizers import muon_utils

    mode = "repeat_last" if kind in ("polar_express", "cans", "deepseekv4") else "cycle"
    return list(muon_utils.get_coefficient_iterator(steps, muon_utils._COEFFICIENT_SETS[kind], mode=mode))
