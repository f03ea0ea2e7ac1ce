"""Newton–Schulz plans chosen by timing them on the CPU that runs the step.

A FLOP-rate model mispredicts CPUs: on one with AVX-512-bf16 units it chose
symmetric products on 4×4 blocks because they were 1.2× faster *in fp32*,
and in bf16 their copies made the step slower than eager's (issue 13). So
on the machine at hand (``Target.measured``) choose-algorithm times the
candidates instead:

- a **program** is how the products run: compute dtype, native or emulated
  GEMM, dense or symmetric products on ``blocks`` row blocks. Its three
  **units** — ``X Xᵀ`` (m×n), ``b A + c A²`` (m×m, symmetric) and
  ``a X + B X`` — are one standard NS iteration; every product of Gram NS is
  one of them too (its m×m products are all symmetric), so both algorithms'
  whole-NS times follow from one iteration's timings and the unit counts
  (:func:`unit_counts`);
- a **candidate** is an algorithm on a program (standard, or Gram with the
  calibrated restarts where the error model admits it). Eager's own program
  (standard NS in eager's dtype, dense) is always one, so the chosen plan is
  never measured slower than eager's;
- timing: a warm-up, then up to :data:`ROUNDS` runs of each unit,
  interleaved across programs, min of the runs, within a budget. A program
  the target's calibrated rate predicts :data:`CAP_FACTOR`× slower than the
  best measured iteration is not run at all (eager's bf16 program on a CPU
  without bf16 units: ~100×, seconds per GEMM), and one whose partial time
  already exceeds :data:`DROP_FACTOR`× the best is dropped mid-round;
- the unit timings are cached per CPU (targets.cpu_id: model, flags, torch,
  threads) and shape in the cache directory, with their spread; an entry
  whose contenders spread more than :data:`SPREAD_LIMIT` (measured under
  load) is measured again at the next compile.

The timer is injectable (``Timer``): tests make each candidate slow in turn
without running anything.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

from ..ir import dtypes
from ..ops.newton_schulz_math import Arith, flops
from ..targets import Target

UNITS = ("xxt", "square", "apply")
MEASURE_VERSION = 1
BUDGET_S = 2.0  # all groups of one compile (GPT-2 small: 3 shapes, ~1 s measured here)
ROUNDS = 3  # timed runs per unit after the warm-up
DROP_FACTOR = 1.5  # partial time above this × the best candidate: stop timing that program
CAP_FACTOR = 4.0  # calibrated-rate prediction above this × the best: never run it
WARM_DROP_FACTOR = 2.0  # the warm-up's bar (first calls carry set-up costs: a looser one)
SPREAD_LIMIT = 0.25  # (median - min) / min of a contender's iteration: above, re-measure next time
MIN_SAMPLE_S = 1e-3  # a timed sample spans at least this long (repeated calls of a small unit)
MAX_REPS = 50
MARGIN = 0.97  # another plan must beat eager's program by 3 %: closer is noise
MIN_BLOCK_ROWS = 128  # row blocks thinner than this lose more to GEMM efficiency than they save
# Every NS shape is timed: the FLOP model predicts a 64×256 bf16 NS at ~25 us where it takes
# ~400 us here, and small matrices are where the thread count decides most (below); timing
# one costs a few ms once per CPU and shape (then it is cached).
MIN_MEASURED_S = 0.0

Timer = Callable[["Program", str, Callable[[], object]], float]


def wall_timer(program: Program, unit: str, run: Callable[[], object]) -> float:
    """Seconds of one ``run()`` (the default timer)."""
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


@dataclass(frozen=True)
class Program:
    compute: torch.dtype
    matmul: str = "native"  # "emulate": half-precision roundings on fp32 GEMMs
    blocks: int = 0
    # Intra-op threads while this NS runs; 0: all of torch's. On a 2-core CPU a 64×256 NS ran
    # 1.0-1.45x faster on one thread (3x with the other core busy): waking a second thread
    # costs more than it saves on small GEMMs. The GEMMs' results are the same either way
    # here (checked bitwise up to 768×2304); a BLAS that splits the reduction across threads
    # would round differently, within the plan's error budget.
    threads: int = 0

    def label(self) -> str:
        text = dtypes.name(self.compute) + (" emulated" if self.matmul == "emulate" else "")
        text += f" sym{self.blocks}" if self.blocks else ""
        return text + (f" {self.threads} thread{'s' if self.threads > 1 else ''}" if self.threads else "")


@contextlib.contextmanager
def intra_op_threads(threads: int) -> Iterator[None]:
    """torch's intra-op threads set to ``threads`` inside (0: unchanged); restored after."""
    previous = torch.get_num_threads()
    if not threads or threads == previous:
        yield
        return
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


