"""Proof, at every compile, that replicated ranks agree: same plan, same params, same grads.

Each rank gathers only what the plan says it does not compute, so a rank
with another plan would read the wrong matrices, and a rank with other grads
would install its peers' updates computed from their grads: both silently
wrong steps. Two small all-reduces (MAX of each value and of its negation,
so one call gives max and min) compare an int64 of the plan digest, then one
checksum per param and grad. They run before the compiled step ever runs,
so a mismatch raises on every rank alike with nothing written.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx

# The collectives are called from distributed_c10d itself: while a step is traced,
# collectives.py swaps torch.distributed's names for one-rank stand-ins, process-wide,
# and another rank's thread (threaded process groups in tests) may be tracing right now.
from torch.distributed import distributed_c10d as c10d

from ..capture.collectives import collective_launches
from ..errors import DistributedMismatchError  # noqa: F401  (defined there, re-exported here)
from .replicated import DIST_PLAN, OwnershipPlan

_MASK = (1 << 62) - 1  # non-negative, so -x never overflows and -1 can mean "no grad"
_NO_GRAD = -1


def check_replicated(opt: torch.optim.Optimizer, gm: fx.GraphModule, basis: str = "") -> None:
    """Raise :class:`DistributedMismatchError` on every rank unless all ranks planned the same
    step on the same basis (``basis``: :func:`planning_basis`) and hold the same params and grads
    (a no-op for a step dist-ownership did not plan)."""
    applied = gm.meta.get(DIST_PLAN)
    if not isinstance(applied, OwnershipPlan):
        return
    group = c10d._resolve_process_group(c10d.GroupName(applied.group_name))
    device = _device(opt)
    check_basis_agrees(basis, group, device)
    digest = int(applied.plan.digest(), 16) & _MASK
    low, high = _min_max(torch.tensor([digest], dtype=torch.int64, device=device), group)
    if low[0] != high[0]:
        raise DistributedMismatchError(_plan_difference(applied, group))
    names, sums = _checksums(opt)
    low, high = _min_max(torch.stack(sums).to(device), group)
    differ = (low != high).nonzero()
    if differ.numel():
        first = int(differ[0, 0])
        raise DistributedMismatchError(
            f"distributed='replicated': {names[first]} differs across ranks ({len(differ)} of {len(names)} "
            "params and grads differ); replicated params need the same params and reduced grads on every "
            "rank (all-reduce the grads first, or use distributed='local'). Nothing was written."
        )


def planning_basis(target: Any, settings: Any, backend: str) -> str:
    """Everything a plan's numbers are a rule of, besides the program and its shapes (which the
    ownership digest and the checksums cover): the target's declared capabilities and the settings.
    Measured rates are left out: they scale every prediction alike and decide nothing numeric."""
    rates = sorted(target.ratios.items()) if target.ratios else sorted(target.gflops.items())
    return repr((
        target.name, rates, tuple(target.formats), target.symmetric_speedup, str(settings.precision),
        tuple(settings.schedule or ()), settings.error_budget, tuple(sorted(settings.disabled_passes)), backend,
    ))


def check_basis_agrees(basis: str, group: Any, device: torch.device) -> None:
    """Raise :class:`DistributedMismatchError` on every rank unless every rank planned on the same
    basis. Plans are a rule of it, so equal bases plan equal numbers; replicas on CPUs of another
    kind (bf16 units on one rank, none on another) would not."""
    digest = int(hashlib.sha256(basis.encode()).hexdigest()[:16], 16) & _MASK
    low, high = _min_max(torch.tensor([digest], dtype=torch.int64, device=device), group)
    if low[0] == high[0]:
        return
    gathered: list[Any] = [None] * c10d.get_world_size(group)
    c10d.all_gather_object(gathered, basis, group=group)
    rank = next(r for r, b in enumerate(gathered) if b != gathered[0])
    raise DistributedMismatchError(
        f"distributed='replicated': the ranks plan on different bases, so their numbers would differ: rank 0 "
        f"{gathered[0]}, rank {rank} {gathered[rank]} (target, declared GEMM ratios, formats, symmetric "
        "products, precision, schedule, error budget, disabled passes, backend). Give every rank the same kind "
        "of machine and settings, or name target= and precision= explicitly. Nothing was written."
    )


def _device(opt: torch.optim.Optimizer) -> torch.device:
    params = [p for g in opt.param_groups for p in g["params"]]
    return params[0].device if params else torch.device("cpu")


def _min_max(values: torch.Tensor, group: Any) -> tuple[torch.Tensor, torch.Tensor]:
    both = torch.cat([values, -values])
    c10d.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    n = values.numel()
    return -both[n:], both[:n]


def _checksums(opt: torch.optim.Optimizer) -> tuple[list[str], list[torch.Tensor]]:
    """One int64 per param and grad, from their bits (a 1-ulp difference changes it)."""
    names: list[str] = []
    sums: list[torch.Tensor] = []
    for g, group in enumerate(opt.param_groups):
        for i, p in enumerate(group["params"]):
            where = f"param_groups[{g}]['params'][{i}] (shape {list(p.shape)})"
            names += [where, f"the grad of {where}"]
            sums.append(_bits_checksum(p.detach()))
            sums.append(_bits_checksum(p.grad.detach()) if p.grad is not None else torch.tensor(_NO_GRAD))
    return names, sums


def _bits_checksum(t: torch.Tensor) -> torch.Tensor:
    """A position-weighted sum of the tensor's bits, as int64 (wrapping), masked non-negative."""
    flat = t.contiguous().reshape(-1)
    width = flat.element_size()
    as_int = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[width]
    bits = flat.view(as_int).to(torch.int64)
    weights = torch.arange(bits.numel(), dtype=torch.int64, device=bits.device) % 65521 + 1
    total = (bits * weights).sum() * 1000003 + bits.sum()
    return (total & _MASK).cpu()


