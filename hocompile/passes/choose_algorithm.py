"""choose-algorithm: per Newton–Schulz op, the algorithm, compute precision and symmetric products.

On the CPU running the step (``Target.measured``) the plan is chosen by
**measurement** (:func:`measured_plan`, passes/measure_ns.py): the
candidates within the error budget (:func:`measured_candidates`) — eager's
own program, standard vs Gram NS, eager's dtype vs fp32, dense vs symmetric
products on row blocks — are timed for one iteration on the real shape, and
the fastest is kept only if it beats eager's program by 3 %. Any other
target (``"sm100"``, ``"cpu-avx2"``: a machine this process cannot time),
and NS ops too small for measuring to pay (under 2 ms predicted), are
planned by the FLOP-rate model (:func:`decide`) from the target's GEMM
rates. Either way the pass writes the answer into the op's arguments and
records a :class:`~hocompile.decisions.Decision` (its ``chose``: algorithm,
compute, restarts, matmul, blocks; its alternatives: every other candidate
with its measured or predicted time, or why it was refused or dropped).

Before::

    t2 = hocompile.newton_schulz(t1, ..., bf16, bf16, 'standard', [], 'native')

After (768×3072 on a CPU with bf16 units, measured)::

    t2 = hocompile.newton_schulz(t1, ..., bf16->bf16, standard sym4x4, native)
        # choose-algorithm: standard bf16 with symmetric products on 4 row blocks, 176 ms predicted
        #   (vs standard bf16 (eager's program) 201 ms | standard bf16 sym2 184 ms | fp32, dropped ... |
        #   gram bf16, error model: bf16 Gram 1.29x eager's error on heavy_tailed 128x512), measured here ...

Precision policy ``"auto"``: eager's compute dtype, or fp32 (more accurate
than a half-precision eager, and faster where the half GEMM is slow: bf16
on an AVX2 CPU runs ~100× slower than fp32). An explicit ``"bf16"`` /
``"fp16"`` keeps that rounding, natively or emulated on fp32 units. Gram NS
in half precision only where the calibrated error model admits it for the
coefficient set and aspect ratio (precision/gram_half.py); in fp32/fp64 only
where eager rounds coarser than the plan computes: against an fp32 eager,
fp32 Gram NS measured 12-40x eager's error on rank-deficient gradients.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.fx as fx

from .. import dtypes
from ..decisions import Alternative, Choice, Decision, format_seconds, record, set_eager_dtype
from ..newton_schulz import flops
from ..ops_schema import NewtonSchulzSpec
from ..precision.calibrate import restarts_for
from ..precision.gram_half import half_gram_verdict
from ..targets import Target
from .base import Pass, PassResult
from .measure_ns import (
    BUDGET_S,
    MARGIN,
    MIN_BLOCK_ROWS,
    MIN_MEASURED_S,
    Candidate,
    MeasureSession,
    Program,
    Timer,
    estimate,
    unit_counts,
    wall_timer,
)

PRECISIONS = ("auto", "fp32", "bf16", "fp16", "fp64")
MAX_ONE_THREAD_WORK = 256 * 256 * 1024  # m²n of the largest NS that is also timed on one thread
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
    # Symmetric products on blocks (aten lowering): only where the target
    # measured them faster and blocks keep >= 64 rows (below that the extra
    # calls cost more than the FLOPs saved).
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


_HALF = (torch.float16, torch.bfloat16)


def measured_candidates(
    m: int, n: int, coefficients: list[tuple[float, float, float]], eager_dtype: torch.dtype, precision: str
) -> tuple[list[Candidate], list[Alternative]]:
    """The candidates within the error budget, and those refused (as alternatives saying why).

    ``"auto"``: eager's dtype (its dense standard NS is eager's own program)
    and, for a half-precision eager, fp32 (more accurate, and faster where
    the half GEMM is slow); an explicit precision: that dtype (half: native
    and emulated). Each dense and on symmetric row blocks.
    """
    if precision == "auto":
        computes = [(eager_dtype, "native")] + ([(torch.float32, "native")] if eager_dtype in _HALF else [])
    elif precision in ("bf16", "fp16"):
        computes = [(dtypes.dtype(precision), "native"), (dtypes.dtype(precision), "emulate")]
    else:
        computes = [(dtypes.dtype(precision), "native")]
    # Dense, and the most row blocks of (4, 2) that keep MIN_BLOCK_ROWS rows: measured here,
    # 2 blocks never beat 4 where both were possible (768 rows: 184 vs 176 ms per NS), and
    # each program timed costs compile time.
    blockings = (0,) + next(((k,) for k in (4, 2) if m // k >= MIN_BLOCK_ROWS), ())
    restarts = restarts_for("gram", len(coefficients))
    saves = flops(m, n, coefficients, "gram", restarts) < flops(m, n, coefficients, "standard")
    found: list[Candidate] = []
    refused: dict[str, Alternative] = {}
    # One thread as well as all of them, dense programs only (row blocks are for large
    # matrices, where every core pays) and up to MAX_ONE_THREAD_WORK: Program.threads says
    # why. Above it one thread never won here (768×3072: 2x slower) and timing it cost
    # ~0.2 s of compile per shape.
    small = m * m * n <= MAX_ONE_THREAD_WORK
    threadings = (0, 1) if torch.get_num_threads() > 1 and small else (0,)
    programs = [
        Program(compute, matmul, blocks, threads)
        for compute, matmul in computes
        for blocks in blockings
        for threads in threadings
        if not (threads and blocks)
    ]
    for program in programs:
        compute, matmul, blocks = program.compute, program.matmul, program.blocks
        native = compute == eager_dtype and matmul == "native"
        eager = precision == "auto" and native and not blocks and not program.threads
        found.append(Candidate("standard", (), program, eager))
        name = f"gram {dtypes.name(compute)}"
        if not saves:
            refused.setdefault(name, Alternative(name, why_not=f"no FLOPs saved at {m}x{n}"))
        elif compute in _HALF:
            verdict = half_gram_verdict(coefficients, m, n, compute)
            if compute != eager_dtype or not verdict.allowed:
                why = verdict.why if not verdict.allowed else "eager's budget is its own dtype"
                refused.setdefault(name, Alternative(name, why_not=f"error model: {why}"))
            else:
                found.append(Candidate("gram", verdict.restarts, program))
        elif eager_dtype.itemsize >= compute.itemsize:
            # Measured (verify=, rank-2 grads): fp32 Gram NS is 12-40x the error of an
            # eager that itself computes in fp32; it is within budget against a bf16 eager.
            refused.setdefault(name, Alternative(name, why_not="not at eager's own precision"))
        else:
            found.append(Candidate("gram", restarts, program))
    return found, list(refused.values())


def measured_plan(
    m: int, n: int, batch: int, coefficients: list[tuple[float, float, float]], eager_dtype: torch.dtype,
    precision: str, session: MeasureSession,
) -> Plan | None:
    """The candidate measured fastest here (eager's program unless another beats it by 3 %); None
    if nothing could be timed."""
    candidates, refused = measured_candidates(m, n, coefficients, eager_dtype, precision)
    counts = {c: unit_counts(m, n, coefficients, c.algorithm, c.restarts) for c in candidates}
    measurement = session.measure(candidates, counts, (batch, m, n), coefficients)
    timings = measurement.timings
    timed = {c: estimate(timings[c.program], counts[c]) for c in candidates if timings[c.program].complete()}
    if not timed:
        return None
    best = min(timed, key=lambda c: (timed[c], c.program.blocks, c.algorithm))
    eager = next((c for c in candidates if c.eager), None)
    if eager is not None and eager in timed and timed[best] > MARGIN * timed[eager]:
        best = eager  # within noise of eager's own program: keep it
    alternatives = [Alternative(c.label(), timed[c]) for c in candidates if c != best and c in timed]
    # A program dropped before its timings were complete: one line for all its candidates.
    dropped = dict.fromkeys(c.program for c in candidates if c not in timed)
    alternatives += [Alternative(p.label(), why_not=timings[p].dropped) for p in dropped]
    how = "cached" if measurement.cached else f"{format_seconds(measurement.spent_s)} spent"
    why = (
        ("eager's own program, nothing measured 3% faster; " if best.eager else "")
        + f"measured here: one iteration per program, min of {measurement.runs()} runs, "
        f"spread {measurement.contenders_spread(candidates, counts):.0%} ({how})"
    )
    program = best.program
    return Plan(
        best.algorithm, best.restarts, program.compute, program.matmul, timed[best],
        tuple(alternatives + refused), program.blocks, why, program.threads,
    )


def _measured_shapes(gm: fx.GraphModule, target: Target, precision: str) -> set[tuple[int, int, int]]:
    """The (batch, m, n) of the NS ops big enough to be timed: they share the measuring budget."""
    shapes = set()
    for node in gm.graph.nodes:
        if node.target is torch.ops.hocompile.newton_schulz.default:
            spec = NewtonSchulzSpec.from_node(node)
            batch, m, n = spec.wide_shape()
            model = decide(m, n, batch, spec.coefficients, spec.compute_dtype, precision, target)
            if model.predicted_s >= MIN_MEASURED_S:
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
            if session is not None and plan.predicted_s >= MIN_MEASURED_S:
                # Big enough for the choice to matter: time the candidates here.
                timed = measured_plan(m, n, batch, spec.coefficients, spec.compute_dtype, self.precision, session)
                plan = timed or plan
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
