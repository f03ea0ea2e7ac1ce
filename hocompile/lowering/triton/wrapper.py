"""The generated step module for the Triton backend: buffers, tables, launches.

``forward(<tensor inputs>, <host scalars>)`` does, in order:

1. allocate the step's buffers (NS workspaces, norm partials, NS results,
   fused intermediates) — one allocation per group, not per parameter;
2. build one int64 pointer table (every pointwise launch's operand addresses
   and scalar indices) and one fp32 scalar table, one host-to-device copy
   each: scalars are read by the kernels from device memory, so a replayed
   CUDA graph stays valid when a schedule changes the learning rate;
3. launch the units in dependency order (schedule.py);
4. copy the few results that could not be written in place, and return the
   outputs the runtime installs itself (newly created state).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from ...graph import ORIGIN
from ...ops_schema import NewtonSchulzSpec
from ..writeback import readers
from .code import CodeWriter, KernelSource
from .ns_kernels import emit_newton_schulz
from .ns_scheduled import emit_newton_schulz_scheduled
from .pointwise import PointwiseSpec, generate_pointwise, partial_count, region_spec
from .regions import NSGroup, NSRef, find_ns_groups, find_regions, is_placeholder_slot
from .schedule import PointwiseGroup, Unit, build_units, schedule


@dataclass
class WrapperPlan:
    body: str
    kernels: list[KernelSource]
    kept: list[int]
    launches: int
    units: list[str] = field(default_factory=list)  # one line per launch unit, for explain()
    # Only kernels reading device tables: launch() may be captured once and
    # replayed with fresh tables (no aten call, copy or new tensor baked in).
    graph_safe: bool = False


class _Names:
    """Python names of values in the generated forward()."""

    def __init__(self) -> None:
        self.expr: dict[fx.Node, str] = {}

    def of(self, node: fx.Node) -> str:
        return self.expr[node]


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype)  # "torch.float32"


def _py(arg: Any, names: _Names) -> str:
    if isinstance(arg, fx.Node):
        return names.of(arg)
    if isinstance(arg, (list, tuple)):
        inner = ", ".join(_py(a, names) for a in arg)
        return f"[{inner}]" if isinstance(arg, list) else f"({inner}{',' if len(arg) == 1 else ''})"
    if isinstance(arg, torch.dtype):
        return _dtype(arg)
    if isinstance(arg, torch.device):
        return "dev"
    if isinstance(arg, (torch.memory_format, torch.layout)):
        return str(arg)
    return repr(arg)


def ns_schedule(node: fx.Node) -> str:
    """The op's per-iteration precision schedule key (choose-precision), or ""."""
    return str(NewtonSchulzSpec.from_node(node).schedule)


def ns_input_dtype(node: fx.Node) -> torch.dtype:
    """The dtype of the NS workspace the pre-kernel writes: the op's compute dtype, or fp32 for a
    schedule (whose reference normalises the fp32 input; the first iteration's operands round later)."""
    return torch.float32 if ns_schedule(node) else NewtonSchulzSpec.from_node(node).compute_dtype


def generate_wrapper(gm: fx.GraphModule, copy_into: list[int | None], arch: str, upcast: str) -> WrapperPlan:
    ns_groups, refs = find_ns_groups(gm)
    regions = find_regions(gm, ns_groups)
    layout = {n: ref.transposed for n, ref in refs.items()}
    groups: dict[PointwiseSpec, PointwiseGroup] = {}
    for region in regions:
        feed_dtype = ns_input_dtype(ns_groups[region.feed.group].node) if region.feed is not None else None
        spec = region_spec(region, layout, feed_dtype, arch)  # type: ignore[arg-type]
        groups.setdefault(spec, PointwiseGroup(spec)).members.append(region)
    units, producer = build_units(gm, list(groups.values()), ns_groups)
    order = schedule(units)
    return _Emitter(gm, copy_into, arch, upcast, ns_groups, refs).emit(units, order, producer)


