"""Newton–Schulz on a tensor-parallel shard: duplicated, distributed or blockwise (DESIGN.md §7).

The matrix is split along one dimension over a group, as ``torch.chunk``
splits it (ceil(N/W) per rank; the last ranks short or empty). The modes
(Megatron / Emerging-Optimizers, REFERENCES.md "Distributed"):

- **duplicated**: all-gather, the op on the whole matrix, keep the own slice
  (bitwise the single-process op).
- **distributed**: X = the op's working matrix (xᵀ when ``transpose``), m×n,
  wide, split along its columns n. Each product is ``X Xᵀ`` (partial
  products summed by one m×m all-reduce, in fp32 (fp64 for fp64) and rounded
  once: the op's rounding model, in another summation order), m×m
  (replicated) or ``B X`` (column-local); the norm is one scalar all-reduce.
  Collectives: standard NS ``steps`` + 1, Gram NS 2 + one per restart. Falls
  back to duplicated (logged) when the split is along m (needs the n×n Gram),
  when X is tall (m > n: the split side is the short one), or for a
  per-iteration ``schedule`` (emulated by the op only).
- **blockwise**: the op on the own block, no communication: a different
  update, so only on request, with a :class:`BlockwiseWarning`.

A split along a batch dimension leaves whole matrices: every mode is the op.
Collectives are functional (``_c10d_functional`` + ``wait_tensor``), so
``make_fx`` traces each mode; tp_plan.py holds the cost model that picks one
(``choose_tp_mode``) and the FX rewrite that inlines it (``rewrite_ns_node``). Arguments are checked before the first
collective; a rank that raises leaves the others waiting in it, as any
mismatched collective does.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import GroupName, _resolve_process_group

from ..errors import BlockwiseWarning  # noqa: F401  (defined there, re-exported here)
from ..ops import newton_schulz as _ops  # noqa: F401  (registers hocompile::newton_schulz)
from ..ops import newton_schulz_math as ns

log = logging.getLogger(__name__)

MODES = ("duplicated", "distributed", "blockwise")
Group = dist.ProcessGroup | str  # a process group or its name (FX graphs carry names)


@dataclass(frozen=True)
class NSArgs:
    """``hocompile::newton_schulz``'s arguments after ``x``, by name (see hocompile/ops/newton_schulz.py)."""

    a: Sequence[float]
    b: Sequence[float]
    c: Sequence[float]
    eps: float
    eps_mode: str = "clamp"
    transpose: bool = False
    compute_dtype: torch.dtype = torch.bfloat16
    out_dtype: torch.dtype | None = None
    algorithm: str = "standard"
    restarts: Sequence[int] = ()
    matmul: str = "emulate"
    blocks: int = 0
    schedule: str = ""

    def call_op(self, x: torch.Tensor) -> torch.Tensor:
        """The single-process op on ``x`` (a node of its own in a traced graph)."""
        return torch.ops.hocompile.newton_schulz(
            x, list(self.a), list(self.b), list(self.c), self.eps, self.eps_mode, self.transpose,
            self.compute_dtype, self.out_dtype or x.dtype, self.algorithm, list(self.restarts), self.matmul,
            self.blocks, self.schedule,
        )


# ------------------------------------------------------------------ helpers


def _group(group: Group) -> tuple[str, int, int]:
    """(name, world size, own rank) of a process group given as an object or by name."""
    pg = _resolve_process_group(GroupName(group)) if isinstance(group, str) else group
    return pg.group_name, dist.get_world_size(pg), dist.get_rank(pg)


