# fx.Node.args is typed as a wide union (nodes, lists, dtypes, ...); this pass
# checks each node's target before reading its args, which mypy cannot follow.
# mypy: disable-error-code="union-attr"
"""fuse-factor-update: a Kronecker factor's Gram lerp/addmm becomes one ``hocompile::factor_update``.

Before (emerging-optimizers SOAP, the left and right factors of one param)::

    t0 = aten.permute(G, [1, 0])
    t1 = aten.mm(G, t0)                          # G Gᵀ
    t2 = aten.lerp.Scalar(L, t1, h0)
    t3 = aten.permute(G, [1, 0])
    t4 = aten.mm(t3, G)                          # Gᵀ G
    t5 = aten.lerp.Scalar(R, t4, h0)

After::

    t2 = hocompile.factor_update(L, G @ G^T, lerp, weight=h0)
    t5 = hocompile.factor_update(R, G^T @ G, lerp, weight=h0)

Spellings: ``lerp`` with a scalar weight (SOAP), ``addmm(F, G, Gᵀ, beta=β,
alpha=w)`` (hocompile's Shampoo), either side. The op makes eager's calls
(see :mod:`hocompile.ops.factor_update`), so the step stays bitwise.

Declined, with the reason: a product that is no Gram of one matrix — among
them REKLS's KL-Shampoo update ``lerp(L, G C Gᵀ, w)``, a three-factor
product with a correction matrix C, which this op does not cover — a Gram
read elsewhere too, a tensor weight, batched (3-D) factors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.fx as fx

from ..ir.declined import Declined
from ..ir.matrix_polynomial import is_call, is_number
from ..ops.factor_update import FactorUpdateSpec
from .base import Pass, PassResult, replace_with_op, with_declines

aten = torch.ops.aten


def _transpose_of(node: Any) -> Any:
    """X for ``permute(X, [1, 0])``, else None."""
    if is_call(node, aten.permute.default) and list(node.args[1]) == [1, 0]:
        return node.args[0]
    return None


def _gram(a: Any, b: Any) -> tuple[fx.Node, str] | Declined:
    """(G, side) for the product ``a @ b`` = ``G Gᵀ`` (left) or ``Gᵀ G`` (right), or why not."""
    if _transpose_of(b) is a and isinstance(a, fx.Node):
        return a, "left"
    if _transpose_of(a) is b and isinstance(b, fx.Node):
        return b, "right"
    return Declined("the product is not the Gram of one matrix (G Gᵀ or Gᵀ G)")


def _scalar(value: Any) -> bool:
    """A number or a host scalar (a placeholder): what the op's float arguments may be."""
    return is_number(value) or (isinstance(value, fx.Node) and value.op == "placeholder")


def _match(node: fx.Node) -> FactorUpdateSpec | Declined:
    """The spec of the factor update ending in ``node`` (a lerp or addmm), or why it is none."""
    factor: Any = node.args[0]
    if not isinstance(factor, fx.Node) or factor.meta["val"].dim() != 2:
        return Declined("factor is not a matrix (batched factors are batch-by-shape's)")
    if is_call(node, aten.lerp.Scalar):
        product: Any = node.args[1]
        weight: Any = node.args[2] if len(node.args) > 2 else node.kwargs.get("weight")
        if len(product.users) != 1:
            return Declined(f"the Gram {product.name} is read elsewhere too (it must be computed anyway)")
        found = _gram(*product.args)
        form = "lerp"
        beta_value: Any = 1.0
    else:
        values = dict(zip(("self", "mat1", "mat2"), node.args)) | dict(node.kwargs)
        found = _gram(values["mat1"], values["mat2"])
        form, beta_value, weight = "addmm", values.get("beta", 1.0), values.get("alpha", 1.0)
    if isinstance(found, Declined):
        return Declined(found.reason + (" (REKLS's KL-Shampoo G C Gᵀ is not covered)" if form == "lerp" else ""))
    if not (_scalar(weight) and _scalar(beta_value)):
        return Declined("weight or beta is a tensor, not a (host) scalar")
    g, side = found
    return FactorUpdateSpec(factor=factor, g=g, side=side, form=form, weight=weight, beta=beta_value)


@dataclass(frozen=True)
class FuseFactorUpdate(Pass):
    """Replace each recognised Kronecker factor update by one ``hocompile::factor_update``."""

    name: ClassVar[str] = "fuse-factor-update"

    def __call__(self, gm: fx.GraphModule) -> PassResult:
        fused = 0
        reasons: list[str] = []
        for node in list(gm.graph.nodes):
            # Only a square lerp towards a product can be a factor update; others (a momentum's lerp,
            # Adam's moments in the eigenbasis) are skipped silently rather than declined.
            val = node.meta.get("val")
            square = isinstance(val, torch.Tensor) and val.dim() == 2 and val.shape[0] == val.shape[1]
            lerp_of_product = is_call(node, aten.lerp.Scalar) and is_call(node.args[1], aten.mm.default) and square
            if not (lerp_of_product or is_call(node, aten.addmm.default)):
                continue
            spec = _match(node)
            if isinstance(spec, Declined):
                reasons.append(self.decline(f"{node.name}: {spec.reason}"))
                continue
            replace_with_op(gm, node, spec)
            gm.graph.erase_node(node)
            fused += 1
        if fused:
            gm.graph.eliminate_dead_code()
            gm.recompile()
        summary = f"fused {fused} factor update(s)" if fused else "no Gram lerp/addmm of a Kronecker factor found"
        return PassResult(gm, bool(fused), with_declines(summary, reasons), reasons)


__all__ = ["FuseFactorUpdate"]
