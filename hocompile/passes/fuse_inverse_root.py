# fx.Node.args is typed as a wide union (nodes, lists, dtypes, ...); this pass
# checks each node's target before reading its args, which mypy cannot follow.
# mypy: disable-error-code="union-attr"
"""fuse-inverse-root: Shampoo's matrix inverse root (eigh or coupled Newton) becomes one ``hocompile::inverse_root``.

Before (hocompile's Shampoo refresh, ``root_method="eigh"``, one factor)::

    t12 = aten._linalg_eigh(A)
    t13 = getitem(t12, 0)
    t14 = getitem(t12, 1)
    t15 = aten.clamp_min(t13, 0.0)
    t16 = aten.add.Tensor(t15, h6)               # + ε
    t17 = aten.pow.Tensor_Scalar(t16, -0.25)     # ^(-1/p)
    t18 = aten.unsqueeze(t17, -2)
    t19 = aten.mul.Tensor(t14, t18)
    t20 = aten.permute(t14, [1, 0])
    t21 = aten.mm(t19, t20)                      # Q diag(·) Qᵀ

After::

    t21 = hocompile.inverse_root(A, -1/4, eps=h6, eigh)

The coupled Newton iteration (``root_method="newton"``) is recognised from
its ridge ``A + ε·eye(n)`` forward: the scaling z = (p+1)/(2‖·‖_F), then
``T = M·(−1/p) + I·(p+1)/p``, ``X ← X T``, ``M ← T^p M`` (the power
compared node for node with a trace of ``torch.linalg.matrix_power``), up to
the symmetrisation ``(X + Xᵀ)·0.5``; the iteration count is read off the
chain. Every constant must be the one matrix_roots computes, so the op, which
calls matrix_roots itself, is bitwise the graph it replaces.

Declined, with the reason: a spectrum or basis read elsewhere (the eigh must
run anyway), an exponent that is not −1/p for an integer p, other spellings.
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

from ..ir.declined import Declined
from ..ir.matrix_polynomial import is_call, is_number
from ..ops.inverse_root import InverseRootSpec
from .base import Pass, PassResult, replace_with_op, with_declines

aten = torch.ops.aten


def _only_user(node: Any) -> Any:
    return next(iter(node.users)) if isinstance(node, fx.Node) and len(node.users) == 1 else None


def _scalar(value: Any) -> bool:
    return is_number(value) or (isinstance(value, fx.Node) and value.op == "placeholder")


def _root_of(exponent: Any, sign: float) -> int | None:
    """p for an exponent that is exactly ``sign / p`` as matrix_roots computes it (``-1.0 / root``)."""
    if not is_number(exponent) or exponent == 0:
        return None
    root = round(sign / exponent)
    return root if root >= 1 and sign / root == exponent else None


def _transpose_of(node: Any) -> Any:
    if is_call(node, aten.permute.default) and list(node.args[1]) == [1, 0]:
        return node.args[0]
    return None


# ------------------------------------------------------------------ eigh


def _reads_both(eigh: fx.Node) -> bool:
    """Eigenvalues and eigenvectors both read: a root candidate (SOAP's basis-only eighs are not)."""
    return {u.args[1] for u in eigh.users if is_call(u, operator.getitem)} >= {0, 1}


def _match_eigh(eigh: fx.Node) -> tuple[InverseRootSpec, fx.Node] | Declined:
    """(spec, the product it replaces) for the eigh-path root starting at ``eigh``, or why not."""
    a: Any = eigh.args[0]
    if eigh.kwargs or len(eigh.args) > 1 and (list(eigh.args[1:]) not in (["L"], ["L", True])):
        return Declined("eigh with non-default UPLO/compute_v")
    if not isinstance(a, fx.Node) or a.meta["val"].dim() != 2:
        return Declined("eigh of a batched input (batch-by-shape stacks matrices)")
    outs: dict[Any, fx.Node] = {u.args[1]: u for u in eigh.users if is_call(u, operator.getitem)}
    if len(outs) != len(eigh.users) or set(outs) != {0, 1}:
        return Declined("eigh result read other than as (eigenvalues, eigenvectors)")
    values, vectors = outs[0], outs[1]
    clamp = _only_user(values)
    if not (is_call(clamp, aten.clamp_min.default) and clamp.args[1] in (0, 0.0)):
        return Declined("eigenvalues not clamped at 0 and read only there")
    shift = _only_user(clamp)
    if not (is_call(shift, aten.add.Tensor) and shift.args[0] is clamp and not shift.kwargs and _scalar(shift.args[1])):
        return Declined("clamped eigenvalues not shifted by a scalar ε")
    power = _only_user(shift)
    root = _root_of(power.args[1], -1.0) if is_call(power, aten.pow.Tensor_Scalar) else None
    if root is None:
        return Declined("eigenvalues not raised to -1/p for an integer p")
    column = _only_user(power)
    if not (is_call(column, aten.unsqueeze.default) and column.args[1] in (-2, 0)):
        return Declined("scales not applied as a row (unsqueeze(-2))")
    scaled = _only_user(column)
    if not (is_call(scaled, aten.mul.Tensor) and list(scaled.args) == [vectors, column]):
        return Declined("eigenvectors not scaled as Q * s[None, :]")
    if len(vectors.users) != 2:
        return Declined("eigenvectors read beyond Q diag(s) Qᵀ")
    vt = next(u for u in vectors.users if u is not scaled)
    product = _only_user(scaled)
    if _transpose_of(vt) is not vectors or not is_call(product, aten.mm.default) or list(product.args) != [scaled, vt]:
        return Declined("not (Q * s) @ Qᵀ")
    return InverseRootSpec(a=a, root=root, epsilon=shift.args[1], method="eigh"), product


# ------------------------------------------------------------------ coupled Newton


@functools.cache
def _power_trace(root: int) -> fx.Graph:
    """``torch.linalg.matrix_power(t, root)`` as aten calls (how many products, in which order)."""
    return make_fx(lambda t: torch.linalg.matrix_power(t, root))(torch.eye(2)).graph


def _same_power(ref: fx.Node, node: Any, t: fx.Node) -> bool:
    """``node`` computes ref's product of ``t`` with the same calls (a ref clone is no call)."""
    if ref.op == "placeholder":
        return node is t
    if ref.target is aten.clone.default:
        return _same_power(ref.args[0], node, t)  # type: ignore[arg-type]
    return (
        is_call(node, ref.target)
        and len(node.args) == len(ref.args)
        and all(_same_power(r, n, t) for r, n in zip(ref.args, node.args))  # type: ignore[arg-type]
    )


def _power_of(node: Any, t: fx.Node, root: int) -> bool:
    output = next(n for n in _power_trace(root).nodes if n.op == "output")
    return _same_power(output.args[0], node, t)  # type: ignore[arg-type]


def _user(node: fx.Node, target: Any) -> Any:
    """The one user of ``node`` calling ``target`` (None: none or several)."""
    found = [u for u in node.users if is_call(u, target)]
    return found[0] if len(found) == 1 else None


def _scales_eye(eye: fx.Node) -> bool:
    """``eye(n)`` read as ``eye · ε``: a Newton root's ridge, worth matching (an identity state is not)."""
    return any(is_call(u, aten.mul.Tensor) and u.args[0] is eye and _scalar(u.args[1]) for u in eye.users)


def _match_newton(eye: fx.Node) -> tuple[InverseRootSpec, fx.Node] | Declined:
    """(spec, the symmetrised result) for the coupled Newton root built on ``eye``, or why not."""
    n = eye.meta["val"].shape[0]
    ridge_eps = next((u for u in eye.users if is_call(u, aten.mul.Tensor) and u.args[0] is eye), None)
    ridge = _only_user(ridge_eps)
    if ridge_eps is None or not _scalar(ridge_eps.args[1]) or not is_call(ridge, aten.add.Tensor) or ridge.kwargs:
        return Declined("eye(n) is not used as A + ε·I")
    a: Any = ridge.args[0]
    eps: Any = ridge_eps.args[1]
    if ridge.args[1] is not ridge_eps or not isinstance(a, fx.Node) or tuple(a.meta["val"].shape) != (n, n):
        return Declined("not A + ε·I for an n×n A")
    norm = _user(ridge, aten.linalg_vector_norm.default)
    doubled = _only_user(norm)
    inverse = _only_user(doubled)
    z = _only_user(inverse)
    if not (
        norm is not None
        and list(norm.args[1:]) == [2, [0, 1]]
        and is_call(doubled, aten.mul.Tensor)
        and doubled.args[1] == 2.0
        and is_call(inverse, aten.reciprocal.default)
        and is_call(z, aten.mul.Tensor)
    ):
        return Declined("no z = (p + 1) / (2 ‖A + εI‖_F)")
    root = round(z.args[1] - 1.0) if is_number(z.args[1]) else 0
    if root < 1 or z.args[1] != root + 1.0:
        return Declined("scale numerator is not p + 1 for an integer p")
    x0_scale = _user(z, aten.pow.Tensor_Scalar)
    x = _only_user(x0_scale)
    m = _user(z, aten.mul.Tensor)
    if x0_scale is None or x0_scale.args[1] != 1.0 / root or not is_call(x, aten.mul.Tensor) or x.args[1] is not eye:
        return Declined("X₀ is not z^(1/p)·I")
    if m is None or m is x or list(m.args) != [z, ridge] or len(ridge.users) != 2:
        return Declined("M₀ is not z·(A + εI)")
    iterations = 0
    while True:
        # M is read twice: by this scaling and by the T^p @ M that updates it
        mt = next((u for u in m.users if is_call(u, aten.mul.Tensor) and u.args[1] == -1.0 / root), None) if m else None
        t = _only_user(mt)
        if not (
            is_call(t, aten.add.Tensor) and list(t.args) == [mt, eye] and t.kwargs == {"alpha": (root + 1.0) / root}
        ):
            break
        step = _only_user(x)
        if not (is_call(step, aten.mm.default) and list(step.args) == [x, t]):
            return Declined(f"iteration {iterations + 1}: X is not updated as X @ T")
        x, iterations = step, iterations + 1
        m = next((u for u in _mm_users(t) if _power_of(u.args[0], t, root) and u.args[1] is m), None)
        if m is None and len(t.users) > 1:
            return Declined(f"iteration {iterations}: M is not updated as matrix_power(T, p) @ M")
    if iterations == 0:
        return Declined("no Newton iteration found after M₀")
    plus = _user(x, aten.add.Tensor)  # X is read by this add and by the permute it adds
    half = _only_user(plus)
    if not (
        is_call(plus, aten.add.Tensor)
        and plus.args[0] is x
        and _transpose_of(plus.args[1]) is x
        and is_call(half, aten.mul.Tensor)
        and half.args[1] == 0.5
        and len(x.users) == 2
    ):
        return Declined("the result is not symmetrised as (X + Xᵀ)·0.5")
    return InverseRootSpec(a=a, root=root, epsilon=eps, method="newton", iterations=iterations), half


def _mm_users(t: fx.Node) -> list[fx.Node]:
    """The products ``P @ M`` whose P is built from ``t`` alone (the candidates for ``T^p @ M``)."""
    seen: list[fx.Node] = []
    frontier = [t]
    while frontier:
        node = frontier.pop()
        for user in node.users:
            if is_call(user, aten.mm.default) and user not in seen:
                seen.append(user)
                frontier.append(user)
    return seen


# ------------------------------------------------------------------ the pass


@dataclass(frozen=True)
class FuseInverseRoot(Pass):
    """Replace each recognised matrix inverse root (eigh or coupled Newton) by one ``hocompile::inverse_root``."""

    name: ClassVar[str] = "fuse-inverse-root"

    def __call__(self, gm: fx.GraphModule) -> PassResult:
        matches: list[tuple[InverseRootSpec, fx.Node]] = []
        reasons: list[str] = []
        # Match all, then rewrite: two roots never share nodes, and nothing is erased mid-walk.
        for node in gm.graph.nodes:
            if is_call(node, aten._linalg_eigh.default) and _reads_both(node):
                match = _match_eigh(node)
            elif is_call(node, aten.eye.default) and _scales_eye(node):
                match = _match_newton(node)
            else:
                continue
            if isinstance(match, Declined):
                reasons.append(self.decline(f"{node.name}: {match.reason}"))
                continue
            matches.append(match)
        for spec, end in matches:
            replace_with_op(gm, end, spec)
        fused = len(matches)
        if fused:
            gm.graph.eliminate_dead_code()
            gm.recompile()
        summary = f"fused {fused} inverse root(s)" if fused else "no eigh or coupled-Newton inverse root found"
        return PassResult(gm, bool(fused), with_declines(summary, reasons), reasons)


__all__ = ["FuseInverseRoot"]
