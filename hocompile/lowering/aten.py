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
from typing import Any

import torch
import torch.fx as fx

from ..diskcache import DiskCache, load_generated
from ..graph import print_graph
from .writeback import schedule_writebacks

LOWERING_VERSION = "aten-2"


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


def lower_to_aten(
    gm: fx.GraphModule, key: str, cache: DiskCache, header: str, copy_into: list[int | None]
) -> LoweredStep:
    """Generate, cache and load the step module. Rewrites ``gm`` (write-backs)."""
    kept = schedule_writebacks(gm, copy_into)
    code = gm.graph.python_code(root_module="self")
    body = f"{header}\n{code.src}"
    # An entry that differs from ``body`` (corrupt, stale, or code that would
    # not import) is rewritten; the module run is always ``body`` itself.
    # Two graphs that print alike can still name their nodes differently (and two
    # optimizer classes share a graph): the file is named by its whole text too,
    # so entries never overwrite each other.
    entry_key = hashlib.sha256(f"{key}\n{body}".encode()).hexdigest()
    module, path, from_disk = load_generated(cache, entry_key, body, dict(code.globals))
    forward = module.forward

    def run(args: list[Any]) -> tuple[torch.Tensor, ...]:
        return forward(gm, *args)

    return LoweredStep(run, path, key, from_disk, body, kept)
