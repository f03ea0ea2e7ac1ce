# fx.Node.args is typed as a wide union (nodes, lists, dtypes, ...); every
# rule checks the node's target before reading its args, which mypy cannot follow.
# mypy: disable-error-code="union-attr"
"""Graph nodes read as noncommutative polynomials in a matrix X and its transpose.

The algebra behind fuse-newton-schulz. A node built from X by products
(``mm``, ``bmm``, ``addmm``, ``baddbmm``), linear combinations with constant
weights (``add``, ``sub``, ``mul``/``div`` by a number, ``neg``, the
``beta``/``alpha`` of ``addmm``, a number added to the diagonal) and transposes is a polynomial in the letters
X and Xᵀ; :func:`lincomb` expands it into words. Every grouping a Muon
implementation writes lands on the same three words X, X·Xᵀ·X and
X·Xᵀ·X·Xᵀ·X, whose weights are an iteration's a, b, c::

    B = b A + c A²;  X = a X + B X        (A = X Xᵀ)   Keller Jordan, torch
    B = A X;  X = a X + b B + c A B                     product grouped the other way
    A = XᵀX;  X = a X + X (b A + c A²)                 tall, not transposed
    Y = c A; Y += b I; Y = Y A; Y += a I; X = Y X       Horner form (``diagonal().add_``)
    addmm(empty, X, Xᵀ, beta=0), X.mul(1.0), baddbmm    spellings of the same words

Anything else — a tensor-valued weight, an elementwise product, a node that
does not derive from X — is an opaque letter of its own, so a polynomial that
mentions one is never mistaken for Newton–Schulz. Expansion stops at a
degree (5 for NS), so words never blow up when it is asked about later nodes.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from .declined import Declined

aten = torch.ops.aten
Letter = tuple[fx.Node, bool]  # a node, transposed or not
Word = tuple[Letter, ...]
Poly = dict[Word, float]

_LINEAR_SAME_SHAPE = {aten.expand.default, aten.view.default, aten._unsafe_view.default, aten.reshape.default}


def is_call(node: Any, *targets: Any) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets


def is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def transposed(node: Any) -> Any:
    """X for a node that is Xᵀ (last two dims swapped), else None."""
    if is_call(node, aten.permute.default):
        dims = list(node.args[1])
        n = len(dims)
        if n >= 2 and dims == list(range(n - 2)) + [n - 1, n - 2]:
            return node.args[0]
    if is_call(node, aten.transpose.int):
        rank = node.meta["val"].dim()
        if rank >= 2 and sorted(int(d) % rank for d in node.args[1:3]) == [rank - 2, rank - 1]:
            return node.args[0]
    return None


def identity_shift(node: Any) -> tuple[fx.Node, float, tuple[fx.Node, ...]] | None:
    """(M, s, the nodes reading M's diagonal) if node is M + s·I, as ``M.diagonal().add_(s)`` traces."""
    if not is_call(node, aten.diagonal_scatter.default):
        return None
    m, src, *where = node.args
    shifted: Any = src.args[0] if is_call(src, aten.add.Tensor) and is_number(src.args[1]) else None
    rank, shape = node.meta["val"].dim(), node.meta["val"].shape
    if shape[-1] != shape[-2]:
        return None  # on a rectangular M, "+ s·I" is no polynomial identity
    last_two = [rank - 2, rank - 1]
    if not is_call(shifted, aten.diagonal.default) or shifted.args[0] is not m or "alpha" in src.kwargs:
        return None
    for args in (where, shifted.args[1:]):
        offset, dim1, dim2 = (list(args) + [0, 0, 1][len(args):])[:3]
        if offset != 0 or sorted(int(d) % rank for d in (dim1, dim2)) != last_two:
            return None
    return m, float(src.args[1]), (shifted, src)


def _same_shape(node: fx.Node, *operands: Any) -> bool:
    """No broadcasting: a sum of matrices only (``addmm(bias, ...)`` with a 1-D bias is no polynomial)."""
    shape = node.meta["val"].shape
    return all(isinstance(o, fx.Node) and o.meta["val"].shape == shape for o in operands)


def _terms(node: fx.Node) -> list[tuple[float, tuple[fx.Node, ...]]] | None:
    """``node`` as Σ weight·(product of operand nodes); None: not linear-polynomial (an opaque letter)."""
    args: Any = node.args
    kwargs: Any = node.kwargs
    if is_call(node, aten.mm.default, aten.bmm.default):
        return [(1.0, (args[0], args[1]))]
    if is_call(node, aten.addmm.default, aten.baddbmm.default):
        beta, alpha = kwargs.get("beta", 1.0), kwargs.get("alpha", 1.0)
        if not (is_number(beta) and is_number(alpha)) or (beta != 0 and not _same_shape(node, args[0])):
            return None
        # beta=0 ignores the input (even an uninitialised ``empty``), as aten does.
        return [(float(alpha), (args[1], args[2]))] + ([(float(beta), (args[0],))] if beta != 0 else [])
    if is_call(node, aten.add.Tensor, aten.sub.Tensor) and isinstance(args[1], fx.Node):
        alpha = kwargs.get("alpha", 1.0)
        if not is_number(alpha) or not _same_shape(node, args[0], args[1]):
            return None
        sign = 1.0 if node.target is aten.add.Tensor else -1.0
        return [(1.0, (args[0],)), (sign * float(alpha), (args[1],))]
    if is_call(node, aten.mul.Tensor) and is_number(args[1]):
        return [(float(args[1]), (args[0],))]
    if is_call(node, aten.div.Tensor) and is_number(args[1]) and args[1] != 0:
        return [(1.0 / float(args[1]), (args[0],))]
    if is_call(node, aten.neg.default):
        return [(-1.0, (args[0],))]
    if (shift := identity_shift(node)) is not None:
        return [(1.0, (shift[0],)), (shift[1], ())]  # no factor: the empty word, the identity
    if is_call(node, *_LINEAR_SAME_SHAPE) and list(args[0].meta["val"].shape) == list(node.meta["val"].shape):
        return [(1.0, (args[0],))]
    return None


def reads(user: fx.Node, node: fx.Node) -> bool:
    """Does ``user``'s value depend on ``node``? Not as the input of an addmm with beta=0
    (a reused buffer: ``addmm(gram, X, Xᵀ, beta=0, out=gram)``)."""
    terms = _terms(user) if transposed(user) is None else None
    if terms is None or not is_call(user, aten.addmm.default, aten.baddbmm.default):
        return True
    return any(node in factors for _, factors in terms)


def _transpose_word(word: Word) -> Word:
    return tuple((node, not t) for node, t in reversed(word))


class Expansion:
    """Memoised expansion of nodes into polynomials over ``stops`` and opaque letters.

    ``inside(node)`` is the set of nodes the expansion of ``node`` went
    through (``node`` itself included, stops and opaque letters not): the
    subgraph that computes it from the stops.
    """

    def __init__(self, stops: frozenset[fx.Node], max_degree: int = 5) -> None:
        self.stops, self.max_degree = stops, max_degree
        self._poly: dict[fx.Node, Poly | None] = {}
        self._inside: dict[fx.Node, frozenset[fx.Node]] = {}
        self.too_high: list[fx.Node] = []  # nodes whose degree exceeded max_degree, in discovery order

    def poly(self, node: fx.Node) -> Poly | None:
        """The polynomial ``node`` computes; None when its degree exceeds ``max_degree``."""
        if node not in self._poly:
            self._poly[node], self._inside[node] = self._expand(node)
        return self._poly[node]

    def inside(self, node: fx.Node) -> frozenset[fx.Node]:
        self.poly(node)
        return self._inside[node]

    def is_letter(self, node: fx.Node) -> bool:
        return node in self.stops or (transposed(node) is None and _terms(node) is None)

    def _expand(self, node: fx.Node) -> tuple[Poly | None, frozenset[fx.Node]]:
        if self.is_letter(node):
            return {((node, False),): 1.0}, frozenset()
        if (inner := transposed(node)) is not None:
            p = self.poly(inner)
            if p is None:
                return None, frozenset()
            return {_transpose_word(w): v for w, v in p.items()}, self._inside[inner] | {node}
        out: Poly = {}
        inside: set[fx.Node] = {node, *(shift[2] if (shift := identity_shift(node)) else ())}
        for weight, factors in _terms(node) or []:
            product: Poly = {(): weight}  # the empty word: the scalar weight
            for f in factors:
                p = self.poly(f)
                inside |= self._inside[f]
                if p is None:
                    return None, frozenset(inside)
                more = self._multiply(product, p)
                if more is None:
                    self.too_high.append(node)
                    return None, frozenset(inside)
                product = more
            for w, v in product.items():
                out[w] = out.get(w, 0.0) + v
        return out, frozenset(inside)

    def _multiply(self, left: Poly, right: Poly) -> Poly | None:
        out: Poly = {}
        for wl, vl in left.items():
            for wr, vr in right.items():
                word = wl + wr
                if len(word) > self.max_degree:
                    return None
                out[word] = out.get(word, 0.0) + vl * vr
        return out


def lincomb(node: fx.Node, stops: frozenset[fx.Node], max_degree: int = 5) -> Poly | None:
    """``node`` as a linear combination of words over ``stops`` and opaque nodes (see module docstring)."""
    return Expansion(stops, max_degree).poly(node)


def odd_coefficients(poly: Poly, x: fx.Node, of_transpose: bool = False) -> tuple[float, float, float] | Declined:
    """(a, b, c) if ``poly`` is a X + b X·Xᵀ·X + c X·Xᵀ·X·Xᵀ·X with b or c nonzero; else why not.

    ``of_transpose``: the same in Y = Xᵀ (a Y + b Y·Yᵀ·Y + ...).
    """
    letter, tr = (x, of_transpose), (x, not of_transpose)
    index = {(letter,): 0, (letter, tr, letter): 1, (letter, tr, letter, tr, letter): 2}
    coef = [0.0, 0.0, 0.0]
    for word, weight in poly.items():
        if weight == 0.0:
            continue
        if word not in index:
            return Declined(f"it has a term {describe_word(word, x)}, not an odd power of X")
        coef[index[word]] += weight
    if coef[1] == 0.0 and coef[2] == 0.0:
        return Declined("it is a multiple of X, not an iteration")
    return coef[0], coef[1], coef[2]


def describe_word(word: Word, x: fx.Node) -> str:
    if not word:
        return "1"
    return "·".join(("X" if node is x else node.name) + ("ᵀ" if t else "") for node, t in word)
