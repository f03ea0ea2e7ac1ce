# fx.Node.args is typed as a wide union (nodes, lists, dtypes, ...); this pass
# checks each node's target before reading its args, which mypy cannot follow.
# mypy: disable-error-code="union-attr"
"""fuse-newton-schulz: recognise a whole Newton–Schulz program, make it one op.

The program, however it is spelled (torch.optim.Muon's ``addmm``, Keller
Jordan's ``b * A + c * A @ A``, emerging-optimizers' ``F.normalize`` and
coefficient lists, Polar Express's safety factor, DeepSeek-V4's ten
iterations): casts and transposes, a Frobenius normalisation with eps, then k
iterations of the odd polynomial ``X = a X + b X Xᵀ X + c X Xᵀ X Xᵀ X``, then
casts and transposes back.

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

**Normalisation** (:mod:`.ns_normalization`): ``x / d`` where ``d`` is
``‖y‖ + eps``, ``max(‖y‖, eps)`` or ``‖y‖`` (eps 0), casts allowed around each
step, and ``y`` the same matrix as ``x`` up to casts and transposes (``G.bf16()
/ (G.norm() + eps)``, a norm taken in fp32 then cast). A constant safety
factor ``s`` (``‖y‖ * s + eps``, ``(‖y‖ + eps) * s``) is folded exactly: X₀ = Y / s
with Y the op's own normalisation (eps / s), so iteration 1's coefficients
become (a/s, b/s³, c/s⁵). With a hyperparameter eps the input is scaled by s
instead (an ``aten.mul`` before the op), since eps / s is no host scalar.

**Iterations** (:func:`_next_iterate`): each node downstream of the iterate X
is expanded into a polynomial in X and Xᵀ (:mod:`.matrix_polynomial`); the
next iterate is the last node that is a·X + b·X Xᵀ X + c·(X Xᵀ)² X (or the
same in Xᵀ) *and* whose subgraph nothing outside reads — so a partial sum
(``a X + b B`` before ``+ c A B``) is never taken for a whole iteration — and
a scale or transpose of it (``X * 0.2``, ``X.mT``) stays outside. Any
grouping, side (``X Xᵀ`` or ``Xᵀ X``), ``addmm``/``baddbmm`` (``beta=0``
ignores the input buffer), Horner form and number of iterations.

**Precision**: the op's ``compute_dtype`` is the dtype of the iterates (X₀
included), ``out_dtype`` that of the chain's end; casts along the way may
change the dtype once on each side (a bf16 detour through fp16 is declined).
The op normalises after its cast; a program that normalises in fp32 and then
casts (emerging-optimizers, ``G.div_(norm)``) rounds once less there, well
inside the NS error budget (tests/test_ns_spellings.py measures it). The op
iterates on the wide side (``transpose`` for a tall input), as eager does
except where it formed the large Gram matrix of a tall X. An fp32/fp64 program
in Horner form (``(a I + B) X``) is declined: there it is 1.5-2x more accurate
than the op's ``a X + B X``.

Anything else — another polynomial, no normalisation, an intermediate used
outside the chain, a hyperparameter as a coefficient or safety factor — is
declined with the reason, naming the node, and the graph is left as it was.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.fx as fx

from ..ir.declined import Declined
from ..ir.matrix_polynomial import Expansion, identity_shift, is_call, is_number, odd_coefficients, reads, transposed
from ..ir.ns_normalization import back_through_layout, is_cast, layout_step, normalization, one_dtype_change
from ..ops.newton_schulz_spec import NewtonSchulzSpec
from .base import Pass, PassResult, with_declines

aten = torch.ops.aten
Coefficients = tuple[float, float, float]
_SEARCH_LIMIT = 256  # nodes visited looking for one iteration (one is ~10)
_NO_ITERATIONS = "normalised matrix is not followed by a·X + (b·A + c·A²)·X iterations"


@dataclass
class _Chain:
    source: fx.Node  # the tensor before cast/transpose: the op's input
    eps: Any
    eps_mode: str
    input_scale: float  # multiply the source by this first (a safety factor with a hyperparameter eps)
    transpose: bool  # iterate on the source's transpose (it is tall)
    compute_dtype: torch.dtype
    coefficients: list[Coefficients]
    end: fx.Node  # its users read the op's result instead


@dataclass(frozen=True)
class FuseNewtonSchulz(Pass):
    """Replace each recognised NS program by one ``hocompile::newton_schulz``."""

    name: ClassVar[str] = "fuse-newton-schulz"

    def __call__(self, gm: fx.GraphModule) -> PassResult:
        fused = 0
        fused_ends: list[fx.Node] = []
        reasons: list[str] = []
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        for node in list(gm.graph.nodes):
            if node.graph is not gm.graph or not is_call(node, aten.div.Tensor):
                continue
            chain = _match(node, order)
            if isinstance(chain, Declined):
                reasons.append(self.decline(f"{node.name}: {chain.reason}"))
                continue
            if chain is None or any(chain.end is n for n in fused_ends):
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
        return PassResult(gm, bool(fused), with_declines(summary, reasons), reasons)


def _gram_of(node: Any) -> Any:
    """X if node is X Xᵀ or Xᵀ X (mm/bmm of X with its transpose), else None."""
    if not is_call(node, aten.mm.default, aten.bmm.default):
        return None
    left, right = node.args[0], node.args[1]
    if transposed(right) is left:
        return left
    return right if transposed(left) is right else None


# ------------------------------------------------------------------ the chain


def _match(div: fx.Node, order: dict[fx.Node, int]) -> _Chain | Declined | None:
    """The NS chain starting at ``div``; None if ``div`` is an ordinary division (nothing to report)."""
    norm = normalization(div)
    if norm is None:
        return None
    if isinstance(norm, Declined):
        return norm
    numerator = back_through_layout(norm.x)
    source = numerator[-1]
    if back_through_layout(norm.y)[-1] is not source:
        return Declined(f"the norm is taken of {norm.y.name}, not of the matrix {norm.x.name} it divides")
    X = div
    while len(X.users) == 1 and layout_step(next(iter(X.users))) is X:
        X = next(iter(X.users))  # cast to the iteration dtype and/or transpose to wide after normalising
    preamble = list(reversed(numerator)) + _forward(div, X)
    if not one_dtype_change(preamble):
        return Declined(f"{source.name} is cast through more than one dtype before the iterations")
    flips = sum(1 for n in preamble if transposed(n) is not None)
    iterations: list[_Iteration] = []
    step = _next_iterate(X, order)
    while isinstance(step, tuple):
        whole, core = step
        # A scale or transpose after the last iteration stays outside the op; between two
        # iterations it belongs to the first (its coefficients stay the ones eager wrote).
        step = _next_iterate(whole.node, order)
        iterations.append(whole if isinstance(step, tuple) else core)
    if not iterations:
        return Declined(f"{_NO_ITERATIONS} ({step.reason})")
    coefficients = [it.coefficients for it in iterations]
    X = iterations[-1].node
    flips += sum(it.flipped for it in iterations)  # iterations on Xᵀ (transposes folded into readers)
    shifted = any(it.shifted for it in iterations)  # some iteration adds a·I: X = (a I + B) X
    compute = preamble[-1].meta["val"].dtype
    if shifted and compute in (torch.float32, torch.float64):
        # Measured (16x32 to 64x256, fp32): (a I + B) X is 1.5-2x closer to fp64 than the op's
        # a X + B X, outside the 1.25x budget; in bf16 it is the other way round (2x).
        return Declined(f"eager computes (a·I + B)·X in {compute}, more accurate there than the op's a·X + B·X")
    end = _end(X, flips % 2)
    if end is None:
        return Declined("transposed to wide but the result is not transposed back")
    scale = norm.s_in * norm.s_out
    if scale != 1.0:
        a, b, c = coefficients[0]
        coefficients[0] = (a / scale, b / scale**3, c / scale**5)
    eps, input_scale = norm.eps, 1.0
    if norm.s_in != 1.0 and is_number(eps):
        eps = float(eps) / norm.s_in
    elif norm.s_in != 1.0:
        input_scale = norm.s_in
    # Iterate on the wide side: eager's own side except where it formed the large, rank-deficient
    # Gram matrix of a tall X (more FLOPs, and Gram NS diverges on it: measured 5e9 relative error).
    rows, cols = source.meta["val"].shape[-2:]
    transpose = bool(rows > cols)
    return _Chain(source, eps, norm.eps_mode, input_scale, transpose, compute, coefficients, end)


def _forward(start: fx.Node, stop: fx.Node) -> list[fx.Node]:
    """The single-user path start → stop (both included)."""
    path = [start]
    while path[-1] is not stop:
        path.append(next(iter(path[-1].users)))
    return path


def _end(last: fx.Node, flips: int) -> fx.Node | None:
    """The chain's last node: after the last iterate, at most one cast and transposes back to the
    input's orientation (``flips`` transposes are pending); None if it never gets back."""
    end = last if flips == 0 else None
    node, casts = last, 0
    while len(node.users) == 1:
        user = next(iter(node.users))
        if transposed(user) is node:
            flips ^= 1
        elif is_cast(user) and casts == 0:
            casts += 1
        else:  # a second cast would round twice; a copy stays (its layout may be what a view needs)
            break
        node = user
        if flips == 0:
            end = node
    return end


