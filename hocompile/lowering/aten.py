"""CPU lowering: the graph becomes a Python module of aten calls.

The module is written to the cache directory and run under that file name,
so a traceback through a compiled step points at a readable line of
generated code, and ``breakpoint()`` in it works. A cache directory that
cannot be written costs only that file: the module then runs from memory.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.fx as fx
from torch._library.custom_ops import OPDEFS
from torch.fx.graph import PythonCode

from ..capture.inplace_foreach import run_eager_inplace
from ..capture.matmul_precision import honour as honour_matmul_precision
from ..diskcache import DiskCache, load_generated
from ..ir.decisions import decisions_of
from ..ir.graph import print_graph
from ..precision.measure_ns import intra_op_threads
from .fused_updates import fuse_updates
from .helper_calls import call_helpers
from .reinplace import Reinplaced, reinplace, reuse_temporaries
from .writeback import schedule_writebacks

LOWERING_VERSION = "aten-8"  # 3: re-inplaced write-backs; 4: registered ops called directly; 5: threads;
# 6: aten ops called as tensor methods; 7: compiled helpers called directly, in place; 8: matmul precision


@dataclass
class LoweredStep:
    """A runnable step: ``run(tensors + scalars) -> outputs[kept]``.

    Outputs the generated code already copied into their destination are not
    returned; ``kept`` lists the indices (into the graph's outputs) that are.
    """

    run: Callable[[list[Any]], tuple[torch.Tensor, ...]]
    path: Path
    key: str
    from_disk: bool
    source: str
    kept: list[int]
    backend: str = "aten"
    kernels: list[Any] = field(default_factory=list)  # KernelSource, for the triton backend
    launches: int = 0  # kernel launches per step (triton backend)
    units: list[str] = field(default_factory=list)  # what each launch is, for explain()
    graphed: bool = False  # replayed from a CUDA graph (runtime/step_graph.py)
    reinplaced: list[Reinplaced] = field(default_factory=list)  # write-backs computed in place (aten backend)
    fused: list[str] = field(default_factory=list)  # "adamw:p0_0": chains run by torch's fused kernels


def cache_key(gm: fx.GraphModule, pipeline_identity: str) -> str:
    """The step module's key: the graph with its decisions' choices, never their predicted
    timings (a recalibrated target that plans the same step keeps the key)."""
    graph = print_graph(gm, predictions=False)
    text = "\n".join([LOWERING_VERSION, torch.__version__, pipeline_identity, graph, _constants_digest(gm)])
    return hashlib.sha256(text.encode()).hexdigest()


def _constants_digest(gm: fx.GraphModule) -> str:
    parts = []
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            value = getattr(gm, str(node.target))
            parts.append(f"{node.target}={value.tolist() if value.numel() < 64 else value.shape}")
    return ";".join(parts)


# Rewrites a generated ``forward``'s source given its parameter names (list_mode.py).
SourceTransform = Callable[[str, list[str]], str]


def lower_to_aten(
    gm: fx.GraphModule,
    key: str,
    cache: DiskCache,
    header: str,
    copy_into: list[int | None],
    fused_updates: bool = False,
    transform: SourceTransform | None = None,
    contiguous: Callable[[list[Any]], bool] | None = None,
) -> LoweredStep:
    """Generate, cache and load the step module. Rewrites ``gm`` (write-backs).

    Two modules come from the graph: the plain one (functional ops, then
    ``copy_`` write-backs) and, where reinplace.py finds write-backs it can
    compute in place, the re-inplaced one. The re-inplaced module runs when
    every tensor input is contiguous (its bitwise-equality argument needs
    that, and strides are not guarded); the plain one otherwise. Before
    that, ``fused_updates`` (opt-in) replaces AdamW / SGD-momentum chains by
    torch's fused kernels (fused_updates.py: within 1e-6 of eager, not bitwise).
    ``transform`` rewrites each module's source before it is cached and run (with
    ``contiguous`` deciding between them from the arguments: list_mode.py).
    """
    kept = schedule_writebacks(gm, copy_into)
    plain_graph = fx.Graph(owning_module=gm)
    plain_graph.output(plain_graph.graph_copy(gm.graph, {}))
    honour_matmul_precision(plain_graph)
    call_helpers(plain_graph, in_place=False)
    run_eager_inplace(plain_graph)
    call_kernels_directly(plain_graph)
    call_tensor_methods(plain_graph)
    keep_collective_inputs_alive(plain_graph)
    plain = _transformed(plain_graph, transform)
    graph = fx.Graph(owning_module=gm)
    graph.output(graph.graph_copy(gm.graph, {}))
    fused = fuse_updates(graph) if fused_updates else []
    honour_matmul_precision(graph)
    helpers_in_place = call_helpers(graph, in_place=True)
    done = reinplace(graph)
    reused = reuse_temporaries(graph)
    run_eager_inplace(graph)
    call_kernels_directly(graph)
    call_tensor_methods(graph)
    keep_collective_inputs_alive(graph)
    if not fused and not done and not reused and not helpers_in_place:
        module, path, body, from_disk = _load(cache, key, header, plain)
        return LoweredStep(_runner(module.forward, gm), path, key, from_disk, body, kept)
    fast, path, body, from_disk = _load(cache, key, header, _transformed(graph, transform))
    fast_forward, plain_forward = fast.forward, None
    is_contiguous = contiguous or _all_contiguous

    def run(args: list[Any]) -> tuple[torch.Tensor, ...]:
        nonlocal plain_forward
        if is_contiguous(args):
            return fast_forward(gm, *args)
        if plain_forward is None:  # built on first need: most runs never see a strided tensor
            plain_forward = _load(cache, key, header, plain)[0].forward
        return plain_forward(gm, *args)

    return LoweredStep(run, path, key, from_disk, body, kept, reinplaced=done, fused=fused)


def _all_contiguous(args: list[Any]) -> bool:
    return all(a.is_contiguous() for a in args if isinstance(a, torch.Tensor))


def _transformed(graph: fx.Graph, transform: SourceTransform | None) -> PythonCode:
    code = graph.python_code(root_module="self")
    if transform is None:
        return code
    names = [str(n.target) for n in graph.nodes if n.op == "placeholder"]
    code.src = transform(code.src, names)
    code.globals.setdefault("torch", torch)
    return code


def fast_program(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` (a host read's program: host_reads.py) with its temporaries reused in place and its
    aten calls as tensor methods: the same kernels, so the same values, with fewer allocations and
    less Python per op. Only for contiguous inputs (the reuse checks the traced layouts)."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    reuse_temporaries(graph)
    call_tensor_methods(graph)
    return fx.GraphModule(gm, graph)


def call_kernels_directly(graph: fx.Graph) -> None:
    """Call registered ops' Python kernels (``torch.library.custom_op`` functions) directly.

    Through the dispatcher a custom op costs ~0.1 ms per call on CPU (its Python
    wrapper, schema checks, the fake-tensor machinery's hooks), as much as a
    768² GEMM; the kernel is the same function either way, so the values are
    the same. Ops defined otherwise (the in-place ``factor_update_``) keep
    their dispatcher call.
    """
    for node in graph.nodes:
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
            continue
        if target.namespace != "hocompile":
            continue
        opdef = OPDEFS.get(target._schema.name)
        # Only where the default kernel is the one the dispatcher would pick: an op with a
        # device-specific kernel (register_kernel) or a disabled one keeps its dispatcher call.
        if opdef is not None and not node.kwargs:
            if set(opdef._backend_fns) <= {None} and not opdef._disabled_kernel:
                node.target = _direct(target._schema.name, opdef._init_fn)
        threads = planned_threads(node)
        if threads:
            node.target = _on_threads(node.target, threads)


def _keep_alive(*tensors: Any) -> None:
    """Nothing: the generated module's reference to ``tensors`` lasts until this call."""


def keep_collective_inputs_alive(graph: fx.Graph) -> None:
    """Each functional collective's inputs stay referenced until its ``wait_tensor``.

    The generated module drops a value after its last use, which for a collective's
    input is the collective's launch. A backend that does not hold its own reference
    (NCCL without record_stream, as reported against nanochat's async Muon gathers)
    could then hand the memory to the next allocation mid-transfer: a torn gather.
    """
    wait = torch.ops._c10d_functional.wait_tensor.default
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not wait:
            continue
        launch = node.args[0]
        if not isinstance(launch, fx.Node) or not str(launch.target).startswith("_c10d_functional."):
            continue
        inputs = [a for a in launch.args if isinstance(a, fx.Node)]
        if inputs:
            with graph.inserting_after(node):
                graph.call_function(_keep_alive, tuple(inputs))


# The overloads a tensor method's argument parser resolves to for the same arguments.
_METHOD_OVERLOADS = frozenset({"default", "Tensor", "Scalar"})


def call_tensor_methods(graph: fx.Graph) -> None:
    """``aten.add_.Tensor(x, y)`` -> ``x.add_(y)``: the same kernel through the tensor's C method.

    An op overload called from Python costs ~1 us more than the method (measured: add_
    4.5 vs 2.8 us, sqrt 2.2 vs 1.1), which is most of a small optimizer step (a 21-param
    AdamW step makes 189 such calls). Only methods implemented in C (``TensorBase``) and not
    redefined in Python by ``torch.Tensor`` (``split``, ``norm``... may call other ops),
    on overloads the method resolves to for the same arguments, and never with ``out=``.
    """
    base, python = torch._C.TensorBase.__dict__, torch.Tensor.__dict__
    for node in graph.nodes:
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
            continue
        if target.namespace != "aten" or target._overloadname not in _METHOD_OVERLOADS:
            continue
        name = target._schema.name.split("::", 1)[1]
        arguments = target._schema.arguments
        if name not in base or name in python or not arguments or arguments[0].name != "self":
            continue
        first = node.args[0] if node.args else None
        if "out" in node.kwargs or not isinstance(first, fx.Node):
            continue
        if not isinstance(first.meta.get("val"), torch.Tensor):
            continue
        node.op, node.target = "call_method", name


def planned_threads(node: fx.Node) -> int:
    """The intra-op threads a plan chose for this op (choose-algorithm, measured), 0 if none."""
    chosen = [d.chose["threads"] for d in decisions_of(node) if "threads" in d.chose]
    last = chosen[-1] if chosen else 0
    return last if isinstance(last, int) else 0


_ON_THREADS: dict[tuple[Any, int], Callable[..., Any]] = {}


def _on_threads(fn: Any, threads: int) -> Callable[..., Any]:
    """``fn`` run with torch's intra-op threads set to ``threads`` (measure_ns.Program.threads)."""
    known = _ON_THREADS.get((fn, threads))
    if known is not None:
        return known

    def call(*args: Any, **kwargs: Any) -> Any:
        with intra_op_threads(threads):
            return fn(*args, **kwargs)

    name = getattr(fn, "__name__", "op").replace(".", "_")
    # The generated module names it so: ``hocompile_ops_newton_schulz_on_1_thread(...)``.
    call.__name__ = call.__qualname__ = f"{name}_on_{threads}_thread{'s' if threads > 1 else ''}"
    call.__module__ = getattr(fn, "__module__", None) or __name__
    call.__wrapped__ = fn  # type: ignore[attr-defined]
    _ON_THREADS[(fn, threads)] = call
    return call


_DIRECT: dict[str, Callable[..., Any]] = {}


def _direct(qualname: str, kernel: Callable[..., Any]) -> Callable[..., Any]:
    """``kernel`` called as itself, still recorded as ``qualname`` while a profiler runs
    (explain(measure=True) attributes time per op family by that name)."""
    known = _DIRECT.get(qualname)
    if known is not None and getattr(known, "__wrapped__", None) is kernel:
        return known

    def call(*args: Any) -> Any:
        if torch.autograd.profiler._is_profiler_enabled:
            with torch.profiler.record_function(qualname):
                return kernel(*args)
        return kernel(*args)

    # The generated module names it after the op (``hocompile_ops_newton_schulz(...)``).
    call.__name__ = call.__qualname__ = kernel.__name__
    call.__module__ = kernel.__module__
    call.__wrapped__ = kernel  # type: ignore[attr-defined]
    _DIRECT[qualname] = call
    return call


def _load(cache: DiskCache, key: str, header: str, code: PythonCode) -> tuple[ModuleType, Path, str, bool]:
    body = f"{header}\n{code.src}"
    # An entry that differs from ``body`` (corrupt, stale, or code that would
    # not import) is rewritten; the module run is always ``body`` itself.
    # Two graphs that print alike can still name their nodes differently (and two
    # optimizer classes share a graph): the file is named by its whole text too,
    # so entries never overwrite each other.
    entry_key = hashlib.sha256(f"{key}\n{body}".encode()).hexdigest()
    module, path, from_disk = load_generated(cache, entry_key, body, dict(code.globals))
    return module, path, body, from_disk


def _runner(forward: Callable[..., tuple[torch.Tensor, ...]], gm: fx.GraphModule) -> Callable[[list[Any]], Any]:
    def run(args: list[Any]) -> tuple[torch.Tensor, ...]:
        return forward(gm, *args)

    return run
