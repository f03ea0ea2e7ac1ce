"""The Triton emitter of ``hocompile::newton_schulz``: registered with the op's family on import.

One group is one NS call (a stack of batch-by-shape members, or one
matrix). Its feeding pointwise kernels store the input rounded to the
compute dtype (fp32 for a choose-precision schedule, whose reference
normalises the fp32 input) and the norm partials the first kernel turns
into the Frobenius norm; the launches are ns_kernels.py's fixed sequence,
or ns_scheduled.py's for a per-iteration precision schedule.
"""

from __future__ import annotations

from typing import Any

import torch

from ...ir.registry import register_lowering
from ...ops.newton_schulz_spec import NewtonSchulzSpec, newton_schulz_op
from ...precision.calibrate import parse_schedule_key
from .code import CodeWriter
from .ns_kernels import NSCall, emit_newton_schulz
from .ns_scheduled import emit_newton_schulz_scheduled
from .op_groups import BACKEND, GroupCode, GroupNames, OpGroup, Workspace


def ns_input_dtype(spec: NewtonSchulzSpec) -> torch.dtype:
    """The workspace dtype: the op's compute dtype, or fp32 for a schedule (whose reference
    normalises the fp32 input; the first iteration's operands round later)."""
    return torch.float32 if spec.schedule else spec.compute_dtype


class NewtonSchulzEmitter:
    """:class:`~.op_groups.GroupEmitter` for Newton–Schulz."""

    def workspace(self, group: OpGroup) -> Workspace:
        return Workspace(ns_input_dtype(group.spec), norm_partials=True)

    def scalars(self, group: OpGroup) -> list[Any]:
        return [group.spec.eps]

    def emit(self, group: OpGroup, names: GroupNames) -> GroupCode:
        spec: NewtonSchulzSpec = group.spec
        assert names.partials is not None
        node = group.node
        # (spec.blocks is an aten option: the kernels compute symmetric products on lower tiles anyway)
        w = CodeWriter()
        schedule = str(spec.schedule)
        origin = f"fuse-newton-schulz{'/choose-precision' if schedule else ''} node {node.name}"
        call = NSCall(
            x=names.x,
            partials=names.partials,
            P=str(names.n_partials),
            eps=names.scalar(spec.eps),  # a 0-d view: read on the device, never baked in
            out=names.out,
            upcast=names.upcast,
            prefix=names.prefix,
            batch=group.batch,
            m=group.m,
            n=group.n,
            coefficients=spec.coefficients,
            out_dtype=spec.out_dtype,
            eps_mode=spec.eps_mode,
            algorithm=spec.algorithm,
            arch=names.arch,
            origin=origin,
        )
        if schedule:
            emitted = emit_newton_schulz_scheduled(w, call, parse_schedule_key(schedule))
        else:
            emitted = emit_newton_schulz(w, call, spec.compute_dtype, list(spec.restarts))
        plan = f"{spec.algorithm} schedule {schedule}" if schedule else spec.algorithm
        summary = (
            f"newton-schulz group {group.index}: {group.batch} x {group.m}x{group.n} {plan}, "
            f"{emitted.launches} launches"
        )
        lines = w.text().rstrip("\n").split("\n")
        return GroupCode(emitted.kernels, emitted.buffers, lines, emitted.launches, summary)


register_lowering(newton_schulz_op(), BACKEND, NewtonSchulzEmitter())

__all__ = ["NewtonSchulzEmitter", "ns_input_dtype"]
