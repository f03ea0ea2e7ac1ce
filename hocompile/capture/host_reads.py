"""Data-dependent host reads: ``.item()``, ``bool(t)``, ``if t > 0``, ``min(t, x)`` on a tensor
the step computes (a norm, a ratio), not a counter. (``float(t)`` is refused, host_scalars.py:
Python makes its result a plain float, which nothing can follow.)

Eager reads such a value once, on the host (one sync), and goes on with a Python
number. A compiled step does the same, split at the read:

1. while tracing, the read evaluates the graph traced so far on the real inputs
   (the trace is functional up to there: nothing is written) and answers with
   a host input ``read<k>`` holding that value, exactly as ``lr`` is one: its
   arithmetic becomes host scalars of the graph, its comparisons guards;
2. the capture keeps, per read, the part of the graph that computes it
   (:class:`HostRead`: the inputs it needs, its host scalars);
3. each node runs once, as in eager: what a read's program computes that the rest of the step
   (or a later read) uses is one of its results, a "carry" input of the rest;
4. before each step the runtime runs those parts, reads the values (the sync
   eager has), checks the guards on them and runs the step compiled for those
   outcomes; another outcome is another variant, compiled once, bounded like
   every branch on a counter (compiled_optimizer.VARIANTS_PER_SIGNATURE).

The values are computed by the same aten ops on the same inputs as eager
computes them, so they are bitwise eager's, and so is everything after.
A value the step uses as an int (a range, an index) stays refused: its
outcomes are not bounded.
"""

from __future__ import annotations

import operator
import os
import traceback
from collections.abc import Callable, Container
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import get_proxy_mode, get_proxy_slot
from torch.utils._python_dispatch import _disable_current_modes

from ..errors import CaptureError
from ..ir.graph import ROLE, InputSlot
from .scalars import HOCOMPILE_DIR, TORCH_DIR, Expr


@dataclass
class HostRead:
    """One host read of the step: ``name`` = ``gm(inputs, scalars).item()``."""

    name: str
    where: str  # the user's line, for explain()
    gm: fx.GraphModule
    slots: tuple[InputSlot, ...]
    exprs: tuple[Expr, ...]  # the host scalars gm takes after the tensors (earlier reads' included)
    shape: tuple[int, ...]
    dtype: torch.dtype
    # Values earlier reads' programs computed that this one uses, and those it computes that a
    # later one or the rest of the step uses ("carry" inputs, by name: split_at_reads).
    carries_in: tuple[str, ...] = ()
    carries_out: tuple[str, ...] = ()
    # gm as the aten lowering runs it (lowering/aten.py fast_program: set when the step is
    # lowered), run when every tensor it takes is contiguous (its reuse assumes the traced layouts).
    fast: fx.GraphModule | None = None

    def value(self, tensor_of: Callable[[InputSlot], torch.Tensor], env: dict[str, Any]) -> Any:
        """The read's value; its carries go into ``env`` (the step's inputs take them from there)."""
        tensors = [tensor_of(s) for s in self.slots] + [env[c] for c in self.carries_in]
        gm = self.fast if self.fast is not None and all(t.is_contiguous() for t in tensors) else self.gm
        with torch.no_grad():
            out = gm(*tensors, *(e.evaluate(env) for e in self.exprs))
        for name, tensor in zip(self.carries_out, out[1:]):
            env[name] = tensor
        return out[0].item()

    def describe(self) -> str:
        dtype = str(self.dtype).replace("torch.", "")
        return f"{self.name} = .item() of a {tuple(self.shape) or 'scalar'} {dtype} tensor{self.where}"


@dataclass
class TraceReads:
    """The reads one trace made: evaluates each on the real inputs, remembers its node."""

    real_inputs: list[torch.Tensor]
    nodes: list[fx.Node] = field(default_factory=list)
    wheres: list[str] = field(default_factory=list)
    order: dict[fx.Node, int] | None = None

    def __call__(self, tensor: torch.Tensor, where: str) -> tuple[str, Any]:
        mode = get_proxy_mode()
        if mode is None:
            raise CaptureError("a host read outside a trace")
        if torch._is_functional_tensor(tensor):
            torch._sync(tensor)
            tensor = torch._from_functional_tensor(tensor)
        try:
            node = get_proxy_slot(tensor, mode.tracer).proxy.node
        except (KeyError, AttributeError, RuntimeError) as exc:
            raise CaptureError(f"the step reads the value of a tensor hocompile cannot follow{where}") from exc
        root = getattr(mode.tracer, "root", torch.nn.Module())
        with _disable_current_modes(), torch.no_grad():
            if self.order is None:  # the trace's placeholders: made before any op, fixed from then on
                self.order = _placeholder_order(node.graph)
            real = _evaluate(root, node, self.real_inputs, self.order).item()
        self.nodes.append(node)
        self.wheres.append(step_line() or where)
        return f"read{len(self.nodes) - 1}", real


