"""choose-algorithm: per Newton–Schulz op, the algorithm and compute precision.

A pure decision (:func:`decide`) from the shape, the coefficients, the
precision eager asked for and the target's measured GEMM throughput; the pass
writes the answer into the op's arguments and ``node.meta`` (shown by
print_graph and explain()).

Before::

    t2 = hocompile.newton_schulz(t1, ..., bf16, bf16, 'standard', [], 'native')

After (768×3072 on a CPU without a bf16 GEMM)::

    t2 = hocompile.newton_schulz(t1, ..., fp32, bf16, 'gram', [], 'native')
        # choose-algorithm: gram fp32, 20.1 ms predicted (vs standard 36.2 ms), no fast bf16 GEMM here

The answer is recorded as a :class:`~hocompile.decisions.Decision` (its
``chose``: algorithm, compute, restarts, matmul, blocks).

Precision policy ``"auto"``: keep eager's compute dtype where the target has
a fast GEMM for it; where it does not (bf16 on an AVX2 CPU runs ~100× slower
than fp32), compute in fp32 — faster there and strictly more accurate than
eager. An explicit ``"bf16"``/``"fp16"`` keeps that rounding, on the native
GEMM if it is fast, else emulated on fp32 units with the same roundings.
Gram NS is used where the cost model predicts a gain, in fp32/fp64 only: in
bf16 it measured outside eager's error budget even with a restart, so half
precision stays standard until choose-precision brings an error model. And
only where eager rounds coarser than the plan computes (a bf16 eager, an fp32
plan): against an fp32 eager, fp32 Gram NS measured 12-40x eager's error on
rank-deficient gradients.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.fx as fx

from .. import dtypes
from ..decisions import Alternative, Choice, Decision, record, set_eager_dtype
from ..newton_schulz import flops
from ..ops_schema import NewtonSchulzSpec
from ..targets import Target
from .base import Pass, PassResult

PRECISIONS = ("auto", "fp32", "bf16", "fp16", "fp64")
SYMMETRIC_BLOCKS = 4  # 4x4: 1.47x on 768x3072 X Xᵀ here, 2x2 only 1.33x (newton_schulz.py)


@dataclass(frozen=True)
class Plan:
    algorithm: str
    restarts: tuple[int, ...]
    compute_dtype: torch.dtype
    matmul: str
    predicted_s: float
    alternative: Alternative
    blocks: int = 0
    why: str = ""  # why this compute precision

    def label(self) -> str:
        return (
            f"{self.algorithm} {dtypes.name(self.compute_dtype)}"
            f"{' restart ' + str(list(self.restarts)) if self.restarts else ''}"
            f"{' (emulated)' if self.matmul == 'emulate' else ''}"
            f"{f' with symmetric products on {self.blocks}x{self.blocks} blocks' if self.blocks else ''}"
        )

    def decision(self) -> Decision:
        chose: dict[str, Choice] = {
            "algorithm": self.algorithm,
            "compute": dtypes.name(self.compute_dtype),
            "restarts": self.restarts,
            "matmul": self.matmul,
            "blocks": self.blocks,
        }
        return Decision(
            ChooseAlgorithm.name,
            chose,
            label=self.label(),
            predicted_s=self.predicted_s,
            alternatives=(self.alternative,),
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
        return Plan("standard", (), compute, matmul, standard, alternative, blocks, why)
    if gram < standard and eager_dtype.itemsize >= compute.itemsize:
        # Measured (verify=, rank-2 grads): fp32 Gram NS is 12-40x the error of
        # an eager that itself computes in fp32, outside the 1.25x budget; it
        # is well inside it only where eager rounds coarser (bf16) than we do.
        alternative = Alternative("gram", gram, why_not="not at eager's own precision")
        return Plan("standard", (), compute, matmul, standard, alternative, blocks, why)
    if gram < standard:
        return Plan("gram", restarts, compute, matmul, gram, Alternative("standard", standard), blocks, why)
    return Plan("standard", (), compute, matmul, standard, Alternative("gram", gram), blocks, why)


@dataclass(frozen=True)
class ChooseAlgorithm(Pass):
    name: ClassVar[str] = "choose-algorithm"
    target: Target = field(default_factory=lambda: Target("unset"))
    precision: str = "auto"

    def __call__(self, gm: fx.GraphModule) -> PassResult:
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
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
        return PassResult(gm, True, summary)
