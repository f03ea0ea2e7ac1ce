"""Horizontally fused pointwise kernels: one launch for a whole group of regions.

A region (see regions.py) is a chain of elementwise ops over one parameter's
tensors. Isomorphic regions of every parameter in a shape group share one
:class:`PointwiseSpec` and so one kernel; program row ``member`` reads its
operands' addresses and its scalars' indices from a row of the step's
pointer table. That is how one launch serves tensors that live in separate
allocations (params, grads, state) without stacking them.

A region that feeds a registered op group (op_groups.py) stores that value,
rounded to the workspace dtype (the NS compute dtype), straight into the
group's stacked workspace (transposed for an n×m member of an m×n batch)
and, when the family asks, writes the partial sums of squares its first
kernel turns into the Frobenius norm.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
import torch.fx as fx

from ...ir import dtypes
from .code import TL_DTYPE, CodeWriter, KernelSource, emit_round
from .op_groups import Workspace
from .pointwise_ops import POINTWISE
from .regions import Region
from .tiles import pointwise_tile


@dataclass(frozen=True)
class InputSpec:
    dtype: torch.dtype
    scalar: bool  # a 0-d tensor, broadcast
    transposed: bool  # a member of a stacked NS result, read transposed


@dataclass(frozen=True)
class FeedSpec:
    """The value a region stores into an op group's workspace slot."""

    op_index: int  # -1: input 0 (an identity region)
    dtype: torch.dtype  # the workspace dtype it is rounded to
    transposed: bool
    norm_partials: bool  # also store this program's sum of squares

    @property
    def slots(self) -> int:
        """Table slots: the workspace address, and the partials' address when written."""
        return 2 if self.norm_partials else 1


@dataclass(frozen=True)
class PointwiseSpec:
    shape: tuple[int, ...]
    ops: tuple[tuple[str, str, torch.dtype], ...]  # (op name, Triton expression, result dtype)
    inputs: tuple[InputSpec, ...]
    outputs: tuple[tuple[int, torch.dtype], ...]  # (op index, dtype stored)
    n_scalars: int
    feed: FeedSpec | None
    arch: str

    family = "pointwise"

    @property
    def numel(self) -> int:
        out = 1
        for s in self.shape:
            out *= s
        return out

    @property
    def rows_cols(self) -> tuple[int, int]:
        if len(self.shape) == 2:
            return self.shape[0], self.shape[1]
        return 1, self.numel

    @property
    def row_width(self) -> int:
        return len(self.inputs) + len(self.outputs) + (self.feed.slots if self.feed else 0) + self.n_scalars

    @property
    def columns(self) -> list[str]:
        """What each slot of a table row holds, as the kernel names it (x0 .. o0 .. ws, part, s0 ..)."""
        feed = ["ws", "part"][: self.feed.slots] if self.feed else []
        outputs = [f"o{k}" for k in range(len(self.outputs))]
        return [f"x{j}" for j in range(len(self.inputs))] + outputs + feed + [f"s{j}" for j in range(self.n_scalars)]

    @property
    def name(self) -> str:
        ops = "_".join(_short_op(op) for op, _, _ in self.ops) or "copy"
        shape = "x".join(str(s) for s in self.shape) or "scalar"
        digest = hashlib.sha256(repr(self).encode()).hexdigest()[:6]
        feed = "_ws" if self.feed else ""  # also stores into an op group's workspace
        return f"pw_{ops}{feed}_{shape}_{digest}"


def _short_op(name: str) -> str:
    return name.split(".")[1] if name.startswith("aten.") else name


def region_spec(
    region: Region, layout: dict[fx.Node, bool], workspace: Workspace | None, arch: str
) -> PointwiseSpec:
    """The spec of one region; isomorphic regions give equal specs.

    ``layout`` says which external inputs are read transposed (members of a
    stacked op-group result); ``workspace`` is the fed group's, if any.
    """
    local: dict[fx.Node, str] = {}
    for j, node in enumerate(region.inputs):
        local[node] = f"x{j}"
    for j, node in enumerate(region.scalars):
        local[node] = f"s{j}"
    ops: list[tuple[str, str, torch.dtype]] = []
    for i, node in enumerate(region.nodes):
        args = [_render(a, local) for a in node.args]
        kwargs = {k: _render(v, local) for k, v in node.kwargs.items()}
        expr = POINTWISE[node.target](args, kwargs)
        ops.append((_op_name(node), expr, node.meta["val"].dtype))
        local[node] = f"v{i}"
    inputs = tuple(
        InputSpec(n.meta["val"].dtype, n.meta["val"].dim() == 0, layout.get(n, False)) for n in region.inputs
    )
    index = {n: i for i, n in enumerate(region.nodes)}
    outputs = tuple((index[n], n.meta["val"].dtype) for n in region.outputs)
    feed = None
    if region.feed is not None:
        assert workspace is not None and region.feed_value is not None
        op_index = index.get(region.feed_value, -1)
        feed = FeedSpec(op_index, workspace.dtype, region.feed.transposed, workspace.norm_partials)
    shape = tuple(int(s) for s in region.shape)
    return PointwiseSpec(shape, tuple(ops), inputs, outputs, len(region.scalars), feed, arch)


def _op_name(node: fx.Node) -> str:
    target = node.target
    return f"aten.{target._schema.name.split('::')[-1]}.{target._overloadname}"  # type: ignore[union-attr]


