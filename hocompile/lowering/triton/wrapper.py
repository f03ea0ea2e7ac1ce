"""The generated step module for the Triton backend: buffers, tables, launches.

``forward(<tensor inputs>, <host scalars>)`` does, in order:

1. ``buffers()``: allocate the step's buffers (each op group's workspace,
   norm partials, result and its emitter's temporaries; fused
   intermediates) — one allocation per group, not per parameter, and none
   inside ``launch()``;
2. ``tables()``: one labelled pointer table per fused pointwise launch (a
   row per member: operand addresses, then scalar indices; ``PW<k>`` is its
   offset) and the fp32 scalar values, concatenated into one host-to-device
   copy each: scalars are read by the kernels from device memory, so a
   replayed CUDA graph stays valid when a schedule changes the learning rate;
3. ``launch()``: the units in dependency order (schedule.py): pointwise
   groups, registered op groups (their family's emitter, op_groups.py),
   registered multi-input calls (call_group.py: ``cout<c>`` is the result)
   and aten calls;
4. copy the few results that could not be written in place, and return the
   outputs the runtime installs itself (newly created state).
"""

from __future__ import annotations

import operator
import re
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from ... import dtypes
from ...graph import ORIGIN
from ..writeback import readers
from .call_group import CallDecline, CallGroup, emit_call, find_calls
from .code import CodeWriter, KernelSource, ValueNames
from .code import python_arg as _py
from .op_groups import GroupCode, GroupNames, GroupRef, OpGroup, Workspace, allocations, find_op_groups
from .pointwise import PointwiseSpec, generate_pointwise, partial_count, region_spec
from .regions import find_regions, is_placeholder_slot
from .schedule import PointwiseGroup, Unit, build_units, schedule


@dataclass
class WrapperPlan:
    body: str
    kernels: list[KernelSource]
    kept: list[int]
    launches: int
    units: list[str] = field(default_factory=list)  # one line per launch unit, for explain()
    # Only kernels reading device tables: launch() may be captured once and
    # replayed with fresh tables (no aten call, copy, new tensor or call-unit input baked in).
    graph_safe: bool = False


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype)  # "torch.float32"


def generate_wrapper(gm: fx.GraphModule, copy_into: list[int | None], arch: str, upcast: str) -> WrapperPlan:
    op_groups, refs = find_op_groups(gm)
    regions = find_regions(gm, op_groups)
    workspaces = [g.emitter.workspace(g) for g in op_groups]
    layout = {n: ref.transposed for n, ref in refs.items()}
    groups: dict[PointwiseSpec, PointwiseGroup] = {}
    for region in regions:
        workspace = workspaces[region.feed.group] if region.feed is not None else None
        spec = region_spec(region, layout, workspace, arch)
        groups.setdefault(spec, PointwiseGroup(spec)).members.append(region)
    calls, declines = find_calls(gm)
    units, producer = build_units(gm, list(groups.values()), op_groups, calls)
    order = schedule(units)
    emitter = _Emitter(gm, copy_into, arch, upcast, op_groups, workspaces, refs, calls, declines)
    return emitter.emit(units, order, producer)