class _Emitter:
    def __init__(
        self,
        gm: fx.GraphModule,
        copy_into: list[int | None],
        arch: str,
        upcast: str,
        ns_groups: list[NSGroup],
        refs: dict[fx.Node, NSRef],
    ) -> None:
        self.gm, self.copy_into, self.arch, self.upcast = gm, copy_into, arch, upcast
        self.ns_groups, self.refs = ns_groups, refs
        self.names = _Names()
        self.placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self.scalar_index: dict[Any, int] = {
            n: i for i, n in enumerate(n for n in self.placeholders if not is_placeholder_slot(n))
        }
        # Constant NS eps values join the scalar table after the host scalars.
        for group in ns_groups:
            eps = NewtonSchulzSpec.from_node(group.node).eps
            if not isinstance(eps, fx.Node) and eps not in self.scalar_index:
                self.scalar_index[eps] = len(self.scalar_index)
        output = next(n for n in gm.graph.nodes if n.op == "output")
        self.outputs: list[Any] = list(output.args[0])
        self.in_place: dict[fx.Node, fx.Node] = {}  # region output -> the input it is written into
        self.kernels: list[KernelSource] = []
        self.table: list[str] = []  # the pointer table, as expressions
        self.launches = 0
        self.computed: set[fx.Node] = set()  # values made by aten calls inside launch()
        self.buffers: list[str] = []  # names buffers() returns
        self.copies = 0  # write-backs that could not be done in place

    # -- what each region output writes into --------------------------------
    def _plan_in_place(self, units: list[Unit], order: list[int], producer: dict[fx.Node, int]) -> None:
        position = {unit: i for i, unit in enumerate(order)}
        dests: dict[fx.Node, fx.Node] = {}
        for value, dest_index in zip(self.outputs, self.copy_into):
            if dest_index is not None and isinstance(value, fx.Node):
                dests.setdefault(value, self.placeholders[dest_index])
        for index, unit in enumerate(units):
            if unit.pointwise is None:
                continue
            for region in unit.pointwise.members:
                inside = set(region.nodes)
                for out in region.outputs:
                    dest = dests.get(out)
                    if dest is None or dest in self.in_place.values():
                        continue
                    # Safe when the old value is read only by this region (each
                    # element is read before the same program overwrites it)
                    # or by units that run before this one.
                    if all(
                        user in inside or position.get(producer.get(user, -1), len(order)) < position[index]
                        for user in readers(dest)
                    ):
                        self.in_place[out] = dest

    def emit(self, units: list[Unit], order: list[int], producer: dict[fx.Node, int]) -> WrapperPlan:
        for node in self.placeholders:
            self.names.expr[node] = node.name
        self._plan_in_place(units, order, producer)
        inputs = ", ".join(n.name for n in self.placeholders)
        tensor = next((n for n in self.placeholders if is_placeholder_slot(n)), None)
        device = f"{tensor.name}.device" if tensor is not None else "torch.device('cpu')"
        w = CodeWriter()
        w.line("def buffers(self, dev):")
        with w.indent():
            w.line('"""Every buffer of the step, allocated once per step (once for good under a CUDA graph)."""')
            for node in self.gm.graph.nodes:
                if node.op == "get_attr":  # a constant the capture recorded (self is the graph module)
                    w.line(f"{node.name} = self.{node.target}.to(dev)")
                    self.names.expr[node] = node.name
                    self.buffers.append(node.name)
            self._emit_buffers(w, units)
            w.line(f"return ({''.join(b + ', ' for b in self.buffers)})")
        launches = CodeWriter()
        with launches.indent():
            summary = [self._emit_unit(launches, units[index]) for index in order]
        unpack = f"({''.join(b + ', ' for b in self.buffers)}) = B"
        w.line()
        w.line()
        w.line(f"def tables(B, {inputs}):")
        with w.indent():
            w.line('"""Host lists: per member of each fused launch, operand addresses then scalar indices;')
            w.line('and the scalar values (host scalars, then constants)."""')
            w.line(unpack)
            scalars = ", ".join(n.name if isinstance(n, fx.Node) else repr(float(n)) for n in self.scalar_index)
            w.line(f"return [{', '.join(self.table)}], [{scalars}]")
        w.line()
        w.line()
        w.line(f"def launch(self, B, ptrs, scal, {inputs}):")
        with w.indent():
            w.line('"""The launches; reads addresses and scalars from device tables (CUDA-graph safe)."""')
            w.line(f"dev = {device}")
            w.line(unpack)
        w.extend(launches)
        self._emit_outputs(w)
        w.line()
        w.line()
        w.line(f"def forward(self, {inputs}):")
        with w.indent():
            w.line(f"dev = {device}")
            w.line("B = buffers(self, dev)")
            w.line(f"host_ptrs, host_scal = tables(B, {inputs})")
            w.line("ptrs = torch.tensor(host_ptrs, dtype=torch.int64, device=dev)")
            w.line("scal = torch.tensor(host_scal, dtype=torch.float32, device=dev)")
            w.line(f"return launch(self, B, ptrs, scal, {inputs})")
        graph_safe = not self.computed and not self.kept and not self.copies
        return WrapperPlan(w.text(), self.kernels, self.kept, self.launches, summary, graph_safe)

    def _emit_buffers(self, w: CodeWriter, units: list[Unit]) -> None:
        for group in self.ns_groups:
            op = NewtonSchulzSpec.from_node(group.node)
            x = op.x_node.meta["val"]
            compute, out_dtype = ns_input_dtype(group.node), op.out_dtype
            shape = (group.batch, group.m, group.n)
            parts = partial_count(group.m * group.n, self.arch)
            g = group.index
            w.line(f"# Newton-Schulz group {g}: {group.batch} x {group.m}x{group.n}, {x.dtype} in")
            w.line(f"ws{g} = torch.empty({shape}, dtype={_dtype(compute)}, device=dev)")  # type: ignore[arg-type]
            self.buffers += [f"ws{g}", f"part{g}", f"nsout{g}"]
            w.line(f"part{g} = torch.empty(({group.batch}, {parts}), dtype=torch.float32, device=dev)")
            w.line(f"nsout{g} = torch.empty({shape}, dtype={_dtype(out_dtype)}, device=dev)")  # type: ignore[arg-type]
            self.names.expr[group.node] = (
                f"nsout{g}" if x.dim() == 3 else self._ns_view(NSRef(g, 0, bool(op.transpose), False))
            )
        for node, ref in self.refs.items():
            self.names.expr[node] = self._ns_view(ref)
        kept_values = {v for v, d in zip(self.outputs, self.copy_into) if d is None}
        for u, unit in enumerate(units):
            if unit.pointwise is None:
                continue
            spec = unit.pointwise.spec
            for k, (op_index, dtype) in enumerate(spec.outputs):
                stacked = f"buf{u}_{k}"
                need_stack = any(
                    r.nodes[op_index] not in self.in_place and r.nodes[op_index] not in kept_values
                    for r in unit.pointwise.members
                )
                if need_stack:
                    stack_shape = (len(unit.pointwise.members), *spec.shape)
                    w.line(f"{stacked} = torch.empty({stack_shape}, dtype={_dtype(dtype)}, device=dev)")
                    self.buffers.append(stacked)
                for i, region in enumerate(unit.pointwise.members):
                    node = region.nodes[op_index]
                    if node in self.in_place:
                        self.names.expr[node] = self.in_place[node].name
                    elif node in kept_values:
                        name = f"new{u}_{k}_{i}"
                        w.line(f"{name} = torch.empty({spec.shape}, dtype={_dtype(dtype)}, device=dev)")
                        self.buffers.append(name)
                        self.names.expr[node] = name
                    else:
                        self.names.expr[node] = f"{stacked}[{i}]"

    def _ns_view(self, ref: NSRef) -> str:
        view = f"nsout{ref.group}[{ref.slot}]"
        return f"{view}.mT" if ref.transposed else view

    def _ptr(self, node: fx.Node) -> str:
        if node in self.refs:
            ref = self.refs[node]
            group = self.ns_groups[ref.group]
            itemsize = group.node.meta["val"].dtype.itemsize
            return f"nsout{ref.group}.data_ptr() + {ref.slot * group.m * group.n * itemsize}"
        return f"{self.names.of(node)}.data_ptr()"

    def _emit_unit(self, w: CodeWriter, unit: Unit) -> str:
        if unit.kind == "pointwise":
            assert unit.pointwise is not None
            return self._emit_pointwise(w, unit.pointwise)
        if unit.kind == "ns":
            assert unit.ns is not None
            return self._emit_ns(w, unit.ns)
        assert unit.node is not None
        return self._emit_node(w, unit.node)

    def _emit_pointwise(self, w: CodeWriter, group: PointwiseGroup) -> str:
        spec = group.spec
        first = group.members[0]
        passes = sorted({str(n.meta.get(ORIGIN, "?")) for n in first.nodes}) or ["batch-by-shape"]
        nodes = ", ".join(n.name for n in first.nodes) or f"the stack feeding {first.feed_value}"
        twins = len(group.members) - 1
        origin = f"{'/'.join(passes)} nodes {nodes}" + (f" and {twins} isomorphic twin(s)" if twins else "")
        kernel = generate_pointwise(spec, origin)
        self.kernels.append(kernel)
        rows: list[str] = []
        for region in group.members:
            rows += [self._ptr(n) for n in region.inputs]
            rows += [self._ptr(n) for n in region.outputs]
            if region.feed is not None:
                ref = region.feed
                ns = self.ns_groups[ref.group]
                compute = ns_input_dtype(ns.node)
                size = ns.m * ns.n * compute.itemsize  # type: ignore[union-attr]
                parts = partial_count(ns.m * ns.n, self.arch)
                rows.append(f"ws{ref.group}.data_ptr() + {ref.slot * size}")
                rows.append(f"part{ref.group}.data_ptr() + {ref.slot * parts * 4}")
            rows += [str(self.scalar_index[s]) for s in region.scalars]
        members = len(group.members)
        if any(n in self.computed for r in group.members for n in r.inputs):
            # An operand made by an aten call earlier in the step (lazily
            # created state): its address exists only now, so this launch
            # gets its own small table.
            w.line(f"rows = torch.tensor([{', '.join(rows)}], dtype=torch.int64, device=dev)")
            w.line(f"{kernel.launcher}(rows, 0, scal, {members})")
        else:
            w.line(f"{kernel.launcher}(ptrs, {len(self.table)}, scal, {members})")
            self.table += rows
        self.launches += 1
        return f"{kernel.name}: {len(group.members)} member(s), 1 launch"

    def _emit_ns(self, w: CodeWriter, group: NSGroup) -> str:
        node = group.node
        spec = NewtonSchulzSpec.from_node(node)
        # (spec.blocks is an aten option: the kernels compute symmetric products on lower tiles anyway)
        eps, compute, algorithm = spec.eps, spec.compute_dtype, spec.algorithm
        eps_expr = f"scal[{self.scalar_index[eps]}]"  # a 0-d view: read on the device, never baked in
        g = group.index
        ns_lines = CodeWriter()
        common: dict[str, Any] = dict(
            x=f"ws{g}",
            partials=f"part{g}",
            P=str(partial_count(group.m * group.n, self.arch)),
            eps=eps_expr,
            out=f"nsout{g}",
            batch=group.batch,
            m=group.m,
            n=group.n,
            coefficients=spec.coefficients,
            out_dtype=spec.out_dtype,
            eps_mode=spec.eps_mode,
            arch=self.arch,
            upcast=self.upcast,
            prefix=f"ns{g}_",
            algorithm=algorithm,
        )
        schedule = ns_schedule(node)
        if schedule:
            from ...precision.calibrate import parse_schedule_key

            origin = f"fuse-newton-schulz/choose-precision node {node.name}"
            kernels = emit_newton_schulz_scheduled(
                ns_lines, schedule=parse_schedule_key(schedule), origin=origin, **common
            )
        else:
            origin = f"fuse-newton-schulz node {node.name}"
            kernels = emit_newton_schulz(ns_lines, dtype=compute, restarts=list(spec.restarts), origin=origin, **common)
        w.extend(ns_lines)
        # A scheduled NS whose last iteration is FP8 ends with one copy_ (the reference's bf16 rounding).
        launched = ns_lines.count("launch_") + ns_lines.count(".copy_(")
        self.launches += launched
        self.kernels += kernels
        plan = f"{algorithm} schedule {schedule}" if schedule else algorithm
        return f"newton-schulz group {g}: {group.batch} x {group.m}x{group.n} {plan}, {launched} launches"

    def _emit_node(self, w: CodeWriter, node: fx.Node) -> str:
        name = node.name
        if node.target is operator.getitem:
            w.line(f"{name} = {_py(node.args[0], self.names)}[{node.args[1]!r}]")
        else:
            target = node.target
            qualified = f"torch.ops.{target.namespace}.{target._schema.name.split('::')[-1]}.{target._overloadname}"  # type: ignore[union-attr]
            args = [_py(a, self.names) for a in node.args]
            args += [f"{k}={_py(v, self.names)}" for k, v in node.kwargs.items()]
            w.line(f"{name} = {qualified}({', '.join(args)})")
            self.launches += 1  # an aten call: at least one launch on a GPU
        self.names.expr[node] = name
        self.computed.add(node)
        return f"aten {name}"

    def _emit_outputs(self, w: CodeWriter) -> None:
        kept: list[int] = []
        returned: list[str] = []
        with w.indent():
            for index, (value, dest_index) in enumerate(zip(self.outputs, self.copy_into)):
                if dest_index is None or not isinstance(value, fx.Node):
                    kept.append(index)
                    returned.append(_py(value, self.names))
                    continue
                dest = self.placeholders[dest_index]
                if self.in_place.get(value) is dest:
                    continue
                w.line(f"{dest.name}.copy_({self.names.of(value)})")
                self.copies += 1
                self.launches += 1
            w.line(f"return ({''.join(r + ', ' for r in returned)})")
        self.kept = kept
