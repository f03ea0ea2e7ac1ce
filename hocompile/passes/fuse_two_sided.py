# fx.Node.args is typed as a wide union (nodes, lists, dtypes, ...); this pass
# checks each node's target before reading its args, which mypy cannot follow.
# mypy: disable-error-code="union-attr"
"""fuse-two-sided: a matrix between two square factors, ``A X B``, becomes one ``hocompile::two_sided``.

Before (SOAP's projection of G into the basis, ``tensordot`` per dimension)::

    t25 = aten.permute(G, [1, 0])
    t26 = aten.mm(t25, Q_L)                      # Gᵀ Q_L = (Q_Lᵀ G)ᵀ
    t27 = aten.permute(t26, [1, 0])
    t28 = aten.mm(t27, Q_R)                      # Q_Lᵀ G Q_R

and (hocompile's Shampoo, ``L̂ @ M`` then ``@ R̂``)::

    t46 = aten.mm(L_root, M)
    t47 = aten.mm(t46, R_root)

After::

    t28 = hocompile.two_sided(Q_L^T @ G @ Q_R, tensordot)
    t47 = hocompile.two_sided(L_root @ M @ R_root, left_first)

A and B may be read transposed (``permute(Q, [1, 0])``: the projection back,
``Q_L U Q_Rᵀ``). The op keeps the association and the exact ``mm`` calls
(see :mod:`hocompile.ops.two_sided`), so the step stays bitwise.

Declined, with the reason (only where a chain of two products was found):
factors that are not square m×m and n×n for an m×n X (REKLS's ``G C Gᵀ``,
a Gram-like product, not a projection), an X that is itself a matrix
product (a longer chain: which three factors are meant is ambiguous),
a factor that is itself a product (a matrix power chain such as the
coupled Newton iteration's), an inner product read elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.fx as fx

from ..ir.declined import Declined
from ..ir.matrix_polynomial import is_call
from ..ops.two_sided import TwoSidedSpec
from .base import Pass, PassResult, replace_with_op, with_declines

aten = torch.ops.aten


def _transpose_of(node: Any) -> Any:
    if is_call(node, aten.permute.default) and list(node.args[1]) == [1, 0]:
        return node.args[0]
    return None


def _operand(node: Any) -> tuple[fx.Node, bool]:
    """(tensor, transposed): ``permute(Q, [1, 0])`` reads Q transposed."""
    inner = _transpose_of(node)
    return (inner, True) if isinstance(inner, fx.Node) else (node, False)


def _inner(end: fx.Node) -> tuple[str, Any, Any, Any] | None:
    """(association, inner mm, the A operand node, X) of a two-product chain ending in ``end``, else None."""
    first: Any = end.args[0]
    transposed = _transpose_of(first)
    if is_call(transposed, aten.mm.default) and _transpose_of(transposed.args[0]) is not None:
        # tensordot: mm(Xᵀ, Aᵀ)ᵀ; the X is under the first permute
        return "tensordot", transposed, transposed.args[1], _transpose_of(transposed.args[0])
    if is_call(first, aten.mm.default):
        return "left_first", first, first.args[0], first.args[1]
    return None


def _match(end: fx.Node, association: str, inner: fx.Node, a_arg: fx.Node, x: Any) -> TwoSidedSpec | Declined:
    if not isinstance(x, fx.Node):
        return Declined("X is not a graph value")
    chain = [inner] + ([end.args[0], inner.args[0]] if association == "tensordot" else [])
    if any(len(n.users) != 1 for n in chain):
        return Declined(f"an inner product or view of {end.name} is read elsewhere (it must be computed anyway)")
    if is_call(x, aten.mm.default, aten.addmm.default):
        return Declined(f"X {x.name} is itself a product: a longer chain, no projection")
    left, a_is_permute = _operand(a_arg)
    right, right_transposed = _operand(end.args[1])
    if any(is_call(f, aten.mm.default, aten.addmm.default) or f is x for f in (left, right)):
        return Declined("a factor is itself a product or X: a matrix power chain, no projection")
    # tensordot computes mm(Xᵀ, Aᵀ): A = leftᵀ when the mm reads left itself.
    left_transposed = not a_is_permute if association == "tensordot" else a_is_permute
    m, n = x.meta["val"].shape if x.meta["val"].dim() == 2 else (None, None)
    if m is None:
        return Declined("X is not a matrix")
    if tuple(left.meta["val"].shape) != (m, m) or tuple(right.meta["val"].shape) != (n, n):
        shapes = f"{tuple(left.meta['val'].shape)}, {tuple(right.meta['val'].shape)}"
        return Declined(f"factors {shapes} are not {m}x{m} and {n}x{n}")
    return TwoSidedSpec(x, left, right, left_transposed, right_transposed, association)


@dataclass(frozen=True)
class FuseTwoSided(Pass):
    """Replace each recognised ``A X B`` chain of two ``mm`` by one ``hocompile::two_sided``."""

    name: ClassVar[str] = "fuse-two-sided"

    def __call__(self, gm: fx.GraphModule) -> PassResult:
        fused = 0
        reasons: list[str] = []
        # Graph order: a projection back is fused before the projection in that reads it.
        for node in list(gm.graph.nodes):
            if not is_call(node, aten.mm.default):
                continue
            chain = _inner(node)
            if chain is None:
                continue  # one product, not a chain of two: no candidate
            spec = _match(node, *chain)
            if isinstance(spec, Declined):
                reasons.append(self.decline(f"{node.name}: {spec.reason}"))
                continue
            replace_with_op(gm, node, spec)
            gm.graph.erase_node(node)
            fused += 1
        if fused:
            gm.graph.eliminate_dead_code()
            gm.recompile()
        summary = f"fused {fused} two-sided product(s)" if fused else "no A X B chain of two products found"
        return PassResult(gm, bool(fused), with_declines(summary, reasons), reasons)


__all__ = ["FuseTwoSided"]
