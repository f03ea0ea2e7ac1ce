"""choose-algorithm: per Newton–Schulz op, the algorithm, compute precision and symmetric products.

What a plan computes is decided by a **rule** (:func:`decide`): the
FLOP-rate model over the shape, the coefficient set, eager's dtype, the
``precision`` setting and the target's *declared* GEMM rates (a GPU's data
sheet; the CPU running the step: its ISA flags, targets.declared_ratios).
Never by a timing: a plan chosen by timing made two processes on one
machine compute different bits when one of them was compiled under load.
On the CPU running the step (``Target.measured``) timing only chooses how
many intra-op threads run the rule's program, between thread counts checked
to give the very same bits (:func:`measured_plan`). The pass writes the
answer into the op's arguments and records a
:class:`~hocompile.ir.decisions.Decision` (its ``chose``: algorithm, compute,
restarts, matmul, blocks; its alternatives with their predicted or measured
times, or why they were refused).

Before::

    t2 = hocompile.newton_schulz(t1, ..., bf16, bf16, 'standard', [], 'native')

After (64×256 fp32 on a 2-thread CPU)::

    t2 = hocompile.newton_schulz(t1, ..., fp32->fp32, standard, native)
        # choose-algorithm: standard fp32 on 1 thread, 0.21 ms predicted (vs gram 0.3 ms | fp32 0.3 ms)
        #   eager's precision; threads measured here (bitwise alike): min of 3 runs, ...

Precision policy ``"auto"``: eager's compute dtype, or fp32 (more accurate
than a half-precision eager, and faster where the half GEMM is slow: bf16
on an AVX2 CPU runs ~100× slower than fp32). An explicit ``"bf16"`` /
``"fp16"`` keeps that rounding, natively where the target has the units,
else emulated on fp32 units. Half precision stays standard NS (bf16 Gram NS
exceeded eager's budget on some inputs, precision/gram_half.py); Gram NS in fp32/fp64 only
where eager rounds coarser than the plan computes: against an fp32 eager,
fp32 Gram NS measured 12-40x eager's error on rank-deficient gradients.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import ClassVar

import torch
import torch.fx as fx

from ..ir import dtypes
from ..ir.decisions import Alternative, Choice, Decision, format_seconds, record, set_eager_dtype
from ..ops.newton_schulz_math import flops
from ..ops.newton_schulz_spec import NewtonSchulzSpec
from ..precision.measure_ns import (
    BUDGET_S,
    MARGIN,
    Candidate,
    Program,
    Timer,
    estimate,
    same_bits,
    unit_counts,
    wall_timer,
)
from ..precision.measure_session import MeasureSession
from ..targets import Target
from .base import Pass, PassResult

PRECISIONS = ("auto", "fp32", "bf16", "fp16", "fp64")
# m²n of the largest NS that is also timed on one thread. Above it all threads won here when quiet
# (256×512: the twin 1.7x slower), and a twin timed faster on a loaded machine lost in the step:
# each switch to one thread and back leaves the step's next multi-threaded op waking a parked
# OpenMP worker. A per-expert MoE (192 256×512 views, two busy loops on the 2-core EPYC) ran its
# Muon step in 4-12 s with its experts on one thread against ~1.5 s on all (eager: 1.2-2.0 s).
MAX_ONE_THREAD_WORK = 64 * 64 * 1024
SYMMETRIC_BLOCKS = 4  # 4x4: 1.47x on 768x3072 X Xᵀ here, 2x2 only 1.33x (newton_schulz.py)


@dataclass(frozen=True)
class Plan:
    algorithm: str
    restarts: tuple[int, ...]
    compute_dtype: torch.dtype
    matmul: str
    predicted_s: float
    alternatives: tuple[Alternative, ...]
    blocks: int = 0
    why: str = ""  # why this compute precision (measured plans: how they were measured)
    threads: int = 0  # intra-op threads while it runs (0: all); measure_ns.Program.threads

    def label(self) -> str:
        return (
            f"{self.algorithm} {dtypes.name(self.compute_dtype)}"
            f"{' restart ' + str(list(self.restarts)) if self.restarts else ''}"
            f"{' (emulated)' if self.matmul == 'emulate' else ''}"
            f"{f' with symmetric products on {self.blocks} row blocks' if self.blocks else ''}"
            f"{f' on {self.threads} thread' + ('s' if self.threads > 1 else '') if self.threads else ''}"
        )

    def decision(self) -> Decision:
        chose: dict[str, Choice] = {
            "algorithm": self.algorithm,
            "compute": dtypes.name(self.compute_dtype),
            "restarts": self.restarts,
            "matmul": self.matmul,
            "blocks": self.blocks,
        }
        if self.threads:  # only when chosen: plans without it print as before
            chose["threads"] = self.threads
        return Decision(
            ChooseAlgorithm.name,
            chose,
            label=self.label(),
            predicted_s=self.predicted_s,
            alternatives=self.alternatives,
            why=self.why,
        )


def decide(
    m: int, n: int, batch: int, coefficients: list[tuple[float, float, float]], eager_dtype: torch.dtype,
    precision: str, target: Target,
) -> Plan:
    """The cheapest algorithm for this shape at the chosen precision."""
    if precision == "auto":
        compute = eager_dtype if target.fast(eager_dtype) else torch.float32
        name = dtypes.name(eager_dtype)
        why = "eager's precision" if compute == eager_dtype else f"no fast {name} GEMM here"
    else:
        compute = dtypes.dtype(precision)
        why = f"precision={precision!r}"
    matmul = "native" if compute in (torch.float32, torch.float64) or target.fast(compute) else "emulate"
    rate = target.throughput(compute if matmul == "native" else torch.float32) * 1e9
    half = compute in (torch.float16, torch.bfloat16)
    restarts = (2,) if half and len(coefficients) > 3 else ()
    # Symmetric products on blocks (aten lowering): only where the target declares
    # them faster (the nominal CPU tables; never the measured CPU: they round unlike
    # eager's dense products) and blocks keep >= 64 rows.
    blocks = SYMMETRIC_BLOCKS if target.symmetric_speedup > 1.1 and min(m, n) >= 64 * SYMMETRIC_BLOCKS else 0
    standard = batch * flops(m, n, coefficients, "standard", blocks=blocks) / rate
    gram = batch * flops(m, n, coefficients, "gram", restarts, blocks=blocks) / rate
    if half:
        # Measured: bf16 Gram NS exceeds eager's error budget (8x on a 1x5
        # input with AOL coefficients, 3.6x on 128x128) even with a restart;
        # until choose-precision has an error model, half precision stays standard.
        alternative = Alternative("gram", gram, why_not="not in half precision")
        return Plan("standard", (), compute, matmul, standard, (alternative,), blocks, why)
    if gram < standard and eager_dtype.itemsize >= compute.itemsize:
        # Measured (verify=, rank-2 grads): fp32 Gram NS is 12-40x the error of
        # an eager that itself computes in fp32, outside the 1.25x budget; it
        # is well inside it only where eager rounds coarser (bf16) than we do.
        alternative = Alternative("gram", gram, why_not="not at eager's own precision")
        return Plan("standard", (), compute, matmul, standard, (alternative,), blocks, why)
    if gram < standard:
        return Plan("gram", restarts, compute, matmul, gram, (Alternative("standard", standard),), blocks, why)
    return Plan("standard", (), compute, matmul, standard, (Alternative("gram", gram),), blocks, why)


def thread_twins(plan: Plan, m: int, n: int) -> list[Program]:
    """The rule's program and, where it may pay, the same program on one intra-op thread.

    One thread only for dense products up to MAX_ONE_THREAD_WORK (m²n): above it one
    thread never won here quiet (256×512: 1.7x slower, 768×3072: 2x), timing it cost up to
    ~0.2 s of compile per shape, and under load its win in isolation was a loss in the step.
    """
    program = Program(plan.compute_dtype, plan.matmul, plan.blocks, 0)
    if plan.blocks or torch.get_num_threads() < 2 or m * m * n > MAX_ONE_THREAD_WORK:
        return [program]
    return [program, Program(plan.compute_dtype, plan.matmul, plan.blocks, 1)]


def measured_plan(
    rule: Plan, m: int, n: int, batch: int, coefficients: list[tuple[float, float, float]],
    session: MeasureSession,
) -> Plan:
    """The rule's plan on the thread count measured fastest here, among those computing its bits.

    What the plan computes (algorithm, dtype, products) is the rule's (:func:`decide`); timing
    only picks how many intra-op threads run it, and only between thread counts that give the
    very same bits here (:func:`~hocompile.precision.measure_ns.same_bits`): a 64×256 fp32 X Xᵀ
    rounds differently on one thread than on two, and a busy machine must not change a plan's
    numbers. The twin must beat all threads by 3 %.
    """
    programs = thread_twins(rule, m, n)
    if len(programs) < 2:
        return rule
    base, twin = programs
    abc = next((t for t in coefficients if t[2] != 0.0), (*coefficients[0][:2], 1.0))
    differs = same_bits(base, twin, (batch, m, n), abc)
    if differs:
        alternative = Alternative(twin.label(), why_not=f"rounds differently here ({differs} unit)")
        return replace(rule, alternatives=rule.alternatives + (alternative,))
    candidates = [Candidate(rule.algorithm, rule.restarts, p) for p in programs]
    counts = {c: unit_counts(m, n, coefficients, c.algorithm, c.restarts) for c in candidates}
    measurement = session.measure(candidates, counts, (batch, m, n), coefficients)
    timings = measurement.timings
    timed = {c: estimate(timings[c.program], counts[c]) for c in candidates if timings[c.program].complete()}
    first, second = candidates
    if second in timed and (first not in timed or timed[second] < MARGIN * timed[first]):
        best, other = second, first  # a base dropped mid-timing was already far slower
    elif first in timed:
        best, other = first, second
    else:
        return rule
    how = "cached" if measurement.cached else f"{format_seconds(measurement.spent_s)} spent"
    why = (
        f"{rule.why}; threads measured here (bitwise alike): min of {measurement.runs()} runs, "
        f"spread {measurement.contenders_spread(candidates, counts):.0%} ({how})"
    ).lstrip("; ")
    label = other.program.label() + ("" if other.program.threads else " all threads")
    dropped = timings[other.program].dropped
    seen = Alternative(label, timed[other]) if other in timed else Alternative(label, why_not=dropped)
    alternatives = rule.alternatives + (seen,)
    return replace(rule, predicted_s=timed[best], alternatives=alternatives, why=why, threads=best.program.threads)


def _measured_shapes(gm: fx.GraphModule, target: Target, precision: str) -> set[tuple[int, int, int]]:
    """The (batch, m, n) of the NS ops that have a thread twin to time: they share the budget."""
    shapes = set()
    for node in gm.graph.nodes:
        if node.target is torch.ops.hocompile.newton_schulz.default:
            spec = NewtonSchulzSpec.from_node(node)
            batch, m, n = spec.wide_shape()
            rule = decide(m, n, batch, spec.coefficients, spec.compute_dtype, precision, target)
            if len(thread_twins(rule, m, n)) > 1:
                shapes.add((batch, m, n))
    return shapes


@dataclass(frozen=True)
class ChooseAlgorithm(Pass):
    name: ClassVar[str] = "choose-algorithm"
    target: Target = field(default_factory=lambda: Target("unset"))
    precision: str = "auto"
    # On a measured target (the CPU running this process): how candidates are
    # timed (tests inject a fake) and the time all groups may take together.
    timer: Timer | None = None
    measure_budget_s: float = BUDGET_S

    def __call__(self, gm: fx.GraphModule) -> PassResult:
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        session = None
        if self.target.measured:
            session = MeasureSession(self.target, self.timer or wall_timer, self.measure_budget_s)
            session.expected_groups = max(1, len(_measured_shapes(gm, self.target, self.precision)))
        decided: dict[str, int] = {}
        for node in gm.graph.nodes:
            if node.target is not torch.ops.hocompile.newton_schulz.default:
                continue
            spec = NewtonSchulzSpec.from_node(node)
            x = spec.x_node.meta["val"]
            rows, cols = int(x.shape[-2]), int(x.shape[-1])
            m, n = (cols, rows) if spec.transpose else (rows, cols)
            batch = int(x.shape[0]) if x.dim() == 3 else 1
            set_eager_dtype(node, spec.compute_dtype)  # choose-precision's default budget
            plan = decide(m, n, batch, spec.coefficients, spec.compute_dtype, self.precision, self.target)
            if session is not None:
                plan = measured_plan(plan, m, n, batch, spec.coefficients, session)
            # A uniform plan: it replaces any earlier per-iteration schedule.
            spec.replace(
                compute_dtype=plan.compute_dtype,
                algorithm=plan.algorithm,
                restarts=tuple(plan.restarts),
                matmul=plan.matmul,
                blocks=plan.blocks,
                schedule="",
            ).apply(node)
            record(node, plan.decision())
            key = f"{plan.algorithm}/{dtypes.name(plan.compute_dtype)}"
            decided[key] = decided.get(key, 0) + 1
        if not decided:
            return PassResult(gm, False, self.decline("no Newton–Schulz op to plan"))
        gm.recompile()
        summary = ", ".join(f"{k} ×{v}" for k, v in sorted(decided.items())) + f" on {self.target.describe()}"
        if session is not None and session.groups:
            summary += f"; {session.describe()}"
        return PassResult(gm, True, summary)