def step_line() -> str:
    """`` at file:line (`code`)`` of the step's own line that reads: the innermost frame outside
    hocompile and torch's machinery (torch.optim's own code counts: Adafactor's reads are there)."""
    here = HOCOMPILE_DIR
    torch_dir = TORCH_DIR
    optim_dir = os.path.join(torch_dir, "optim", "")
    for frame in reversed(traceback.extract_stack()):
        name = frame.filename
        machinery = name.startswith(torch_dir) and not name.startswith(optim_dir)
        if name.startswith(here) or name.startswith("<") or machinery:
            continue
        code = f" (`{frame.line.strip()}`)" if frame.line else ""
        return f" at {name.split('site-packages/')[-1]}:{frame.lineno}{code}"
    return ""


def _evaluate(root: torch.nn.Module, node: fx.Node, real_inputs: list[torch.Tensor], order: dict[fx.Node, int]) -> Any:
    """``node``'s value on the real inputs: its ancestors in the graph traced so far, run one by one
    (no module generated per read: a step with a read per param stays cheap to trace)."""
    env: dict[fx.Node, Any] = {}
    for n in _ancestors(node):
        if n.op == "placeholder":
            env[n] = real_inputs[order[n]]
        elif n.op == "get_attr":
            env[n] = getattr(root, str(n.target))
        elif n.op == "call_function":
            args, kwargs = fx.node.map_arg((n.args, n.kwargs), env.__getitem__)
            env[n] = n.target(*args, **kwargs)  # type: ignore[operator]
        else:
            raise CaptureError(f"a host read depends on `{n.format_node()}`, which hocompile cannot evaluate")
    return env[node]


def _placeholder_order(graph: fx.Graph) -> dict[fx.Node, int]:
    """The graph's placeholders by position (they come first: the walk stops at the first other node)."""
    order: dict[fx.Node, int] = {}
    for n in graph.nodes:
        if n.op != "placeholder":
            break
        order[n] = len(order)
    return order


def split_at_reads(
    gm: fx.GraphModule, slots: list[InputSlot], reads: TraceReads
) -> tuple[tuple[HostRead, ...], list[InputSlot]]:
    """Split ``gm`` (placeholders finished) at its host reads: per read, the program that computes
    it from what earlier reads' programs have not computed already; ``gm`` keeps the rest.

    Each node runs once, as in eager: a value a program computes that a later program or the rest
    of the step uses (Adafactor's update, whose norm is read) is one of its results, handed on as
    a "carry" input (the slots returned are ``slots`` and the carries, in ``gm``'s new order)."""
    position = {p: i for i, p in enumerate(p for p in gm.graph.nodes if p.op == "placeholder")}
    slot_of = {p: s for p, s in zip(position, slots)}
    stage_of: dict[fx.Node, int] = {}
    for k, node in enumerate(reads.nodes):
        for n in _ancestors(node, stop=stage_of):
            if n.op == "call_function" and n not in stage_of:
                stage_of[n] = k
    _absorb_getitems(stage_of)
    _refuse_random_draws(stage_of, reads)
    aliasing = _aliases_an_input(gm.graph)
    last_read = {node: k for k, node in enumerate(reads.nodes)}  # a value read again by a later read
    exports: dict[fx.Node, InputSlot] = {}
    counts: dict[int, int] = {}
    for n in gm.graph.nodes:  # topological: carries numbered in the order they are computed
        stage = stage_of.get(n)
        if stage is not None and (
            any(stage_of.get(u, len(reads.nodes)) > stage for u in n.users)
            or last_read.get(n, -1) > stage
        ):
            if not isinstance(n.meta.get("val"), torch.Tensor):
                raise CaptureError(
                    f"the part of the step before host read {stage} computes `{n.format_node()}`, which the rest "
                    "uses and is not a tensor; hocompile cannot hand it on"
                )
            j = counts[stage] = counts.get(stage, -1) + 1
            exports[n] = InputSlot.carry(stage, j)
    by_stage: list[list[fx.Node]] = [[] for _ in reads.nodes]
    for n in gm.graph.nodes:
        if n in stage_of:
            by_stage[stage_of[n]].append(n)
    programs = tuple(
        _program(gm, k, node, where, by_stage[k], slot_of, exports, aliasing, position)
        for k, (node, where) in enumerate(zip(reads.nodes, reads.wheres))
    )
    # The rest of the step: the carries are placeholders after the tensor inputs, before the host scalars.
    anchor = next(n for n in gm.graph.nodes if n not in slot_of)
    for n, slot in exports.items():
        with gm.graph.inserting_before(anchor):
            ph = gm.graph.placeholder(slot.label())
        ph.meta = {key: value for key, value in n.meta.items() if key in ("val", "tensor_meta")}
        ph.meta[ROLE] = slot
        n.replace_all_uses_with(ph, delete_user_cb=lambda user: user not in stage_of)
    for n in reversed(list(gm.graph.nodes)):
        if n in stage_of:
            gm.graph.erase_node(n)
    return programs, list(slots) + list(exports.values())


