"""An aten graph torch.compile hands over, as hocompile's IR: the passes run on it as on a
captured step, and the aten (CPU) or Triton (CUDA) lowering runs it.

AOTAutograd gives a functionalized aten graph whose placeholders are the step's tensors (params,
grads, state: Dynamo lifts them) and whose input mutations are trailing ``copy_(input, value)``
nodes (``keep_inference_input_mutations``). That is the shape capture.py produces, less the
binding plan: each placeholder gets ``InputSlot.graph_input(i)`` as its ROLE, the ``copy_``
nodes become write-backs into input ``i`` (the lowering computes them in place where that is
exactly safe, lowering/reinplace.py), and the graph's own outputs are returned as they are.

What hocompile's IR does not cover (symbolic shapes, a mutation that is not a trailing copy into
an input, an output that is not a tensor) is refused with the reason, and the caller hands the
graph to Inductor or runs it as it is, saying so.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from ..diskcache import DiskCache
from ..errors import BackendFallbackWarning  # noqa: F401  (defined there, re-exported here)
from ..ir.graph import ORIGIN, ROLE, InputSlot, decisions, graph_stats, print_graph
from ..lowering import LoweredStep, cache_key, lower_to_aten
from ..passes import PassRecord, run_pipeline
from ..settings import Settings

aten = torch.ops.aten


class NotHocompileIR(Exception):
    """The graph is outside what hocompile's passes take; the message says why."""


@dataclass
class GraphRecord:
    """What hocompile did to one graph torch.compile handed it (hocompile.explain_last())."""

    route: str  # "backend" (torch.compile(backend="hocompile")) or "inductor pass"
    title: str
    passes: list[PassRecord] = field(default_factory=list)
    final_graph: str = ""
    decisions: list[str] = field(default_factory=list)
    before: dict[str, int] = field(default_factory=dict)
    after: dict[str, int] = field(default_factory=dict)
    pass_seconds: float = 0.0
    lower_seconds: float = 0.0
    lowering: str = ""  # "aten: <path>", "triton: <path>", "inductor", or why it ran as it is
    declined: str = ""  # non-empty: hocompile left this graph alone, and why
    key: str = ""


@dataclass
class PreparedGraph:
    gm: fx.GraphModule
    copy_into: list[int | None]  # per output: the input it is written into, or None (returned)
    returned: int  # how many of the outputs are the graph's own (the rest are write-backs)
    nones: list[int]  # positions of the graph's None outputs (left out of the lowered graph)


def prepare(gm: fx.GraphModule, eager_alpha: bool = True) -> PreparedGraph:
    """Give ``gm`` (an AOT/post-grad aten graph, rewritten in place) ROLEs, ORIGINs and write-backs;
    ``eager_alpha``: Dynamo's fma for a tensor ``alpha=`` back to eager's add (hocompile's lowering
    runs it; Inductor, which compiles its own fma, takes the graph with it as Dynamo made it)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for i, node in enumerate(placeholders):
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            raise NotHocompileIR(
                f"input {i} ({node.name}) is a {type(val).__name__}, not a tensor: symbolic shapes or numbers "
                "(compile with dynamic=False; hocompile's passes plan static shapes)"
            )
        node.meta[ROLE] = InputSlot.graph_input(i)
    index = {node: i for i, node in enumerate(placeholders)}
    if eager_alpha:
        _eager_alpha(gm.graph)
    writes: list[tuple[int, fx.Node]] = []
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is aten.copy_.default and node.args[0] in index and not node.users:
            value = node.args[1]
            if not isinstance(value, fx.Node):
                raise NotHocompileIR(f"`{node.format_node()}` copies a constant into an input")
            writes.append((index[node.args[0]], value))
            gm.graph.erase_node(node)
            continue
        schema = getattr(node.target, "_schema", None)
        if schema is not None and schema.is_mutable:
            raise NotHocompileIR(f"`{node.format_node()}` mutates a tensor in the middle of the graph")
        node.meta.setdefault(ORIGIN, "torch.compile")
    output = next(n for n in gm.graph.nodes if n.op == "output")
    given = list(output.args[0]) if isinstance(output.args[0], (list, tuple)) else [output.args[0]]
    nones = [k for k, value in enumerate(given) if value is None]  # a backward graph's grads of non-leaves
    own = [value for value in given if value is not None]
    for k, value in enumerate(own):
        if not isinstance(value, fx.Node) or not isinstance(value.meta.get("val"), torch.Tensor):
            raise NotHocompileIR(f"output {k} of the graph is {value!r}, not a tensor the graph computes")
    output.args = (tuple(own) + tuple(v for _, v in writes),)
    gm.graph.lint()
    gm.recompile()
    return PreparedGraph(gm, [None] * len(own) + [i for i, _ in writes], len(own), nones)


def _eager_alpha(graph: fx.Graph) -> None:
    """``t.add_(x, alpha=a)`` with a tensor ``a`` (torch.optim.Muon's ``alpha=-adjusted_lr`` when
    the lr is a tensor): Dynamo traces it as ``prims.fma(x, a, t)``, one rounding where eager
    reads ``a`` as a number (``.item()``) and runs add's kernel. Put eager's arithmetic back:
    ``add(t, x, alpha=a.item())``, bitwise eager's (the read is the sync eager has too)."""
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not torch.ops.prims.fma.default or node.kwargs:
            continue
        other, alpha, base = node.args
        val = alpha.meta.get("val") if isinstance(alpha, fx.Node) else None
        if not (isinstance(val, torch.Tensor) and val.dim() == 0 and isinstance(base, fx.Node)):
            continue
        with graph.inserting_before(node):
            number = graph.call_function(aten._local_scalar_dense.default, (alpha,))
            number.meta.update(val=0.0, **{ORIGIN: "torch.compile"})
            add = graph.call_function(aten.add.Tensor, (base, other), {"alpha": number})
        add.meta = dict(node.meta)
        node.replace_all_uses_with(add)
        graph.erase_node(node)


