"""stack-members: a stamped class's Newton–Schulz calls run on stacks of its members.

In a stamped step (classes/stamp.py) one call stands for every member of its
class. Thousands of small matrices (a MoE's experts) make one call per member
host-bound: a bf16 48×128 NS costs ~2 ms one by one here and ~0.2 ms per
matrix in a stack of 64. This pass decides, per call and on the CPU that runs
it, whether its members run stacked, ``k`` per call: it times one call per
member against one call per stack of ``k`` (the planned op as it will run,
interleaved, min of a few rounds), and stacks only where that is faster
**and** computes the very same bits (checked on random inputs at ``k`` and a
smaller stack, since a batched GEMM may take another kernel than one GEMM).
So a stamped step that stacks is bitwise the one that does not, and the step
traced whole. The answer is cached per CPU, op and shape. Timing stays
within :data:`BUDGET_S` per compile: from one call's time the pass predicts
what measuring a stack costs, measures a smaller stack where the full one
would not fit, and declines (saying so) where not even MIN_MEMBERS would.

Before (one member's program)::

    t5 = hocompile.newton_schulz(t4, ...)  # choose-algorithm: standard bf16

After (the same node, a decision the list-mode lowering reads)::

    t5 = hocompile.newton_schulz(t4, ...)  # ...; stack-members: 64 members per call, 0.2 ms vs 2.1 ms each
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.fx as fx

from ..diskcache import read_json, write_json
from ..ir import dtypes
from ..ir.decisions import Alternative, Decision, decisions_of, format_seconds, record
from ..ir.graph import PER_PARAM, ROLE, InputSlot
from ..ir.registry import registered_calls
from ..precision.measure_ns import intra_op_threads
from ..targets import Target, cpu_id
from .base import Pass, PassResult, with_declines

STACK_VERSION = 2
ROUNDS = 3
# Seconds one compile may spend timing stacks (each of stack-members and stack-calls): a first
# compile is the user's first impression, and on a loaded machine timing takes several times
# longer. A stack whose measurement would not fit is measured smaller, or not at all.
BUDGET_S = 0.5
MARGIN = 0.9  # a stack must be 10 % faster than one call per member: closer is noise
MIN_MEMBERS = 4  # fewer members gain nothing from a stack worth measuring
# A stack saves at most each call's host work (dispatch, allocation) and what GEMMs this small lose to
# their size. Where one call's GEMMs (the cost model, at RATE_HEADROOM times the rate this CPU was
# calibrated at) outweigh its host work FAR_APART times over and its short side is at least
# SATURATED_SIDE (GEMMs past that run at full rate alone), a stack cannot be MARGIN faster: the pass
# says so without timing it. GPT-2 small's 768-wide matrices spent 0.35 s of each compile timing one call.
FAR_APART = 20.0
SATURATED_SIDE = 256
RATE_HEADROOM = 4.0  # the 256³ calibration under-reads large GEMMs (EPYC bf16: 332 declared, 734 at 768³)
HOST_PROBE_SIDE = 32  # the matrix a call's host work is timed on: its GEMMs take microseconds

# Members of a class, by its representative (group, index): what a call of that member stands for.
Members = tuple[tuple[tuple[int, int], int], ...]


def chosen_threads(node: fx.Node) -> int:
    chosen = [d.chose["threads"] for d in decisions_of(node) if "threads" in d.chose]
    return chosen[-1] if chosen and isinstance(chosen[-1], int) else 0


@dataclass(frozen=True)
class StackMembers(Pass):
    name: ClassVar[str] = "stack-members"
    target: Target = field(default_factory=lambda: Target("unset"))
    members: Members = ()
    max_batch: int = 64
    max_stack_bytes: int = 64 * 2**20
    cache_dir: Path | None = None
    budget_s: float = BUDGET_S

    def __call__(self, gm: fx.GraphModule) -> PassResult:
        if not self.target.measured:
            return PassResult(gm, False, self.decline(f"{self.target.name} is not this machine: nothing to time"))
        count = dict(self.members)
        owner = _owners(gm)
        made, declined = 0, []
        budget = Budget(self.budget_s)
        for node, family in registered_calls(gm.graph):
            if family.batch is None or family.name != "newton_schulz":
                continue
            n = count.get(owner.get(node, (-1, -1)), 1)
            if n < MIN_MEMBERS:
                declined.append(f"{node.name}: {n} member(s)")
                continue
            val = node.meta["val"]
            if val.dim() != 2:
                declined.append(f"{node.name}: already batched")
                continue
            size = 2 * int(val.numel() * val.element_size())
            k = max(1, min(n, self.max_batch, self.max_stack_bytes // max(1, size)))
            decision = self._decide(node, family, k, budget)
            record(node, decision)
            made += bool(decision.chose)
            if not decision.chose:
                declined.append(f"{node.name}: {decision.why}")
        if not made:
            reason = declined[0] if declined else "no Newton–Schulz call of a class with members to stack"
            return PassResult(gm, False, self.decline(reason), declined)
        return PassResult(gm, True, with_declines(f"{made} call(s) stacked over their class's members", declined))

    def _decide(self, node: fx.Node, family: Any, k: int, budget: Budget) -> Decision:
        planned = PlannedCall.of(node, family)
        x, threads = planned.x, planned.threads
        text = f"{STACK_VERSION};{cpu_id()};{family.name};{planned.without_input()!r};{tuple(x.shape)}"
        key = hashlib.sha256(f"{text};{x.dtype};{k};{threads}".encode()).hexdigest()[:24]
        path = self.cache_dir / f"stack-{key}.json" if self.cache_dir is not None else None
        found = read_json(path, parse_stacking) if path is not None else None
        if found is None and (apart := far_apart(node, family, planned, self.target, budget)):
            return Decision(self.name, {}, why=apart)
        if found is None:
            one_s = budget.spend_on(one_call_seconds, planned.one_by_one, tuple(x.shape), x.dtype)
            fits = [size for size in range(k, MIN_MEMBERS - 1, -1) if budget.fits(stacking_cost(one_s, size))]
            if not fits:
                cost = format_seconds(stacking_cost(one_s, k))
                why = f"not measured: a stack of {k} would take {cost} to time (one call {format_seconds(one_s)})"
                return Decision(self.name, {}, why=why + f", {format_seconds(budget.left())} of the budget left")
            k = fits[0]
            found = budget.spend_on(measure_stacking, planned.one_by_one, planned.stacked, tuple(x.shape), x.dtype,
                                    sizes_for(k))
            if path is not None:
                write_json(path, found)
        loop_s, stacked_s, same, k = found["loop_s"], found["stacked_s"], found["bitwise"], found["stack"]
        each = f"{format_seconds(stacked_s)} vs {format_seconds(loop_s)} per member one by one"
        one_by_one = Alternative("one call per member", loop_s)
        if not same:
            return Decision(self.name, {}, why=f"a stack of {k} rounds differently here ({each})")
        if stacked_s > MARGIN * loop_s:
            why = f"a stack of {k} is not faster here ({each})"
            return Decision(self.name, {}, why=why, alternatives=(one_by_one,))
        return Decision(
            self.name, {"stack": k}, f"{k} members per call", stacked_s, alternatives=(one_by_one,),
            why=f"measured here, bitwise one call per member's ({dtypes.name(x.dtype)}[{x.shape[0]}, {x.shape[1]}])",
        )


_HOST_SECONDS: dict[str, float] = {}  # one call's host work, by CPU, planned call and thread count


def far_apart(node: fx.Node, family: Any, planned: PlannedCall, target: Target, budget: Budget) -> str:
    """Why a stack of this call cannot be MARGIN faster than one call per matrix, by the cost model
    (FAR_APART); "" where only timing can tell. The host work is timed once per process on a
    HOST_PROBE_SIDE² matrix (well under a millisecond)."""
    spec = family.spec_of(node)
    _, short, _ = spec.wide_shape()
    if short < SATURATED_SIDE:
        return ""
    gemm_s = family.cost(spec).matmul_flops / (RATE_HEADROOM * target.throughput(spec.compute_dtype) * 1e9)
    key = f"{cpu_id()};{planned.without_input()!r};{planned.x.dtype};{planned.threads}"
    if key not in _HOST_SECONDS:
        probe = (HOST_PROBE_SIDE, HOST_PROBE_SIDE)
        _HOST_SECONDS[key] = min(budget.spend_on(one_call_seconds, planned.one_by_one, probe, planned.x.dtype)
                                 for _ in range(3))
    host_s = _HOST_SECONDS[key]
    if gemm_s < FAR_APART * host_s:
        return ""
    return (f"a stack cannot be {1 - MARGIN:.0%} faster: one call is ≥{format_seconds(gemm_s)} of GEMMs "
            f"(cost model) against {format_seconds(host_s)} of host work; not timed")


def _owners(gm: fx.GraphModule) -> dict[fx.Node, tuple[int, int]]:
    """Each node reading exactly one member's inputs: that member (the representative of its class)."""
    deps: dict[fx.Node, frozenset[tuple[int, int]]] = {}
    for node in gm.graph.nodes:
        role = node.meta.get(ROLE)
        if node.op == "placeholder":
            member = isinstance(role, InputSlot) and role.kind in PER_PARAM
            deps[node] = frozenset([(role.group, role.index)] if member else [])
        else:
            deps[node] = frozenset().union(*(deps.get(a, frozenset()) for a in node.all_input_nodes))
    return {n: next(iter(d)) for n, d in deps.items() if len(d) == 1}


