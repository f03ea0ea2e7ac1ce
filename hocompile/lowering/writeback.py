"""Write results back where they are final, not after the whole step.

The graph is functional: every new param and state tensor is an output, and
returning them all at the end would hold a second copy of the optimizer's
whole state at the peak (2× model size for Muon: params and momentum). The
lowering instead copies each output into its destination as soon as nothing
later reads the destination's old value, so a temporary lives about as long
as eager's in-place update would.

Validation and capture happen before the graph runs, so a refused input still
changes nothing. A graph with *fallible* ops (eigh, SVD, Cholesky: LAPACK can
fail to converge on the data, and the optimizers in the field retry such a
failure in float64 in a Python ``except`` no trace can see) writes nothing
back before its last fallible op: when one raises, params and state are as
they were, and the runtime runs that step eagerly instead (its retry and all).
The cost is that those outputs live until that op, not from their last read.
Any other error raised while the lowered code runs (out of memory, say) can
leave part of the update applied, as it would in eager's in-place loop.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ..ir.graph import is_fallible  # noqa: F401  (re-exported: reinplace and the runtime read it here)

aten = torch.ops.aten


def write_fence(gm: fx.GraphModule) -> fx.Node | None:
    """The last fallible op: no write-back may come before it (see the module docstring)."""
    return next((n for n in reversed(gm.graph.nodes) if is_fallible(n)), None)


def is_view_node(node: fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    if node.op != "call_function" or schema is None:
        return False
    return any(r.alias_info is not None for r in schema.returns)


def readers(node: fx.Node) -> list[fx.Node]:
    """Nodes reading ``node``'s storage: users, and users of views of it."""
    out: list[fx.Node] = []
    stack = list(node.users)
    while stack:
        user = stack.pop()
        if user.op == "output":
            continue
        out.append(user)
        if is_view_node(user):
            stack += list(user.users)
    return out


def schedule_writebacks(gm: fx.GraphModule, copy_into: list[int | None]) -> list[int]:
    """Insert early ``copy_`` nodes; returns the output indices still returned.

    ``copy_into[i]`` is the placeholder index output ``i`` is copied into, or
    None for outputs the runtime installs itself (newly created state).
    """
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    output = next(n for n in gm.graph.nodes if n.op == "output")
    fence = write_fence(gm)
    values = list(output.args[0])
    kept: list[int] = []
    for index, (value, dest_index) in enumerate(zip(values, copy_into)):
        if dest_index is None or not isinstance(value, fx.Node) or value.op != "call_function" or is_view_node(value):
            kept.append(index)
            continue
        dest = placeholders[dest_index]
        anchor = max([value, *readers(dest), *([fence] if fence else [])], key=order.__getitem__)
        with gm.graph.inserting_after(anchor):
            copy = gm.graph.call_function(aten.copy_.default, (dest, value))
        copy.meta["hocompile.origin"] = "writeback"
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
    output.args = (tuple(values[i] for i in kept),)
    gm.recompile()
    return kept
