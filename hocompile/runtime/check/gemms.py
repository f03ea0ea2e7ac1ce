"""The self-check's eager runs on a CPU without units for eager's half-precision GEMMs.

Without AVX-512-BF16 or AMX (``targets.declared_ratios``: bf16 at 0.01 of fp32), a bf16 GEMM runs at
~2.6 GFLOP/s where fp32 runs at ~170 (the 2-core EPYC capped with ``ONEDNN_MAX_CPU_ISA=AVX2``). A plan
computes Newton–Schulz in fp32 there, but the self-check ran eager's bf16 step on two members of each
class, and again under another summation order: a program's first check took 15 s for eight 768²
Muon matrices whose compiled step takes 0.55 s (eager's: 32 s), and each program has one.

Under :class:`HalfGemmsInFp32` the check's eager runs compute each bf16 GEMM as aten does without the
units, products of the bf16 values summed in fp32 and the result rounded once to bf16, but with
fp32 GEMM kernels: eager's arithmetic in another summation order, which is what the check's
Rounding probe already models as eager's own spread (judgement_modes.py).

So it is used only where that spread is the judgement (:func:`fp32_reference_dtypes`): every bf16
GEMM of the compiled program is inside a planned op (fused Newton–Schulz), so the tensors it moves
are all judged against eager's spread, never bitwise. A bf16 GEMM the plan keeps as eager writes it
is promised eager's bits, and a compiled step computing it as this mode does would match the faster
reference bit for bit while differing from eager's: such a program is checked against eager's own
run. A check that finds a difference on the faster reference judges again against eager's own
(self_check.py): it costs a rerun, and a step is failed only on eager's own bits.

Nor for a step that calls a torch.compile'd helper: under a dispatch mode Dynamo does not reuse the
helper's compiled code (with ``fullgraph=True`` it raises, and then no longer compiles the frame at
all, for the real step either).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ...targets import declared_ratios

aten = torch.ops.aten

# GEMMs by their out-of-place op; the in-place forms map to it.
_GEMMS = frozenset({aten.mm, aten.addmm, aten.bmm, aten.baddbmm, aten.addbmm, aten.mv, aten.addmv})
_IN_PLACE = {aten.addmm_: aten.addmm, aten.baddbmm_: aten.baddbmm, aten.addbmm_: aten.addbmm, aten.addmv_: aten.addmv}
_NO_UNITS = 0.05  # a declared ratio below this: the dtype's GEMMs are emulated by the CPU (targets._EMULATED)


def fp32_reference_dtypes(gm: torch.fx.GraphModule, calls_compiled_helpers: bool) -> frozenset[torch.dtype]:
    """The dtypes whose GEMMs the self-check's eager runs may compute in fp32 for the program ``gm``
    (its final graph): this CPU's slow ones, unless a GEMM of one is left outside the planned ops or
    the step calls a torch.compile'd helper. Empty: the check runs eager as eager runs."""
    slow = slow_half_gemms()
    if not slow or calls_compiled_helpers:
        return frozenset()
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is torch.ops.hocompile_torch.compiled_call.default:
            return frozenset()
        packet: Any = getattr(node.target, "overloadpacket", None)
        if packet is not None and _IN_PLACE.get(packet, packet) in _GEMMS:
            value = node.meta.get("val")
            if not isinstance(value, torch.Tensor) or value.dtype in slow:  # unknown dtype: assume the worst
                return frozenset()
    return slow


def slow_half_gemms() -> frozenset[torch.dtype]:
    """The half dtypes whose CPU GEMMs this machine has no units for (only bf16 is taken: its products
    are summed in fp32 wherever aten computes them, which fp16's slow paths do not promise)."""
    return frozenset({torch.bfloat16}) if declared_ratios()["bf16"] < _NO_UNITS else frozenset()


class HalfGemmsInFp32(TorchDispatchMode):
    """CPU GEMMs of ``dtypes`` computed on fp32 copies of their operands and rounded once to the dtype."""

    def __init__(self, dtypes: frozenset[torch.dtype]) -> None:
        super().__init__()
        self.dtypes = dtypes
        self.calls = 0  # GEMMs computed so (the tests read it)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        packet = func.overloadpacket
        base = _IN_PLACE.get(packet, packet)
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if (
            base not in _GEMMS
            or not tensors
            or tensors[0].dtype not in self.dtypes
            or any(t.dtype != tensors[0].dtype or t.device.type != "cpu" for t in tensors)
        ):
            return func(*args, **kwargs)
        out = kwargs.pop("out", None)
        dtype = tensors[0].dtype
        wide = [a.float() if isinstance(a, torch.Tensor) else a for a in args]
        result = base(*wide, **kwargs).to(dtype)
        self.calls += 1
        if packet in _IN_PLACE:
            return args[0].copy_(result)
        if out is not None:
            out.resize_(result.shape)
            return out.copy_(result)
        return result