def _refuse_random_draws(stage_of: dict[fx.Node, int], reads: TraceReads) -> None:
    """A read's program runs ahead of the rest of the step: random numbers drawn in it come out of
    the stream in another order than eager's (every read's draws, then the rest's), and a check or an
    eager fallback of that step would start from the stream the programs moved."""
    for n, k in stage_of.items():
        target = n.target
        if isinstance(target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in target.tags:
            raise CaptureError(
                f"the step draws random numbers ({n.target}) that its host read {k} {reads.wheres[k].strip()} "
                "depends on: hocompile computes a read ahead of the rest of the step, which would draw them "
                "in another order than eager does"
            )


def _program(
    gm: fx.GraphModule, k: int, node: fx.Node, where: str, nodes: list[fx.Node],
    slot_of: dict[fx.Node, InputSlot], exports: dict[fx.Node, InputSlot], aliasing: set[fx.Node],
    position: dict[fx.Node, int],
) -> HostRead:
    """Read ``k``'s program: ``nodes`` (in order) from the inputs, earlier carries and host scalars
    they use, returning the read value and this stage's carries."""
    mine = set(nodes)
    used = {x for n in nodes for x in n.all_input_nodes if x not in mine}
    if node not in mine:  # the read is of an input, or of a value an earlier read's program computed
        used.add(node)
    inputs = sorted((x for x in used if x.op == "placeholder"), key=position.__getitem__)
    tensors = [p for p in inputs if p in slot_of]
    hosts = [p for p in inputs if p not in slot_of]
    carried = sorted((x for x in used if x in exports), key=lambda x: (exports[x].group, exports[x].index))
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for p in tensors + carried + hosts:
        env[p] = graph.placeholder(p.name)
        env[p].meta = dict(p.meta)
    for x in used:
        if x.op == "get_attr":
            env[x] = graph.node_copy(x)
    for n in nodes:
        env[n] = graph.node_copy(n, env.__getitem__)
    outs = [n for n in nodes if n in exports]
    results = []
    for n in outs:
        # A view of an input would change under the rest of the step's in-place writes: a copy.
        results.append(graph.call_function(torch.ops.aten.clone.default, (env[n],)) if n in aliasing else env[n])
    graph.output((env[node], *results))
    val = node.meta.get("val")
    return HostRead(
        f"read{k}", where, fx.GraphModule(gm, graph), tuple(slot_of[p] for p in tensors),
        tuple(p.meta[ROLE] for p in hosts),
        tuple(val.shape) if val is not None else (), val.dtype if val is not None else torch.float32,
        carries_in=tuple(exports[x].key for x in carried), carries_out=tuple(exports[n].key for n in outs),
    )


def _absorb_getitems(stage_of: dict[fx.Node, int]) -> None:
    """An op with several results is handed on by its items: they join its program (an item a
    later program took moves up to it: it reads nothing else)."""
    for n in list(stage_of):
        if not isinstance(n.meta.get("val"), torch.Tensor):
            for user in n.users:
                if user.op == "call_function" and user.target is operator.getitem:
                    stage_of[user] = min(stage_of.get(user, stage_of[n]), stage_of[n])


def _aliases_an_input(graph: fx.Graph) -> set[fx.Node]:
    """Nodes whose value may share memory with a tensor input (views of views of a param)."""
    out: set[fx.Node] = set()
    for n in graph.nodes:
        if n.op != "call_function":
            continue
        target = n.target
        views = target is operator.getitem or (
            isinstance(target, torch._ops.OpOverload) and any(r.alias_info is not None for r in target._schema.returns)
        )
        if views and any(x.op == "placeholder" or x in out for x in n.all_input_nodes):
            out.add(n)
    return out


def _ancestors(node: fx.Node, stop: Container[fx.Node] = ()) -> list[fx.Node]:
    """``node`` and everything it depends on, each after its inputs (a postorder walk: no scan of
    the whole graph per read); a node in ``stop`` is listed but not walked through."""
    done: dict[fx.Node, None] = {}
    stack: list[tuple[fx.Node, bool]] = [(node, False)]
    while stack:
        n, expanded = stack.pop()
        if n in done:
            continue
        if expanded:
            done[n] = None
            continue
        stack.append((n, True))
        if n not in stop:
            stack += [(x, False) for x in n.all_input_nodes if x not in done]
    return list(done)
