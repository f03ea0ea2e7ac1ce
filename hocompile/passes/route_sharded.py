"""route-sharded: orthogonalise sharded matrices whole on an owner rank, or mark them for a TP mode.

The step was captured at global shapes (distributed/sharded.py) and runs on
each rank's local shard (rows for ``Shard(0)``, columns for ``Shard(1)``).
Elementwise work is right on any shard; an orthogonalisation is not: it
needs the whole matrix. Per NS call a cost model (distributed/tp_plan.py,
``choose_tp_mode``; or the ``tp_mode`` setting) picks between routing the
matrix to an owner and the tensor-parallel modes (duplicated, distributed;
blockwise only on request). Routed calls: per bucket (calls of one input and
output dtype, in step order), one uneven ``all_to_all_single`` sends every
rank's shard of each matrix to its owner (``distributed.plan.assign_owners``,
longest processing time on NS cost), the owner joins the shards in rank order
and runs the call, and a second one returns each rank its shard of the
result. Nothing is all-gathered and ``full_tensor()`` is never called. The
others are marked for tp-newton-schulz (passes/tp_newton_schulz.py), which
inlines their mode after choose-algorithm and choose-precision have planned
them. Before (rank 1 of 2, a 3×4 matrix, Shard(0))::

    t2 = aten.lerp(g, t1, h1)                           # fp64[3, 4] (rows 2..2 here)
    t3 = hocompile.newton_schulz(t2, ...)

After (rank 0 owns it)::

    t4 = aten.reshape(t2, [-1]); t5 = _c10d_functional.all_to_all_single(t4, [0, 0], [4, 0], "0")
    t6 = _c10d_functional.wait_tensor(t5)               # rank 0 receives 8 + 4 values
    # rank 0's graph: newton_schulz(cat([its 2 rows, the row from rank 1])), then its rows sent back
    t12 = _c10d_functional.wait_tensor(all_to_all_single(<empty>, [4, 0], [0, 0], "0"))
    t3 = aten.view(getitem(aten.split_with_sizes(t12, [4]), 0), [1, 4])

Before rewriting, every op that touches a sharded value outside the routed
calls must be local to the shard: elementwise (pointwise, ``*_like``,
copies) on values of one shape sharded along one dim. Anything else (a
reduction, a matmul, a view with sizes, a Shard(0) value beside a Shard(1)
one) would compute on a rank's shard what eager computes on the whole
tensor, so the pass refuses, naming the op and the parameter. The pass runs
before batch-by-shape, so an owner's matrices batch as they would on one rank.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.fx as fx

from ..distributed.plan import Item, assign_owners, ns_cost
from ..distributed.sharded import SHARDED, SHARDED_OUTPUTS, chunk_rows
from ..distributed.tp_plan import PLAN_MODES, TPChoice
from ..errors import CaptureError
from ..ir.decisions import record
from ..ir.graph import ROLE, stable_topological_sort
from ..ir.registry import family_of
from ..targets import Target
from .base import Pass, PassResult
from .tp_newton_schulz import choose_mode, mark_for_tp, require_tp_done

aten = torch.ops.aten
funcol = torch.ops._c10d_functional

# Families whose call needs the whole matrix and returns one of the same shape.
ROUTED_FAMILIES = frozenset({"newton_schulz", "polar"})
# Elementwise ops that are not tagged pointwise: they make or copy a tensor element for element,
# so they are local to a shard along any dim (ops local to rows only, not columns, must not be here).
_ELEMENTWISE = frozenset(
    {
        "aten::zeros_like",
        "aten::ones_like",
        "aten::empty_like",
        "aten::full_like",
        "aten::clone",
        "aten::copy",
        "aten::_to_copy",
        "aten::alias",
    }
)
# The graph key with which routed steps are marked done (compile_step checks it).
ROUTED = "hocompile.route_sharded"


def _elementwise(node: fx.Node) -> bool:
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return False
    if torch.Tag.nondeterministic_seeded in target.tags:
        return False  # random numbers drawn per shard are not eager's
    return torch.Tag.pointwise in target.tags or target._schema.name in _ELEMENTWISE


def _scalar(node: fx.Node) -> bool:
    val = node.meta.get("val")
    return not isinstance(val, torch.Tensor) or val.dim() == 0


def _shape(node: fx.Node) -> tuple[int, ...]:
    return tuple(int(s) for s in node.meta["val"].shape)


@dataclass(frozen=True)
class RouteSharded(Pass):
    name: ClassVar[str] = "route-sharded"
    world: int = 1
    rank: int = 0
    group_name: str = ""
    tp_mode: str = "auto"  # "auto" (the cost model), or one of PLAN_MODES for every sharded NS
    target: Target | None = None  # the rates the cost model prices with (None: route everything)

    def __call__(self, gm: fx.GraphModule) -> PassResult:
        # value -> (the sharded input it was computed from, the dim it is sharded along)
        sharded: dict[fx.Node, tuple[str, int]] = {}
        for node in gm.graph.nodes:
            if node.op == "placeholder" and SHARDED in node.meta:
                sharded[node] = (node.meta[ROLE].describe(), node.meta[SHARDED].dim)
        if not sharded:
            return PassResult(gm, False, "no sharded (DTensor) inputs")
        if self.tp_mode not in ("auto", *PLAN_MODES):
            raise ValueError(f"route-sharded: tp_mode must be 'auto' or one of {PLAN_MODES}, got {self.tp_mode!r}")
        calls = self._check_local(gm, sharded)
        choices = {n: choose_mode(n, sharded[n][1], self.world, calls, self.tp_mode, self.target) for n in calls}
        tp = [n for n in calls if choices[n].mode != "route"]
        for node in tp:
            mark_for_tp(gm, node, sharded[node][1], self.world, self.rank, choices[node])
        calls = [n for n in calls if choices[n].mode == "route"]
        buckets: dict[tuple[torch.dtype, torch.dtype], list[fx.Node]] = {}
        for node in calls:
            key = (_matrix(node).meta["val"].dtype, node.meta["val"].dtype)
            buckets.setdefault(key, []).append(node)
        items = []
        for b, nodes in enumerate(buckets.values()):
            for node in nodes:
                spec = family_of(node).spec_of(node)  # type: ignore[union-attr]
                steps = len(getattr(spec, "a", (1,)))
                shape = _shape(node)
                items.append(Item(node.name, shape, str(node.meta["val"].dtype), ns_cost(shape, steps), b))
        plan = assign_owners(items, self.world)
        owners = dict(zip((i.key for i in plan.items), plan.owners))
        for nodes in buckets.values():
            dims = [sharded[n][1] for n in nodes]
            self._route_bucket(gm.graph, nodes, [owners[n.name] for n in nodes], dims, [choices[n] for n in nodes])
        stable_topological_sort(gm.graph)
        gm.graph.lint()
        gm.recompile()
        gm.meta[ROUTED] = plan
        summary = (
            f"routed {len(calls)} call(s) in {len(buckets)} bucket(s), 2 all-to-all each; "
            + plan.describe()[0]
            + f"; rank {self.rank} owns {len(plan.owned(self.rank))}"
        )
        if tp:
            modes = sorted({choices[n].mode for n in tp})
            summary += f"; {len(tp)} call(s) for tensor-parallel NS ({', '.join(modes)})"
        return PassResult(gm, True, summary)

    # -- the check ---------------------------------------------------------
    def _check_local(self, gm: fx.GraphModule, sharded: dict[fx.Node, tuple[str, int]]) -> list[fx.Node]:
        """The calls to route (or run tensor-parallel), in order; a CaptureError at the first op that is
        not local to the shard."""
        calls: list[fx.Node] = []
        for node in gm.graph.nodes:
            if node.op != "call_function":
                continue
            touched = [a for a in node.all_input_nodes if a in sharded]
            if not touched:
                continue
            source, dim = sharded[touched[0]]
            family = family_of(node)
            if family is not None and family.name in ROUTED_FAMILIES:
                if family.fallible:
                    # An owner raising on its data (SVD not converging) while the others wait
                    # in the return all-to-all would hang them all.
                    raise CaptureError(
                        f"{family.name} on {source} may raise on its data; routing it across ranks could "
                        "leave the other ranks waiting forever, so hocompile does not route it"
                    )
                x = _matrix(node)
                if x.meta["val"].dim() != 2 or _shape(node) != _shape(x):
                    raise CaptureError(
                        f"{family.name} on {source} has a {x.meta['val'].dim()}-D input; routing sharded "
                        "matrices handles one 2-D matrix per call"
                    )
                calls.append(node)
                sharded[node] = (source, dim)
                continue
            what = f"{node.target}" if not isinstance(node.target, torch._ops.OpOverload) else node.target.name()
            reason = ""
            if not _elementwise(node):
                reason = "it is not elementwise (its result depends on elements other ranks hold)"
            elif any(a not in sharded and not _scalar(a) for a in node.all_input_nodes):
                reason = "it combines the sharded value with a tensor that is not sharded alike"
            elif any(_shape(a) != _shape(node) for a in touched):
                reason = "it broadcasts a sharded value to another shape"
            elif any(sharded[a][1] != dim for a in touched):
                reason = "it combines values sharded along different dims (Shard(0) and Shard(1))"
            if reason:
                raise CaptureError(
                    f"the step runs {what} on a value computed from {source}, a Shard({dim}) DTensor: {reason}. "
                    "Each rank runs the compiled step on its own shard, so outside the orthogonalisation "
                    "only elementwise ops (pointwise, *_like, copies) may touch sharded values"
                )
            sharded[node] = (source, dim)
        self._check_outputs(gm, sharded)
        return calls

    def _check_outputs(self, gm: fx.GraphModule, sharded: dict[fx.Node, tuple[str, int]]) -> None:
        output = next(n for n in gm.graph.nodes if n.op == "output")
        destinations = output.meta.get(SHARDED_OUTPUTS)
        values = list(output.args[0])  # type: ignore[arg-type]
        if destinations is None or len(destinations) != len(values):
            raise CaptureError("route-sharded: the graph's outputs no longer match the sharded write-backs")
        for value, dest in zip(values, destinations):
            if not isinstance(value, fx.Node):
                continue
            is_sharded = value in sharded
            ok = (is_sharded and (_shape(value), sharded[value][1]) == dest) if dest is not None else not is_sharded
            if not ok and not (dest is not None and _scalar(value)):
                where = f"a DTensor of shape {dest[0]} sharded along dim {dest[1]}" if dest else "a plain tensor"
                what = f"sharded along dim {sharded[value][1]}" if is_sharded else "not sharded"
                raise CaptureError(
                    f"the step writes {value.name} ({what}) into {where}; "
                    "hocompile cannot tell which elements each rank holds there"
                )

    # -- the rewrite -------------------------------------------------------
    def _route_bucket(
        self, graph: fx.Graph, nodes: list[fx.Node], owners: list[int], dims: list[int], choices: list[TPChoice]
    ) -> None:
        world, me = self.world, self.rank
        sizes = [chunk_rows(_shape(n)[d], world) for n, d in zip(nodes, dims)]  # along each matrix's shard dim

        def shard(k: int, s: int) -> tuple[int, int]:
            """Rank ``s``'s shard shape of matrix ``k``."""
            rows, cols = _shape(nodes[k])
            return (sizes[k][s], cols) if dims[k] == 0 else (rows, sizes[k][s])

        def numel(k: int, s: int) -> int:
            rows, cols = shard(k, s)
            return rows * cols

        xs = [_matrix(n) for n in nodes]
        mine = [k for k, o in enumerate(owners) if o == me]
        by_owner = [[k for k, o in enumerate(owners) if o == d] for d in range(world)]
        in_dtype, out_dtype = xs[0].meta["val"].dtype, nodes[0].meta["val"].dtype
        with graph.inserting_before(nodes[0]):
            # There: my shard of every matrix, grouped by owner; I receive my matrices' shards from every rank.
            send = [_flat(graph, xs[k], numel(k, me)) for d in range(world) for k in by_owner[d]]
            in_splits = [sum(numel(k, me) for k in by_owner[d]) for d in range(world)]
            out_splits = [sum(numel(k, s) for k in mine) for s in range(world)]
            recv = self._all_to_all(graph, send, out_splits, in_splits, xs[0], in_dtype)
            pieces = _split(graph, recv, [shard(k, s) for s in range(world) for k in mine])
            results: dict[int, fx.Node] = {}
            for j, k in enumerate(mine):
                parts = [pieces[s * len(mine) + j] for s in range(world)]  # shards in rank order
                full = _new(graph, aten.cat.default, (parts, dims[k]), xs[k], _shape(xs[k]), in_dtype)
                results[k] = self._call_like(graph, nodes[k], full)
            # Back: each rank's shard of my results; I receive my shard of every matrix from its owner.
            back = []
            for s in range(world):
                for k in mine:
                    start = sum(sizes[k][:s])
                    cut = (results[k], dims[k], start, start + sizes[k][s])
                    part = _new(graph, aten.slice.Tensor, cut, xs[k], shard(k, s), out_dtype)
                    back.append(_flat(graph, part, numel(k, s)))  # a column slice: reshape copies it
            in2 = [sum(numel(k, s) for k in mine) for s in range(world)]
            out2 = [sum(numel(k, me) for k in by_owner[o]) for o in range(world)]
            recv2 = self._all_to_all(graph, back, out2, in2, xs[0], out_dtype)
            order = [k for o in range(world) for k in by_owner[o]]
            local = _split(graph, recv2, [shard(k, me) for k in order])
        for k, value in zip(order, local):
            value.meta["val"] = nodes[k].meta["val"]  # global shape: the sharded-value convention
            record(value, choices[k].decision())  # on every rank (the call itself is on its owner only)
            nodes[k].replace_all_uses_with(value)
            graph.erase_node(nodes[k])

    def _all_to_all(
        self,
        graph: fx.Graph,
        pieces: list[fx.Node],
        out_splits: list[int],
        in_splits: list[int],
        like: fx.Node,
        dtype: torch.dtype,
    ) -> fx.Node:
        if not pieces:  # this rank owns no matrix: it still joins the collective, with an empty buffer
            flat = _new(graph, aten.new_empty.default, (like, [0]), like, (0,), dtype, {"dtype": dtype})
        elif len(pieces) == 1:
            flat = pieces[0]
        else:
            flat = _new(graph, aten.cat.default, (pieces,), like, (sum(in_splits),), dtype)
        args = (flat, out_splits, in_splits, self.group_name)
        sent = _new(graph, funcol.all_to_all_single.default, args, like, (sum(out_splits),), dtype)
        return _new(graph, funcol.wait_tensor.default, (sent,), like, (sum(out_splits),), dtype)

    def _call_like(self, graph: fx.Graph, node: fx.Node, x: fx.Node) -> fx.Node:
        """``node``'s call on the whole matrix ``x`` (its other arguments as they were)."""
        old = _matrix(node)
        args = tuple(x if a is old else a for a in node.args)
        kwargs = {k: (x if v is old else v) for k, v in node.kwargs.items()}
        call = graph.call_function(node.target, args, kwargs)  # type: ignore[arg-type]
        call.meta.update(node.meta)
        return call


