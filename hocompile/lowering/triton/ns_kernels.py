"""A whole Newton–Schulz as a fixed sequence of matmul-kernel launches.

:func:`emit_newton_schulz` writes the wrapper lines; the kernels come from
the generators of matmul_kernels.py (re-exported here). It follows
``newton_schulz._standard`` and ``newton_schulz._gram`` product by product,
with the same rounding points, so its result is the aten reference's
``matmul="emulate"`` result up to the summation order inside each product.

standard, per iteration (3 launches)::

    A = gram(X)                      # the first one also normalises: X0
    B = sym_poly(A; 0, b, c)         # b A + c A²
    X = gemm(B, X; C=X, beta=a)      # a X + B X; the last one writes ``out``

gram (Gram NS)::

    R = gram(X) normalising; Q = none
    each iteration: P = sym_poly(R; a, b, c); Q = P, or gemm_sym(P, Q)
      restart after it: X0 = gemm(Q, X0); R = gram(X0); Q = none
      else, unless last: R = gemm_sym(P, gemm_sym(P, R))
    out = gemm(Q, X0)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ...ir import dtypes
from .code import CodeWriter, KernelSource
from .matmul_kernels import GemmSpec, GramSpec, SymPolySpec, generate_gemm, generate_gram, generate_sym_poly
from .op_groups import Buffer

__all__ = [
    "GemmSpec",
    "GramSpec",
    "NSLaunches",
    "SymPolySpec",
    "emit_newton_schulz",
    "generate_gemm",
    "generate_gram",
    "generate_sym_poly",
]


@dataclass
class NSLaunches:
    """What an NS emitter wrote launch lines for: the kernels (each once), the buffers the lines
    use (the caller allocates them, once, before the lines run) and how many launches the lines make."""

    kernels: list[KernelSource]
    buffers: list[Buffer]
    launches: int


class Temporaries:
    """Temporaries of one NS, named where first needed and reused once dead.

    A launch reads its inputs while other programs write its output, so an
    output never shares a buffer with the launch's inputs (``busy``). Buffers
    are reused by shape and dtype (a scheduled NS stores each iteration's
    iterate in its own format). Nothing is allocated here: ``buffers`` lists
    them for the caller to allocate once per step (``buffers()`` of the
    generated module), so ``launch()`` allocates nothing.
    """

    def __init__(self, prefix: str, batch: int, dtype: torch.dtype) -> None:
        self.prefix, self.batch, self.dtype = prefix, batch, dtype
        self.shapes: dict[str, tuple[int, int, torch.dtype]] = {}
        self.buffers: list[Buffer] = []

    def take(self, rows: int, cols: int, dtype: torch.dtype | None = None, *, busy: Sequence[str | None]) -> str:
        dtype = dtype or self.dtype
        for name, shape in self.shapes.items():
            if shape == (rows, cols, dtype) and name not in busy:
                return name
        name = f"{self.prefix}buf{len(self.shapes)}"
        self.shapes[name] = (rows, cols, dtype)
        self.buffers.append(Buffer(name, (self.batch, rows, cols), dtype))
        return name

    def fixed(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> str:
        """A buffer never reused (an amax partials vector): ``prefix + name``."""
        self.buffers.append(Buffer(self.prefix + name, shape, dtype))
        return self.prefix + name


class KernelSet:
    """Generates each spec once and remembers the order of first use; counts the launches."""

    def __init__(self, origin: str) -> None:
        self.origin = origin
        self.used: dict[str, KernelSource] = {}
        self.launches = 0  # each launch line asks for its launcher once

    def gram(self, spec: GramSpec) -> str:
        return self._use(spec.name, lambda: generate_gram(spec, self.origin))

    def sym_poly(self, spec: SymPolySpec) -> str:
        return self._use(spec.name, lambda: generate_sym_poly(spec, self.origin))

    def gemm(self, spec: GemmSpec) -> str:
        return self._use(spec.name, lambda: generate_gemm(spec, self.origin))

    def _use(self, name: str, generate: Callable[[], KernelSource]) -> str:
        self.launches += 1
        if name not in self.used:
            self.used[name] = generate()
        return self.used[name].launcher


@dataclass(frozen=True)
class NSCall:
    """One Newton–Schulz call to emit: where its operands live in the generated code, its
    ``[batch, m, n]`` shape (wide: m <= n) and its plan. ``partials`` names the ``[batch, P]``
    fp32 partial sums of squares of ``x`` (the gram launcher reads their count from the tensor,
    so ``P``, its expression, is only written into a comment); ``eps`` is a 0-d fp32 device
    tensor expression, ``upcast`` the expression passed as launchers' upcast; temporaries are
    named ``prefix`` ``buf<i>``; ``origin`` names the node the kernels come from."""

    x: str
    partials: str
    P: str
    eps: str
    out: str
    upcast: str
    prefix: str
    batch: int
    m: int
    n: int
    coefficients: Sequence[tuple[float, float, float]]
    out_dtype: torch.dtype
    eps_mode: str
    algorithm: str
    arch: str
    origin: str


def emit_newton_schulz(w: CodeWriter, call: NSCall, dtype: torch.dtype, restarts: Sequence[int]) -> NSLaunches:
    """Write the launches of ``call`` on ``x`` (in ``dtype``) into ``out``: the kernels used (each
    once), the temporaries (for the caller to allocate) and the launch count."""
    x, partials, P, eps, out, upcast, prefix = (call.x, call.partials, call.P, call.eps, call.out, call.upcast,
                                                call.prefix)
    batch, m, n, coefficients, out_dtype = call.batch, call.m, call.n, call.coefficients, call.out_dtype
    eps_mode, algorithm, arch, origin = call.eps_mode, call.algorithm, call.arch, call.origin
    if m > n:
        raise ValueError(f"emit_newton_schulz takes the wide orientation (m <= n), got {m}x{n}")
    if algorithm not in ("standard", "gram"):
        raise ValueError(f"algorithm must be 'standard' or 'gram', got {algorithm!r}")
    if not coefficients:
        raise ValueError("Newton–Schulz needs at least one iteration")
    kernels = KernelSet(origin)
    temps = Temporaries(prefix, batch, dtype)
    w.line(
        f"# Newton-Schulz ({algorithm}, {len(coefficients)} iterations) on {x}: {batch} x {m}x{n}, "
        f"{dtypes.name(dtype)} -> {dtypes.name(out_dtype)}; partials {partials} [{batch}, {P}]"
    )
    norm = GramSpec(batch, m, n, dtype, arch, normalize=True, eps_mode=eps_mode)
    if algorithm == "standard":
        _standard(
            w,
            kernels,
            temps,
            norm,
            x=x,
            partials=partials,
            eps=eps,
            out=out,
            n=n,
            coefficients=coefficients,
            out_dtype=out_dtype,
            upcast=upcast,
        )
    else:
        _gram(
            w,
            kernels,
            temps,
            norm,
            x=x,
            partials=partials,
            eps=eps,
            out=out,
            n=n,
            coefficients=coefficients,
            out_dtype=out_dtype,
            restarts=restarts,
            upcast=upcast,
        )
    return NSLaunches(list(kernels.used.values()), temps.buffers, kernels.launches)


def _coefficient_comment(w: CodeWriter, k: int, a: float, b: float, c: float) -> None:
    w.line(f"# iteration {k + 1}: a={a!r}, b={b!r}, c={c!r}")


def _standard(
    w: CodeWriter,
    kernels: KernelSet,
    temps: Temporaries,
    norm: GramSpec,
    *,
    x: str,
    partials: str,
    eps: str,
    out: str,
    n: int,
    coefficients: Sequence[tuple[float, float, float]],
    out_dtype: torch.dtype,
    upcast: str,
) -> None:
    batch, m, dtype, arch = norm.batch, norm.m, norm.dtype, norm.arch
    X: str | None = None  # the current iterate; None until the first gram normalises x
    for k, (a, b, c) in enumerate(coefficients):
        a, b, c = float(a), float(b), float(c)
        _coefficient_comment(w, k, a, b, c)
        A = temps.take(m, m, busy=[X])
        if X is None:
            X = temps.take(m, n, busy=[A])
            w.line(f"{kernels.gram(norm)}({x}, {A}, upcast={upcast}, x0={X}, partials={partials}, eps={eps})")
        else:
            w.line(f"{kernels.gram(GramSpec(batch, m, n, dtype, arch))}({X}, {A}, upcast={upcast})")
        B = temps.take(m, m, busy=[A, X])
        poly = SymPolySpec(batch, m, dtype, arch, cubic=c == 0.0)
        w.line(f"{kernels.sym_poly(poly)}({A}, {B}, 0.0, {b!r}, {c!r}, upcast={upcast})")
        last = k == len(coefficients) - 1
        target = out if last else temps.take(m, n, busy=[B, X])
        gemm = GemmSpec(batch, m, n, m, dtype, arch, out_dtype=out_dtype if last else None, accumulate=True)
        w.line(f"{kernels.gemm(gemm)}({B}, {X}, {target}, 1.0, upcast={upcast}, C={X}, beta={a!r})")
        X = target


def _gram(
    w: CodeWriter,
    kernels: KernelSet,
    temps: Temporaries,
    norm: GramSpec,
    *,
    x: str,
    partials: str,
    eps: str,
    out: str,
    n: int,
    coefficients: Sequence[tuple[float, float, float]],
    out_dtype: torch.dtype,
    restarts: Sequence[int],
    upcast: str,
) -> None:
    batch, m, dtype, arch = norm.batch, norm.m, norm.dtype, norm.arch
    square = GemmSpec(batch, m, m, m, dtype, arch, symmetric=True)  # products of polynomials in R commute
    R = temps.take(m, m, busy=[])
    X0 = temps.take(m, n, busy=[R])
    w.line(f"{kernels.gram(norm)}({x}, {R}, upcast={upcast}, x0={X0}, partials={partials}, eps={eps})")
    Q: str | None = None
    for k, (a, b, c) in enumerate(coefficients):
        a, b, c = float(a), float(b), float(c)
        _coefficient_comment(w, k, a, b, c)
        P = temps.take(m, m, busy=[R, Q, X0])
        poly = SymPolySpec(batch, m, dtype, arch, cubic=c == 0.0)
        w.line(f"{kernels.sym_poly(poly)}({R}, {P}, {a!r}, {b!r}, {c!r}, upcast={upcast})")
        if Q is None:
            Q = P
        else:
            Q_next = temps.take(m, m, busy=[P, Q, R, X0])
            w.line(f"{kernels.gemm(square)}({P}, {Q}, {Q_next}, 1.0, upcast={upcast})")
            Q = Q_next
        last = k == len(coefficients) - 1
        if not last and (k + 1) in restarts:
            w.line("# restart: rebuild X from Q X0 and R from X, bounding the error growth of the Q product")
            X_next = temps.take(m, n, busy=[Q, X0])
            w.line(f"{kernels.gemm(GemmSpec(batch, m, n, m, dtype, arch))}({Q}, {X0}, {X_next}, 1.0, upcast={upcast})")
            X0 = X_next
            R = temps.take(m, m, busy=[X0])
            w.line(f"{kernels.gram(GramSpec(batch, m, n, dtype, arch))}({X0}, {R}, upcast={upcast})")
            Q = None
        elif not last:
            PR = temps.take(m, m, busy=[P, Q, R, X0])
            w.line(f"{kernels.gemm(square)}({P}, {R}, {PR}, 1.0, upcast={upcast})")
            R = temps.take(m, m, busy=[P, Q, PR, X0])
            w.line(f"{kernels.gemm(square)}({P}, {PR}, {R}, 1.0, upcast={upcast})")
    assert Q is not None  # the last iteration never restarts
    final = GemmSpec(batch, m, n, m, dtype, arch, out_dtype=out_dtype)
    w.line(f"{kernels.gemm(final)}({Q}, {X0}, {out}, 1.0, upcast={upcast})")