def run_passes(
    prepared: PreparedGraph, settings: Settings, record: GraphRecord, device: torch.device, backend: str,
    inductor: bool = False,
) -> None:
    """hocompile's default pipeline for ``device`` on the graph (rewritten in place); ``inductor``:
    a post-grad graph Inductor lowers next."""
    from ..runtime.compile_step import step_pipeline  # (the runtime imports this package's users)

    pipeline, _ = step_pipeline(settings, device, backend, stack_calls=not inductor)
    record.before = graph_stats(prepared.gm)
    start = time.perf_counter()
    prepared.gm, record.passes = run_pipeline(prepared.gm, pipeline, settings.disabled_passes, settings.dump_dir)
    record.pass_seconds = time.perf_counter() - start
    record.after = graph_stats(prepared.gm)
    record.final_graph = print_graph(prepared.gm, record.title)
    record.decisions = decisions(prepared.gm)


def lower(
    prepared: PreparedGraph, settings: Settings, record: GraphRecord, device: torch.device, backend: str
) -> Callable[[list[Any]], list[Any]]:
    """The graph lowered; the returned function takes the inputs (a list, boxed: AOTAutograd's
    convention), writes the write-backs into them and returns the graph's own outputs."""
    start = time.perf_counter()
    identity = ";".join(f"{r.name}:{r.status}" for r in record.passes)
    record.key = cache_key(prepared.gm, f"torch.compile;{identity};backend={backend}")
    header = f"# Generated by hocompile for a graph torch.compile handed over ({record.route}): {record.title}"
    lowered: LoweredStep
    if backend == "triton":
        from ..runtime.lower_step import lower_triton_step

        lowered = lower_triton_step(prepared.gm, record.key, header, prepared.copy_into, settings, device)
    else:
        lowered = lower_to_aten(
            prepared.gm, record.key, DiskCache(settings.cache_dir), header, prepared.copy_into, settings.fused_updates
        )
    record.lower_seconds = time.perf_counter() - start
    record.lowering = f"{lowered.backend}, {'from disk cache' if lowered.from_disk else 'generated'}: {lowered.path}"
    copy_into, kept, returned, nones = prepared.copy_into, lowered.kept, prepared.returned, prepared.nones
    step = lowered.run

    def run(args: list[Any]) -> list[Any]:
        outputs = step(list(args))
        own: list[Any] = [None] * returned
        for index, value in zip(kept, outputs):
            dest = copy_into[index]
            if dest is None:
                own[index] = value
            else:  # a write-back the generated code left to the caller (a view, a new layout)
                args[dest].copy_(value)
        args.clear()  # boxed: the inputs' references go as soon as they are used
        for k in nones:
            own.insert(k, None)
        return own

    run._boxed_call = True  # type: ignore[attr-defined]
    return run
