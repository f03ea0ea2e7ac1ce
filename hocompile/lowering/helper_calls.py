"""torch.compile'd helpers in the lowered step: called directly, and in place where that is exact.

A step that calls a user's compiled helper holds one ``hocompile_torch::compiled_call`` per call
(compiled_calls.py). Through the dispatcher each costs ~60 us on top of the helper itself (~50 us
for Lion's update of a 64x64 matrix), and the op's kernel clones every argument, since an op may
neither write its inputs nor return them; the graph then copies the written ones back. 400 such
calls made a Lion step 2.5x eager's. The lowered module instead:

- calls the kernel itself (compiled_calls.call_directly), copying only the arguments the helper
  writes: the same wrapper on the same values, so the same bits;
- in the fast module (aten.py runs it when every input is contiguous, as for reinplace.py), lets the
  helper write the step's own tensor, as eager's call does (compiled_calls.call_in_place), where
  for every argument it writes:

  - the argument is a step input (a placeholder) written back from this call's result, passed once
    and with no view of it among the call's other arguments;
  - nothing reads the input's old value after the call (its readers and its views' readers come
    before), and the call comes after the write fence (writeback.py: a fallible op raising later
    must find the input as it was);

  then the call's result for it *is* the input: its write-back (``copy_(dest, copy(dest, result))``)
  is dropped and later readers of the new value read the input.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ..capture.compiled_calls import call_directly, call_in_place, written_arguments
from ..ir.graph import is_fallible
from .reinplace import views_of
from .writeback import readers

aten = torch.ops.aten


def _compiled_call() -> object:
    return torch.ops.hocompile_torch.compiled_call.default


def _writebacks(dest: fx.Node) -> list[fx.Node]:
    return [u for u in dest.users if u.meta.get("hocompile.origin") == "writeback" and u.args[0] is dest]


def _result_for(call: fx.Node, index: int) -> fx.Node | None:
    """The call's ``getitem`` of output ``index`` (None: unused or read otherwise)."""
    if any(u.target is not operator.getitem for u in call.users):
        return None
    found = [u for u in call.users if u.args[1] == index]
    return found[0] if len(found) == 1 else None


def _in_place_plan(
    call: fx.Node, order: dict[fx.Node, int], fence: fx.Node | None
) -> list[tuple[fx.Node, fx.Node]] | None:
    """For each argument the call writes: (the input, the call's result for it); None where not exact."""
    tensors = call.args[0]
    if not isinstance(tensors, (list, tuple)):
        return None
    written, outputs = written_arguments(int(call.args[2]))  # type: ignore[arg-type]
    if not written or (fence is not None and order[call] <= order[fence]):
        return None
    plan = []
    for j, i in enumerate(written):
        dest = tensors[i]
        if not isinstance(dest, fx.Node) or dest.op != "placeholder" or sum(t is dest for t in tensors) != 1:
            return None
        result = _result_for(call, outputs + j)
        backs = _writebacks(dest)
        if result is None or len(backs) != 1:
            return None
        back = backs[0]
        value = back.args[1]
        # The write-back's value: the result itself, or ``copy(dest, result)`` (the step's ``dest.copy_(...)``).
        if value is not result and not (
            isinstance(value, fx.Node) and value.target is aten.copy.default and value.args == (dest, result)
        ):
            return None
        allowed = {call, back, value}
        views = views_of(dest)
        if any(t in views for t in tensors if isinstance(t, fx.Node)):
            return None  # a view of dest passed beside it
        if any(order[r] > order[call] for r in readers(dest) if r not in allowed):
            return None  # its old value is read after the call
        plan.append((dest, result))
    return plan


def call_helpers(graph: fx.Graph, in_place: bool) -> list[str]:
    """Rewrite the graph's compiled_call nodes (see the module docstring); the names of those run in place."""
    op = _compiled_call()
    order = {n: i for i, n in enumerate(graph.nodes)}
    fence = next((n for n in reversed(graph.nodes) if is_fallible(n)), None)
    done: list[str] = []
    for call in [n for n in graph.nodes if n.op == "call_function" and n.target is op]:
        plan = _in_place_plan(call, order, fence) if in_place and not call.kwargs else None
        if plan is None:
            call.target = call_directly
            continue
        call.target = call_in_place
        for dest, result in plan:
            back = _writebacks(dest)[0]
            value = back.args[1]
            graph.erase_node(back)
            if isinstance(value, fx.Node) and value is not result:
                value.replace_all_uses_with(dest)
                graph.erase_node(value)
            result.replace_all_uses_with(dest)
            graph.erase_node(result)
        done.append(call.name)
    graph.lint()
    return done
