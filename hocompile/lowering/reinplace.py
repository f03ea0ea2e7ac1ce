"""Re-inplacing: compute a written-back result straight into its destination.

The captured graph is functional, so eager's ``exp_avg.lerp_(g, w)`` becomes
``lerp = lerp(exp_avg, g, w)`` plus a write-back ``copy_(exp_avg, lerp)``
(writeback.py): a fresh allocation, a full extra pass over memory, and page
faults on every step. Where it is exactly safe, this rewrite turns the chain
of ops that produces a written-back value into in-place (``lerp_``) or
``out=`` calls on the destination and drops the ``copy_``::

    Before                                       After
    mul = mul(p, h0)                             mul = mul_(p, h0)
    addcdiv = addcdiv(mul, m, d, value=h1)       addcdiv = addcdiv_(mul, m, d, value=h1)   # mul *is* p
    copy_(p, addcdiv)

Why the values are bitwise those of the functional graph: an aten op's
functional, in-place and ``out=`` overloads share one kernel, and for
pointwise ops (and a GEMM accumulating into its ``self``) with every operand
contiguous the kernel visits the same elements in the same order with the
same vector code whichever buffer it writes. Contiguity of the real tensors
is not part of the guards, so the lowering runs this graph only when every
tensor input is contiguous (aten.py keeps the plain module for the rest).

Conditions, for a destination ``dest`` and the chain ``n_1 .. n_k`` (each
``n_i`` consumes ``n_{i-1}`` as its ``self`` argument and nothing else does,
``n_k`` is the written-back value) whose members from ``n_s`` on are written
into ``dest``:

- every ``n_i`` from ``n_s`` on has ``dest``'s shape and dtype, is
  contiguous, is not a view and (after ``n_s``) has an in-place overload;
- every reader of ``dest``'s old value (its users and the users of its
  views) other than ``n_s`` comes before ``n_s``; ``n_s`` itself may read
  ``dest`` only as the tensor itself (no view), and, unless it is pointwise,
  only as its ``self``;
- ``n_s`` comes after the write fence (writeback.py: nothing is written
  before the last op that may raise on its data);
- ``n_k`` is not also an output the runtime installs (it would alias dest).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx
from torch._ops import OpOverload

from .writeback import is_fallible, is_view_node, readers

aten = torch.ops.aten

# node.meta key: the destination a node now writes in place (read by tests and dumps).
REINPLACED = "hocompile.reinplaced"

# Non-pointwise ops whose in-place overload accumulates into ``self`` with the
# same GEMM call as the functional one (beta * self + alpha * a @ b); registered
# ops with an in-place form (``hocompile::factor_update_``: eager's lerp_/addmm_).
_ACCUMULATE_INTO_SELF = frozenset({"aten::addmm", "aten::baddbmm", "hocompile::factor_update"})
# Non-pointwise ops whose ``out=`` overload runs the functional one's kernel
# into the given buffer (only used when no argument aliases the destination).
_REGISTERED_INPLACE = frozenset({"factor_update"})
_OUT_OK = frozenset({"aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm"})


@dataclass(frozen=True)
class Reinplaced:
    """One write-back turned into in-place work: ``nodes`` now write ``dest``."""

    dest: str
    nodes: tuple[str, ...]
    form: str  # "inplace" (the first node updates dest itself) or "out" (it writes dest with out=)


def _schema_args(op: OpOverload) -> list[tuple[str, str]]:
    return [(a.name, str(a.type)) for a in op._schema.arguments if a.name != "out"]


def inplace_overload(op: OpOverload) -> OpOverload | None:
    """``aten.lerp_.Scalar`` for ``aten.lerp.Scalar``: same arguments, the first one written.

    Registered ops qualify where their family defines a ``name_`` form (factor_update_)."""
    namespace, name = op._schema.name.split("::")
    if not op._schema.arguments:
        return None
    if namespace == "aten" and op._schema.arguments[0].name == "self":
        packet = getattr(aten, f"{name}_", None)
    elif namespace == "hocompile" and name in _REGISTERED_INPLACE:
        packet = getattr(torch.ops.hocompile, f"{name}_", None)
    else:
        return None
    overload = getattr(packet, op._overloadname, None)
    if not isinstance(overload, OpOverload) or _schema_args(overload) != _schema_args(op):
        return None
    alias = overload._schema.arguments[0].alias_info
    return overload if alias is not None and alias.is_write else None


def out_overload(op: OpOverload) -> OpOverload | None:
    """``aten.lerp.Scalar_out`` for ``aten.lerp.Scalar``: same arguments plus ``out=``."""
    namespace, name = op._schema.name.split("::")
    packet = getattr(aten, name, None) if namespace == "aten" else None
    if packet is None:
        return None
    for overload_name in packet.overloads():
        overload = getattr(packet, overload_name)
        outs = [a for a in overload._schema.arguments if a.kwarg_only and a.name == "out"]
        if len(outs) == 1 and len(overload._schema.returns) == 1 and _schema_args(overload) == _schema_args(op):
            return overload
    return None


def _pointwise(node: fx.Node) -> bool:
    tags = getattr(node.target, "tags", ())
    return torch.Tag.pointwise in tags and torch.Tag.nondeterministic_seeded not in tags


def _fits(node: fx.Node, dest: fx.Node) -> bool:
    """``node``'s value could live in ``dest``: same shape, dtype, device; both contiguous."""
    value, target = node.meta.get("val"), dest.meta.get("val")
    if not isinstance(value, torch.Tensor) or not isinstance(target, torch.Tensor):
        return False
    same = value.shape == target.shape and value.dtype == target.dtype and value.device == target.device
    return same and value.is_contiguous() and target.is_contiguous()


