"""DTensors sharded on one dim (FSDP2's ``Shard(0)``, a row-parallel TP weight's ``Shard(1)``) in a
compiled step: global shapes in, local shards run.

Eager ``torch.optim.Muon`` on a DTensor sees the global shape (its update
scale reads rows and columns), so the step is captured on fakes of the
*global* shape, and the generated module runs on the local shards. That is
only right when every op outside the orthogonalisations is local to the
shard, elementwise (passes/route_sharded.py checks it, and routes each
orthogonalisation to an owner rank with two uneven all-to-alls, or marks it
for a tensor-parallel mode: passes/tp_newton_schulz.py). This file holds what capture, the
pass and the runtime share: the shard layout (``torch.chunk`` rules, as
FSDP2 and ``distribute_tensor`` split), fakes of global shape, and how
results become DTensors again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import CaptureError

# Placeholder meta: the ShardLayout of a DTensor input (absent on plain tensors).
SHARDED = "hocompile.sharded"
# Output node meta: per graph output, (global shape, shard dim) of the DTensor it is
# written into (a copy into a DTensor, or new state of a DTensor param), else None.
SHARDED_OUTPUTS = "hocompile.sharded_outputs"


def is_dtensor(value: Any) -> bool:
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(value, DTensor)


def chunk_rows(rows: int, world: int) -> tuple[int, ...]:
    """Rows each rank holds when ``rows`` are split like ``torch.chunk(t, world)``: ceil-sized
    chunks, so trailing ranks may hold fewer rows, or none (3 rows on 4 ranks: 1, 1, 1, 0)."""
    size = -(-rows // world) if rows else 0
    return tuple(max(0, min(size, rows - r * size)) for r in range(world))


@dataclass(frozen=True)
class ShardLayout:
    """How one DTensor is split: its global shape, along which dim, over which ranks, by which group."""

    shape: tuple[int, ...]  # global
    world: int
    rank: int
    group_name: str
    dim: int = 0  # the sharded dim: 0 (FSDP2, rows) or 1 (columns)

    @property
    def rows(self) -> tuple[int, ...]:
        """Length along the sharded dim held by each rank (rows for Shard(0), columns for Shard(1))."""
        return chunk_rows(self.shape[self.dim], self.world)

    @property
    def starts(self) -> tuple[int, ...]:
        out, at = [], 0
        for count in self.rows:
            out.append(at)
            at += count
        return tuple(out)


def layout_of(tensor: Any, what: str) -> ShardLayout:
    """The layout of a DTensor the compiled step can run on, or a CaptureError saying why not."""
    from torch.distributed.tensor import Shard

    mesh = tensor.device_mesh
    placements = tuple(tensor.placements)
    # Shard(1) needs a dim 1; a negative Shard dim is normalised by DTensor itself.
    dims = [d for d in (0, 1) if placements == (Shard(d),) and tensor.dim() > d]
    if mesh.ndim != 1 or not dims:
        raise CaptureError(
            f"{what} is a DTensor with placements {placements} on a {mesh.ndim}-D mesh; hocompile compiles "
            "DTensors sharded on one 1-D mesh along rows (Shard(0), as FSDP2 shards) or columns (Shard(1)) only"
        )
    dim = dims[0]
    layout = ShardLayout(tuple(tensor.shape), mesh.size(), mesh.get_local_rank(), mesh.get_group().group_name, dim)
    local = tuple(tensor.to_local().shape)
    expected = tuple(layout.rows[layout.rank] if d == dim else size for d, size in enumerate(layout.shape))
    if local != expected:
        # FSDP2 and distribute_tensor split like torch.chunk; anything else would
        # route the wrong rows, so refuse rather than guess.
        raise CaptureError(
            f"{what}: rank {layout.rank} holds a local shard of shape {local}, but a torch.chunk split of "
            f"{layout.shape} along dim {dim} over {layout.world} ranks gives {expected}; hocompile splits by "
            "that rule only"
        )
    return layout


def local_tensor(value: Any) -> Any:
    """A DTensor's local shard (it aliases the DTensor's storage: writes into it land); other values as they are."""
    return value.to_local() if is_dtensor(value) else value


def like_param(value: torch.Tensor, param: Any) -> Any:
    """New state computed from ``param``'s local rows, installed as eager installs it: a DTensor
    with the param's mesh, placements, global shape and stride (0-d values stay plain)."""
    if not is_dtensor(param) or value.dim() == 0:
        return value
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        value, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
    )


