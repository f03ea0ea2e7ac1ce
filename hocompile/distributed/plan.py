"""Which rank orthogonalises which matrix: longest-processing-time on NS cost.

Every rank computes the same plan from the same inputs (shapes, step counts,
world size), with no communication: items are ordered by cost, ties broken by
their position in the step, and each goes to the least-loaded rank, ties to
the lowest rank. Loads carry over from one bucket to the next, so many small
buckets still balance in total. ``DistPlan.digest()`` is what ranks compare
once to prove they agree (a mismatch would gather the wrong results).
"""

from __future__ import annotations

import hashlib
import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, field


def ns_cost(shape: Sequence[int], steps: int, gram: bool = False, batch: int = 1) -> float:
    """Relative cost of ``steps`` Newton–Schulz iterations on a ``shape`` matrix.

    Standard NS does ``X Xᵀ`` (s²l), ``A·A`` (s³) and ``B X`` (s²l) per step:
    steps·s²·(2l+s) for short side s, long side l (the multiply-adds; torchtitan
    and Megatron balance on the same figure). Gram NS iterates on the s×s Gram
    matrix and touches the long side twice in all: s²l once to form it, s²l to
    apply it, plus two s³ products per step.
    """
    if len(shape) < 2:
        return 0.0
    *lead, rows, cols = shape
    n_batch = batch
    for d in lead:
        n_batch *= d
    s, long_ = min(rows, cols), max(rows, cols)
    if gram:
        return float(n_batch * (2 * s * s * long_ + 2 * steps * s**3))
    return float(n_batch * steps * s * s * (2 * long_ + s))


@dataclass(frozen=True)
class Item:
    """One unit of owned work: a matrix (or a stack of same-shaped ones) in a bucket."""

    key: str  # stable name in the step (the node), for explain() and the digest
    shape: tuple[int, ...]
    dtype: str
    cost: float
    bucket: int = 0