def _occurrences(node: fx.Node, value: fx.Node) -> int:
    flat = [*node.args, *node.kwargs.values()]
    return sum(1 for a in flat if a is value) + sum(
        1 for a in flat if isinstance(a, (list, tuple)) for b in a if b is value
    )


def _chain(value: fx.Node, dest: fx.Node) -> list[fx.Node]:
    """``value`` and the single-use producers of its ``self`` argument that could share ``dest``."""
    chain = [value]
    node = value
    while _updates_self(node):
        producer = node.args[0]
        if not isinstance(producer, fx.Node) or producer.op != "call_function":
            break
        if not isinstance(producer.target, OpOverload) or len(producer.users) != 1:
            break
        if is_view_node(producer) or _occurrences(node, producer) != 1 or not _fits(producer, dest):
            break
        chain.insert(0, producer)
        node = producer
    return chain


def _updates_self(node: fx.Node) -> bool:
    """``node`` could run in place on its ``self`` argument with the same values."""
    if not isinstance(node.target, OpOverload) or inplace_overload(node.target) is None:
        return False
    return _pointwise(node) or node.target._schema.name in _ACCUMULATE_INTO_SELF


def views_of(dest: fx.Node) -> set[fx.Node]:
    """Every view of ``dest`` in the graph, views of views included (helper_calls.py uses it too)."""
    out: set[fx.Node] = set()
    stack = list(dest.users)
    while stack:
        user = stack.pop()
        if is_view_node(user) and user not in out:
            out.add(user)
            stack += list(user.users)
    return out


def _first_write_ok(node: fx.Node, dest: fx.Node, views: set[fx.Node]) -> str | None:
    """How ``node`` can write ``dest`` first ("inplace"/"out"), or None; see the module docstring."""
    assert isinstance(node.target, OpOverload)
    flat = [*node.args, *node.kwargs.values()]
    flat += [b for a in flat if isinstance(a, (list, tuple)) for b in a]
    if any(a in views for a in flat if isinstance(a, fx.Node)):
        return None  # a view of dest read while dest is written
    reads_dest = [i for i, a in enumerate(node.args) if a is dest] + [k for k, a in node.kwargs.items() if a is dest]
    pointwise = _pointwise(node)
    name = node.target._schema.name
    if node.args and node.args[0] is dest and inplace_overload(node.target) is not None:
        if pointwise or (name in _ACCUMULATE_INTO_SELF and reads_dest == [0]):
            return "inplace"
        return None
    if reads_dest and not pointwise:
        return None
    if out_overload(node.target) is None or not (pointwise or name in _OUT_OK):
        return None
    return "out"


