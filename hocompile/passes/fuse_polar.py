# fx.Node.args is typed as a wide union (nodes, lists, dtypes, ...); this pass
# checks each node's target before reading its args, which mypy cannot follow.
# mypy: disable-error-code="union-attr"
"""fuse-polar: ``svd(X)`` → ``U @ Vh`` (optionally ``* S.sum()``) becomes one ``hocompile::polar``.

Before (emerging-optimizers MOP, one parameter)::

    t2 = aten._linalg_svd(t1)
    t3 = getitem(t2, 0)
    t4 = getitem(t2, 1)
    t5 = getitem(t2, 2)
    t6 = aten.mm(t3, t5)
    t7 = aten.sum(t4)
    t8 = aten.mul.Tensor(t6, t7)

After::

    t2 = hocompile.polar(t1, svd, scale=nuclear)

Spellings: ``torch.linalg.svd(X, full_matrices=False)`` or ``torch.svd(X)``
(its ``V.mT`` is a permute pair canonicalize removes), ``@``/``mm``/
``matmul``, the scale on either side of ``*``, ``S.sum()`` or
``S.sum(-1)``, or no scale. ``full_matrices=True`` is accepted for a square
X only (the same factors). The op with ``method="svd"`` makes exactly the
same calls, so the step stays bitwise eager; ``method="gram_eigh"`` is the
opt-in faster factor whose error grows like κ²·eps (see
:mod:`hocompile.ops.polar`), never the default.

Declined, with the reason: batched (3-D) or unreduced SVDs, an explicit
``driver``, U or Vh read by anything but ``U @ Vh``, singular values read for
anything but scaling that product by their sum, ``U @ Vh`` read elsewhere
when it is scaled. The SVD has to run anyway then, so fusing gains nothing.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.fx as fx

from ..ir.declined import Declined
from ..ir.matrix_polynomial import is_call
from ..ops.polar import METHODS, PolarSpec
from .base import Pass, PassResult, replace_with_op, with_declines

aten = torch.ops.aten


@dataclass(frozen=True)
class _Match:
    source: fx.Node  # X: the op's input
    scale: str  # "none" or "nuclear"
    end: fx.Node  # U @ Vh, or its product with S.sum(): its readers read the op instead


@dataclass(frozen=True)
class FusePolar(Pass):
    """Replace each recognised polar factor by one ``hocompile::polar`` (``method``: "svd" or opt-in "gram_eigh")."""

    name: ClassVar[str] = "fuse-polar"
    method: str = "svd"

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"fuse-polar method must be one of {METHODS}, got {self.method!r}")

    def __call__(self, gm: fx.GraphModule) -> PassResult:
        fused = 0
        reasons: list[str] = []
        for node in list(gm.graph.nodes):
            if not is_call(node, aten._linalg_svd.default):
                continue
            match = _match(node)
            if isinstance(match, Declined):
                reasons.append(self.decline(f"{node.name}: {match.reason}"))
                continue
            _replace(gm, match, self.method)
            fused += 1
        if fused:
            gm.graph.eliminate_dead_code()
            gm.recompile()
        summary = f"fused {fused} polar factor(s) ({self.method})" if fused else "no svd → U @ Vh found"
        return PassResult(gm, bool(fused), with_declines(summary, reasons), reasons)


def _svd_options(svd: fx.Node) -> tuple[bool, bool, Any]:
    """(full_matrices, compute_uv, driver) of an ``aten._linalg_svd`` call, defaults filled in."""
    names = ("A", "full_matrices", "compute_uv")
    values = dict(zip(names, svd.args)) | dict(svd.kwargs)
    return bool(values.get("full_matrices", False)), bool(values.get("compute_uv", True)), values.get("driver")


def _outputs(svd: fx.Node) -> dict[int, fx.Node] | Declined:
    """U, S, Vh by index: the getitems reading the svd (one each), or why not."""
    outs: dict[int, fx.Node] = {}
    for user in svd.users:
        index = user.args[1] if is_call(user, operator.getitem) else None
        if not isinstance(index, int) or index in outs:
            return Declined(f"svd result read as a whole by {user.name}")
        outs[index] = user
    return outs


def _only_user(node: Any) -> Any:
    """The one reader of ``node`` (None: several, none, or no node at all)."""
    if not isinstance(node, fx.Node) or len(node.users) != 1:
        return None
    return next(iter(node.users))


def _is_total_sum(node: Any, s: fx.Node) -> bool:
    """``S.sum()`` or ``S.sum(-1)``/``S.sum(0)`` of the 1-D S, no dtype or keepdim: a 0-d total."""
    if is_call(node, aten.sum.default):
        return node.args[0] is s and "dtype" not in node.kwargs
    if is_call(node, aten.sum.dim_IntList):
        dims = list(node.args[1]) if len(node.args) > 1 and node.args[1] is not None else []
        keepdim = bool(node.args[2]) if len(node.args) > 2 else bool(node.kwargs.get("keepdim", False))
        return node.args[0] is s and dims in ([0], [-1]) and not keepdim and "dtype" not in node.kwargs
    return False


def _match(svd: fx.Node) -> _Match | Declined:
    """The polar factor computed from ``svd``, or why this svd is not one."""
    source = svd.args[0]
    if not isinstance(source, fx.Node):
        return Declined("svd of a constant")
    full, compute_uv, driver = _svd_options(svd)
    if not compute_uv:
        return Declined("singular values only (compute_uv=False): no polar factor")
    if driver is not None:
        return Declined(f"explicit svd driver {driver!r}")
    x = source.meta["val"]
    if x.dim() != 2:
        return Declined(f"batched {x.dim()}-D svd input; fuse-polar matches matrices (batch-by-shape stacks them)")
    if full and x.shape[0] != x.shape[1]:
        return Declined("full_matrices=True on a non-square matrix: U @ Vh is no polar factor")
    outs = _outputs(svd)
    if isinstance(outs, Declined):
        return outs
    u, s, vh = outs.get(0), outs.get(1), outs.get(2)
    if u is None or vh is None:
        return Declined("U or Vh unused: no U @ Vh product")
    product = _only_user(u)
    if not (is_call(product, aten.mm.default) and product.args[0] is u and product.args[1] is vh):
        return Declined("U is read by something other than U @ Vh")
    if _only_user(vh) is not product:
        return Declined("Vh is read by something other than U @ Vh")
    if s is None or not s.users:
        return _Match(source, "none", product)
    total = _only_user(s)
    if not _is_total_sum(total, s):
        return Declined("singular values read beyond S.sum() (the svd must run anyway)")
    scaled = _only_user(total)
    if not (is_call(scaled, aten.mul.Tensor) and set(scaled.args[:2]) == {product, total}):
        return Declined("S.sum() is used other than to scale U @ Vh")
    if _only_user(product) is not scaled:
        return Declined("U @ Vh is read unscaled as well as scaled by S.sum()")
    return _Match(source, "nuclear", scaled)


def _replace(gm: fx.GraphModule, match: _Match, method: str) -> None:
    """Insert the op before the match's end and reroute its readers; DCE removes the svd and products."""
    spec = PolarSpec(x=match.source, method=method, scale=match.scale)
    replace_with_op(gm, match.end, spec)