class _Emitter:
    def __init__(
        self,
        gm: fx.GraphModule,
        copy_into: list[int | None],
        arch: str,
        upcast: str,
        op_groups: list[OpGroup],
        workspaces: list[Workspace],
        refs: dict[fx.Node, GroupRef],
        calls: list[CallGroup],
        declines: list[CallDecline],
    ) -> None:
        self.gm, self.copy_into, self.arch, self.upcast = gm, copy_into, arch, upcast
        self.op_groups, self.workspaces, self.refs = op_groups, workspaces, refs
        self.names = ValueNames()
        self.placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self.scalar_index: dict[Any, int] = {
            n: i for i, n in enumerate(n for n in self.placeholders if not is_placeholder_slot(n))
        }
        # Constant scalars of op groups (NS eps), then of call units, join the scalar table after
        # the host scalars.
        for group in op_groups:
            self._add_constants(group.emitter.scalars(group))
        for call in calls:
            self._add_constants(call.emitter.scalars(call.node))
        output = next(n for n in gm.graph.nodes if n.op == "output")
        self.outputs: list[Any] = list(output.args[0])
        self.in_place: dict[fx.Node, fx.Node] = {}  # region output -> the input it is written into
        self.kernels: list[KernelSource] = []
        self.tables: list[tuple[str, str, list[list[str]]]] = []  # (label, header comment, a row per member)
        self.launches = 0
        self.computed: set[fx.Node] = set()  # values made by aten calls inside launch()
        self.buffers: list[str] = []  # names buffers() returns
        self.copies = 0  # write-backs that could not be done in place
        self.group_code: dict[int, GroupCode] = {}
        self.calls = calls
        self.declines = {d.node: d for d in declines}
        self.call_code: dict[int, GroupCode] = {}
        self.baked = 0  # call-unit inputs passed as tensors that are not step buffers

    def _scalar(self, value: Any) -> str:
        return f"scal[{self.scalar_index[value]}]"  # a 0-d view of the device scalar table

    def _add_constants(self, values: list[Any]) -> None:
        for value in values:
            if not isinstance(value, fx.Node) and value not in self.scalar_index:
                self.scalar_index[value] = len(self.scalar_index)

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
        for group in self.op_groups:  # first: buffers() allocates what the emitters' launches use
            self.group_code[group.index] = group.emitter.emit(group, self._group_names(group))
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
            self._emit_call_buffers(w)
            w.line(f"return ({''.join(b + ', ' for b in self.buffers)})")
        launches = CodeWriter()
        with launches.indent():
            summary = [self._emit_unit(launches, units[index]) for index in order]
        unpack = f"({''.join(b + ', ' for b in self.buffers)}) = B"
        w.line()
        w.line()
        self._emit_tables(w, inputs, unpack)
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
        graph_safe = not self.computed and not self.kept and not self.copies and not self.baked
        return WrapperPlan(w.text(), self.kernels, self.kept, self.launches, summary, graph_safe)

    def _emit_tables(self, w: CodeWriter, inputs: str, unpack: str) -> None:
        """Each fused launch's labelled table, its offset ``PW<k>`` in the device table, and the scalars."""
        if self.tables:
            w.line("# Where each fused launch's table starts in the one device pointer table tables() builds.")
            offset = 0
            for label, header, rows in self.tables:
                w.line(f"{label.upper()} = {offset}  # {header.split(',')[0]}")
                offset += sum(len(row) for row in rows)
            w.line()
            w.line()
        w.line(f"def tables(B, {inputs}):")
        with w.indent():
            w.line('"""Host lists: a pointer table per fused launch (per member: operand addresses, then scalar')
            w.line('indices), concatenated; and the scalar values (host scalars, then constants)."""')
            w.line(unpack)
            for label, header, rows in self.tables:
                w.line(f"# {header}")
                w.line(f"{label} = [")
                with w.indent():
                    w.lines([f"{', '.join(row)},  # member {i}" for i, row in enumerate(rows)])
                w.line("]")
            scalars = ", ".join(n.name if isinstance(n, fx.Node) else repr(float(n)) for n in self.scalar_index)
            w.line(f"return [{', '.join('*' + label for label, _, _ in self.tables)}], [{scalars}]")

    def _group_names(self, group: OpGroup) -> GroupNames:
        g = group.index
        partials = f"part{g}" if self.workspaces[g].norm_partials else None
        return GroupNames(
            x=f"ws{g}",
            partials=partials,
            n_partials=partial_count(group.m * group.n, self.arch),
            out=f"out{g}",
            prefix=f"g{g}_",
            scalar=self._scalar,
            upcast=self.upcast,
            arch=self.arch,
        )

    def _emit_buffers(self, w: CodeWriter, units: list[Unit]) -> None:
        for group in self.op_groups:
            g, workspace, code = group.index, self.workspaces[group.index], self.group_code[group.index]
            x = group.feeds[0].meta["val"]
            shape = (group.batch, group.m, group.n)
            w.line(f"# {group.family.name} group {g}: {group.batch} x {group.m}x{group.n}, {dtypes.name(x.dtype)} in")
            w.line(f"ws{g} = torch.empty({shape}, dtype={_dtype(workspace.dtype)}, device=dev)")
            self.buffers.append(f"ws{g}")
            if workspace.norm_partials:
                parts = partial_count(group.m * group.n, self.arch)
                w.line(f"part{g} = torch.empty(({group.batch}, {parts}), dtype=torch.float32, device=dev)")
                self.buffers.append(f"part{g}")
            w.line(f"out{g} = torch.empty({shape}, dtype={_dtype(group.out_dtype)}, device=dev)")
            self.buffers.append(f"out{g}")
            if code.buffers:
                w.line(f"# its kernels' temporaries ({group.family.name} emitter)")
                w.lines(allocations(code.buffers, "dev"))
                self.buffers += [b.name for b in code.buffers]
            whole = group.node.meta["val"].dim() == 3
            single = GroupRef(g, 0, group.feed_transposed[0], feed=False)
            self.names.expr[group.node] = f"out{g}" if whole else self._group_view(single)
        for node, ref in self.refs.items():
            self.names.expr[node] = self._group_view(ref)
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

    def _emit_call_buffers(self, w: CodeWriter) -> None:
        """Each call unit's result and temporaries; its launch lines are kept for launch()."""
        for call in self.calls:
            # An aten node's value is named after it when launch() computes it (_emit_node).
            inputs = {f: self.names.expr.get(x, x.name) for f, x in call.inputs().items()}
            # The kernels take tensors, not table addresses: an input outside buffers() (a grad, a
            # state tensor) is baked into a captured CUDA graph, so the step is not graph safe.
            self.baked += sum(re.split(r"[\[.]", e)[0] not in self.buffers for e in inputs.values())
            code, lines = emit_call(call, inputs, self._scalar, self.upcast, self.arch)
            self.call_code[call.index] = code
            w.lines(lines)
            self.buffers += [f"cout{call.index}", *(b.name for b in code.buffers)]
            self.names.expr[call.node] = f"cout{call.index}"

    def _group_view(self, ref: GroupRef) -> str:
        view = f"out{ref.group}[{ref.slot}]"
        return f"{view}.mT" if ref.transposed else view

    def _ptr(self, node: fx.Node) -> str:
        if node in self.refs:
            ref = self.refs[node]
            group = self.op_groups[ref.group]
            return f"out{ref.group}.data_ptr() + {ref.slot * group.m * group.n * group.out_dtype.itemsize}"
        return f"{self.names.of(node)}.data_ptr()"

    def _emit_unit(self, w: CodeWriter, unit: Unit) -> str:
        if unit.pointwise is not None:
            return self._emit_pointwise(w, unit.pointwise)
        if unit.group is not None:
            code = self.group_code[unit.group.index]
            w.lines(code.lines)
            self.launches += code.launches  # the emitter's own count, not a count of its text
            self.kernels += code.kernels
            return code.summary
        if unit.call is not None:
            code = self.call_code[unit.call.index]
            w.lines(code.lines)
            self.launches += code.launches
            self.kernels += code.kernels
            return f"call {unit.call.index} {unit.call.node.name}: {code.summary}"
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
        rows: list[list[str]] = []
        for region in group.members:
            row = [self._ptr(n) for n in region.inputs] + [self._ptr(n) for n in region.outputs]
            if region.feed is not None:
                ref = region.feed
                op_group, workspace = self.op_groups[ref.group], self.workspaces[ref.group]
                size = op_group.m * op_group.n * workspace.dtype.itemsize
                row.append(f"ws{ref.group}.data_ptr() + {ref.slot * size}")
                if workspace.norm_partials:
                    parts = partial_count(op_group.m * op_group.n, self.arch)
                    row.append(f"part{ref.group}.data_ptr() + {ref.slot * parts * 4}")
            row += [str(self.scalar_index[s]) for s in region.scalars]
            rows.append(row)
        members = len(group.members)
        if any(n in self.computed for r in group.members for n in r.inputs):
            # An operand made by an aten call earlier in the step (lazily
            # created state): its address exists only now, so this launch
            # gets its own small table.
            flat = ", ".join(v for row in rows for v in row)
            w.line(f"rows = torch.tensor([{flat}], dtype=torch.int64, device=dev)")
            w.line(f"{kernel.launcher}(rows, 0, scal, {members})")
        else:
            label = f"pw{len(self.tables)}"
            header = f"{label}: {kernel.name}, {members} member(s) x [{', '.join(spec.columns)}]"
            self.tables.append((label, header, rows))
            w.line(f"{kernel.launcher}(ptrs, {label.upper()}, scal, {members})")
        self.launches += 1
        return f"{kernel.name}: {len(group.members)} member(s), 1 launch"

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
        decline = self.declines.get(node)
        return f"aten {name}" + (f" (kept as an aten call: {decline.reason})" if decline is not None else "")

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