def global_fakes(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Fakes to trace a step on: DTensors as plain tensors of their *global* shape, dtype and
    stride (nothing allocated), others converted as make_fx's own fake mode would."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    # The same mode make_fx(tracing_mode="fake") makes for itself; it finds this one on the inputs.
    mode = FakeTensorMode(allow_fallback_kernels=True, shape_env=ShapeEnv(), static_shapes=True)
    out: list[torch.Tensor] = []
    for t in tensors:
        if is_dtensor(t):
            with mode:
                out.append(torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device))
        else:
            out.append(mode.from_tensor(t, static_shapes=True))
    return out


def sharded_layouts(tensors: Sequence[Any], names: Sequence[str]) -> dict[int, ShardLayout]:
    """Index -> layout of every DTensor input; all on one process group (one mesh), or a CaptureError."""
    layouts = {k: layout_of(t, name) for k, (t, name) in enumerate(zip(tensors, names)) if is_dtensor(t)}
    groups = {(lay.group_name, lay.world, lay.rank) for lay in layouts.values()}
    if len(groups) > 1:
        raise CaptureError(
            f"the step's DTensors live on {len(groups)} different meshes ({sorted(groups)}); "
            "hocompile routes over one 1-D mesh per step"
        )
    return layouts


def mark_sharded(gm: Any, tensors: Sequence[Any], slots: Sequence[Any], outputs: Sequence[Any]) -> tuple[Any, ...]:
    """Record each DTensor input's layout on its placeholder, and which outputs land in a
    DTensor (SHARDED_OUTPUTS); the slots that are sharded.

    A param's grad and its non-scalar state must be sharded as the param is: a
    full-size plain momentum next to a sharded param would mix global and local rows.
    """
    names = [slot.describe() for slot in slots]
    layouts = sharded_layouts(tensors, names)
    if not layouts:
        return ()
    by_slot = dict(zip(slots, tensors))
    params = {(s.group, s.index): t for s, t in by_slot.items() if s.kind == "param"}
    for slot, tensor in by_slot.items():
        if slot.kind in ("attr", "group"):
            if is_dtensor(tensor):
                raise CaptureError(f"{slot.describe()} is a DTensor; hocompile shards params, grads and state only")
            continue
        if slot.kind == "param" or not isinstance(tensor, torch.Tensor) or tensor.dim() == 0:
            continue
        param = params[(slot.group, slot.index)]
        if is_dtensor(param) != is_dtensor(tensor):
            which = "a DTensor, its param is not" if is_dtensor(tensor) else "not a DTensor, its param is"
            raise CaptureError(
                f"{slot.describe()} is {which}; a sharded param's grad and state must be sharded alike"
            )
        if is_dtensor(tensor) and sharded_differently(tensor, param):
            # A Shard(1) grad of a Shard(0) param (or another mesh) holds other elements than the param's shard.
            placements: Any = (tensor.placements, param.placements)  # type: ignore[attr-defined]
            raise CaptureError(
                f"{slot.describe()} is sharded as {tuple(placements[0])} ({tuple(tensor.shape)}), its param as "
                f"{tuple(placements[1])} ({tuple(param.shape)}); a sharded param's grad and state must be sharded alike"
            )
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for k, layout in layouts.items():
        placeholders[k].meta[SHARDED] = layout
    destinations: list[tuple[tuple[int, ...], int] | None] = []
    for action in outputs:
        slot = action.slot
        dest: Any = by_slot.get(slot) if action.mode == "copy" else params.get((slot.group, slot.index))
        destinations.append((tuple(dest.shape), shard_dim_of(dest)) if is_dtensor(dest) else None)
    output = next(n for n in gm.graph.nodes if n.op == "output")
    output.meta[SHARDED_OUTPUTS] = tuple(destinations)
    return tuple(slots[k] for k in sorted(layouts))


def step_layout(gm: Any) -> ShardLayout | None:
    """The mesh a captured step's DTensors share (any sharded placeholder's layout), or None."""
    return next((n.meta[SHARDED] for n in gm.graph.nodes if n.op == "placeholder" and SHARDED in n.meta), None)


def shard_dim_of(tensor: Any) -> int:
    """The sharded dim of a DTensor layout_of accepted (0 or 1)."""
    return int(tensor.placements[0].dim)


def sharded_differently(a: Any, b: Any) -> bool:
    """Whether two DTensors' local shards hold different elements (mesh, placements or global shape differ)."""
    return bool(a.device_mesh != b.device_mesh or tuple(a.placements) != tuple(b.placements) or a.shape != b.shape)
