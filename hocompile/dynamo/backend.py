"""``torch.compile(fn, backend="hocompile")``: hocompile's passes on the graphs Dynamo captures.

Dynamo traces ``fn`` (``opt.step``, or a function that calls it); AOTAutograd functionalizes each
graph to aten; hocompile's pipeline runs on it (graphs.py: the same passes as
``compile_optimizer``, planned for the inputs' device) and its lowering runs it: aten on CPU,
Triton on CUDA. ``options={"lowering": "inductor"}`` instead hands the graph to Inductor with
hocompile's passes installed as its post-grad pass (inductor.py), for the code around the
optimizer (a model's forward and backward) where Inductor's fusion is the better choice.

The other options are compile_optimizer's keywords (``disable_passes``, ``precision``,
``error_budget``, ``cache_dir``...). A graph outside hocompile's IR runs as AOTAutograd gave it,
with a :class:`BackendFallbackWarning` saying why: never silently different.

Hyperparameters: Dynamo bakes Python floats into the graph and recompiles when one changes
(every step of an lr schedule). Give the optimizer tensors (``lr=torch.tensor(0.02)``; torch's
LR schedulers fill them in place): they are graph inputs, and a schedule recompiles nothing.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

from ..errors import BackendFallbackWarning
from ..settings import Settings
from .graphs import GraphRecord, NotHocompileIR, lower, prepare, run_passes
from .last import remember

log = logging.getLogger(__name__)
__all__ = ["BackendFallbackWarning", "hocompile_backend", "settings_from"]

LOWERINGS = ("hocompile", "inductor")


def settings_from(options: dict[str, Any] | None) -> tuple[Settings, str]:
    """compile_optimizer's settings from ``torch.compile(..., options=...)``, and the lowering."""
    options = dict(options or {})
    lowering = options.pop("lowering", "hocompile")
    if lowering not in LOWERINGS:
        raise ValueError(f"hocompile backend: options['lowering'] must be one of {LOWERINGS}, got {lowering!r}")
    try:
        settings = Settings.resolve(**options)
    except TypeError as exc:
        raise TypeError(f"hocompile backend: unknown option in options={options!r} ({exc})") from None
    return settings, lowering


def hocompile_backend(
    gm: fx.GraphModule, example_inputs: list[Any], *, options: dict[str, Any] | None = None, mode: str | None = None
) -> Callable[..., Any]:
    """The Dynamo backend registered as ``"hocompile"``."""
    from torch._dynamo.backends.common import aot_autograd

    settings, lowering = settings_from(options)
    if lowering == "inductor":
        from torch._inductor.compile_fx import compile_fx

        from .inductor import inductor_passes

        pre, _ = inductor_passes(**{k: v for k, v in (options or {}).items() if k != "lowering"})
        compiled = compile_fx(gm, example_inputs, config_patches={"post_grad_custom_pre_pass": pre})
        return compiled  # type: ignore[return-value]
    from torch._guards import CompileContext

    frame = CompileContext.current_compile_id()
    parts = iter(("forward", "backward"))

    def compiler(aot_gm: fx.GraphModule, inputs: list[Any]) -> Callable[..., Any]:
        # Dynamo's compile id ("frame 0/1": frame 0, its second compile), as TORCH_LOGS names it
        part = "graph" if not any(getattr(t, "requires_grad", False) for t in example_inputs) else next(parts, "graph")
        return compile_graph(aot_gm, inputs, settings, f"frame {frame} ({part})")

    # keep_inference_input_mutations: the step's writes into params and state stay in the graph as
    # trailing copy_ nodes, which hocompile lowers as write-backs (in place where exactly safe)
    return aot_autograd(fw_compiler=compiler, bw_compiler=compiler, keep_inference_input_mutations=True)(
        gm, example_inputs
    )


def compile_graph(gm: fx.GraphModule, inputs: list[Any], settings: Settings, title: str) -> Callable[..., Any]:
    """One AOT graph: hocompile's passes and lowering, or (outside its IR) the graph as it is, loudly."""
    from ..runtime.compile_step import resolve_backend

    record = GraphRecord("backend", title)
    tensors = [t for t in inputs if isinstance(t, torch.Tensor)]
    device = tensors[0].device if tensors else torch.device("cpu")
    backend = resolve_backend(settings, device)
    work = _copy(gm)
    try:
        prepared = prepare(work)
        run_passes(prepared, settings, record, device, backend)
        runner = lower(prepared, settings, record, device, backend)
    except Exception as exc:  # outside the IR, or a pass failing on a graph it was not built for
        if not isinstance(exc, NotHocompileIR):
            exc = NotHocompileIR(f"hocompile failed on it ({type(exc).__name__}: {exc})")
        record.declined = str(exc)
        record.lowering = "as AOTAutograd gave it (aten, no hocompile passes)"
        remember(record)
        warnings.warn(
            f"hocompile backend: {title} runs without hocompile's passes: {exc}", BackendFallbackWarning, stacklevel=2
        )
        return _as_is(gm)
    remember(record)
    log.info("hocompile backend: %s: %s", title, ", ".join(f"{r.name} {r.status}" for r in record.passes))
    log.debug("hocompile backend: final graph of %s:\n%s", title, record.final_graph)
    return runner


def _copy(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` to rewrite (nodes' meta kept): the original stays runnable as it is."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    return fx.GraphModule(gm, graph)


def _as_is(gm: fx.GraphModule) -> Callable[..., Any]:
    from functorch.compile import make_boxed_func

    return make_boxed_func(gm.forward)  # type: ignore[no-any-return]