def chunk_sizes(full: int, world: int) -> list[int]:
    """Shard lengths ``torch.chunk`` gives (ceil(full/world) each, the tail short, then empty)."""
    size = -(-full // world)
    return [max(0, min(size, full - r * size)) for r in range(world)]


def _all_reduce(t: torch.Tensor, name: str) -> torch.Tensor:
    return torch.ops._c10d_functional.wait_tensor(torch.ops._c10d_functional.all_reduce(t, "sum", name))


def _shard_dim(local: torch.Tensor, shard_dim: int) -> int:
    if local.dim() not in (2, 3):
        raise ValueError(f"local shard must be [m, n] or [B, m, n], got shape {tuple(local.shape)}")
    if not -local.dim() <= shard_dim < local.dim():
        raise ValueError(f"shard_dim={shard_dim} is out of range for a {local.dim()}-d shard")
    return shard_dim - local.dim() if shard_dim >= 0 else shard_dim  # -1 columns, -2 rows, -3 batch


def _check_local(local: torch.Tensor, dim: int, full_size: int, sizes: list[int], rank: int) -> None:
    if full_size < 1:
        raise ValueError(f"full_size={full_size}: the sharded dimension of the full matrix must be >= 1")
    if local.shape[dim] != sizes[rank]:
        raise ValueError(
            f"rank {rank} holds {local.shape[dim]} along dim {dim}, but torch.chunk of full_size={full_size} "
            f"over {len(sizes)} ranks gives it {sizes[rank]} (wrong full_size, or not torch.chunk sharding)"
        )


# ------------------------------------------------------------------ the three modes


def duplicated_ns(local: torch.Tensor, shard_dim: int, group: Group, args: NSArgs, *, full_size: int) -> torch.Tensor:
    """All-gather the shards (one collective), the op on the whole matrix, the own slice back."""
    dim = _shard_dim(local, shard_dim)
    name, world, rank = _group(group)
    sizes = chunk_sizes(full_size, world)
    _check_local(local, dim, full_size, sizes, rank)
    if dim == -3:
        return args.call_op(local)  # whole matrices: nothing to gather
    chunk = sizes[0]
    front = local.movedim(dim, 0)
    if front.shape[0] < chunk:  # uneven: gather equal pieces (functional all-gather needs them), cut after
        pad = front.new_zeros((chunk - front.shape[0], *front.shape[1:]))
        front = torch.cat([front, pad])
    gathered = torch.ops._c10d_functional.all_gather_into_tensor(front.contiguous(), world, name)
    gathered = torch.ops._c10d_functional.wait_tensor(gathered)
    if any(s != chunk for s in sizes):
        pieces = gathered.view(world, chunk, *front.shape[1:])
        gathered = torch.cat([pieces[r, : sizes[r]] for r in range(world)])
    out = args.call_op(gathered.movedim(0, dim).contiguous())  # the layout of an unsharded matrix: same GEMMs
    start = min(rank * chunk, full_size)
    return out.narrow(dim, start, sizes[rank]).contiguous()


def blockwise_ns(local: torch.Tensor, shard_dim: int, group: Group, args: NSArgs) -> torch.Tensor:
    """The op on the own block only: no communication, and not the matrix's update (warns)."""
    dim = _shard_dim(local, shard_dim)
    if dim != -3:
        message = "blockwise tensor-parallel Newton–Schulz orthogonalises each shard on its own: the update"
        warnings.warn(message + " differs from the unsharded optimizer's (requested explicitly)", BlockwiseWarning, 2)
    return args.call_op(local)


def distributed_ns(
    local: torch.Tensor, shard_dim: int, group: Group, args: NSArgs, *, full_size: int, eps: torch.Tensor | None = None
) -> torch.Tensor:
    """NS on the shard: m×m Gram all-reduces and one norm all-reduce (module docstring). ``eps``: a 0-d
    fp64 tensor used in place of ``args.eps`` (a host scalar that changes between steps, in a traced graph)."""
    dim = _shard_dim(local, shard_dim)
    if dim == -3:
        return args.call_op(local)
    contracted = -2 if args.transpose else -1  # X's columns, as a dim of x
    gram_side = local.shape[-1 if args.transpose else -2]  # m of X = m×n; n = full_size when split on columns
    why = ""
    if dim != contracted:
        why = "the shard splits the Gram side (X's rows), which needs the n×n Gram"
    elif gram_side > full_size:
        why = "X is tall: the split side n is its short one (and an m×m Gram of rank n amplifies rounding)"
    elif args.schedule:
        why = f"per-iteration precision schedule {args.schedule!r} is emulated by the op only"
    if why:
        log.info("tensor-parallel NS: distributed -> duplicated: %s", why)
        return duplicated_ns(local, shard_dim, group, args, full_size=full_size)
    name = _group(group)[0]
    if args.algorithm not in ns.ALGORITHMS or args.matmul not in ns.MATMUL_MODES or args.eps_mode not in ns.EPS_MODES:
        raise ValueError(f"bad newton_schulz options: {args.algorithm=}, {args.matmul=}, {args.eps_mode=}")
    compute = args.compute_dtype
    acc = torch.float64 if compute == torch.float64 else torch.float32
    # Dense products: `blocks` only changes how the op's symmetric products are tiled, not their values.
    arith = ns.Arith(compute, args.matmul, acc)
    xt = local.mT if args.transpose else local
    X = _normalize(arith.cast_in(xt), args, arith, name, eps)
    coefficients = list(zip(args.a, args.b, args.c))
    if args.algorithm == "standard":
        X = _standard(X, coefficients, arith, name)
    else:
        X = _gram(X, coefficients, args.restarts, arith, name)
    out = X.mT if args.transpose else X
    return out.to(args.out_dtype or local.dtype)


def _normalize(x: torch.Tensor, args: NSArgs, arith: ns.Arith, name: str, eps: torch.Tensor | None) -> torch.Tensor:
    """ns.normalize / ns._normalize_native with the squared norm summed over the group (one all-reduce)."""
    if arith.native:  # x in the compute dtype; the norm accumulates in fp32 and rounds like eager's
        squares = x.to(torch.float32).square().sum(dim=(-2, -1), keepdim=True)
        norm = _all_reduce(squares, name).sqrt().to(x.dtype)
        return x / _denominator(norm, args, eps)
    xa = x.to(arith.acc)
    norm = ns._round(_all_reduce(xa.square().sum(dim=(-2, -1), keepdim=True), name).sqrt(), arith.compute)
    denom = ns._round(_denominator(norm, args, eps), arith.compute)
    return arith.cast_in(ns._round(xa / denom, arith.compute))


def _denominator(norm: torch.Tensor, args: NSArgs, eps: torch.Tensor | None) -> torch.Tensor:
    """max(norm, eps) or norm + eps, as the op computes it with a Python-float eps."""
    if eps is None:
        return norm.clamp(min=args.eps) if args.eps_mode == "clamp" else norm + args.eps
    # torch computes a tensor-scalar op in fp64 for fp64 tensors, else in fp32 (then rounds): the same here.
    opmath = torch.float64 if norm.dtype == torch.float64 else torch.float32
    n, e = norm.to(opmath), eps.to(opmath)
    return (torch.maximum(n, e) if args.eps_mode == "clamp" else n + e).to(norm.dtype)


def _gram_of(X: torch.Tensor, arith: ns.Arith, name: str) -> torch.Tensor:
    """``X Xᵀ`` of the whole matrix: partial products summed in the accumulation dtype, rounded once."""
    xa = X.to(arith.acc)
    total = _all_reduce(xa @ xa.mT, name)
    return total.to(arith.compute) if arith.native else ns._round(total, arith.compute)


def _standard(X: torch.Tensor, coefficients: ns.Coefficients, arith: ns.Arith, name: str) -> torch.Tensor:
    """ns._standard line by line; only ``A`` is formed across the group."""
    for a, b, c in coefficients:
        A = _gram_of(X, arith, name)
        B = arith.sym_addmm(A, A, A, beta=b, alpha=c) if c != 0.0 else ns._scale(A, b, arith)
        X = arith.addmm(X, B, X, beta=a, alpha=1.0)
    return X


def _gram(
    X0: torch.Tensor, coefficients: ns.Coefficients, restarts: Sequence[int], arith: ns.Arith, name: str
) -> torch.Tensor:
    """ns._gram line by line; only ``R`` (at the start and at each restart) is formed across the group."""
    m = X0.shape[-2]
    eye = torch.eye(m, dtype=X0.dtype, device=X0.device).expand(*X0.shape[:-2], m, m)
    R = _gram_of(X0, arith, name)
    Q: torch.Tensor | None = None
    steps = len(coefficients)
    for k, (a, b, c) in enumerate(coefficients):
        bR_plus_aI = b * R + a * eye
        P = arith.sym_addmm(bR_plus_aI, R, R, beta=1.0, alpha=c) if c != 0.0 else ns._round(bR_plus_aI, arith.compute)
        Q = P if Q is None else arith.sym(P, Q)
        last = k == steps - 1
        if not last and (k + 1) in restarts:
            X0 = arith.mm(Q, X0)
            R = _gram_of(X0, arith, name)
            Q = None
        elif not last:
            R = arith.sym(P, arith.sym(P, R))
    assert Q is not None
    return arith.mm(Q, X0)


def tp_newton_schulz(
    local: torch.Tensor,
    shard_dim: int,
    group: Group,
    args: NSArgs,
    *,
    mode: str,
    full_size: int,
    eps: torch.Tensor | None = None,
) -> torch.Tensor:
    """The op's result for this rank's shard under ``mode`` (one of :data:`MODES`); ``eps``: see
    :func:`distributed_ns` (distributed only: the other modes call the op, which takes ``args.eps``)."""
    if eps is not None and mode != "distributed":
        raise ValueError(f"an eps tensor is for mode='distributed' only, not {mode!r}")
    if mode == "duplicated":
        return duplicated_ns(local, shard_dim, group, args, full_size=full_size)
    if mode == "distributed":
        return distributed_ns(local, shard_dim, group, args, full_size=full_size, eps=eps)
    if mode == "blockwise":
        return blockwise_ns(local, shard_dim, group, args)
    raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