@dataclass(frozen=True)
class DistPlan:
    """The owner of every item, and what it costs each rank."""

    world: int
    items: tuple[Item, ...]
    owners: tuple[int, ...]
    loads: tuple[float, ...] = field(default=())

    def owner(self, key: str) -> int:
        return self.owners[[i.key for i in self.items].index(key)]

    def owned(self, rank: int) -> list[Item]:
        return [i for i, o in zip(self.items, self.owners) if o == rank]

    def imbalance(self) -> float:
        """Max-rank load over the ideal (total / world): 1.0 is perfect."""
        total = sum(self.loads)
        return max(self.loads) / (total / self.world) if total else 1.0

    def digest(self) -> str:
        text = f"world={self.world};" + ";".join(
            f"{i.key}:{i.shape}:{i.dtype}:{i.cost:.6g}:{i.bucket}->{o}" for i, o in zip(self.items, self.owners)
        )
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def summary(self, max_lines: int = 12) -> list[str]:
        """:meth:`describe` for many ranks and items, in a few lines: the headline, the
        buckets (their spread, the first and last ``max_lines // 4``), and runs of ranks
        with the same item count and load (to 0.001), at most ``max_lines`` of them."""
        ideal = sum(self.loads) / self.world if self.world else 0.0
        count = [0] * self.world
        per_bucket: dict[int, tuple[list[int], list[float], set[str]]] = {}
        for item, owner in zip(self.items, self.owners):
            count[owner] += 1
            counts, costs, kinds = per_bucket.setdefault(item.bucket, ([0] * self.world, [0.0] * self.world, set()))
            counts[owner] += 1
            costs[owner] += item.cost
            kinds.add(item.dtype)
        lines = self.describe()[:1]
        sizes = [sum(c) for c, _, _ in per_bucket.values()]
        if sizes:
            worst = max(max(costs) / (sum(costs) / self.world) for _, costs, _ in per_bucket.values() if sum(costs))
            lines.append(
                f"  {len(per_bucket)} bucket(s) of {min(sizes)}-{max(sizes)} items; within one bucket the "
                f"busiest rank has up to {worst:.2f}x that bucket's ideal"
            )
        keys = sorted(per_bucket)
        edge = max(1, max_lines // 4)
        shown = keys if len(keys) <= 2 * edge else keys[:edge] + keys[-edge:]
        for b in shown:
            if len(shown) < len(keys) and b == keys[-edge]:
                lines.append(f"  ... {len(keys) - len(shown)} more buckets")
            counts, costs, kinds = per_bucket[b]
            lines.append(
                f"  bucket {b}: {sum(counts)} {','.join(sorted(kinds))} items, {min(counts)}-{max(counts)} per rank, "
                f"cost {sum(costs) / ideal if ideal else 0.0:.3f}x one rank's ideal"
            )
        if self.world <= max_lines:
            lines += self.describe()[1:]
            return lines
        shares = [load / ideal if ideal else 0.0 for load in self.loads]
        busiest = sorted(range(self.world), key=lambda r: (-shares[r], r))[:3]
        lines.append(
            f"  {self.world} ranks: {min(count)}-{max(count)} items each, load {min(shares):.3f}-{max(shares):.3f}x "
            f"ideal; busiest " + ", ".join(f"rank {r} ({count[r]} items, {shares[r]:.3f}x)" for r in busiest)
        )
        return lines

    def describe(self) -> list[str]:
        """explain()'s lines: per rank, its items and load against the ideal."""
        ideal = sum(self.loads) / self.world if self.world else 0.0
        lines = [f"{self.world} ranks, max-rank NS cost {self.imbalance():.3f}x the ideal (digest {self.digest()})"]
        for rank in range(self.world):
            mine = self.owned(rank)
            share = self.loads[rank] / ideal if ideal else 0.0
            lines.append(f"  rank {rank}: {len(mine)} matrices, load {share:.3f}x ideal")
        return lines


def assign_buckets(sizes: Sequence[tuple[str, int]], cap_bytes: int, min_items: int = 1) -> list[int]:
    """Bucket of each item, given (dtype, bytes) per item in step order.

    Items of one dtype fill a bucket in order until the next would pass
    ``cap_bytes`` and the bucket holds ``min_items`` (with fewer items than
    ranks, some ranks idle while the bucket's gather waits for the others);
    the buckets are numbered by their last item, the order in which their
    gathers can be issued.
    """
    current: dict[str, tuple[list[int], int]] = {}
    closed: list[list[int]] = []
    for k, (dtype, size) in enumerate(sizes):
        members, used = current.get(dtype, ([], 0))
        if len(members) >= min_items and used + size > cap_bytes:
            closed.append(members)
            members, used = [], 0
        current[dtype] = (members + [k], used + size)
    closed += [members for members, _ in current.values()]
    closed.sort(key=lambda members: members[-1])
    bucket = [0] * len(sizes)
    for b, members in enumerate(closed):
        for k in members:
            bucket[k] = b
    return bucket


def assign_owners(items: Sequence[Item], world: int, loads: Sequence[float] | None = None) -> DistPlan:
    """LPT: buckets in order; within one, items by cost (descending, then position) to the least-loaded rank."""
    if world < 1:
        raise ValueError(f"world size must be >= 1, got {world}")
    load = list(loads) if loads is not None else [0.0] * world
    if len(load) != world:
        raise ValueError(f"{len(load)} starting loads for {world} ranks")
    owners = [0] * len(items)
    order = sorted(range(len(items)), key=lambda k: (items[k].bucket, -items[k].cost, k))
    heap = [(load[r], r) for r in range(world)]
    heapq.heapify(heap)
    for k in order:
        current, rank = heapq.heappop(heap)
        owners[k] = rank
        load[rank] = current + items[k].cost
        heapq.heappush(heap, (load[rank], rank))
    return DistPlan(world, tuple(items), tuple(owners), tuple(load))


def assign_by_numel(items: Sequence[Item], world: int) -> DistPlan:
    """Megatron Core 0.19's layer-wise rule, for comparison (``LayerWiseDistributedOptimizer``): per
    bucket, items by element count (descending) to the rank holding the fewest of the bucket's elements.
    Its loads are the items' costs all the same: what each rank then spends orthogonalising."""
    if world < 1:
        raise ValueError(f"world size must be >= 1, got {world}")
    owners = [0] * len(items)
    load = [0.0] * world
    for bucket in sorted({i.bucket for i in items}):
        held = [0] * world
        members = [k for k in range(len(items)) if items[k].bucket == bucket]
        for k in sorted(members, key=lambda k: (-math.prod(items[k].shape), k)):
            rank = min(range(world), key=lambda r: (held[r], r))
            owners[k] = rank
            held[rank] += math.prod(items[k].shape)
            load[rank] += items[k].cost
    return DistPlan(world, tuple(items), tuple(owners), tuple(load))