@dataclass(frozen=True)
class PlannedCall:
    """A Newton–Schulz call as its plan runs it (its spec with the host scalars the capture saw,
    its intra-op threads), callable one matrix at a time or on a stack: what stack-members and
    stack-calls time against each other."""

    family: Any
    spec: Any  # concrete: no fx.Node left but the tensor input, which each call replaces
    name: str  # the tensor field
    x: torch.Tensor  # the input's fake value (shape, dtype)
    threads: int

    @classmethod
    def of(cls, node: fx.Node, family: Any) -> PlannedCall:
        spec = family.spec_of(node)
        (name,) = spec.tensor_fields()
        # Host scalars (eps) as the values the capture saw: what the op computes does not depend on them.
        values = {f: v.meta["val"] for f in spec.field_names() if isinstance(v := getattr(spec, f), fx.Node)}
        return cls(family, spec.replace(**values), name, spec.node_of(name).meta["val"], chosen_threads(node))

    def without_input(self) -> Any:
        return self.spec.replace(**{self.name: None})

    def _call(self, t: torch.Tensor) -> torch.Tensor:
        with intra_op_threads(self.threads):
            return self.family.op(*self.spec.replace(**{self.name: t}).to_args())  # type: ignore[no-any-return]

    def one_by_one(self, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        return [self._call(t) for t in xs]

    def stacked(self, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        """One call on the stack of ``xs`` (each as it is: a tall matrix stays tall), unbound."""
        return list(self._call(torch.stack(xs)).unbind(0))


Calls = Callable[[list[torch.Tensor]], list[torch.Tensor]]


def parse_stacking(data: Any) -> dict[str, Any]:
    return {
        "loop_s": float(data["loop_s"]), "stacked_s": float(data["stacked_s"]), "bitwise": bool(data["bitwise"]),
        "stack": int(data["stack"]),
    }


@dataclass
class Budget:
    """What is left of one pass run's timing budget (seconds of wall time)."""

    total_s: float
    spent_s: float = 0.0

    def left(self) -> float:
        return max(0.0, self.total_s - self.spent_s)

    def fits(self, seconds: float) -> bool:
        return seconds <= self.left()

    def spend_on(self, fn: Callable[..., Any], *args: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.spent_s += time.perf_counter() - start


def sizes_for(k: int) -> list[int]:
    """The stack sizes checked bitwise for stacks of ``k``: ``k``, a remainder's, and one."""
    return sorted({k, max(1, k // 2 + 1), 1})


def stacking_cost(one_s: float, k: int, sizes: list[int] | None = None) -> float:
    """Predicted seconds of measure_stacking: the bitwise runs at every size, both ways, then
    ROUNDS of ``k`` calls one by one and stacked."""
    return one_s * (2 * sum(sizes or sizes_for(k)) + 2 * ROUNDS * k)


def one_call_seconds(one: Calls, shape: tuple[int, ...], dtype: Any) -> float:
    """Seconds of one call on one matrix, after a warm-up call: the yardstick of what timing costs."""
    x = [torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(dtype)]
    one(x)
    start = time.perf_counter()
    one(x)
    return time.perf_counter() - start


def measure_stacking(
    one: Calls, stacked: Calls, shape: tuple[int, ...], dtype: Any, sizes: list[int]
) -> dict[str, Any]:
    """Seconds per matrix one call each and in one stack of the largest size (min of ROUNDS,
    interleaved), and whether a stack of every size in ``sizes`` gives the one-by-one bits."""
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(shape, generator=gen).to(dtype) for _ in range(max(sizes))]
    same = all(all(torch.equal(a, b) for a, b in zip(one(xs[:m]), stacked(xs[:m]))) for m in sizes)
    loop_s = stacked_s = float("inf")
    for _ in range(ROUNDS):
        start = time.perf_counter()
        one(xs)
        loop_s = min(loop_s, (time.perf_counter() - start) / len(xs))
        start = time.perf_counter()
        stacked(xs)
        stacked_s = min(stacked_s, (time.perf_counter() - start) / len(xs))
    return {"loop_s": loop_s, "stacked_s": stacked_s, "bitwise": same, "stack": max(sizes)}