def _render(arg: object, local: dict[fx.Node, str]) -> str:
    if isinstance(arg, fx.Node):
        return local[arg]
    if isinstance(arg, bool):
        return "1.0" if arg else "0.0"
    if isinstance(arg, (int, float)):
        return repr(float(arg))
    if arg is None:
        return "None"
    return repr(arg)  # dtypes and the like: ops that take them ignore them


def generate_pointwise(spec: PointwiseSpec, origin: str) -> KernelSource:
    name = spec.name
    tile = pointwise_tile(spec.arch)
    rows, _ = spec.rows_cols
    w = CodeWriter()
    w.line(f"# kernel {name}: family pointwise; from {origin}")
    feed_slots = ", workspace" + (" + norm partials" if spec.feed.norm_partials else "") if spec.feed else ""
    w.line(
        f"# shape {list(spec.shape)}; row = {len(spec.inputs)} inputs, {len(spec.outputs)} outputs"
        f"{feed_slots}, {spec.n_scalars} scalar indices"
    )
    w.line(f"# tile BLOCK={tile.BLOCK} num_warps={tile.num_warps}")
    w.line("@triton.jit")
    w.line(f"def {name}(ptrs, base, scal, N, C, R, WIDTH: tl.constexpr, BLOCK: tl.constexpr):")
    with w.indent():
        w.line("member = tl.program_id(1)")
        w.line("offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)")
        w.line("mask = offs < N")
        transposed = any(i.transposed for i in spec.inputs) or bool(spec.feed and spec.feed.transposed)
        if transposed:
            w.line("# element (r, c) of an R x C member sits at (c, r) of the wide NS batch")
            w.line("offs_t = (offs % C) * R + offs // C")
        w.line("row = ptrs + base + member * WIDTH")
        slot = 0
        for j, inp in enumerate(spec.inputs):
            w.line(f"x{j}_ptr = tl.load(row + {slot}).to(tl.pointer_type({TL_DTYPE[inp.dtype]}))")
            if inp.scalar:
                w.line(f"x{j} = tl.load(x{j}_ptr).to(tl.float32)")
            else:
                where = "offs_t" if inp.transposed else "offs"
                w.line(f"x{j} = tl.load(x{j}_ptr + {where}, mask=mask, other=0.0).to(tl.float32)")
            slot += 1
        scalar_slot = slot + len(spec.outputs) + (spec.feed.slots if spec.feed else 0)
        for j in range(spec.n_scalars):
            w.line(f"s{j} = tl.load(scal + tl.load(row + {scalar_slot + j}))")
        for i, (op, expr, dtype) in enumerate(spec.ops):
            w.line(f"v{i} = {expr}  # {op}")
            emit_round(w, f"v{i}", dtype)  # eager rounds each op's result to its dtype
        for k, (op_index, dtype) in enumerate(spec.outputs):
            w.line(f"o{k}_ptr = tl.load(row + {slot}).to(tl.pointer_type({TL_DTYPE[dtype]}))")
            w.line(f"tl.store(o{k}_ptr + offs, v{op_index}.to({TL_DTYPE[dtype]}), mask=mask)")
            slot += 1
        if spec.feed is not None:
            _emit_feed(w, spec.feed, slot)
    w.line()
    w.line()
    w.line(f"def launch_{name}(ptrs, base, scal, members):")
    with w.indent():
        w.line(f"grid = (triton.cdiv({spec.numel}, {tile.BLOCK}), members)")
        cols = spec.numel // rows if rows else spec.numel
        w.line(
            f"{name}[grid](ptrs, base, scal, {spec.numel}, {cols}, {rows}, WIDTH={spec.row_width}, "
            f"BLOCK={tile.BLOCK}, num_warps={tile.num_warps})"
        )
    tiling = {"BLOCK": tile.BLOCK, "num_warps": tile.num_warps}
    return KernelSource(name, "pointwise", spec, origin, w.text(), tiling, tuple(sorted(w.helpers)))


def _emit_feed(w: CodeWriter, feed: FeedSpec, slot: int) -> None:
    """Store the fed value into its workspace slot (and its norm partial) from row slot ``slot`` on."""
    dtype = feed.dtype
    value = "x0" if feed.op_index < 0 else f"v{feed.op_index}"
    partials = ", norm partials" if feed.norm_partials else ""
    w.line(f"# op-group input: rounded to {dtypes.name(dtype)} (the op's cast), stacked{partials}")
    w.line(f"f = {value}")
    emit_round(w, "f", dtype)
    w.line(f"f_ptr = tl.load(row + {slot}).to(tl.pointer_type({TL_DTYPE[dtype]}))")
    w.line(f"tl.store(f_ptr + {'offs_t' if feed.transposed else 'offs'}, f.to({TL_DTYPE[dtype]}), mask=mask)")
    if feed.norm_partials:
        w.line(f"part_ptr = tl.load(row + {slot + 1}).to(tl.pointer_type(tl.float32))")
        w.line("tl.store(part_ptr + tl.program_id(0), tl.sum(tl.where(mask, f * f, 0.0), axis=0))")


def partial_count(spec_numel: int, arch: str) -> int:
    """How many norm partials one member's pointwise launch writes (one per program)."""
    block = pointwise_tile(arch).BLOCK
    return -(-spec_numel // block)
