"""A toy op family defined outside the package: ``hocompile::toy_row_normalize``.

It exists to show that a family is added by adding files: the op, its spec
and its registry entry live here, and tests drive it through capture, the
printer, plan()/explain(), batch-by-shape and both lowerings without any
hocompile module knowing its name. ``ToyRowNormSGD`` calls the op in its
step, so capture records it as one node.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from hocompile.ir.registry import BatchRule, Cost, Input, OpFamily, OpSpec, Scalar, register


@torch.library.custom_op("hocompile::toy_row_normalize", mutates_args=())
def toy_row_normalize(x: torch.Tensor, alpha: float, eps: float) -> torch.Tensor:
    """alpha · x / max(‖row‖, eps), per row of [m, n] or [B, m, n]."""
    norm = x.float().norm(dim=-1, keepdim=True).clamp_min(eps)
    return (x.float() * (alpha / norm)).to(x.dtype)


@toy_row_normalize.register_fake
def _fake(x: torch.Tensor, alpha: float, eps: float) -> torch.Tensor:
    if x.dim() not in (2, 3):
        raise ValueError(f"toy_row_normalize takes [m, n] or [B, m, n], got {tuple(x.shape)}")
    return torch.empty_like(x)


@dataclass(frozen=True)
class ToyRowNormalizeSpec(OpSpec):
    qualname: ClassVar[str] = "hocompile::toy_row_normalize"

    x: Input
    alpha: float
    eps: Scalar


def _reference(spec: ToyRowNormalizeSpec) -> torch.Tensor:
    assert isinstance(spec.x, torch.Tensor)
    x = spec.x.double()
    return spec.alpha * x / x.norm(dim=-1, keepdim=True).clamp_min(float(spec.eps))  # type: ignore[arg-type]


def _cost(spec: ToyRowNormalizeSpec) -> Cost:
    x = spec.node_of("x").meta["val"]
    return Cost(flops=4.0 * x.numel(), bytes=2.0 * x.numel() * x.element_size())


def _key(spec: ToyRowNormalizeSpec) -> Hashable | None:
    x = spec.node_of("x").meta["val"]
    if x.dim() != 2:
        return None
    return (tuple(x.shape), x.dtype, spec.alpha, spec.eps)


TOY = register(
    OpFamily(
        spec=ToyRowNormalizeSpec,
        title="toy row normalisation",
        reference=_reference,
        describe=lambda spec, fmt: [fmt(spec.x), f"alpha={spec.alpha!r}", f"eps={fmt(spec.eps)}"],
        cost=_cost,
        batch=BatchRule(key=_key, batched=lambda spec, stacked: spec.replace(x=stacked["x"])),
    )
)


class ToyRowNormSGD(torch.optim.Optimizer):
    """SGD on row-normalised gradients: p -= lr · g / ‖row of g‖."""

    def __init__(self, params: Any, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                u = torch.ops.hocompile.toy_row_normalize(p.grad, 1.0, 1e-7)
                p.add_(u, alpha=-group["lr"])
