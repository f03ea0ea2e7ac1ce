"""Which tensor-parallel NS mode for a sharded matrix, and the FX rewrite that inlines it.

tensor_parallel.py holds the modes (duplicated, distributed, blockwise) as
functions of a local shard. Here: :func:`choose_tp_mode`, a cost model that
weighs them, and routing the whole matrix to an owner rank
(passes/route_sharded.py), on the target's GEMM rate and a link's bandwidth
and latency; and :func:`rewrite_ns_node`, which traces the chosen mode with
``make_fx`` and inlines it in place of one ``hocompile::newton_schulz`` node
(passes/tp_newton_schulz.py calls both).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..ir.decisions import Alternative, Decision, format_seconds, record
from ..targets import Target
from .tensor_parallel import MODES, NSArgs, tp_newton_schulz

# What the planner weighs: the TP modes, and "route" (the whole matrix to one owner rank and back).
PLAN_MODES = ("route", *MODES)

@dataclass(frozen=True)
class Link:
    """What one collective costs: ``latency_s`` + bytes per rank / ``bandwidth`` (bytes/s per direction)."""

    bandwidth: float
    latency_s: float
    source: str


# Per target. GPUs: nominal per-direction NVLink rates of the SXM parts (sm89 parts have no NVLink: PCIe 4.0
# x16) and ~10 us per small NCCL collective. CPUs: gloo between 2 processes on this project's 2-core machines,
# measured (bus bandwidth 0.8-1.1 GB/s at 4-16 MB, 0.4-1 ms per small all-reduce, under load).
LINKS: dict[str, Link] = {
    "sm80": Link(300e9, 10e-6, "NVLink3 300 GB/s"),
    "sm89": Link(32e9, 15e-6, "PCIe4 32 GB/s"),
    "sm90": Link(450e9, 10e-6, "NVLink4 450 GB/s"),
    "sm100": Link(900e9, 10e-6, "NVLink5 900 GB/s"),
    "sm103": Link(900e9, 10e-6, "NVLink5 900 GB/s"),
}
GLOO_CPU = Link(1e9, 500e-6, "gloo 1 GB/s")


@dataclass(frozen=True)
class TPChoice:
    """The mode for one sharded NS, why, and the predicted seconds of each mode weighed."""

    mode: str
    reason: str
    predicted_s: dict[str, float] = field(default_factory=dict)

    def describe(self) -> str:
        """explain()'s line."""
        return f"tensor-parallel NS: {self.mode}, {self.reason}"

    def decision(self) -> Decision:
        others = tuple(Alternative(m, t) for m, t in self.predicted_s.items() if m != self.mode)
        return Decision(
            "tensor-parallel", {"tp_mode": self.mode}, label=self.mode,
            predicted_s=self.predicted_s.get(self.mode), alternatives=others, why=self.reason,
        )


