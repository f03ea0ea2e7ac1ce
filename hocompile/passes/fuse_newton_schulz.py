# fx.Node.args is typed as a wide union (nodes, lists, dtypes, ...); this pass
# checks each node's target before reading its args, which mypy cannot follow.
# mypy: disable-error-code="union-attr"
"""fuse-newton-schulz: recognise a whole Newton–Schulz program, make it one op.

The program, however it is spelled (torch.optim.Muon's ``addmm``, Keller
Jordan's ``b * A + c * A @ A``, emerging-optimizers' ``F.normalize`` and
coefficient lists): optional cast, optional transpose to wide, Frobenius
normalisation with eps, then k iterations of ``A = X Xᵀ; B = b A + c A²;
X = a X + B X``, then the transpose back and an optional cast.

Before (torch.optim.Muon, one parameter, 2 iterations)::

    t2 = aten._to_copy(t1, dtype=bf16)
    t3 = aten.permute(t2, [1, 0])
    t4 = aten.linalg_vector_norm(t3)
    t5 = aten.clamp(t4, h2)
    t6 = aten.div.Tensor(t3, t5)
    t7 = aten.permute(t6, [1, 0])
    t8 = aten.mm(t6, t7)
    t9 = aten.addmm(t8, t8, t8, beta=-4.775, alpha=2.0315)
    t10 = aten.addmm(t6, t9, t6, beta=3.4445)
    ...
    t15 = aten.permute(t14, [1, 0])

After::

    t2 = hocompile.newton_schulz(t1, [3.4445, 3.4445], [-4.775, -4.775], [2.0315, 2.0315], h2,
                                 'clamp', True, bf16, bf16, 'standard', [], 'native')

Matching is algebraic: each node is read as a linear combination of products
(:func:`lincomb`), so ``addmm(A, A, A, beta=b, alpha=c)`` and
``b * A + (c * A) @ A`` are the same thing. Anything else — another
polynomial, no normalisation, an intermediate used outside the chain — is
declined with the reason, and the graph is left as it was.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.fx as fx

from .. import ops  # noqa: F401  (registers hocompile::newton_schulz)
from ..graph import ROLE
from ..scalars import Expr
from .base import Pass, PassResult

aten = torch.ops.aten
Key = Any  # a base node, or ("mm", left_base, right_base)


def _is(node: Any, *targets: Any) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def scaled(node: Any) -> tuple[float, Any]:
    """``node`` as ``coef * base``, stripping multiplications by constants."""
    if _is(node, aten.mul.Tensor) and _number(node.args[1]):
        coef, base = scaled(node.args[0])
        return coef * float(node.args[1]), base
    return 1.0, node


def _transposed(node: Any) -> Any:
    """X for a node that is Xᵀ (last two dims swapped), else None."""
    if _is(node, aten.permute.default):
        dims = list(node.args[1])
        n = len(dims)
        if n >= 2 and dims == list(range(n - 2)) + [n - 1, n - 2]:
            return node.args[0]
    if _is(node, aten.transpose.int) and sorted(d % node.meta["val"].dim() for d in node.args[1:3]) == [
        node.meta["val"].dim() - 2, node.meta["val"].dim() - 1,
    ]:
        return node.args[0]
    return None


def _product(left: Any, right: Any) -> dict[Key, float]:
    cl, bl = scaled(left)
    cr, br = scaled(right)
    return {("mm", bl, br): cl * cr}


def lincomb(node: Any, stops: frozenset[fx.Node] = frozenset()) -> dict[Key, float]:
    """``node`` as a linear combination of bases and products of bases.

    Nodes in ``stops`` are bases even when they are products themselves
    (A = X Xᵀ is a base of B = b A + c A²).
    """
    out: dict[Key, float] = {}
    if node in stops:
        return {node: 1.0}

    def add(terms: dict[Key, float], weight: float) -> None:
        for key, coef in terms.items():
            out[key] = out.get(key, 0.0) + weight * coef

    if _is(node, aten.addmm.default, aten.baddbmm.default):
        add(lincomb(node.args[0], stops), float(node.kwargs.get("beta", 1.0)))
        add(_product(node.args[1], node.args[2]), float(node.kwargs.get("alpha", 1.0)))
    elif _is(node, aten.add.Tensor, aten.sub.Tensor) and isinstance(node.args[1], fx.Node):
        sign = 1.0 if node.target is aten.add.Tensor else -1.0
        add(lincomb(node.args[0], stops), 1.0)
        add(lincomb(node.args[1], stops), sign * float(node.kwargs.get("alpha", 1.0)))
    elif _is(node, aten.mul.Tensor) and _number(node.args[1]):
        add(lincomb(node.args[0], stops), float(node.args[1]))
    elif _is(node, aten.mm.default, aten.bmm.default):
        add(_product(node.args[0], node.args[1]), 1.0)
    else:
        out[node] = 1.0
    return out


@dataclass
class _Chain:
    source: fx.Node  # the tensor before cast/transpose: the op's input
    eps: Any
    eps_mode: str
    transpose: bool
    compute_dtype: torch.dtype
    coefficients: list[tuple[float, float, float]]
    end: fx.Node  # its users read the op's result instead


@dataclass(frozen=True)
class FuseNewtonSchulz(Pass):
    """Replace each recognised NS program by one ``hocompile::newton_schulz``."""

    name: ClassVar[str] = "fuse-newton-schulz"

    def __call__(self, gm: fx.GraphModule) -> PassResult:
        fused = 0
        fused_ends: list[fx.Node] = []
        reasons: list[str] = []
        for node in list(gm.graph.nodes):
            if node.graph is not gm.graph or not _is(node, aten.div.Tensor):
                continue
            chain, reason = _match(node)
            if chain is not None and any(chain.end is n for n in fused_ends):
                continue
            if chain is None:
                if reason:
                    reasons.append(self.decline(f"{node.name}: {reason}"))
                continue
            _replace(gm, chain)
            fused_ends.append(chain.end)
            fused += 1
        if fused:
            gm.graph.eliminate_dead_code()
        leftover = [n for n in gm.graph.nodes if _gram_of(n) is not None]
        for n in leftover:
            reasons.append(self.decline(f"{n.name}: X Xᵀ product outside any recognised Newton–Schulz chain"))
        gm.recompile()
        summary = f"fused {fused} Newton–Schulz chain(s)" if fused else "no Newton–Schulz chain found"
        if reasons:
            summary += f"; declined {len(reasons)}: " + reasons[0] + (" ..." if len(reasons) > 1 else "")
        return PassResult(gm, bool(fused), summary, reasons)


def _gram_of(node: Any) -> Any:
    """X if node is X Xᵀ (mm/bmm of X with its transpose), else None."""
    if not _is(node, aten.mm.default, aten.bmm.default):
        return None
    left, right = node.args[0], node.args[1]
    return left if _transposed(right) is left else None


def _normalization(div: fx.Node) -> tuple[Any, Any, str] | None:
    """(x, eps, mode) if div is x / clamp(‖x‖, eps) or x / (‖x‖ + eps)."""
    x, denom = div.args[0], div.args[1]
    if _is(denom, aten.expand.default):
        denom = denom.args[0]
    if _is(denom, aten.clamp.default, aten.clamp_min.default) and len(denom.args) >= 2:
        if _is(denom, aten.clamp.default) and len(denom.args) > 2 and denom.args[2] is not None:
            return None  # an upper clamp is not a normalisation
        norm, eps, mode = denom.args[0], denom.args[1], "clamp"
    elif _is(denom, aten.add.Tensor) and _scalar_arg(denom.args[1]):
        norm, eps, mode = denom.args[0], denom.args[1], "add"
    else:
        return None
    if not _is(norm, aten.linalg_vector_norm.default) or norm.args[0] is not x:
        return None
    ord_: Any = norm.args[1] if len(norm.args) > 1 else norm.kwargs.get("ord", 2)
    dims = norm.args[2] if len(norm.args) > 2 else norm.kwargs.get("dim")
    ndim = x.meta["val"].dim()
    if float(ord_) != 2.0:
        return None
    if dims is not None and sorted(d % ndim for d in dims) != [ndim - 2, ndim - 1]:
        return None
    if dims is None and ndim != 2:
        return None  # a norm over the whole batch is not per-matrix
    return x, eps, mode


def _scalar_arg(arg: Any) -> bool:
    """A constant or a host scalar (hyperparameter) input."""
    return _number(arg) or (
        isinstance(arg, fx.Node) and arg.op == "placeholder" and isinstance(arg.meta.get(ROLE), Expr)
    )


def _match(div: fx.Node) -> tuple[_Chain | None, str]:
    norm = _normalization(div)
    if norm is None:
        return None, ""  # an ordinary division: not a candidate, nothing to report
    start, eps, eps_mode = norm
    X: fx.Node = div
    # emerging-optimizers normalises in fp32, then casts to bf16 for the iterations.
    if len(X.users) == 1 and _is(next(iter(X.users)), aten._to_copy.default) and _only_dtype(next(iter(X.users))):
        X = next(iter(X.users))
    compute = X.meta["val"].dtype
    coefficients: list[tuple[float, float, float]] = []
    while (step := _iteration(X)) is not None:
        coefficients.append(step[0])
        X = step[1]
    if not coefficients:
        return None, "normalised matrix is not followed by a·X + (b·A + c·A²)·X iterations"
    source, transpose = start, False
    for _ in range(2):  # a cast and a transpose, in either order
        if (inner := _transposed(source)) is not None and not transpose:
            source, transpose = inner, True
        elif _is(source, aten._to_copy.default) and _only_dtype(source):
            source = source.args[0]
    end = X
    if len(end.users) == 1 and _is(next(iter(end.users)), aten._to_copy.default) and _only_dtype(
        next(iter(end.users))
    ):
        end = next(iter(end.users))  # emerging casts back to fp32 before transposing back
    if transpose:
        back = [u for u in end.users if _transposed(u) is end]
        if len(back) != 1 or len(end.users) != 1:
            return None, "transposed to wide but the result is not transposed back"
        end = back[0]
    return _Chain(source, eps, eps_mode, transpose, compute, coefficients, end), ""


def _only_dtype(node: fx.Node) -> bool:
    return set(node.kwargs) <= {"dtype"} and len(node.args) == 1


def _iteration(X: fx.Node) -> tuple[tuple[float, float, float], fx.Node] | None:
    """Match one iteration starting at X: returns (a, b, c) and the new X."""
    grams = [u for u in X.users if _is(u, aten.permute.default, aten.transpose.int) and _transposed(u) is X]
    for t in grams:
        for A in t.users:
            if _gram_of(A) is not X:
                continue
            for candidate in _later_users(X):
                terms = lincomb(candidate, frozenset({X}))
                found = _update_terms(terms, X, A)
                if found is None:
                    continue
                return found[0], candidate
    return None


def _later_users(X: fx.Node) -> list[fx.Node]:
    """Nodes that read X directly or through a scalar multiple (candidates for a X + B X)."""
    out: list[fx.Node] = []
    frontier = list(X.users)
    seen: set[fx.Node] = set()
    while frontier:
        node = frontier.pop(0)
        if node in seen or len(seen) > 64:
            continue
        seen.add(node)
        out.append(node)
        if _is(node, aten.mul.Tensor, aten.mm.default, aten.bmm.default):
            frontier += list(node.users)
    return out


def _update_terms(terms: dict[Key, float], X: fx.Node, A: fx.Node) -> tuple[tuple[float, float, float], Any] | None:
    if len(terms) != 2 or X not in terms:
        return None
    (prod,) = [k for k in terms if k is not X]
    if not (isinstance(prod, tuple) and prod[0] == "mm" and prod[2] is X):
        return None
    B, scale = prod[1], terms[prod]
    b_terms = lincomb(B, frozenset({A}))
    allowed = {A, ("mm", A, A)}
    if not set(b_terms) <= allowed or A not in b_terms:
        return None
    a = terms[X]
    b = scale * b_terms[A]
    c = scale * b_terms.get(("mm", A, A), 0.0)
    return (a, b, c), B


def _replace(gm: fx.GraphModule, chain: _Chain) -> None:
    """Insert the op and reroute the chain's readers; DCE removes the chain.

    Correctness does not depend on the chain being dead: an intermediate read
    elsewhere simply stays computed by its original nodes.
    """
    coeffs = chain.coefficients
    out_val = chain.end.meta["val"]
    args: tuple[Any, ...] = (
        chain.source,
        [a for a, _, _ in coeffs],
        [b for _, b, _ in coeffs],
        [c for _, _, c in coeffs],
        chain.eps,
        chain.eps_mode,
        chain.transpose,
        chain.compute_dtype,
        out_val.dtype,
        "standard",
        [],
        "native",
    )
    with gm.graph.inserting_before(chain.end):
        op = gm.graph.call_function(torch.ops.hocompile.newton_schulz.default, args)
    op.meta["val"] = out_val
    chain.end.replace_all_uses_with(op)
