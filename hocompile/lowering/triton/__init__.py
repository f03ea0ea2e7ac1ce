"""Triton lowering: the step graph becomes generated kernels and a host wrapper.

- regions.py / schedule.py decide what is launched: one horizontally fused
  pointwise kernel per group of isomorphic per-parameter regions, and a
  fixed sequence of matmul kernels per Newton–Schulz group;
- pointwise.py and ns_kernels.py generate each kernel from a small spec
  (one generator per family, stable names, a provenance header);
- wrapper.py writes ``forward()``; the whole module is written to the cache
  directory and imported from there (readable tracebacks, ``breakpoint()``,
  ``TRITON_INTERPRET=1``).

On CUDA tensors the kernels compile for the device; on CPU tensors they run
in Triton's interpreter (``TRITON_INTERPRET=1``, which this module sets
before the generated kernels are defined), which is how tests check them.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx

from .code import KernelSource
from .module import assemble, load
from .tiles import MATMUL_TILES, tile_overrides
from .wrapper import generate_wrapper

TRITON_LOWERING_VERSION = "triton-1"


def device_arch(device: torch.device) -> str:
    """The tile-table architecture for ``device``: "interpret" on CPU, else smXY."""
    if device.type != "cuda":
        return "interpret"
    major, minor = torch.cuda.get_device_capability(device)
    name = f"sm{major}{minor}"
    if name in MATMUL_TILES:
        return name
    known = sorted((k for k in MATMUL_TILES if k.startswith("sm")), key=lambda k: int(k[2:]))
    older = [k for k in known if int(k[2:]) <= major * 10 + minor]
    return older[-1] if older else known[0]


def _enter_interpreter() -> None:
    """Make kernels defined from now on run in Triton's CPU interpreter.

    Triton decides when ``triton.language`` is imported whether its own
    helpers (``tl.sum``, ...) are interpreted, so a process that imported
    Triton without ``TRITON_INTERPRET=1`` cannot interpret kernels later.
    """
    if "triton.language" in sys.modules:
        import triton.language as tl
        from triton.runtime.interpreter import InterpretedFunction

        if not isinstance(tl.standard.sum, InterpretedFunction):
            raise RuntimeError(
                "hocompile: backend='triton' on CPU params runs the kernels in Triton's interpreter, but Triton "
                "was imported before TRITON_INTERPRET=1 was set; set TRITON_INTERPRET=1 in the environment "
                "before importing triton (or use backend='aten' on CPU)"
            )
    os.environ["TRITON_INTERPRET"] = "1"


@dataclass
class TritonModule:
    run: Callable[[list[Any]], tuple[torch.Tensor, ...]]
    path: Path
    source: str
    kernels: list[KernelSource]
    kept: list[int]
    launches: int
    units: list[str]
    from_disk: bool
    module: Any = None
    graph_safe: bool = False


def lower_to_triton(
    gm: fx.GraphModule,
    cache_dir: Path,
    header: str,
    copy_into: list[int | None],
    device: torch.device,
    cuda_graphs: bool = False,
    autotune: bool = False,
) -> TritonModule:
    arch = device_arch(device)
    if arch == "interpret":
        _enter_interpreter()
    plan = generate_wrapper(gm, copy_into, arch, upcast="_UPCAST")
    if autotune:
        from .autotune import autotune as tune

        # Tile choices change only launch constants, never the plan: regenerate with the winners.
        with tile_overrides(tune(plan.kernels, cache_dir, arch, device)):
            plan = generate_wrapper(gm, copy_into, arch, upcast="_UPCAST")
    prelude = [
        f"# lowered for {arch}; {plan.launches} launches per step",
        *(f"#   {line}" for line in plan.units),
    ]
    body = "\n".join(
        [
            "# The interpreter computes half precision wrongly: kernels upcast after loads there.",
            "_UPCAST = os.environ.get('TRITON_INTERPRET', '0') not in ('', '0')",
            "",
            "",
            plan.body,
        ]
    )
    text = assemble(plan.kernels, body, header="\n".join([header, *prelude]))
    module, from_disk = load(text, cache_dir)
    forward = module.forward

    def run(args: list[Any]) -> tuple[torch.Tensor, ...]:
        return forward(gm, *args)

    if cuda_graphs and plan.graph_safe:
        from ...runtime.step_graph import GraphedStep

        run = GraphedStep(module, gm, device)

    path = Path(module.__file__ or "")
    unique = list({k.name: k for k in plan.kernels}.values())
    return TritonModule(
        run, path, text, unique, plan.kept, plan.launches, plan.units, from_disk, module, plan.graph_safe
    )


__all__ = ["KernelSource", "TritonModule", "device_arch", "lower_to_triton", "TRITON_LOWERING_VERSION"]