def reinplace(graph: fx.Graph) -> list[Reinplaced]:
    """Rewrite ``graph``'s write-back ``copy_`` nodes into in-place work where safe; what was done."""
    done: list[Reinplaced] = []
    output = next(n for n in graph.nodes if n.op == "output")
    returned = set(output.all_input_nodes)
    fence = next((n for n in reversed(graph.nodes) if is_fallible(n)), None)
    for copy in [n for n in graph.nodes if n.meta.get("hocompile.origin") == "writeback"]:
        order = {n: i for i, n in enumerate(graph.nodes)}
        dest, value = copy.args
        if not isinstance(dest, fx.Node) or dest.op != "placeholder" or not isinstance(value, fx.Node):
            continue
        if value.op != "call_function" or not isinstance(value.target, OpOverload) or value in returned:
            continue
        if is_view_node(value) or not _fits(value, dest):
            continue
        chain = _chain(value, dest)
        old_readers = set(readers(dest)) - {copy}
        views = views_of(dest)
        for start, first in enumerate(chain):
            if fence is not None and order[first] <= order[fence]:
                continue
            if any(order[r] >= order[first] for r in old_readers - {first}):
                continue
            form = _first_write_ok(first, dest, views)
            if form is not None:
                _rewrite(chain[start:], dest, form)
                graph.erase_node(copy)
                done.append(Reinplaced(dest.name, tuple(n.name for n in chain[start:]), form))
                break
    graph.lint()
    return done


def _overload(node: fx.Node, form: str) -> OpOverload:
    assert isinstance(node.target, OpOverload)
    overload = inplace_overload(node.target) if form == "inplace" else out_overload(node.target)
    assert overload is not None  # checked by the caller
    return overload


def _rewrite(chain: list[fx.Node], dest: fx.Node, form: str) -> None:
    first = chain[0]
    first.target = _overload(first, form)
    if form == "out":
        first.kwargs = {**first.kwargs, "out": dest}
    for node in chain[1:]:
        node.target = _overload(node, "inplace")
    for node in chain:
        node.meta[REINPLACED] = dest.name


def reuse_temporaries(graph: fx.Graph) -> list[str]:
    """Run a pointwise op in place on its ``self`` when that is a temporary read by nothing else.

    ``div = div(sqrt, h)`` becomes ``div = div_(sqrt, h)`` when ``sqrt`` is a
    fresh aten result (a functional op: its schema returns no alias, so it is
    never a destination written above) whose only reader is ``div``, of
    ``div``'s shape, dtype and contiguity: one allocation less, same values
    (same kernel, see the module docstring). Custom ops are not trusted to
    return fresh tensors, so only aten results are reused. The names of the
    nodes rewritten are returned (a chain ``div_(sqrt) -> add_(div)`` reuses one buffer).
    """
    done: list[str] = []
    returned = set(next(n for n in graph.nodes if n.op == "output").all_input_nodes)
    for node in list(graph.nodes):
        if node.op != "call_function" or not _pointwise(node) or not _updates_self(node) or is_view_node(node):
            continue
        temp = node.args[0]
        if not isinstance(temp, fx.Node) or temp.op != "call_function" or temp in returned:
            continue
        if not isinstance(temp.target, OpOverload) or temp.target.namespace != "aten":
            continue
        if is_view_node(temp) and temp.name not in done:  # in place on a reused temporary is still one
            continue
        if len(temp.users) != 1 or _occurrences(node, temp) != 1 or not _fits(temp, node) or not _fits(node, node):
            continue
        node.target = _overload(node, "inplace")
        node.meta[REINPLACED] = temp.name
        done.append(node.name)
    return done