def choose_tp_mode(
    shape: Sequence[int],
    shard_dim: int,
    world: int,
    steps: int,
    rates: Target,
    *,
    transpose: bool = False,
    compute_dtype: torch.dtype = torch.bfloat16,
    in_bytes: int = 4,
    link: Link | None = None,
    requested: str | None = None,
    routed_matrices: int = 0,
    routed_flops: float | None = None,
    out_bytes: int | None = None,
) -> TPChoice:
    """Route, duplicated or distributed for the full ``shape`` split along ``shard_dim`` over ``world`` ranks.

    X = the op's working matrix (m×n, Gram side m), T = ``steps`` of standard
    quintic NS, R = the target's GEMM rate in ``compute_dtype``, β/α the link's
    bandwidth/latency, e = ``in_bytes`` per input element, f = (W-1)/W:

    - duplicated:  α + f·m·n·e/β + T(4m²n + 2m³)/R  (gather X, full NS);
    - distributed: (T+1)α + T·2f·4m²/β + T(4m²⌈n/W⌉ + 2m³)/R  (fp32 m×m all-reduces).

    - route (offered when ``routed_matrices`` > 0, the sharded matrices the
      step could route): 2α/k + f·m·n·(e + e_out)/β + T(4m²n + 2m³)/(R·s),
      k = ``routed_matrices``: two all-to-alls per bucket (shared by its k
      matrices), the owner receives the other ranks' shards and sends its
      results back (e_out = ``out_bytes``, default e), and ownership spreads
      the whole-matrix NS over s = min(W, F / this matrix's FLOPs) ranks,
      F = ``routed_flops`` (all k matrices' NS FLOPs; default k times this
      one's): a matrix that dominates the step's NS keeps its owner busy
      while the others idle.

    Ignoring latency, distributed wins once n > 8T/β / (4T/R + e/(mβ)) ≈ 2R/β:
    ~4.4k columns at sm90's bf16 rate over NVLink4, ~170 at a 2-core CPU's fp32
    rate over gloo, where latency then keeps small matrices duplicated
    (:func:`crossover_long_side` finds the exact point). Blockwise is chosen
    only when ``requested``: it changes the update.
    """
    if world < 1 or steps < 1 or len(shape) not in (2, 3):
        raise ValueError(f"choose_tp_mode needs world >= 1, steps >= 1, a 2-d or 3-d shape: {world}, {steps}, {shape}")
    if requested not in (None, *PLAN_MODES):
        raise ValueError(f"requested must be one of {PLAN_MODES} or None, got {requested!r}")
    if requested == "route" and routed_matrices < 1:
        raise ValueError("requested='route' needs routed_matrices >= 1 (the matrices the step routes)")
    if requested == "blockwise":
        return TPChoice("blockwise", "requested: each shard orthogonalised alone, the update differs from unsharded")
    dim = shard_dim - len(shape) if shard_dim >= 0 else shard_dim
    if dim == -3:
        return TPChoice("duplicated", "shards hold whole matrices: the op runs locally, no communication")
    batch = shape[0] if len(shape) == 3 else 1
    rows, cols = shape[-2], shape[-1]
    m, n = (cols, rows) if transpose else (rows, cols)
    link = link or LINKS.get(rates.name, GLOO_CPU)
    rate = rates.planning_throughput(compute_dtype) * 1e9  # a declared rate: the mode changes the bits
    frac = (world - 1) / world
    full = ns_flops_as_given(shape, steps, transpose)
    times = {"duplicated": link.latency_s + frac * batch * m * n * in_bytes / link.bandwidth + full / rate}
    if routed_matrices > 0:
        k, moved = routed_matrices, batch * m * n * (in_bytes + (out_bytes or in_bytes))
        spread = min(world, (routed_flops if routed_flops is not None else k * full) / full)
        times["route"] = 2 * link.latency_s / k + frac * moved / link.bandwidth + full / rate / max(1.0, spread)
    if requested == "route":
        return TPChoice("route", f"requested: the whole matrix on its owner rank ({_facts(times, rates, rate, link)})",
                        times)
    # Where distributed cannot run: the cheaper of the others; a request for it gets duplicated (its fallback).
    pick = requested if requested in times else "duplicated" if requested else min(times, key=lambda k: times[k])
    asked = "requested, " if requested else ""
    if dim != (-2 if transpose else -1):
        why = f"{asked}the shard splits the Gram side m of {m}x{n} (distributed needs n split)"
        return TPChoice(pick, f"{why}; {_facts(times, rates, rate, link)}", times)
    if m > n:
        why = f"{asked}X is tall ({m}x{n}): its split side is the short one (no distributed)"
        return TPChoice(pick, f"{why}; {_facts(times, rates, rate, link)}", times)
    acc_bytes = 8 if compute_dtype == torch.float64 else 4
    split = batch * steps * (4 * m * m * math.ceil(n / world) + 2 * m**3)
    gram_bytes = batch * m * m * acc_bytes
    times["distributed"] = (steps + 1) * link.latency_s + steps * 2 * frac * gram_bytes / link.bandwidth + split / rate
    mode = requested or min(times, key=lambda k: times[k])
    facts = f"{steps} all-reduces of {m}x{m} ({gram_bytes / 1e6:.3g} MB) vs gathering {m}x{n}, "
    return TPChoice(mode, asked + facts + _facts(times, rates, rate, link), times)


def ns_flops_as_given(shape: Sequence[int], steps: int, transpose: bool = False) -> int:
    """T(4m²n + 2m³) for X = the op's working matrix m×n (``shape``'s last two dims, swapped if ``transpose``),
    times the batch: the op's products as given (not ns.flops, which makes X wide first)."""
    batch = shape[0] if len(shape) == 3 else 1
    m, n = (shape[-1], shape[-2]) if transpose else (shape[-2], shape[-1])
    return batch * steps * (4 * m * m * n + 2 * m**3)


def _facts(times: dict[str, float], rates: Target, rate: float, link: Link) -> str:
    weighed = " vs ".join(f"{k} {format_seconds(v)}" for k, v in times.items())
    return f"{weighed} at {rates.name} {rate / 1e12:.3g} TFLOP/s, {link.source}"


def crossover_long_side(m: int, world: int, steps: int, rates: Target, **options: object) -> int:
    """The smallest long side n (X = m×n, split along n) where choose_tp_mode picks distributed."""
    def distributed(n: int) -> bool:
        return choose_tp_mode((m, n), -1, world, steps, rates, **options).mode == "distributed"  # type: ignore[arg-type]

    high = max(world, 1)
    while not distributed(high):
        if high > 2**40:
            raise ValueError(f"distributed never wins for m={m} on {rates.name}")
        high *= 2
    low = high // 2
    while high - low > 1:  # invariant: distributed(high), not distributed(low) (or low == 0)
        middle = (low + high) // 2
        low, high = (low, middle) if distributed(middle) else (middle, high)
    return high