@dataclass(frozen=True)
class Candidate:
    algorithm: str
    restarts: tuple[int, ...]
    program: Program
    eager: bool = False  # eager's own program

    def label(self) -> str:
        restart = f" restart {list(self.restarts)}" if self.restarts else ""
        return f"{self.algorithm} {self.program.label()}{restart}" + (" (eager's program)" if self.eager else "")


def unit_counts(
    m: int, n: int, coefficients: Sequence[tuple[float, float, float]], algorithm: str, restarts: Sequence[int]
) -> dict[str, int]:
    """How many of each unit one NS runs (m ≤ n): standard T×(X Xᵀ, A², B X); Gram from its FLOPs."""
    steps, quintic = len(coefficients), sum(1 for _, _, c in coefficients if c != 0.0)
    if algorithm == "standard":
        return {"xxt": steps, "square": quintic, "apply": steps}
    rebuilds = sum(1 for r in restarts if 0 < r < steps)
    wide = (rebuilds + 1) * 2 * m * m * n  # R = X Xᵀ per segment; Q X0 per segment
    cubes = (flops(m, n, coefficients, "gram", restarts) - 2 * wide) // (2 * m**3)
    return {"xxt": rebuilds + 1, "square": int(cubes), "apply": rebuilds + 1}


@dataclass
class ProgramTiming:
    samples: dict[str, list[float]] = field(default_factory=lambda: {u: [] for u in UNITS})
    dropped: str = ""
    warm: dict[str, float] = field(default_factory=dict)  # the warm-up run of each unit (not a sample)

    def best(self, unit: str) -> float | None:
        return min(self.samples[unit]) if self.samples[unit] else None

    def complete(self) -> bool:
        return not self.dropped and all(self.samples[u] for u in UNITS)

    def spread(self) -> float:
        """(median - min) / min of whole-iteration times over the rounds."""
        rounds = min(len(self.samples[u]) for u in UNITS)
        totals = [sum(self.samples[u][i] for u in UNITS) for i in range(rounds)]
        if not totals or min(totals) <= 0:
            return 0.0
        return (statistics.median(totals) - min(totals)) / min(totals)

    def to_json(self) -> dict[str, Any]:
        return {"samples": self.samples, "dropped": self.dropped}


def estimate(timing: ProgramTiming, counts: dict[str, int]) -> float:
    """Whole-NS seconds from the best unit times (unmeasured units count 0: a lower bound)."""
    return sum(counts[u] * (timing.best(u) or 0.0) for u in UNITS)


