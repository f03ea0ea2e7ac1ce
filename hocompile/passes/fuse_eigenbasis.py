# fx.Node.args is typed as a wide union (nodes, lists, dtypes, ...); this pass
# checks each node's target before reading its args, which mypy cannot follow.
# mypy: disable-error-code="union-attr"
"""fuse-eigenbasis: SOAP's sort-then-QR eigenbasis refresh becomes ``rayleigh_order`` + ``power_qr`` on one L Q.

Before (emerging-optimizers 0.3.0 SOAP, one Kronecker factor, after canonicalize)::

    t12 = aten.permute(Q, [1, 0])
    t13 = aten.mm(t12, L)                       # Qᵀ L          n³ multiply-adds
    t14 = aten.permute(Q, [1, 0])
    t15 = aten.mul.Tensor(t13, t14)
    t16 = aten.sum.dim_IntList(t15, [1])        # diag(Qᵀ L Q)
    t17 = aten.sort(t16, -1, True)
    t18 = getitem(t17, 1)                        # order (also permutes exp_avg_sq)
    t19 = aten.index.Tensor(Q, [None, t18])
    t30 = aten.mm(L, t19)                        # L Q[:, order]  n³ multiply-adds
    t31 = aten.linalg_qr(t30)
    t32 = getitem(t31, 0)

After::

    t12 = aten.mm(L, Q)                          # the one n³ product
    t13 = hocompile.rayleigh_order(t12, Q, descending)
    t14 = hocompile.power_qr(t12, columns=t13, householder)

Why it is exact: L is symmetric, so Qᵀ L = (L Q)ᵀ, and a column gather
commutes with the left product, L Q[:, order] = (L Q)[:, order]. The pass
proves the symmetry from the graph: L must be a Gram product ``A Aᵀ`` /
``Aᵀ A``, or a ``lerp``/``add`` of a state and such a Gram (SOAP's factor
update, symmetric as long as the state is, and SOAP only ever stores these
lerps into it, starting from zeros). The op arithmetic is eager's (see
:mod:`hocompile.ops.eigenbasis` for what is bitwise and what is not).

Declined, with the reason: anything else reading the Qᵀ L product, the
sort's values, Q[:, order] or R of the QR; a complete QR (``mode``
other than "reduced"); 3-D inputs; a factor not provably symmetric.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.fx as fx

from ..ir.declined import Declined
from ..ir.matrix_polynomial import is_call
from ..ops.eigenbasis import PowerQRSpec, RayleighOrderSpec
from .base import Pass, PassResult, with_declines

aten = torch.ops.aten


@dataclass(frozen=True)
class _Match:
    factor: fx.Node  # L (symmetric n×n)
    basis: fx.Node  # Q (n×n)
    sort: fx.Node  # aten.sort of diag(QᵀLQ): new nodes go before it
    order: fx.Node  # getitem(sort, 1): its readers read rayleigh_order instead
    qr: fx.Node  # aten.linalg_qr: power_qr goes before it
    q_new: fx.Node  # getitem(qr, 0): its readers read power_qr instead


@dataclass(frozen=True)
class FuseEigenbasis(Pass):
    """Replace each recognised SOAP eigenbasis refresh by one shared L Q, ``rayleigh_order`` and ``power_qr``."""

    name: ClassVar[str] = "fuse-eigenbasis"

    def __call__(self, gm: fx.GraphModule) -> PassResult:
        fused = 0
        reasons: list[str] = []
        for node in list(gm.graph.nodes):
            if not is_call(node, aten.linalg_qr.default):
                continue
            match = _match(node)
            if isinstance(match, Declined):
                reasons.append(self.decline(f"{node.name}: {match.reason}"))
                continue
            _replace(gm, match)
            fused += 1
        if fused:
            gm.graph.eliminate_dead_code()
            gm.recompile()
        summary = f"fused {fused} eigenbasis refresh(es)" if fused else "no sort-by-diag(QᵀLQ) → qr(L Q) found"
        return PassResult(gm, bool(fused), with_declines(summary, reasons), reasons)


def _only_user(node: fx.Node) -> fx.Node | None:
    return next(iter(node.users)) if len(node.users) == 1 else None


def _getitems(node: fx.Node) -> dict[int, fx.Node] | None:
    """The getitems reading a tuple-valued node, by index (None if it is read as a whole or twice)."""
    outs: dict[int, fx.Node] = {}
    for user in node.users:
        if not is_call(user, operator.getitem) or user.args[1] in outs:
            return None
        index: Any = user.args[1]
        outs[int(index)] = user
    return outs


def _transpose_of(node: Any) -> fx.Node | None:
    """X for ``permute(X, [1, 0])``, else None."""
    if is_call(node, aten.permute.default) and list(node.args[1]) == [1, 0]:
        return node.args[0]
    return None


def _is_gram(node: Any) -> bool:
    """``A @ Aᵀ`` or ``Aᵀ @ A``: symmetric by construction (both triangles are the same dot products)."""
    if not is_call(node, aten.mm.default):
        return False
    a, b = node.args
    return _transpose_of(b) is a or _transpose_of(a) is b


def _is_symmetric(node: fx.Node) -> bool:
    """A Gram, or SOAP's ``lerp(state, Gram, w)`` / ``state + Gram`` update of a (symmetric) state."""
    if _is_gram(node):
        return True
    if is_call(node, aten.lerp.Scalar, aten.lerp.Tensor, aten.add.Tensor):
        return isinstance(node.args[0], fx.Node) and node.args[0].op == "placeholder" and _is_gram(node.args[1])
    return False


