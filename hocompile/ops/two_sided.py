"""``hocompile::two_sided``: the two-sided product ``A X B`` of a matrix with two square factors.

It is the projection into a Kronecker eigenbasis and back, and Shampoo's
preconditioning, with ``A = left`` or ``leftᵀ`` and ``B = right`` or ``rightᵀ``:

- SOAP/REKLS project in, ``Q_Lᵀ X Q_R``, and back, ``Q_L U Q_Rᵀ``, with
  ``torch.tensordot(x, Q, dims=[[0], [0]])`` once per dimension, which
  dispatches to ``mm(Xᵀ, Aᵀ)ᵀ`` then ``mm(·, B)`` (``association="tensordot"``);
- hocompile's Shampoo computes ``L̂ M R̂`` as ``mm(mm(A, X), B)``
  (``association="left_first"``).

Both orders are kept as eager has them, because the two roundings differ
(emerging-optimizers keeps ``tensordot`` for that reason): the CPU kernel
makes exactly eager's ``mm`` calls on the same views, so an unbatched call
is bitwise eager. A stacked call makes the same products with ``bmm``.

Batching is by exact shapes (x, left, right, flags, association) and by
generation (how many two_sided calls precede X; see :func:`_batch_key`):
an n×m member would need left and right swapped, not transposed, which a
:class:`~hocompile.ir.registry.BatchRule` does not express.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.fx as fx

from ..ir.registry import BatchRule, Cost, Input, OpFamily, OpSpec, register

ASSOCIATIONS = ("tensordot", "left_first")


def _check(x: torch.Tensor, left: torch.Tensor, right: torch.Tensor, association: str) -> None:
    if association not in ASSOCIATIONS:
        raise ValueError(f"two_sided association must be one of {ASSOCIATIONS}, got {association!r}")
    if x.dim() not in (2, 3) or left.dim() != x.dim() or right.dim() != x.dim():
        raise ValueError(f"two_sided takes matrices or stacks of one rank, got {x.dim()}, {left.dim()}, {right.dim()}")
    m, n = x.shape[-2], x.shape[-1]
    if left.shape[-2:] != (m, m) or right.shape[-2:] != (n, n):
        raise ValueError(
            f"two_sided of {tuple(x.shape)} needs {m}x{m} and {n}x{n} factors, got "
            f"{tuple(left.shape)} and {tuple(right.shape)}"
        )


def two_sided_eager(
    x: torch.Tensor,
    left: torch.Tensor,
    right: torch.Tensor,
    left_transposed: bool,
    right_transposed: bool,
    association: str,
) -> torch.Tensor:
    """``A X B`` (A = leftᵀ if ``left_transposed``, B likewise) in eager's association and calls."""
    a = left.mT if left_transposed else left
    b = right.mT if right_transposed else right
    mm = torch.bmm if x.dim() == 3 else torch.mm
    if association == "tensordot":
        return mm(mm(x.mT, a.mT).mT, b)
    return mm(mm(a, x), b)


@torch.library.custom_op("hocompile::two_sided", mutates_args=())
def two_sided(
    x: torch.Tensor,
    left: torch.Tensor,
    right: torch.Tensor,
    left_transposed: bool,
    right_transposed: bool,
    association: str,
) -> torch.Tensor:
    """``A X B`` with ``A = leftᵀ`` or ``left`` and ``B = rightᵀ`` or ``right``, in ``association`` order."""
    _check(x, left, right, association)
    return two_sided_eager(x, left, right, left_transposed, right_transposed, association)


@two_sided.register_fake
def _two_sided_fake(
    x: torch.Tensor,
    left: torch.Tensor,
    right: torch.Tensor,
    left_transposed: bool,
    right_transposed: bool,
    association: str,
) -> torch.Tensor:
    _check(x, left, right, association)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@dataclass(frozen=True)
class TwoSidedSpec(OpSpec):
    """``hocompile::two_sided(x, left, right, left_transposed, right_transposed, association)``, by name."""

    qualname: ClassVar[str] = "hocompile::two_sided"

    x: Input
    left: Input
    right: Input
    left_transposed: bool
    right_transposed: bool
    association: str

    def shape(self) -> tuple[int, int, int]:
        """(batch, m, n) of X."""
        x = self.node_of("x").meta["val"]
        return (int(x.shape[0]) if x.dim() == 3 else 1), int(x.shape[-2]), int(x.shape[-1])


def two_sided_flops(m: int, n: int) -> float:
    """A X B for X m×n: 2m²n for A X, 2mn² for (A X) B, in either association."""
    return 2.0 * m * m * n + 2.0 * m * n * n


def _cost(spec: TwoSidedSpec) -> Cost:
    batch, m, n = spec.shape()
    flops = batch * two_sided_flops(m, n)
    size = spec.node_of("x").meta["val"].element_size()
    moved = (2 * m * n + m * m + n * n) * size  # X in, result out, both factors in
    return Cost(flops=flops, bytes=float(batch * moved), matmul_flops=flops)


def _reference(spec: TwoSidedSpec) -> torch.Tensor:
    assert isinstance(spec.x, torch.Tensor) and isinstance(spec.left, torch.Tensor)
    assert isinstance(spec.right, torch.Tensor)
    a = spec.left.double().mT if spec.left_transposed else spec.left.double()
    b = spec.right.double().mT if spec.right_transposed else spec.right.double()
    return a @ spec.x.double() @ b


def _describe(spec: TwoSidedSpec, fmt: Callable[[Any], str]) -> list[str]:
    a = fmt(spec.left) + ("^T" if spec.left_transposed else "")
    b = fmt(spec.right) + ("^T" if spec.right_transposed else "")
    return [f"{a} @ {fmt(spec.x)} @ {b}", spec.association]


def _generation(node: fx.Node) -> int:
    """The most ``two_sided`` calls on any path into ``node``, over its ancestors only (a param's
    chain, tens of nodes, not the whole step graph)."""
    depth: dict[fx.Node, int] = {}
    stack: list[tuple[fx.Node, bool]] = [(node, False)]
    while stack:
        n, expanded = stack.pop()
        if n in depth:
            continue
        inputs = n.all_input_nodes
        if not expanded:
            stack.append((n, True))
            stack.extend((i, False) for i in inputs if i not in depth)
            continue
        own = int(n.op == "call_function" and n.target is TwoSidedSpec.op())
        depth[n] = max((depth[i] for i in inputs), default=0) + own
    return depth[node]


def _batch_key(spec: TwoSidedSpec) -> Hashable | None:
    """Shapes, flags, association, and the generation of X: SOAP projects back, then in again, then
    back once more per param; calls of one generation never read each other, so a stack of them
    cannot form a cycle (a stack of Q_L U Q_Rᵀ of step start and of the update would)."""
    x = spec.node_of("x").meta["val"]
    if x.dim() != 2:
        return None  # already batched
    generation = _generation(spec.node_of("x"))
    return (tuple(x.shape), x.dtype, spec.left_transposed, spec.right_transposed, spec.association, generation)


TWO_SIDED = register(
    OpFamily(
        spec=TwoSidedSpec,
        title="two-sided product A X B (Kronecker-basis projection, Shampoo preconditioning)",
        reference=_reference,
        describe=_describe,
        cost=_cost,
        batch=BatchRule(
            key=_batch_key,
            batched=lambda spec, stacked: spec.replace(x=stacked["x"], left=stacked["left"], right=stacked["right"]),
        ),
    )
)

__all__ = ["ASSOCIATIONS", "TWO_SIDED", "TwoSidedSpec", "two_sided", "two_sided_eager", "two_sided_flops"]
