"""fp64 references of one optimizer step, for verify=N (hocompile/runtime/check/verify.py).

- x: eager's program, re-captured from the optimizer (so independent of
  every pass), run with each floating dtype widened to fp64;
- y: the compiled (final) graph run the same way, each registered
  ``hocompile::`` op evaluated by its family's exact fp64 ``reference``
  (for NS: as planned, Gram NS, restarts, symmetric blocks);
- z: the compiled graph in fp64 with each Newton–Schulz op evaluated as
  standard NS in the coarser of eager's nominal precision and the plan's
  (emulated exactly, as hocompile/ops/newton_schulz_math.py does on CPUs). Only NS
  has a precision model yet: every other family is its exact fp64
  reference in z too, so its ops add nothing to the ``‖z − y‖`` budget.

``‖y − x‖`` is the plan's algebraic deviation from eager (zero up to fp64
rounding for a correct plan), ``‖z − y‖`` the error eager's own precision
makes on this input: the budget the precision passes plan against.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from ...capture.trace import CapturedStep, slot_tensor, step_tensors
from ...ir import dtypes
from ...ir.decisions import eager_dtype
from ...ir.graph import ROLE, InputSlot
from ...ir.registry import family_of
from ...ops.newton_schulz_math import newton_schulz
from ...ops.newton_schulz_spec import NewtonSchulzSpec
from ...precision.calibrate import parse_schedule_key
from ...precision.emulate import FORMATS
from ...precision.schedule_ns import newton_schulz_scheduled

if TYPE_CHECKING:
    from ..entries import CompiledEntry, StepRunner

# ------------------------------------------------------------ which tensors a plan changes


def plan_dependent_slots(entry: CompiledEntry) -> frozenset[InputSlot]:
    """Slots whose new value depends on a ``hocompile::`` op of the final graph."""
    assert entry.captured is not None
    captured = entry.captured
    downstream = plan_downstream(captured.gm)
    if not any(_is_plan_op(n) for n in downstream) and entry.final_stats.get("hocompile ops", 0):
        # Not the final graph (a pass returned a new module): any output may depend on a plan.
        return frozenset(action.slot for action in captured.outputs)
    return frozenset(slot for slot, value, _ in _graph_outputs(entry) if value in downstream)


def _graph_outputs(entry: CompiledEntry) -> list[tuple[InputSlot, Any, int | None]]:
    """(slot, value node, position among the returned values; None: copied into the input) per output."""
    assert entry.captured is not None
    captured, gm = entry.captured, entry.captured.gm
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    values = list(pytree.tree_leaves(output.args[0]))
    lowered = entry.lowered
    # The aten lowering turned outputs written in place into copy_ nodes; the others are `kept`.
    indices = lowered.kept if lowered is not None and len(values) != len(captured.outputs) else range(len(values))
    found: list[tuple[InputSlot, Any, int | None]] = [
        (captured.outputs[index].slot, value, position) for position, (index, value) in enumerate(zip(indices, values))
    ]
    return found + copied_outputs(gm)


def plan_downstream(gm: fx.GraphModule) -> set[fx.Node]:
    """The nodes of ``gm`` whose value depends on a ``hocompile::`` op (the ops included)."""
    downstream: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if _is_plan_op(node) or any(a in downstream for a in node.all_input_nodes):
            downstream.add(node)
    return downstream


def copied_outputs(gm: fx.GraphModule) -> list[tuple[InputSlot, Any, int | None]]:
    """(slot, value node, None) per output the aten lowering copies into its input (a ``copy_`` node)."""
    found: list[tuple[InputSlot, Any, int | None]] = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.aten.copy_.default:
            slot = node.args[0].meta.get(ROLE) if isinstance(node.args[0], fx.Node) else None
            if isinstance(slot, InputSlot):
                found.append((slot, node.args[1], None))
    return found


def _is_plan_op(node: fx.Node) -> bool:
    return node.op == "call_function" and getattr(node.target, "namespace", "") == "hocompile"


# ------------------------------------------------------------ fp64 references


def _widen(value: Any) -> Any:
    if isinstance(value, torch.dtype) and value.is_floating_point:
        return torch.float64
    if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != torch.float64:
        return value.double()
    return value


class Float64Run(fx.Interpreter):
    """Runs a graph with every floating dtype widened to fp64, each registered op by its family's
    fp64 reference. ``nominal``: each Newton–Schulz op instead as standard NS in the coarser of
    eager's and the plan's precision (other families have no nominal model: exact in both)."""

    def __init__(self, gm: fx.GraphModule, nominal: bool = False) -> None:
        super().__init__(gm)
        self.nominal = nominal

    def run_node(self, n: fx.Node) -> Any:
        family = family_of(n)
        if family is None:
            return super().run_node(n)
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        spec = family.spec.from_args(args, kwargs)  # runtime values: tensor fields hold tensors
        if self.nominal and isinstance(spec, NewtonSchulzSpec):
            return self._nominal_newton_schulz(n, spec)
        return family.reference(spec)  # fp64 for floating results; an integer result (an order) stays integer

    def call_function(self, target: Any, args: Any, kwargs: Any) -> Any:
        args, kwargs = pytree.tree_map(_widen, (args, kwargs))
        return super().call_function(target, args, kwargs)

    def get_attr(self, target: Any, args: Any, kwargs: Any) -> Any:
        return _widen(super().get_attr(target, args, kwargs))

    def _nominal_newton_schulz(self, node: fx.Node, op: NewtonSchulzSpec) -> torch.Tensor:

        assert isinstance(op.x, torch.Tensor)
        x, coefficients = op.x.double(), op.coefficients
        eps, eps_mode, transpose = float(op.eps), str(op.eps_mode), bool(op.transpose)  # type: ignore[arg-type]
        eager = eager_dtype(node, op.compute_dtype)
        candidates = [_gemm_format(eager), _gemm_format(op.compute_dtype)]
        if op.schedule:
            candidates.append(parse_schedule_key(op.schedule)[-1])  # NS corrects the earlier iterations
        fmt = max(candidates, key=_format_roundoff)
        if fmt in dtypes.FLOAT_NAMES:
            out = newton_schulz(x, coefficients, eps, eps_mode=eps_mode, transpose=transpose,
                                compute_dtype=dtypes.dtype(fmt), out_dtype=op.out_dtype, matmul="emulate")
        else:
            out = newton_schulz_scheduled(x.float(), coefficients, eps, (fmt,) * len(coefficients),
                                          eps_mode=eps_mode, transpose=transpose, out_dtype=op.out_dtype)
        return out.double()


def _gemm_format(dtype: torch.dtype) -> str:
    """The GEMM format a dtype computes NS in: its own name where a GEMM has it, else fp32."""
    fmt = dtypes.name(dtype)
    return fmt if fmt in dtypes.FLOAT_NAMES else "fp32"


def _format_roundoff(fmt: str) -> float:

    if fmt == "fp64":
        return 2.0**-53
    if fmt == "tf32":
        return 2.0**-11  # fp32 storage, operands rounded to 10 mantissa bits
    spec = FORMATS[fmt]
    return float(torch.finfo(spec.element or spec.storage).eps) / 2


@dataclass
class References:
    """Per plan-dependent slot: its value before the step (t0) and the three fp64 references."""

    before: dict[InputSlot, torch.Tensor] = field(default_factory=dict)
    exact: dict[InputSlot, torch.Tensor] = field(default_factory=dict)  # x: eager's program
    plan: dict[InputSlot, torch.Tensor] = field(default_factory=dict)  # y: the compiled graph
    nominal: dict[InputSlot, torch.Tensor] = field(default_factory=dict)  # z: plan ops at eager's precision
    # Plan-dependent slots of members a stamped step's check leaves out (reference_classes.py samples
    # each class: its members run one program, so a wrong program shows on any of them).
    unsampled: set[InputSlot] = field(default_factory=set)

    @staticmethod
    def compute(
        runner: StepRunner, entry: CompiledEntry, reference: CapturedStep, planned: frozenset[InputSlot]
    ) -> References:
        assert entry.captured is not None
        inner = runner.optimizer
        reference_env = runner.host_env(reference)
        inputs = [_widen(t) for t in step_tensors(inner, reference.inputs, reference_env)]
        values = Float64Run(reference.gm).run(*inputs, *reference.scalars(reference_env))
        refs = References(exact={a.slot: v for a, v in zip(reference.outputs, values) if a.slot in planned})
        env = runner.host_env(entry.captured)
        scalars = list(entry.captured.scalars(env))
        outputs = _graph_outputs(entry)
        for nominal, into in ((False, refs.plan), (True, refs.nominal)):
            # The aten lowering's graph copies results into its inputs: it gets copies.
            inputs = [widened_copy(t) for t in step_tensors(inner, entry.captured.inputs, env)]
            by_slot = dict(zip(entry.captured.inputs, inputs))
            values = Float64Run(entry.captured.gm, nominal).run(*inputs, *scalars)
            for slot, _, position in outputs:
                if slot in planned:
                    into[slot] = by_slot[slot] if position is None else values[position]
        for slot in planned:
            try:
                refs.before[slot] = widened_copy(slot_tensor(inner, slot).detach())
            except (KeyError, IndexError):  # state the step creates
                pass
        return refs


def widened_copy(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float64, copy=True) if t.is_floating_point() else t.clone()