def _diag_source(d: Any) -> tuple[fx.Node, fx.Node] | Declined:
    """(L, Q) for ``d = ((Qᵀ @ L) * Qᵀ).sum(1)``, or why ``d`` is not that diagonal."""
    if not is_call(d, aten.sum.dim_IntList) or list(d.args[1]) != [1] or d.kwargs or len(d.args) > 2:
        return Declined("sort key is not a row sum")
    prod = d.args[0]
    if not is_call(prod, aten.mul.Tensor) or _only_user(prod) is not d:
        return Declined("sort key is not the row sum of a product read only there")
    for qtl, qt in (prod.args, prod.args[::-1]):
        q = _transpose_of(qt)
        if q is None or not is_call(qtl, aten.mm.default) or _transpose_of(qtl.args[0]) is not q:
            continue
        if _only_user(qtl) is not prod:
            return Declined(f"Qᵀ L ({qtl.name}) is read elsewhere: it must be computed anyway")
        return qtl.args[1], q
    return Declined("sort key is not diag(Qᵀ L Q) spelled ((Qᵀ @ L) * Qᵀ).sum(1)")


def _match(qr: fx.Node) -> _Match | Declined:
    """The eigenbasis refresh ending in ``qr``, or why this QR is not one."""
    mode = qr.args[1] if len(qr.args) > 1 else qr.kwargs.get("mode", "reduced")
    if mode != "reduced":
        return Declined(f"QR mode {mode!r}: only the reduced Q is an orthogonal-iteration step")
    outs = _getitems(qr)
    if outs is None or set(outs) != {0}:
        return Declined("R of the QR is read: the op returns Q only")
    x: Any = qr.args[0]
    if not is_call(x, aten.mm.default) or _only_user(x) is not qr:
        return Declined("QR input is not a product L @ Q[:, order] read only by the QR")
    factor: Any = x.args[0]
    gathered: Any = x.args[1]
    val = factor.meta["val"]
    if val.dim() != 2 or val.shape[0] != val.shape[1]:
        return Declined(f"factor {tuple(val.shape)} is not a square matrix")
    if not (is_call(gathered, aten.index.Tensor) and len(gathered.args[1]) == 2 and gathered.args[1][0] is None):
        return Declined("QR input's right factor is not a column gather Q[:, order]")
    basis: Any = gathered.args[0]
    order: Any = gathered.args[1][1]
    if _only_user(gathered) is not x:
        return Declined("Q[:, order] is read elsewhere (the op does not return it)")
    if not is_call(order, operator.getitem) or order.args[1] != 1:
        return Declined("column order is not the indices of a sort")
    sort: Any = order.args[0]
    if not is_call(sort, aten.sort.default) or tuple(sort.args[1:]) not in ((-1, True), (0, True)) or sort.kwargs:
        return Declined("column order is not a descending sort (argsort(descending=True))")
    if set(_getitems(sort) or {-1}) != {1}:
        return Declined("the sorted values are read: only the order is computed")
    source = _diag_source(sort.args[0])
    if isinstance(source, Declined):
        return source
    if source != (factor, basis):
        return Declined("the sort's L and Q are not the QR's L and Q")
    if not _is_symmetric(factor):
        return Declined(f"cannot prove {factor.name} symmetric (a Gram or lerp(state, Gram)): Qᵀ L = (L Q)ᵀ needs it")
    return _Match(factor, basis, sort, order, qr, outs[0])


def _replace(gm: fx.GraphModule, match: _Match) -> None:
    """One L Q before the sort; rayleigh_order and power_qr read it; DCE removes Qᵀ L, the gather and L Q[:, order]."""
    graph = gm.graph
    with graph.inserting_before(match.sort):
        lq = graph.call_function(aten.mm.default, (match.factor, match.basis))
        lq.meta["val"] = match.qr.args[0].meta["val"]  # L @ Q[:, order]: same shape, dtype and layout
        order = graph.call_function(RayleighOrderSpec.op(), RayleighOrderSpec(lq=lq, q=match.basis).to_args())
        order.meta["val"] = match.order.meta["val"]
    match.order.replace_all_uses_with(order)
    with graph.inserting_before(match.qr):
        q_new = graph.call_function(PowerQRSpec.op(), PowerQRSpec(lq=lq, order=order).to_args())
    q_new.meta["val"] = match.q_new.meta["val"]
    match.q_new.replace_all_uses_with(q_new)


__all__ = ["FuseEigenbasis"]
