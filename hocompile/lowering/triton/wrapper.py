"""The generated step module for the Triton backend: buffers, tables, launches, then one commit.

``forward(<tensor inputs>, <host scalars>)`` does, in order:

1. strided tensor inputs: the step runs on contiguous copies (fence.py);
2. ``buffers()``: allocate the step's buffers (each op group's workspace,
   norm partials, result and its emitter's temporaries; fused
   intermediates; the *stages* every written-back value lands in, placed in
   bytes of buffers that are dead by then where they fit) — one allocation
   per group, not per parameter, and none inside ``launch()``;
3. ``tables()``: one labelled pointer table per fused launch (a row per
   member: operand addresses, then scalar indices; ``PW<k>`` is its offset)
   and the fp32 scalar values, concatenated into one host-to-device copy
   each: scalars are read by the kernels from device memory, so a replayed
   CUDA graph stays valid when a schedule changes the learning rate;
4. ``launch()``: the units in dependency order (schedule.py; units that
   only produce write-backs last): pointwise groups, registered op groups
   (their family's emitter, op_groups.py), registered multi-input calls
   (call_group.py: ``cout<c>`` is the result) and aten calls; then the
   *commit*: the stages are copied into their params and state (fence.py),
   so an error in any launch before it has written nothing;
5. return the outputs the runtime installs itself (newly created state).
"""

from __future__ import annotations

import operator
import re
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from ...ir import dtypes
from ...ir.graph import ORIGIN
from .call_group import CallDecline, CallGroup, emit_call, find_calls
from .code import CodeWriter, KernelSource, ValueNames
from .code import python_arg as _py
from .fence import HELPERS, FenceReport, Host, Liveness, Stage, WriteBack, emit_commit, stage_lines
from .module import write_forward, write_tables
from .op_groups import GroupCode, GroupNames, GroupRef, OpGroup, Workspace, find_op_groups
from .pointwise import PointwiseSpec, generate_pointwise, partial_count, region_spec
from .recompute import recompute_early_writebacks
from .regions import find_regions, is_placeholder_slot, operand_layouts
from .schedule import PointwiseGroup, Unit, units_in_order


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
    fence: FenceReport | None = None


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype)  # "torch.float32"