def _matrix(node: fx.Node) -> fx.Node:
    """The matrix a routed call orthogonalises (its family's one tensor argument)."""
    family = family_of(node)
    assert family is not None
    return family.spec_of(node).node_of(family.spec.tensor_fields()[0])  # type: ignore[no-any-return]


def _new(
    graph: fx.Graph,
    target: Any,
    args: tuple[Any, ...],
    like: fx.Node,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    kwargs: dict[str, Any] | None = None,
) -> fx.Node:
    """A call node with a ``val`` of this rank's actual ``shape`` (made in ``like``'s fake mode)."""
    node = graph.call_function(target, args, kwargs or {})
    val = like.meta["val"]
    with val.fake_mode:
        node.meta["val"] = torch.empty(shape, dtype=dtype, device=val.device)
    return node


def _flat(graph: fx.Graph, x: fx.Node, numel: int) -> fx.Node:
    return _new(graph, aten.reshape.default, (x, [-1]), x, (numel,), x.meta["val"].dtype)


def _split(graph: fx.Graph, flat: fx.Node, shapes: list[tuple[int, int]]) -> list[fx.Node]:
    """``flat`` cut into consecutive pieces of ``shapes`` (empty pieces included)."""
    if not shapes:
        return []
    dtype = flat.meta["val"].dtype
    sizes = [r * c for r, c in shapes]
    parts = graph.call_function(aten.split_with_sizes.default, (flat, sizes))
    with flat.meta["val"].fake_mode:
        parts.meta["val"] = [torch.empty(n, dtype=dtype, device=flat.meta["val"].device) for n in sizes]
    out = []
    for index, shape in enumerate(shapes):
        piece = graph.call_function(operator.getitem, (parts, index))
        piece.meta["val"] = parts.meta["val"][index]
        out.append(_new(graph, aten.view.default, (piece, list(shape)), flat, shape, dtype))
    return out


def require_routed(gm: fx.GraphModule) -> None:
    """A step on sharded inputs that route-sharded did not rewrite would orthogonalise each
    rank's rows alone: refuse it (the pass was disabled, or a pipeline left it out)."""
    if ROUTED not in gm.meta:
        raise CaptureError(
            "the step's params are Shard(0) DTensors but the route-sharded pass did not run "
            "(HOCOMPILE_DISABLE_PASSES?); without it each rank would orthogonalise only its own rows"
        )
    require_tp_done(gm)
