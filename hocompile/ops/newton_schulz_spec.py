"""``hocompile::newton_schulz``'s named arguments (:class:`NewtonSchulzSpec`) and its registry entry.

The op takes 14 positional arguments. Passes, the printer, the verify
reference and the lowerings read and rewrite them through this one class, so
no code outside it indexes ``node.args`` by position:

    spec = NewtonSchulzSpec.from_node(node)
    if spec.transpose: ...
    spec.replace(algorithm="gram", restarts=(2,)).apply(node)

The field names, order, defaults and types are checked against the op's
registered ``torch.library`` schema when the family is registered (at
import), so the two cannot drift apart. Everything else downstream code asks
about the op (printed line, cost, batching, fp64 reference) is its
:class:`~hocompile.ir.registry.OpFamily` entry, :data:`NEWTON_SCHULZ`.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, fields
from typing import Any, ClassVar

import torch
import torch.fx as fx

from ..ir.registry import BatchRule, Cost, Input, OpFamily, OpSpec, Scalar, register, schema_mismatches
from ..ir.registry import check_schema as check_spec_schema
from . import newton_schulz as ops  # noqa: F401  (registers hocompile::newton_schulz)
from . import newton_schulz_math as ns


def newton_schulz_op() -> Any:
    """The ``hocompile::newton_schulz`` overload that graphs call."""
    return NewtonSchulzSpec.op()


@dataclass(frozen=True)
class NewtonSchulzSpec(OpSpec):
    """The arguments of one ``hocompile::newton_schulz`` call, by name (see :mod:`hocompile.ops.newton_schulz`)."""

    qualname: ClassVar[str] = "hocompile::newton_schulz"

    x: Input
    a: tuple[float, ...]
    b: tuple[float, ...]
    c: tuple[float, ...]
    eps: Scalar
    eps_mode: str
    transpose: bool
    compute_dtype: torch.dtype
    out_dtype: torch.dtype
    algorithm: str
    restarts: tuple[int, ...]
    matmul: str
    blocks: int = 0
    schedule: str = ""

    @property
    def x_node(self) -> fx.Node:
        """The input as a graph node (passes and lowerings work on graphs)."""
        return self.node_of("x")

    @property
    def coefficients(self) -> list[tuple[float, float, float]]:
        """(a, b, c) per iteration."""
        return list(zip(self.a, self.b, self.c))

    def wide_shape(self) -> tuple[int, int, int]:
        """(batch, m, n) of the matrix NS works on (m ≤ n after the transpose), from the input's meta."""
        x = self.x_node.meta["val"]
        rows, cols = int(x.shape[-2]), int(x.shape[-1])
        m, n = (cols, rows) if self.transpose else (rows, cols)
        return (int(x.shape[0]) if x.dim() == 3 else 1), m, n


def check_schema() -> None:
    """Fail fast if ``hocompile::newton_schulz``'s schema and the spec have drifted apart."""
    check_spec_schema(NewtonSchulzSpec)


# ------------------------------------------------------------------ the family


def _describe(spec: NewtonSchulzSpec, fmt: Callable[[Any], str]) -> list[str]:
    """(a, b, c) per iteration grouped into runs: ``(3.4445, -4.775, 2.0315)x5``."""
    runs: list[list[Any]] = []
    for triple in spec.coefficients:
        if runs and runs[-1][0] == triple:
            runs[-1][1] += 1
        else:
            runs.append([triple, 1])
    coeffs = " + ".join(
        f"({', '.join(repr(float(v)) for v in t)})" + (f"x{n}" if n > 1 else "") for t, n in runs
    )
    blocks, schedule, restarts = int(spec.blocks), str(spec.schedule), spec.restarts
    where = f"{spec.algorithm}" + (f" restart {list(restarts)}" if restarts else "")
    where += f" sym{blocks}x{blocks}" if blocks > 1 else ""
    where += f" schedule {schedule}" if schedule else ""
    return [
        fmt(spec.x),
        f"[{coeffs}]",
        f"eps={fmt(spec.eps)} {spec.eps_mode}",
        "transpose" if spec.transpose else "wide",
        f"{fmt(spec.compute_dtype)}->{fmt(spec.out_dtype)}",
        where,
        spec.matmul,
    ]


def _cost(spec: NewtonSchulzSpec) -> Cost:
    batch, m, n = spec.wide_shape()
    matmul = batch * ns.flops(m, n, spec.coefficients, spec.algorithm, spec.restarts, blocks=spec.blocks)
    x = spec.x_node.meta["val"]
    moved = x.numel() * (x.element_size() + spec.out_dtype.itemsize)
    return Cost(flops=float(matmul), bytes=float(moved), matmul_flops=float(matmul))


def _reference(spec: NewtonSchulzSpec) -> torch.Tensor:
    """The op's polynomial in fp64, no intermediate rounding, with the spec's algorithm and restarts."""
    assert isinstance(spec.x, torch.Tensor)
    return ns.newton_schulz(
        spec.x.double(), spec.coefficients, float(spec.eps), eps_mode=spec.eps_mode,  # type: ignore[arg-type]
        transpose=spec.transpose, compute_dtype=torch.float64, out_dtype=torch.float64,
        algorithm=spec.algorithm, restarts=spec.restarts, matmul="native", blocks=spec.blocks,
    )


def _batch_key(spec: NewtonSchulzSpec) -> Hashable | None:
    """Calls batch when they agree on everything but their input (tall ones as their transpose)."""
    x = spec.x_node.meta["val"]
    if x.dim() != 2:
        return None  # already batched
    _, m, n = spec.wide_shape()
    options = tuple(getattr(spec, f.name) for f in fields(spec) if f.name not in ("x", "transpose"))
    return ((m, n), x.dtype, *options)


def _stack_bytes(spec: NewtonSchulzSpec) -> int:
    x = spec.x_node.meta["val"]
    return int(x.numel() * x.element_size() * 2)  # stacked input + output


NEWTON_SCHULZ = register(
    OpFamily(
        spec=NewtonSchulzSpec,
        title="Newton–Schulz orthogonalisation",
        reference=_reference,
        describe=_describe,
        cost=_cost,
        batch=BatchRule(
            key=_batch_key,
            batched=lambda spec, stacked: spec.replace(x=stacked["x"], transpose=False),
            transposed=lambda spec: bool(spec.transpose),
            stack_bytes=_stack_bytes,
        ),
    )
)

__all__ = ["NEWTON_SCHULZ", "NewtonSchulzSpec", "check_schema", "newton_schulz_op", "schema_mismatches"]
