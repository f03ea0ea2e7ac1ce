"""Shampoo, as the field runs it, written so that hocompile compiles its step.

Per parameter (2-D; an N-D one is viewed as ``(shape[0], -1)``), with ``G``
the gradient of one block and ``t`` the step:

- factors, per block: ``L ← β₂ L + (1 − β₂) G Gᵀ`` and ``R ← β₂ R + (1 − β₂) Gᵀ G``
  (``β₂ = 1``: the plain sums ``L += G Gᵀ``, AdaGrad-style, no bias correction);
- roots, every ``precondition_frequency`` steps from ``start_preconditioning_step``:
  ``L̂ = (L / (1 − β₂ᵗ) + εI)^(-1/p)``, ``R̂`` likewise, by eigh or coupled Newton
  (``matrix_roots.py``), kept in the state until the next refresh;
- direction: ``M̂ = m / (1 − β₁ᵗ)`` with ``m ← β₁ m + (1 − β₁) G`` (first moment),
  then ``L̂ M̂ R̂`` per block, rescaled to the norm of the grafting optimizer's
  step on that block (Adam: ``M̂ / (sqrt(v / (1 − β₂ᵗ)) + ε_graft)``; SGD: ``M̂``);
  before ``start_preconditioning_step`` the grafting step itself;
- ``p ← p (1 − lr·wd) − lr · direction`` (decoupled weight decay).

Exponents: ``p = 4`` on both sides of a 2-D block (``L^(-1/4) G R^(-1/4)``,
the Kronecker factorisation of full-matrix AdaGrad's ``-1/2``);
``one_sided=True`` preconditions only the smaller side of each block with
``-1/2`` (``L^(-1/2) G`` when rows ≤ cols, else ``G R^(-1/2)``): one small
root instead of two, and the exact AdaGrad root for that side.
``exponent_override=k`` uses ``-1/k`` on every preconditioned side.

Blocking: each dimension larger than ``max_preconditioner_dim`` is split into
chunks of that size (the last one shorter); every block has its own factors.

1-D parameters (biases, norms) take the grafting step alone (``grafting=None``:
the momentum ``M̂``, i.e. SGD).

Why the step is written as it is (hocompile captures it into one graph):
``group["step"]`` is a Python int, so ``step % precondition_frequency`` is
decided on the host: the refresh and the steps between refreshes are two
compiled variants, selected before each step, and no step reads a tensor on
the host. Per-block state lives under flat keys (``left_root_0``) rather than
in lists, which a compiled step could not repeat.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

from .matrix_roots import ROOT_METHODS, matrix_inverse_root

__all__ = ["Shampoo", "block_ranges"]

GRAFTINGS = ("adam", "sgd", None)
# Added to the Shampoo direction's norm before dividing by it: a zero block
# (a dead unit) must give a zero step, not NaN.
NORM_FLOOR = 1e-16


def block_ranges(size: int, max_dim: int) -> list[tuple[int, int]]:
    """``[(start, end), ...]`` chunks of ``range(size)`` of at most ``max_dim`` each, in order."""
    return [(start, min(start + max_dim, size)) for start in range(0, size, max_dim)]


class Shampoo(torch.optim.Optimizer):
    """Shampoo with blocking, grafting, periodic eigh/Newton roots; see the module docstring."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        epsilon: float = 1e-12,
        weight_decay: float = 0.0,
        precondition_frequency: int = 10,
        start_preconditioning_step: int = 1,
        max_preconditioner_dim: int = 1024,
        exponent_override: int | None = None,
        one_sided: bool = False,
        root_method: str = "eigh",
        newton_iterations: int = 30,
        grafting: str | None = "adam",
        grafting_epsilon: float = 1e-8,
    ) -> None:
        if not 0.0 <= betas[0] < 1.0 or not 0.0 < betas[1] <= 1.0:
            raise ValueError(f"betas {betas}: need 0 <= beta1 < 1 and 0 < beta2 <= 1")
        if precondition_frequency < 1 or start_preconditioning_step < 1 or max_preconditioner_dim < 1:
            raise ValueError(
                "precondition_frequency, start_preconditioning_step and max_preconditioner_dim must be >= 1"
            )
        if exponent_override is not None and (not isinstance(exponent_override, int) or exponent_override < 1):
            # an int: the Newton iteration takes the root as a matrix power
            raise ValueError(f"exponent_override {exponent_override!r}: a positive int (the root p)")
        if root_method not in ROOT_METHODS:
            raise ValueError(f"root_method {root_method!r}: one of {ROOT_METHODS}")
        if grafting not in GRAFTINGS:
            raise ValueError(f"grafting {grafting!r}: one of {GRAFTINGS}")
        defaults: dict[str, Any] = dict(
            lr=lr,
            betas=tuple(float(b) for b in betas),
            epsilon=epsilon,
            weight_decay=weight_decay,
            precondition_frequency=precondition_frequency,
            start_preconditioning_step=start_preconditioning_step,
            max_preconditioner_dim=max_preconditioner_dim,
            exponent_override=exponent_override,
            one_sided=one_sided,
            root_method=root_method,
            newton_iterations=newton_iterations,
            grafting=grafting,
            grafting_epsilon=grafting_epsilon,
        )
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            # A Python int: hocompile lifts it to a host input, so the branches
            # below pick a compiled variant on the host, with no device sync.
            step = group["step"] = group.get("step", 0) + 1
            start = group["start_preconditioning_step"]
            precondition = step >= start
            refresh = precondition and (step - start) % group["precondition_frequency"] == 0
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("Shampoo does not support sparse gradients")
                self._update(p, group, step, precondition, refresh)
        return loss

    def _update(self, p: torch.Tensor, group: dict[str, Any], step: Any, precondition: bool, refresh: bool) -> None:
        beta1, beta2 = group["betas"]
        grad = p.grad
        assert grad is not None
        state = self.state[p]
        if not state:
            self._init_state(p, group, state)
        state["exp_avg"].lerp_(grad, 1.0 - beta1)
        momentum = state["exp_avg"] / (1.0 - beta1**step)
        # β₂ = 1 means sums (AdaGrad), which take no bias correction.
        factor_weight = 1.0 - beta2 if beta2 < 1.0 else 1.0
        bias2 = 1.0 - beta2**step if beta2 < 1.0 else 1.0
        graft = self._grafting_step(state, group, grad, momentum, beta2, factor_weight, bias2)
        if group["weight_decay"] != 0.0:
            p.mul_(1.0 - group["lr"] * group["weight_decay"])
        if p.dim() < 2:
            p.add_(graft, alpha=-group["lr"])
            return
        rows = p.shape[0]
        # Factors and roots are at least float32 (_init_state): a bf16 param's blocks are
        # promoted to them (a no-op, and no graph node, for float32 params).
        work = torch.promote_types(p.dtype, torch.float32)
        grad2d, momentum2d, graft2d = (t.reshape(rows, -1).to(work) for t in (grad, momentum, graft))
        max_dim, sides = group["max_preconditioner_dim"], self._sides(group)
        blocks = [
            (r0, r1, c0, c1)
            for r0, r1 in block_ranges(rows, max_dim)
            for c0, c1 in block_ranges(grad2d.shape[1], max_dim)
        ]
        # The factors accumulate from the first step, also before start_preconditioning_step.
        for block, (r0, r1, c0, c1) in enumerate(blocks):
            g = grad2d[r0:r1, c0:c1]
            left, right = sides(r1 - r0, c1 - c0)
            for side, root, outer in (("left", left, (g, g.T)), ("right", right, (g.T, g))):
                if not root:
                    continue
                factor = state[f"{side}_factor_{block}"]
                factor.addmm_(*outer, beta=beta2, alpha=factor_weight)
                if refresh:
                    self._refresh(state, f"{side}_root_{block}", factor / bias2, root, group)
        if not precondition:
            p.add_(graft, alpha=-group["lr"])
            return
        directions: list[torch.Tensor] = []
        for block, (r0, r1, c0, c1) in enumerate(blocks):
            direction = momentum2d[r0:r1, c0:c1]
            left, right = sides(r1 - r0, c1 - c0)
            if left:
                direction = state[f"left_root_{block}"] @ direction
            if right:
                direction = direction @ state[f"right_root_{block}"]
            if group["grafting"] is not None:
                # Shampoo picks the direction, the grafted optimizer the step size (per block).
                target = torch.linalg.vector_norm(graft2d[r0:r1, c0:c1])
                direction = direction * (target / (torch.linalg.vector_norm(direction) + NORM_FLOOR))
            directions.append(direction)
        p.add_(self._assemble(directions, blocks).reshape(p.shape).to(p.dtype), alpha=-group["lr"])

    @staticmethod
    def _assemble(directions: list[torch.Tensor], blocks: list[tuple[int, int, int, int]]) -> torch.Tensor:
        """The blocks (row-major, as ``blocks`` lists them) joined back into one matrix."""
        if len(directions) == 1:
            return directions[0]
        rows: list[list[torch.Tensor]] = []
        for direction, (_, _, c0, _) in zip(directions, blocks):
            if c0 == 0:
                rows.append([])
            rows[-1].append(direction)
        return torch.cat([torch.cat(row, dim=1) for row in rows], dim=0)

    def _grafting_step(
        self,
        state: dict[str, Any],
        group: dict[str, Any],
        grad: torch.Tensor,
        momentum: torch.Tensor,
        beta2: Any,
        factor_weight: Any,
        bias2: Any,
    ) -> torch.Tensor:
        if group["grafting"] != "adam":
            return momentum
        second = state["exp_avg_sq"]
        second.mul_(beta2).addcmul_(grad, grad, value=factor_weight)
        return momentum / (second / bias2).sqrt().add_(group["grafting_epsilon"])

    def _refresh(self, state: dict[str, Any], key: str, factor: torch.Tensor, root: int, group: dict[str, Any]) -> None:
        state[key] = matrix_inverse_root(
            factor,
            root,
            group["epsilon"],
            group["root_method"],
            previous=state[key],
            newton_iterations=group["newton_iterations"],
        )

    @staticmethod
    def _sides(group: dict[str, Any]) -> Callable[[int, int], tuple[int, int]]:
        """``(rows, cols) -> (left root, right root)`` of a block, 0 where that side is not preconditioned."""
        override = group["exponent_override"]
        if not group["one_sided"]:
            both = override or 4
            return lambda rows, cols: (both, both)
        one = override or 2
        return lambda rows, cols: (one, 0) if rows <= cols else (0, one)

    def _init_state(self, p: torch.Tensor, group: dict[str, Any], state: dict[str, Any]) -> None:
        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        if group["grafting"] == "adam":
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        if p.dim() < 2:
            return
        rows, cols = p.shape[0], math.prod(p.shape[1:])
        sides = self._sides(group)
        # Factors and roots in float32 at least: a bf16 G Gᵀ loses the small
        # eigenvalues that the inverse root amplifies.
        dtype = torch.promote_types(p.dtype, torch.float32)
        block = 0
        for r0, r1 in block_ranges(rows, group["max_preconditioner_dim"]):
            for c0, c1 in block_ranges(cols, group["max_preconditioner_dim"]):
                left, right = sides(r1 - r0, c1 - c0)
                for side, n, on in (("left", r1 - r0, left), ("right", c1 - c0, right)):
                    if not on:
                        continue
                    state[f"{side}_factor_{block}"] = torch.zeros(n, n, dtype=dtype, device=p.device)
                    # Identity until the first refresh: Shampoo starts as the grafted step.
                    state[f"{side}_root_{block}"] = torch.eye(n, dtype=dtype, device=p.device)
                block += 1
