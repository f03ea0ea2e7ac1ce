"""Triton lowering: the step graph becomes generated kernels and a host wrapper.

- regions.py / op_groups.py / schedule.py decide what is launched, as
  units: a *pointwise group* (one horizontally fused kernel for isomorphic
  per-parameter regions), a *registered op group* (a ``hocompile::`` op
  whose family registered a Triton emitter with
  ``registry.register_lowering(op, "triton", emitter)``; Newton–Schulz's is
  ns_group.py, registered when this package is imported), a *call unit*
  (a registered op with several tensor inputs, ``factor_update`` and
  ``two_sided``: call_group.py, emitters in factor_update_group.py and
  two_sided_group.py), or an *aten call* (anything else, a registered op
  without a Triton emitter or declined by call_group.find_calls included);
- pointwise.py and ns_kernels.py generate each kernel from a small spec
  (one generator per family, stable names, a provenance header);
- wrapper.py writes ``forward()``; the whole module is written to the cache
  directory and imported from there (readable tracebacks, ``breakpoint()``,
  ``TRITON_INTERPRET=1``).

:func:`lower_to_triton` returns a plain runnable; replaying the generated
``launch()`` from a CUDA graph (``runtime/step_graph.py``) is the runtime's
business, which :attr:`TritonModule.module` and ``graph_safe`` allow.

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

from ...targets import device_arch
from . import factor_update_group, ns_group, two_sided_group  # noqa: F401  (each registers its family's emitter)
from .autotune import autotune as tune
from .code import KernelSource
from .module import assemble, load
from .tiles import tile_overrides
from .wrapper import generate_wrapper


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
    """A lowered step: ``run(args)`` runs it once; ``module`` is the generated module, whose
    ``buffers()``/``tables()``/``launch()`` a CUDA-graph replay drives when ``graph_safe``."""

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
    """Generate, write and load the step module for ``gm``; ``run`` is a plain runnable.

    ``cuda_graphs`` is accepted only as False: wrapping for CUDA-graph replay
    lives in the runtime (it stays a positional parameter until the runtime's
    call stops passing it).
    """
    if cuda_graphs:
        raise ValueError("lower_to_triton returns a plain runnable; the runtime wraps it for CUDA-graph replay")
    arch = device_arch(device)
    if arch == "interpret":
        _enter_interpreter()
    plan = generate_wrapper(gm, copy_into, arch, upcast="_UPCAST")
    if autotune:
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

    path = Path(module.__file__ or "")
    unique = list({k.name: k for k in plan.kernels}.values())
    return TritonModule(
        run, path, text, unique, plan.kept, plan.launches, plan.units, from_disk, module, plan.graph_safe
    )


__all__ = ["KernelSource", "TritonModule", "lower_to_triton"]