@dataclass(frozen=True)
class _Iteration:
    coefficients: Coefficients
    node: fx.Node  # the new iterate
    flipped: int  # 1: a polynomial in Xᵀ
    shifted: bool  # adds a multiple of the identity (Horner form)


def _next_iterate(X: fx.Node, order: dict[fx.Node, int]) -> tuple[_Iteration, _Iteration] | Declined:
    """The next iteration after X, whole and without a trailing scale or transpose; else why there is none.

    Every node reachable from X through products, linear combinations and
    transposes is expanded as a polynomial in X; the iterate is the last one
    (in graph order) that is an odd quintic in X (or in Xᵀ: canonicalize folds
    ``(Xᵀ)ᵀ`` to X, so an iteration on a transposed X reads X directly) and
    *closed*: nothing outside the subgraph computing it reads any of its nodes.
    """
    ex = Expansion(frozenset({X}))
    val = X.meta["val"]
    found: dict[fx.Node, tuple[Coefficients, int]] = {}
    why: dict[fx.Node, str] = {}
    frontier, seen = list(X.users), set[fx.Node]()
    while frontier and len(seen) < _SEARCH_LIMIT:
        node = frontier.pop()
        if node in seen or ex.is_letter(node):
            continue
        seen.add(node)
        poly = ex.poly(node)
        if poly is None:
            continue  # degree above 5: neither it nor anything after it is one iteration
        shape = tuple(node.meta["val"].shape)
        same = shape in (tuple(val.shape), tuple(val.mT.shape)) and node.meta["val"].dtype == val.dtype
        others = {n for word in poly for n, _ in word if n is not X}
        if not others:
            frontier += list(node.users)
        if not same:
            continue
        leak = _leak(ex, node)
        coefficients, flipped = odd_coefficients(poly, X), 0
        if isinstance(coefficients, Declined) and isinstance(of_transpose := odd_coefficients(poly, X, True), tuple):
            coefficients, flipped = of_transpose, 1  # an odd polynomial in Xᵀ has Xᵀ's shape
        if others or isinstance(coefficients, Declined):
            # Only what looks like a whole iteration (a X + more, nothing else reading its parts) says
            # why it is not one; a part (A, A², X * a) says nothing.
            linear = poly.get(((X, False),), 0.0) or poly.get(((X, True),), 0.0)
            if leak is None and linear and len(poly) > 1:
                detail = f"it mixes in {sorted(n.name for n in others)}" if others else str(coefficients)
                why[node] = f"{node.name}: {detail}"
            continue
        if leak is not None:
            why[node] = f"{leak[0].name} is also read by {leak[1].name}, outside the iteration {node.name}"
            continue
        found[node] = coefficients, flipped
    if not found:
        if why:  # the latest candidate got furthest
            return Declined(why[max(why, key=lambda n: order.get(n, -1))])
        if ex.too_high:
            return Declined(f"{ex.too_high[0].name} is a product of degree above 5 in {X.name}")
        return Declined(f"no X Xᵀ product of {X.name}")
    node = core = max(found, key=lambda n: order.get(n, -1))
    # A scalar multiple (``X * 0.2``, ``X.mul(1.0)``) or the transpose of an iterate: that iterate, then
    # a scale or a transpose.
    while (below := transposed(core)) in found or (
        is_call(core, aten.mul.Tensor, aten.div.Tensor, aten.neg.default) and (below := core.args[0]) in found
    ):
        core = below

    def iteration(n: fx.Node) -> _Iteration:
        shifted = any(identity_shift(m) is not None for m in ex.inside(n))
        return _Iteration(found[n][0], n, found[n][1], shifted)

    return iteration(node), iteration(core)