# ------------------------------------------------------------------ the graph rewrite


def rewrite_ns_node(
    gm: torch.fx.GraphModule,
    node: torch.fx.Node,
    *,
    shard_dim: int,
    group_name: str,
    mode: str,
    full_size: int,
    choice: TPChoice | None = None,
    local_shape: Sequence[int] | None = None,
) -> torch.fx.Node:
    """Replace one ``hocompile::newton_schulz`` node, whose input is this rank's shard, by ``mode``'s program.

    The mode's function is traced with ``make_fx`` on the input's fake value
    and inlined: functional collectives with their waits, plus the op itself
    (duplicated: on the gathered matrix; blockwise: on the shard) or the
    distributed aten program. The graph is per rank (the own slice's offset
    is a constant), so rank and world size belong in the cache key. A host-
    scalar ``eps`` is kept on the op's node; the distributed program reads it
    as a 0-d fp64 tensor (``aten.scalar_tensor``). The node's meta (earlier passes' decisions)
    moves to the inlined op, or to the result when none is left; ``choice``
    is recorded on the result. Returns the node that now gives the result.

    ``local_shape``: the shard's shape when the input's fake value has the
    *global* shape (a step captured on DTensors: distributed/sharded.py); the
    program is traced on a shard of that shape and the result keeps the
    node's global value, as every other sharded value in such a graph does.
    """
    from torch.fx.experimental.proxy_tensor import make_fx

    from ..ops.newton_schulz_spec import NewtonSchulzSpec

    spec = NewtonSchulzSpec.from_node(node)
    fake = spec.x_node.meta.get("val")
    if not isinstance(fake, torch._subclasses.FakeTensor):
        raise ValueError(f"{node.name}: its input {spec.x_node.name} has no fake value in meta['val'] to trace with")
    eps_node = spec.eps if isinstance(spec.eps, torch.fx.Node) else None
    eps_input = eps_node is not None and mode == "distributed"  # the program takes it as a 0-d fp64 tensor
    args = NSArgs(
        spec.a, spec.b, spec.c, 1.0 if eps_node is not None else float(spec.eps), spec.eps_mode,  # type: ignore[arg-type]
        spec.transpose, spec.compute_dtype, spec.out_dtype, spec.algorithm, spec.restarts, spec.matmul,
        spec.blocks, spec.schedule,
    )

    def program(local: torch.Tensor, *eps: torch.Tensor) -> torch.Tensor:
        eps_tensor = eps[0] if eps else None
        return tp_newton_schulz(local, shard_dim, group_name, args, mode=mode, full_size=full_size, eps=eps_tensor)

    with fake.fake_mode:
        local = fake if local_shape is None else torch.empty(tuple(local_shape), dtype=fake.dtype, device=fake.device)
        eps_fake = [torch.empty((), dtype=torch.float64, device=fake.device)] if eps_input else []
        traced = make_fx(program)(local, *eps_fake)
    if any(n.op == "get_attr" for n in traced.graph.nodes):
        raise ValueError(f"{node.name}: the {mode} program traced with tensor constants; cannot inline it")
    placeholders = [n for n in traced.graph.nodes if n.op == "placeholder"]
    inputs = {placeholders[0]: spec.x_node}
    before = set(gm.graph.nodes)
    with gm.graph.inserting_before(node):
        if eps_input:  # the host scalar (a Python float at run time) as the 0-d tensor the program reads
            as_tensor = torch.ops.aten.scalar_tensor.default
            eps_tensor = gm.graph.call_function(as_tensor, (eps_node,), {"dtype": torch.float64})
            eps_tensor.meta["val"] = eps_fake[0]
            inputs[placeholders[1]] = eps_tensor
        result = gm.graph.graph_copy(traced.graph, inputs)
    assert isinstance(result, torch.fx.Node)
    inlined = [n for n in gm.graph.nodes if n not in before and n.target is NewtonSchulzSpec.op()]
    for op_node in inlined:
        if eps_node is not None:  # the host scalar, as the original op had it
            NewtonSchulzSpec.from_node(op_node).replace(eps=eps_node).apply(op_node)
    (inlined[0] if inlined else result).meta.update({k: v for k, v in node.meta.items() if k != "val"})
    if local_shape is not None:
        result.meta["val"] = node.meta["val"]
    record(result, (choice or TPChoice(mode, "requested")).decision())
    node.replace_all_uses_with(result)
    gm.graph.erase_node(node)
    gm.recompile()
    return result