def _first_difference(mine: list[Any], group: Any) -> tuple[int, int | None, Any, Any] | None:
    """Where another rank's list first differs from rank 0's: (rank, index, rank 0's entry, its
    entry), or (rank, None, rank 0's length, its length); None if all agree. Every rank gathers
    every list: only after a digest already differed, so rare."""
    everyone: list[Any] = [None] * c10d.get_world_size(group)
    c10d.all_gather_object(everyone, mine, group=group)
    for rank, other in enumerate(everyone):
        if other == everyone[0]:
            continue
        for k, (a, b) in enumerate(zip(everyone[0], other)):
            if a != b:
                return rank, k, a, b
        return rank, None, len(everyone[0]), len(other)
    return None


def _plan_difference(applied: OwnershipPlan, group: Any) -> str:
    """Which item the ranks' plans first disagree on."""
    mine = [(i.key, i.shape, i.dtype, i.bucket, o) for i, o in zip(applied.plan.items, applied.plan.owners)]
    text = "distributed='replicated': the ranks planned different steps"
    found = _first_difference(mine, group)
    if found is None:
        return f"{text} (their plan digests differ). Nothing was written."
    rank, k, a, b = found
    if k is not None:
        return f"{text}: item {k} is {a} on rank 0 but {b} on rank {rank}. Nothing was written."
    return f"{text}: rank 0 has {a} orthogonalisations, rank {rank} {b}. Nothing was written."


def collective_signature(gm: fx.GraphModule) -> tuple[str | None, list[tuple[str, str, tuple[int, ...]]]]:
    """The group and, in issue order, each functional collective the step makes: its op, its
    input's dtype and (where every rank must send the same size) its input's shape."""
    group: str | None = None
    issued: list[tuple[str, str, tuple[int, ...]]] = []
    for node in collective_launches(gm):
        name = str(node.target)
        x = node.args[0] if node.args else None
        val = x.meta.get("val") if isinstance(x, fx.Node) else None
        dtype, shape = (str(val.dtype), tuple(val.shape)) if isinstance(val, torch.Tensor) else ("?", ())
        # all_to_all_single's sizes differ per rank by design (its splits say so)
        issued.append((name, dtype, () if "all_to_all" in name else shape))
        group = group or str(node.args[-1])
    return group, issued


def check_collectives_agree(gm: fx.GraphModule, device: torch.device) -> None:
    """Raise :class:`DistributedMismatchError` on every rank unless every rank's step issues the
    same collectives in the same order (ops, dtypes, sizes). Without this, ranks whose plans
    differ (a cost model fed by each machine's own measured rates, a rank that planned another
    precision) would wait in different collectives: a hang, or a gather of the wrong bytes."""
    group_name, issued = collective_signature(gm)
    if group_name is None:
        return
    group = c10d._resolve_process_group(c10d.GroupName(group_name))
    digest = int(hashlib.sha256(repr(issued).encode()).hexdigest()[:16], 16) & _MASK
    low, high = _min_max(torch.tensor([digest], dtype=torch.int64, device=device), group)
    if low[0] == high[0]:
        return
    text = "the ranks compiled steps that issue different collectives"
    found = _first_difference(issued, group)
    if found is not None:
        rank, k, a, b = found
        text += f": collective {k} is {a} on rank 0 but {b} on rank {rank}" if k is not None else (
            f": rank 0 issues {a}, rank {rank} {b}"
        )
    raise DistributedMismatchError(
        f"{text}. Plans that depend on a machine's measured rates (tp_mode='auto', the NS "
        "precision) can differ between ranks: name tp_mode= and precision= explicitly. Nothing was written."
    )


def rank0_target(target: Any, group_name: str) -> Any:
    """Rank 0's target on every rank of ``group_name``: a cost model fed by each machine's own
    measured rates could choose differently per rank (and the ranks would then issue different
    collectives), so the choices that decide collectives are made from one rank's rates."""
    group = c10d._resolve_process_group(c10d.GroupName(group_name))
    if c10d.get_world_size(group) == 1:
        return target
    box = [target]
    c10d.broadcast_object_list(box, group=group, group_src=0)
    return box[0]
