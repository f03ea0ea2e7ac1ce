"""Replaying a whole Triton step from a CUDA graph (``compile_optimizer(..., cuda_graphs=True)``).

A step of 50 launches spends a good part of its time in Python and in the
launch path; a CUDA graph replays all of them with one call. What makes that
valid while training goes on is the generated module's split
(lowering/triton/wrapper.py):

- ``buffers()`` allocates the step's workspaces: here once, for good;
- ``tables()`` lists, on the host, every operand address and every scalar
  (lr, momentum, eps): refreshed before each replay and copied into two
  static device tensors, so a new grad tensor or a new learning rate needs
  no recapture;
- ``launch()`` only launches kernels that read those tables or the static
  buffers: it is what the graph records.

A step that is not graph safe (an aten call or copy with a baked-in
address, or new state created by the step) runs normally, and so does a
call with a strided tensor input (the kernels index inputs by address,
row-major: the generated ``forward`` runs it on copies). On CPU tensors
there is no graph: the same static-buffer replay runs directly, which is how
tests check the mechanics.
"""

from __future__ import annotations

import logging
from types import ModuleType
from typing import Any

import torch
import torch.fx as fx

log = logging.getLogger("hocompile")


class GraphedStep:
    def __init__(self, module: ModuleType, gm: fx.GraphModule, device: torch.device) -> None:
        self.module, self.gm, self.device = module, gm, device
        self.buffers: tuple[Any, ...] | None = None
        self.ptrs: torch.Tensor | None = None
        self.scal: torch.Tensor | None = None
        self.graph: Any = None
        self.replays = 0

    def __call__(self, args: list[Any]) -> tuple[torch.Tensor, ...]:
        if not self.module.all_dense(*args):  # on contiguous copies, outside the graph (fence.py)
            return self.module.forward(self.gm, *args)  # type: ignore[no-any-return]
        if self.buffers is None:
            return self._first(args)
        assert self.ptrs is not None and self.scal is not None
        host_ptrs, host_scal = self.module.tables(self.buffers, *args)
        # Host-to-device copies outside the graph: the graph reads these tensors.
        self.ptrs.copy_(torch.tensor(host_ptrs, dtype=torch.int64))
        self.scal.copy_(torch.tensor(host_scal, dtype=torch.float32))
        self.replays += 1
        if self.graph is not None:
            self.graph.replay()
            return ()
        return self.module.launch(self.gm, self.buffers, self.ptrs, self.scal, *args)  # type: ignore[no-any-return]

    def _first(self, args: list[Any]) -> tuple[torch.Tensor, ...]:
        buffers = self.module.buffers(self.gm, self.device)
        host_ptrs, host_scal = self.module.tables(buffers, *args)
        ptrs = torch.tensor(host_ptrs, dtype=torch.int64, device=self.device)
        scal = torch.tensor(host_scal, dtype=torch.float32, device=self.device)
        self.buffers, self.ptrs, self.scal = buffers, ptrs, scal
        if self.device.type != "cuda":
            return self.module.launch(self.gm, buffers, ptrs, scal, *args)  # type: ignore[no-any-return]
        # This step runs for real on a side stream (it also compiles the
        # kernels); capturing afterwards records without executing.
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            outputs = self.module.launch(self.gm, buffers, ptrs, scal, *args)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.module.launch(self.gm, buffers, ptrs, scal, *args)
        self.graph = graph
        log.info("hocompile: step captured as a CUDA graph")
        return outputs  # type: ignore[no-any-return]