def _is_view(node: fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return schema is not None and any(r.alias_info is not None for r in schema.returns)


def generate_wrapper(gm: fx.GraphModule, copy_into: list[int | None], arch: str, upcast: str) -> WrapperPlan:
    recompute_early_writebacks(gm, copy_into)  # so the fence finds dead buffers for them (recompute.py)
    op_groups, refs = find_op_groups(gm)
    regions = find_regions(gm, op_groups)
    calls, declines = find_calls(gm)
    workspaces = [g.emitter.workspace(g) for g in op_groups]
    layout = operand_layouts(gm, regions, op_groups, [c.node for c in calls], refs)
    groups: dict[PointwiseSpec, PointwiseGroup] = {}
    for region in regions:
        workspace = workspaces[region.feed.group] if region.feed is not None else None
        spec = region_spec(region, layout, workspace, arch)
        groups.setdefault(spec, PointwiseGroup(spec)).members.append(region)
    units, order = units_in_order(gm, list(groups.values()), op_groups, calls)
    emitter = _Emitter(gm, copy_into, arch, upcast, op_groups, workspaces, refs, calls, declines, layout)
    return emitter.emit(units, order)


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
        layout: dict[fx.Node, bool],
    ) -> None:
        self.gm, self.copy_into, self.arch, self.upcast = gm, copy_into, arch, upcast
        self.op_groups, self.workspaces, self.refs, self.layout = op_groups, workspaces, refs, layout
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
        self.kernels: list[KernelSource] = []
        self.tables: list[tuple[str, str, list[list[str]]]] = []  # (label, header comment, a row per member)
        self.launches = 0
        self.computed: set[fx.Node] = set()  # values made by aten calls inside launch()
        self.buffers: list[str] = []  # names buffers() returns
        self.alloc = CodeWriter()  # buffers()'s allocation lines, stages excepted
        self.hosts: list[tuple[str, int]] = []  # step buffers (name, bytes) a stage may reuse once dead
        self.stages: list[tuple[str, tuple[int, ...], torch.dtype, int]] = []  # name, shape, dtype, unit
        self.liveness: Liveness | None = None
        self.copies = 0  # write-backs and snapshots done by aten copies (not from the pointer table)
        self.group_code: dict[int, GroupCode] = {}
        self.calls = calls
        self.declines = {d.node: d for d in declines}
        self.call_code: dict[int, GroupCode] = {}
        self.baked = 0  # call-unit inputs passed as tensors that are not step buffers
        self.kept: list[int] = []
        self.commits = 0

    def _scalar(self, value: Any) -> str:
        return f"scal[{self.scalar_index[value]}]"  # a 0-d view of the device scalar table

    def _add_constants(self, values: list[Any]) -> None:
        for value in values:
            if not isinstance(value, fx.Node) and value not in self.scalar_index:
                self.scalar_index[value] = len(self.scalar_index)

    def _allocate(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        """An allocation line of buffers(); the buffer's bytes may host stages once it is dead."""
        self.alloc.line(f"{name} = torch.empty({shape}, dtype={_dtype(dtype)}, device=dev)")
        count = 1
        for s in shape:
            count *= s
        self.hosts.append((name, count * dtype.itemsize))
        self.buffers.append(name)

    def emit(self, units: list[Unit], order: list[int]) -> WrapperPlan:
        for node in self.placeholders:
            self.names.expr[node] = node.name
        for group in self.op_groups:  # first: buffers() allocates what the emitters' launches use
            self.group_code[group.index] = group.emitter.emit(group, self._group_names(group))
        inputs = ", ".join(n.name for n in self.placeholders)
        tensor = next((n for n in self.placeholders if is_placeholder_slot(n)), None)
        device = f"{tensor.name}.device" if tensor is not None else "torch.device('cpu')"
        for node in self.gm.graph.nodes:
            if node.op == "get_attr":  # a constant the capture recorded (self is the graph module)
                # (kernels index it by address: a strided constant is made row-major once, here)
                self.alloc.line(f"{node.name} = _laid_out(self.{node.target}.to(dev), False)")
                self.names.expr[node] = node.name
                self.buffers.append(node.name)
        self._emit_buffers(units)
        self._emit_call_buffers()
        self.liveness = Liveness({h for h, _ in self.hosts} | {n.name for n in self.placeholders})
        launches = CodeWriter()
        with launches.indent():
            summary = [self._emit_unit(launches, units[index], position) for position, index in enumerate(order)]
            summary.append(self._emit_commit(launches, len(order)))
        fence = self._place_stages({index: position for position, index in enumerate(order)})
        summary[-1] = f"{fence.describe()}; {summary[-1]}"
        w = CodeWriter()
        w.lines(HELPERS.rstrip("\n").split("\n"))
        w.line()
        w.line()
        w.line("def buffers(self, dev):")
        with w.indent():
            w.line('"""Every buffer of the step, allocated once per step (once for good under a CUDA graph)."""')
            w.extend(self.alloc)
            w.line(f"return ({''.join(b + ', ' for b in self.buffers)})")
        unpack = f"({''.join(b + ', ' for b in self.buffers)}) = B"
        w.line()
        w.line()
        scalars = [n.name if isinstance(n, fx.Node) else repr(float(n)) for n in self.scalar_index]
        write_tables(w, self.tables, scalars, inputs, unpack)
        w.line()
        w.line()
        w.line(f"def launch(self, B, ptrs, scal, {inputs}):")
        with w.indent():
            w.line('"""The launches, then the commit; reads addresses and scalars from device tables (graph safe)."""')
            w.line(f"dev = {device}")
            w.line(unpack)
        w.extend(launches)
        w.line()
        w.line()
        tensors = [n.name for n in self.placeholders if is_placeholder_slot(n)]
        write_forward(w, inputs, tensors, sorted({d for d in self.copy_into if d is not None}), device)
        graph_safe = not self.computed and not self.kept and not self.copies and not self.baked
        return WrapperPlan(w.text(), self.kernels, self.kept, self.launches, summary, graph_safe, fence)

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

    def _emit_buffers(self, units: list[Unit]) -> None:
        w = self.alloc
        for group in self.op_groups:
            g, workspace, code = group.index, self.workspaces[group.index], self.group_code[group.index]
            x = group.feeds[0].meta["val"]
            shape = (group.batch, group.m, group.n)
            w.line(f"# {group.family.name} group {g}: {group.batch} x {group.m}x{group.n}, {dtypes.name(x.dtype)} in")
            self._allocate(f"ws{g}", shape, workspace.dtype)
            if workspace.norm_partials:
                self._allocate(f"part{g}", (group.batch, partial_count(group.m * group.n, self.arch)), torch.float32)
            self._allocate(f"out{g}", shape, group.out_dtype)
            if code.buffers:
                w.line(f"# its kernels' temporaries ({group.family.name} emitter)")
                for b in code.buffers:
                    self._allocate(b.name, b.shape, b.dtype)
            whole = group.node.meta["val"].dim() == 3
            single = GroupRef(g, 0, group.feed_transposed[0], feed=False)
            self.names.expr[group.node] = f"out{g}" if whole else self._group_view(single)
        for node, ref in self.refs.items():
            self.names.expr[node] = self._group_view(ref)
        kept_values = {v for v, d in zip(self.outputs, self.copy_into) if d is None}
        written = {v for v, d in zip(self.outputs, self.copy_into) if d is not None}
        for u, unit in enumerate(units):
            if unit.pointwise is None:
                continue
            spec = unit.pointwise.spec
            for k, (op_index, dtype) in enumerate(spec.outputs):
                stacked = f"buf{u}_{k}"
                if any(r.nodes[op_index] not in written | kept_values for r in unit.pointwise.members):
                    self._allocate(stacked, (len(unit.pointwise.members), *spec.shape), dtype)
                for i, region in enumerate(unit.pointwise.members):
                    node = region.nodes[op_index]
                    if node in written:  # a stage: placed once the launch order is known (_place_stages)
                        name = f"st{len(self.stages)}"
                        self.stages.append((name, spec.shape, dtype, u))
                        self.buffers.append(name)
                        self.names.expr[node] = name
                    elif node in kept_values:
                        name = f"new{u}_{k}_{i}"
                        w.line(f"{name} = torch.empty({spec.shape}, dtype={_dtype(dtype)}, device=dev)")
                        self.buffers.append(name)  # returned to the runtime: never a host
                        self.names.expr[node] = name
                    else:
                        self.names.expr[node] = f"{stacked}[{i}]"

    def _emit_call_buffers(self) -> None:
        """Each call unit's result and temporaries; its launch lines are kept for launch()."""
        for call in self.calls:
            # An aten node's value is named after it when launch() computes it (_emit_node).
            inputs = {f: self.names.expr.get(x, x.name) for f, x in call.inputs().items()}
            # The kernels take tensors, not table addresses: an input outside buffers() (a grad, a
            # state tensor) is baked into a captured CUDA graph, so the step is not graph safe.
            self.baked += sum(re.split(r"[\[.]", e)[0] not in self.buffers for e in inputs.values())
            code, lines = emit_call(call, inputs, self._scalar, self.upcast, self.arch)
            self.call_code[call.index] = code
            val = call.node.meta["val"]
            self.alloc.line(lines[0])  # the comment naming the call
            self._allocate(f"cout{call.index}", tuple(val.shape), val.dtype)
            for b in code.buffers:
                self._allocate(b.name, b.shape, b.dtype)
            self.names.expr[call.node] = f"cout{call.index}"

    def _place_stages(self, position: dict[int, int]) -> FenceReport:
        """Stage lines of buffers(): in bytes of a dead step buffer where one fits, else in the arena."""
        assert self.liveness is not None
        hosts = [Host(name, size, self.liveness.last.get(name, -1)) for name, size in self.hosts]
        stages = [Stage(name, shape, dtype, position[u]) for name, shape, dtype, u in self.stages]
        lines, report = stage_lines(stages, hosts, self.commits)
        self.alloc.lines(lines)
        return report

    def _group_view(self, ref: GroupRef) -> str:
        view = f"out{ref.group}[{ref.slot}]"
        return f"{view}.mT" if ref.transposed else view

    def _ptr(self, node: fx.Node) -> str:
        if node in self.refs:
            ref = self.refs[node]
            group = self.op_groups[ref.group]
            return f"out{ref.group}.data_ptr() + {ref.slot * group.m * group.n * group.out_dtype.itemsize}"
        if node in self.computed:  # laid out just before its launch (_emit_pointwise)
            return f"{node.name}_l.data_ptr()"
        return f"{self.names.of(node)}.data_ptr()"

    def _emit_unit(self, w: CodeWriter, unit: Unit, position: int) -> str:
        assert self.liveness is not None
        mark = w.mark()
        defines, view = None, False
        if unit.pointwise is not None:
            summary, rows = self._emit_pointwise(w, unit.pointwise)
            text = "\n".join([*w.since(mark), *(", ".join(r) for r in rows)])
        else:
            if unit.group is not None:
                code = self.group_code[unit.group.index]
                w.lines(code.lines)
                self.launches += code.launches  # the emitter's own count, not a count of its text
                self.kernels += code.kernels
                summary = code.summary
            elif unit.call is not None:
                code = self.call_code[unit.call.index]
                w.lines(code.lines)
                self.launches += code.launches
                self.kernels += code.kernels
                summary = f"call {unit.call.index} {unit.call.node.name}: {code.summary}"
            else:
                assert unit.node is not None
                summary = self._emit_node(w, unit.node)
                defines = unit.node.name  # its result may share memory with what it reads
                view = unit.node.target is operator.getitem or _is_view(unit.node)
            text = "\n".join(w.since(mark))
        self.liveness.use(position, text, defines, view)
        return summary

    def _emit_pointwise(self, w: CodeWriter, group: PointwiseGroup) -> tuple[str, list[list[str]]]:
        spec = group.spec
        first = group.members[0]
        passes = sorted({str(n.meta.get(ORIGIN, "?")) for n in first.nodes}) or ["batch-by-shape"]
        nodes = ", ".join(n.name for n in first.nodes) or f"the stack feeding {first.feed_value}"
        twins = len(group.members) - 1
        origin = f"{'/'.join(passes)} nodes {nodes}" + (f" and {twins} isomorphic twin(s)" if twins else "")
        kernel = generate_pointwise(spec, origin)
        self.kernels.append(kernel)
        made = [n for r in group.members for n in r.inputs if n in self.computed]
        for node in dict.fromkeys(made):
            # Made by an aten call: the kernel reads it by address in the layout its spec says.
            w.line(f"{node.name}_l = _laid_out({node.name}, {self.layout.get(node, False)})")
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
        if made:
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
        return f"{kernel.name}: {len(group.members)} member(s), 1 launch", rows

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

    def _flat_source(self, value: fx.Node, dest: fx.Node) -> str | None:
        """The address the commit kernel copies ``value`` from, when it is row-major memory of the
        step's own with ``dest``'s shape and dtype (its bits are copied); None: an aten ``copy_``."""
        val, want = value.meta.get("val"), dest.meta.get("val")
        if not isinstance(val, torch.Tensor) or not isinstance(want, torch.Tensor):
            return None
        if tuple(val.shape) != tuple(want.shape) or val.dtype != want.dtype or val.numel() == 0:
            return None
        if value in self.refs:
            return None if self.refs[value].transposed else self._ptr(value)
        expr = self.names.expr.get(value, "")
        row_major = re.fullmatch(r"(st\d+|cout\d+|buf\d+_\d+\[\d+\]|out\d+(\[\d+\])?)", expr)
        return f"{expr}.data_ptr()" if row_major else None

    def _emit_commit(self, w: CodeWriter, position: int) -> str:
        """Every launch has run: copy each written-back value into its param or state tensor."""
        assert self.liveness is not None
        writes: list[WriteBack] = []
        returned: list[str] = []
        for index, (value, dest_index) in enumerate(zip(self.outputs, self.copy_into)):
            if dest_index is None or not isinstance(value, fx.Node):
                self.kept.append(index)
                returned.append(_py(value, self.names))
                continue
            dest = self.placeholders[dest_index]
            val = value.meta.get("val")
            size = (val.dtype.itemsize, val.numel()) if isinstance(val, torch.Tensor) else (0, 0)
            writes.append(WriteBack(dest.name, self.names.of(value), self._flat_source(value, dest), *size))
        commit = emit_commit(writes, self.liveness, self.arch)
        w.lines([*commit.lines, f"return ({''.join(r + ', ' for r in returned)})"])
        self.tables += commit.tables
        self.kernels += commit.kernels
        self.launches += commit.launches
        self.copies += commit.copies
        self.commits = len(writes)
        sources = [wb.address or wb.source for wb in writes]
        self.liveness.use(position, "\n".join([*sources, *returned]))
        return commit.summary
