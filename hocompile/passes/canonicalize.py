"""canonicalize: drop what tracing leaves behind and nothing reads.

Before::

    t5 = aten.scalar_tensor(0.0)
    t6 = aten.lift_fresh_copy(t5)
    t7 = aten.detach(t6)
    t8 = aten.add.Tensor(t7, 1)
    t9 = aten.detach(t8)            # returned as new state
    t10 = aten.clone(t3)            # read only by t11
    t11 = aten.mul.Tensor(t10, h0)
    t12 = aten.permute(t11, [1, 0])
    t13 = aten.permute(t12, [1, 0])  # .T of .T

After::

    t5 = aten.scalar_tensor(0.0)
    t8 = aten.add.Tensor(t5, 1)
    t11 = aten.mul.Tensor(t3, h0)   # t13's users now read t11

``detach`` and ``alias`` are identities, and so are ``expand``/``view``
to the shape a value already has, in a no-grad functional graph;
``lift_fresh_copy`` and ``clone`` are copies, which a functional graph never
needs unless the copy is an output whose source is also an output or input (two
state slots must not end up sharing one tensor). A ``_to_copy`` to the dtype
and layout the value already has is the same kind of copy. Two permutes in a
row compose into one (nothing when they cancel): torch.optim.Muon's ``.T``
dance otherwise hides its Newton–Schulz chain. Then dead code goes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.fx as fx

from .base import Pass, PassResult

aten = torch.ops.aten
_IDENTITIES = {aten.detach.default, aten.alias.default}
_COPIES = {aten.lift_fresh_copy.default, aten.clone.default}
# Shape ops that are identities when asked for the shape the value already has
# (``X @ Y`` on 3-D tensors traces as expand + view + bmm + _unsafe_view).
_SAME_SHAPE = {aten.expand.default, aten.view.default, aten._unsafe_view.default, aten.reshape.default}


@dataclass(frozen=True)
class Canonicalize(Pass):
    name: ClassVar[str] = "canonicalize"

    def __call__(self, gm: fx.GraphModule) -> PassResult:
        output = next(n for n in gm.graph.nodes if n.op == "output")
        returned = set(output.args[0])
        self._transposes_as_permutes(gm)
        removed = self._fold_permutes(gm, returned)
        for node in list(gm.graph.nodes):
            if node.op != "call_function" or not self._is_removable(node, returned):
                continue
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
            removed += 1
        before = len(gm.graph.nodes)
        gm.graph.eliminate_dead_code()
        dead = before - len(gm.graph.nodes)
        # An output list may now name one node twice (two slots, one value):
        # each write-back then needs its own tensor, so keep a clone there.
        seen: set[fx.Node] = set()
        outs = list(output.args[0])
        for i, value in enumerate(outs):
            if value in seen or value.op == "placeholder":
                with gm.graph.inserting_before(output):
                    outs[i] = gm.graph.call_function(aten.clone.default, (value,))
                outs[i].meta.update(value.meta)
                outs[i].meta["hocompile.origin"] = self.name
            seen.add(outs[i])
        output.args = (tuple(outs),)
        gm.recompile()
        changed = bool(removed or dead)
        summary = f"removed {removed} identity/copy ops and {dead} dead nodes" if changed else self.decline(
            "nothing to remove"
        )
        return PassResult(gm, changed, summary)

    @staticmethod
    def _transposes_as_permutes(gm: fx.GraphModule) -> None:
        """``transpose(x, i, j)`` is the permute swapping i and j: one spelling, so pairs fold."""
        for node in gm.graph.nodes:
            if node.target is not aten.transpose.int or not isinstance(node.args[0], fx.Node):
                continue
            rank = node.args[0].meta["val"].dim()
            i, j = (int(d) % rank for d in node.args[1:3])  # type: ignore[call-overload]
            dims = list(range(rank))
            dims[i], dims[j] = dims[j], dims[i]
            node.target = aten.permute.default
            node.args = (node.args[0], dims)

    @staticmethod
    def _fold_permutes(gm: fx.GraphModule, returned: set[fx.Node]) -> int:
        folded = 0
        for node in list(gm.graph.nodes):
            if node.target is not aten.permute.default or node in returned:
                continue
            src = node.args[0]
            if not isinstance(src, fx.Node) or src.target is not aten.permute.default:
                continue
            inner, outer = list(src.args[1]), list(node.args[1])  # type: ignore[arg-type,union-attr]
            composed = [inner[d] for d in outer]
            if composed == list(range(len(composed))):
                node.replace_all_uses_with(src.args[0])
                gm.graph.erase_node(node)
            else:
                node.args = (src.args[0], composed)
            folded += 1
        return folded

    @staticmethod
    def _is_removable(node: fx.Node, returned: set[fx.Node]) -> bool:
        if node.target in _IDENTITIES:
            return True
        if node.target in _SAME_SHAPE and isinstance(node.args[0], fx.Node):
            src = node.args[0].meta.get("val")
            return src is not None and list(src.shape) == list(node.args[1]) and node not in returned  # type: ignore[arg-type]
        if node.target in _COPIES:
            return node not in returned
        if node.target is aten._to_copy.default and node not in returned:
            src = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
            val = node.meta.get("val")
            same = src is not None and val is not None and src.dtype == val.dtype
            only_dtype = set(node.kwargs) <= {"dtype"}
            return bool(same and only_dtype)
        return False
