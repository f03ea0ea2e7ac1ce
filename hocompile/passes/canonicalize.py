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
``lift_fresh_copy`` and ``clone`` are copies, which a functional graph needs
only where layout or aliasing can tell: a copy goes only when its result has
its source's strides (``x.mT.flatten()`` traces as a contiguous ``clone`` +
``_unsafe_view``, and that view fails on the transposed source) and no output
or ``_unsafe_view`` is reached through views of it (two state slots must not
end up sharing one tensor, nor state alias an input). A ``_to_copy`` to the
dtype the value already has is the same kind of copy. Two permutes in a
row compose into one (nothing when they cancel): torch.optim.Muon's ``.T``
dance otherwise hides its Newton–Schulz chain. Every removal keeps each
value's strides, so the fake tensors in ``meta["val"]`` stay true. Then dead
code goes.

Kept::

    t1 = aten.permute(t0, [1, 0])
    t2 = aten.clone(t1, memory_format=contiguous)   # strides differ from t1's
    t3 = aten._unsafe_view(t2, [15])
"""

from __future__ import annotations

import operator
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
            # Compare the result's shape, not the argument: view(x, [4, -1]) of a 4×6 x is x.
            src, val = node.args[0].meta.get("val"), node.meta.get("val")
            same_shape = src is not None and val is not None and list(src.shape) == list(val.shape)
            return same_shape and node not in returned and Canonicalize._same_layout(node)
        if node.target is aten.permute.default and isinstance(node.args[0], fx.Node):
            dims = list(node.args[1])  # type: ignore[arg-type]
            identity = dims == list(range(len(dims)))  # a lone permute(x, [0, 1]) (tensordot makes them)
            return identity and node not in returned and Canonicalize._same_layout(node)
        if node.target in _COPIES:
            return node not in returned and Canonicalize._layout_and_aliasing_allow(node)
        if node.target is aten._to_copy.default and node not in returned:
            src = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
            val = node.meta.get("val")
            same = src is not None and val is not None and src.dtype == val.dtype
            only_dtype = set(node.kwargs) <= {"dtype"}
            return bool(same and only_dtype) and Canonicalize._layout_and_aliasing_allow(node)
        return False

    @staticmethod
    def _layout_and_aliasing_allow(copy: fx.Node) -> bool:
        """May ``copy``'s users read its source instead? Only if nothing can tell the difference."""
        return Canonicalize._same_layout(copy) and not Canonicalize._needs_fresh_tensor(copy)

    @staticmethod
    def _same_layout(node: fx.Node) -> bool:
        """Does ``node``'s value have its source's strides and storage offset?

        A copy is also a layout change when it makes a permuted or expanded
        value contiguous (``x.mT.flatten()`` traces as ``clone(memory_format=
        contiguous)`` + ``_unsafe_view``): a view below it then needs that
        layout, and reading the source instead fails at run time or, through
        ``as_strided``, reads other elements. The fake tensors from tracing
        carry eager's strides, and every op this pass removes keeps them.
        """
        src = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
        val = node.meta.get("val")
        if not isinstance(src, torch.Tensor) or not isinstance(val, torch.Tensor):
            return False
        return src.shape == val.shape and src.stride() == val.stride() and src.storage_offset() == val.storage_offset()

    @staticmethod
    def _needs_fresh_tensor(copy: fx.Node) -> bool:
        """Does a reader rely on ``copy`` owning its storage?

        Without the copy, every view of it becomes a view of the source. That
        is harmless inside the graph (nothing is mutated) but not when such a
        view is returned (the written-back value would alias an input or another
        output) or feeds ``_unsafe_view``, whose contract is an unaliased input:
        its schema claims a fresh tensor, so the write-back scheduler would not
        see it as a reader of the source.
        """
        stack = list(copy.users)
        while stack:
            user = stack.pop()
            if user.op == "output" or user.target is aten._unsafe_view.default:
                return True
            if Canonicalize._aliases_input(user):
                stack += list(user.users)
        return False

    @staticmethod
    def _aliases_input(node: fx.Node) -> bool:
        """Is ``node`` a view (schema says its result aliases an argument), or an item of one?"""
        if node.op != "call_function":
            return False
        if node.target is operator.getitem:  # split/unbind return lists of views
            return True
        schema = getattr(node.target, "_schema", None)
        return schema is not None and any(r.alias_info is not None for r in schema.returns)
