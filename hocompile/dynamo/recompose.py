"""Inductor's post-grad graphs spell a few ops as their decompositions; hocompile's passes match
eager's aten. Before the passes run on such a graph (inductor.py), put those spellings back:

- ``prims.convert_element_type(x, dtype)`` is ``aten._to_copy(x, dtype=dtype)`` (the same values);
- ``pow(sum(pow(x, 2)), 0.5)`` over a matrix's two dims is ``linalg_vector_norm(x)`` (the
  Frobenius norm a Newton–Schulz normalisation takes: ``X / X.norm()``); its reduction order is
  aten's rather than Inductor's, within a rounding, and only where the sum covers a whole matrix.

Nothing else is touched: the rest of the graph is Inductor's, as it made it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

aten, prims = torch.ops.aten, torch.ops.prims


def recompose(graph: fx.Graph) -> int:
    """Rewrite ``graph`` in place; the number of nodes rewritten."""
    done = 0
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is prims.convert_element_type.default and len(node.args) == 2 and not node.kwargs:
            with graph.inserting_before(node):
                cast = graph.call_function(aten._to_copy.default, (node.args[0],), {"dtype": node.args[1]})
            done += _replace(node, cast)
        elif (norm := _frobenius(node)) is not None:
            with graph.inserting_before(node):
                new = graph.call_function(aten.linalg_vector_norm.default, (norm,))
            done += _replace(node, new)
    graph.eliminate_dead_code()
    return done


def _frobenius(node: fx.Node) -> fx.Node | None:
    """``x`` if ``node`` is ``pow(sum(pow(x, 2), dims), 0.5)`` with ``dims`` all of a 2-D ``x``."""
    if node.target is not aten.pow.Tensor_Scalar or node.args[1] != 0.5:
        return None
    total = node.args[0]
    if not (isinstance(total, fx.Node) and total.target is aten.sum.dim_IntList and len(total.users) == 1):
        return None
    square = total.args[0]
    if not (isinstance(square, fx.Node) and square.target is aten.pow.Tensor_Scalar and square.args[1] == 2):
        return None
    x = square.args[0]
    val = x.meta.get("val") if isinstance(x, fx.Node) else None
    dims: Any = total.args[1] if len(total.args) > 1 else None
    keepdim = total.args[2] if len(total.args) > 2 else total.kwargs.get("keepdim", False)
    if not isinstance(val, torch.Tensor) or val.dim() != 2 or keepdim or total.kwargs.get("dtype") is not None:
        return None
    if dims is not None and (not isinstance(dims, (list, tuple)) or sorted(int(d) % 2 for d in dims) != [0, 1]):
        return None
    return x if isinstance(x, fx.Node) else None


def _replace(old: fx.Node, new: fx.Node) -> int:
    new.meta = dict(old.meta)
    old.replace_all_uses_with(new)
    old.graph.erase_node(old)
    return 1