def _unit_programs(program: Program, batch: int, m: int, n: int, abc: tuple[float, float, float]) -> dict[str, Any]:
    """The three units on this program's tensors (values like a normalised NS iterate).

    No GEMM runs here: a program that is never timed (capped) costs nothing.
    """
    gen = torch.Generator().manual_seed(0)
    lead = (batch,) if batch > 1 else ()
    store = program.compute if program.matmul == "native" else torch.float32
    acc = torch.float64 if program.compute == torch.float64 else torch.float32
    arith = Arith(program.compute, program.matmul, acc, program.blocks)
    x = (torch.randn(*lead, m, n, generator=gen) / (m * n) ** 0.5).to(store)
    s = torch.randn(*lead, m, m, generator=gen) / m
    a_sym = (s + s.mT).to(store)
    a, b, c = abc
    units: dict[str, Callable[[], object]] = {
        "xxt": lambda: arith.sym(x, x.mT),
        "square": lambda: arith.sym_addmm(a_sym, a_sym, a_sym, beta=b, alpha=c),
        "apply": lambda: arith.addmm(x, a_sym, x, beta=a, alpha=1.0),
    }
    if not program.threads:
        return units

    def on_threads(unit: Callable[[], object]) -> Callable[[], object]:
        def run() -> object:
            with intra_op_threads(program.threads):
                return unit()

        return run

    return {name: on_threads(unit) for name, unit in units.items()}


def same_bits(a: Program, b: Program, shape: tuple[int, int, int], abc: tuple[float, float, float]) -> str:
    """The first unit where programs ``a`` and ``b`` compute different bits here; empty if none.

    Whether two GEMM programs round alike depends on the shape, the kernel and the thread split,
    not on the values (the BLAS's summation order is fixed by those), so one seeded input per unit
    stands for all. Measured here: a 64×256 fp32 X Xᵀ on one thread differs from two threads'.
    """
    batch, m, n = shape
    with _disable_current_modes(), torch.no_grad():  # real tensors, even under AOTAutograd's fake mode
        first, second = _unit_programs(a, batch, m, n, abc), _unit_programs(b, batch, m, n, abc)
        for unit in UNITS:
            x, y = first[unit](), second[unit]()
            if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and torch.equal(x, y)):
                return unit
    return ""


def model_unit_seconds(program: Program, m: int, n: int, batch: int, target: Target) -> dict[str, float]:
    """What the target's calibrated GEMM rate predicts for each unit (the cap's yardstick)."""
    rate = target.throughput(program.compute if program.matmul == "native" else torch.float32) * 1e9
    if program.threads:  # the calibrated rate is all threads'; it orders programs, nothing more
        rate *= min(1.0, program.threads / max(1, torch.get_num_threads()))
    share = (program.blocks + 1) / (2 * program.blocks) if program.blocks > 1 else 1.0
    return {
        "xxt": batch * 2 * m * m * n * share / rate,
        "square": batch * 2 * m**3 * share / rate,
        "apply": batch * 2 * m * m * n / rate,
    }


@dataclass
class GroupMeasurement:
    """The unit timings of every program for one shape, and how they were obtained."""

    timings: dict[Program, ProgramTiming]
    spent_s: float = 0.0
    cached: bool = False

    def runs(self) -> int:
        """Timed runs of the most-measured program."""
        return max((min(len(t.samples[u]) for u in UNITS) for t in self.timings.values()), default=0)

    def contenders_spread(self, candidates: Sequence[Candidate], counts: dict[Candidate, dict[str, int]]) -> float:
        complete = [c for c in candidates if self.timings[c.program].complete()]
        if not complete:
            return 0.0
        best = min(estimate(self.timings[c.program], counts[c]) for c in complete)
        close = {
            c.program for c in complete if estimate(self.timings[c.program], counts[c]) <= DROP_FACTOR * best
        }
        return max(self.timings[p].spread() for p in close)


