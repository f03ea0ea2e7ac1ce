"""Data-dependent host reads: ``.item()``, ``float(t)``, ``if t > 0``, ``min(t, x)`` on a tensor
the step computes (a norm, a ratio), not a counter.

Eager reads such a value once, on the host (one sync), and goes on with a Python
number. A compiled step does the same, split at the read:

1. while tracing, the read evaluates the graph traced so far on the real inputs
   (the trace is functional up to there: nothing is written) and answers with
   a host input ``read<k>`` holding that value, exactly as ``lr`` is one: its
   arithmetic becomes host scalars of the graph, its comparisons guards;
2. the capture keeps, per read, the part of the graph that computes it
   (:class:`HostRead`: the inputs it needs, its host scalars);
3. before each step the runtime runs those parts, reads the values (the sync
   eager has), checks the guards on them and runs the step compiled for those
   outcomes; another outcome is another variant, compiled once, bounded like
   every branch on a counter (compiled_optimizer.VARIANTS_PER_SIGNATURE).

The values are computed by the same aten ops on the same inputs as eager
computes them, so they are bitwise eager's, and so is everything after.
A value the step uses as an int (a range, an index) stays refused: its
outcomes are not bounded.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import get_proxy_mode, get_proxy_slot
from torch.utils._python_dispatch import _disable_current_modes

from .graph import ROLE, InputSlot
from .scalars import CaptureError, Expr


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

    def value(self, tensor_of: Callable[[InputSlot], torch.Tensor], env: dict[str, Any]) -> Any:
        with torch.no_grad():
            out = self.gm(*(tensor_of(s) for s in self.slots), *(e.evaluate(env) for e in self.exprs))
        return out.item()

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
    here = os.path.dirname(os.path.abspath(__file__))
    torch_dir = os.path.dirname(torch.__file__)
    optim_dir = os.path.join(torch_dir, "optim")
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


def read_programs(
    gm: fx.GraphModule, slots: list[InputSlot], reads: TraceReads
) -> tuple[HostRead, ...]:
    """Per read, the part of ``gm`` (host scalars lifted already) that computes it."""
    order = _placeholder_order(gm.graph)
    slot_of = dict(zip(order, slots))
    programs = []
    for k, (node, where) in enumerate(zip(reads.nodes, reads.wheres)):
        needed = _ancestors(node)
        graph = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        inputs = sorted((n for n in needed if n.op == "placeholder"), key=order.__getitem__)
        tensors = [p for p in inputs if p in slot_of]
        hosts = [p for p in inputs if p not in slot_of]
        for p in tensors + hosts:
            env[p] = graph.placeholder(p.name)
            env[p].meta = dict(p.meta)
        for n in needed:
            if n.op != "placeholder":
                env[n] = graph.node_copy(n, env.__getitem__)
        graph.output(env[node])
        val = node.meta.get("val")
        programs.append(HostRead(
            f"read{k}", where, fx.GraphModule(gm, graph), tuple(slot_of[p] for p in tensors),
            tuple(p.meta[ROLE] for p in hosts),
            tuple(val.shape) if val is not None else (), val.dtype if val is not None else torch.float32,
        ))
    return tuple(programs)


def _ancestors(node: fx.Node) -> list[fx.Node]:
    """``node`` and everything it depends on, each after its inputs (a postorder walk: no scan of
    the whole graph per read)."""
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
        stack += [(x, False) for x in n.all_input_nodes if x not in done]
    return list(done)