def _leak(ex: Expansion, node: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """A node of the subgraph computing ``node`` that something outside it reads, and that reader."""
    inside = ex.inside(node)
    return next(((n, u) for n in inside - {node} for u in n.users if u not in inside and reads(u, n)), None)


def _replace(gm: fx.GraphModule, chain: _Chain) -> None:
    """Insert the op and reroute the chain's readers; DCE removes the chain.

    Correctness does not depend on the chain being dead: an intermediate read
    elsewhere simply stays computed by its original nodes.
    """
    coeffs = chain.coefficients
    out_val = chain.end.meta["val"]
    source_val = chain.source.meta["val"]
    with gm.graph.inserting_before(chain.end):
        x = chain.source
        if chain.input_scale != 1.0:
            x = gm.graph.call_function(aten.mul.Tensor, (chain.source, chain.input_scale))
            x.meta["val"] = source_val * chain.input_scale
        spec = NewtonSchulzSpec(
            x=x,
            a=tuple(a for a, _, _ in coeffs),
            b=tuple(b for _, b, _ in coeffs),
            c=tuple(c for _, _, c in coeffs),
            eps=chain.eps,
            eps_mode=chain.eps_mode,
            transpose=chain.transpose,
            compute_dtype=chain.compute_dtype,
            out_dtype=out_val.dtype,
            algorithm="standard",
            restarts=(),
            matmul="native",
        )
        op = gm.graph.call_function(torch.ops.hocompile.newton_schulz.default, spec.to_args())
    op.meta["val"] = out_val
    chain.end.replace_all_uses_with(op)