def measure_programs(
    candidates: Sequence[Candidate],
    counts: dict[Candidate, dict[str, int]],
    shape: tuple[int, int, int],
    abc: tuple[float, float, float],
    target: Target,
    budget_s: float,
    timer: Timer,
) -> GroupMeasurement:
    """Time the candidates' programs, interleaved, dropping the hopeless ones early (module docstring)."""
    batch, m, n = shape
    programs = list(dict.fromkeys(c.program for c in candidates))
    model = {p: model_unit_seconds(p, m, n, batch, target) for p in programs}
    of_program = {p: [c for c in candidates if c.program == p] for p in programs}

    def model_best(p: Program) -> float:  # the calibrated rate's whole-NS prediction, best candidate
        return min(sum(counts[c][u] * model[p][u] for u in UNITS) for c in of_program[p])

    programs.sort(key=model_best)  # the likely winners first: they set the bar the others are dropped at
    timings = {p: ProgramTiming() for p in programs}
    built: dict[Program, dict[str, Any]] = {}

    reps: dict[tuple[Program, str], int] = {}

    def runner(p: Program, unit: str) -> Callable[[], object]:
        def run() -> object:  # tensors are made on first use: a fake timer never makes them
            if p not in built:
                built[p] = _unit_programs(p, batch, m, n, abc)
            result = None
            for _ in range(reps.get((p, unit), 1)):
                result = built[p][unit]()
            return result

        return run

    def timed(p: Program, unit: str) -> float:
        """Seconds of one run of ``unit``: averaged over enough calls to span MIN_SAMPLE_S."""
        return timer(p, unit, runner(p, unit)) / reps.get((p, unit), 1)

    spent = 0.0

    def best_estimate(timing_now: Program) -> float | None:
        """The bar ``timing_now`` is dropped at: other programs' best, never its own (a load spike
        during its own round must not drop it against its own warm-up and leave no plan)."""
        others = [c for c in candidates if c.program != timing_now]
        done = [estimate(timings[c.program], counts[c]) for c in others if timings[c.program].complete()]
        if done:
            return min(done)
        # During the warm-up round: the warmed-up programs' times (an over-estimate, so a cautious bar).
        warm = [
            sum(counts[c][u] * timings[c.program].warm[u] for u in UNITS)
            for c in others
            if not timings[c.program].dropped and len(timings[c.program].warm) == len(UNITS)
        ]
        return min(warm) if warm else None

    for round_ in range(ROUNDS + 1):  # round 0 warms up
        for p in programs:
            timing = timings[p]
            if timing.dropped:
                continue
            best = best_estimate(p)
            if round_ == 0 and best is not None and model_best(p) > CAP_FACTOR * best:
                ratio = model_best(p) / best
                timing.dropped = f"not run: this CPU's calibrated rate predicts {ratio:.0f}x the best"
                continue
            for unit in UNITS:
                seconds = timed(p, unit)
                spent += seconds * reps.get((p, unit), 1)
                if round_ > 0:
                    timing.samples[unit].append(seconds)
                else:
                    timing.warm[unit] = seconds
                    # A 64×64 product takes ~20 us: one call is at the mercy of a scheduler tick
                    # (measured: eager's program "117x the best" once). Small units are timed over
                    # several calls.
                    reps[(p, unit)] = max(1, min(MAX_REPS, int(MIN_SAMPLE_S / max(seconds, 1e-9))))
                if round_ == 0 and best is not None and seconds > CAP_FACTOR * best:
                    timing.dropped = f"dropped: one warm-up {unit} took {seconds / best:.1f}x the best whole NS"
                    break
                if best is None:
                    continue
                if round_ == 0:
                    lower = min(sum(counts[c][u] * timing.warm.get(u, 0.0) for u in UNITS) for c in of_program[p])
                    if lower > WARM_DROP_FACTOR * best:
                        timing.dropped = f"dropped in the warm-up: at least {lower / best:.1f}x the best"
                        break
                    continue
                lower = min(estimate(timing, counts[c]) for c in of_program[p])
                if lower > DROP_FACTOR * best:
                    timing.dropped = f"dropped after {round_} run(s): at least {lower / best:.1f}x the best"
                    break
        if round_ >= 1 and spent > budget_s:
            break
    return GroupMeasurement(timings, spent)


__all__ = [
    "BUDGET_S",
    "Candidate",
    "GroupMeasurement",
    "Program",
    "ProgramTiming",
    "Timer",
    "estimate",
    "intra_op_threads",
    "measure_programs",
    "same_bits",
    "unit_counts",
    "wall_timer",
]
