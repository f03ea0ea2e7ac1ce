"""The two modes the judgement (judgement.py) runs eager under: another summation order, and the
candidate's decompositions.

- :class:`Rounding` moves the result of every summing op (GEMMs, sums, norms) by up to a couple
  of units in the last place, seeded: what another kernel or BLAS does to a step. Eager run under
  a few seeds shows how far the step itself moves when only rounding changes: its own spread.
- :class:`Boundaries` records the ``eigh``/``qr``/``svd`` calls a step makes (main-thread
  ``torch.linalg`` calls and their aten overloads), or hands the recorded outputs to the same
  calls in another run, matched by input. The ill-conditioned outputs of those decompositions
  (the basis of a degenerate eigenspace, signs) are where a step's spread comes from; with them
  substituted, what follows is usually well-conditioned and a wrong sign, scale or term shows.
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

PROBE_ULPS = 2.0  # each summing op's result moves by up to this many units in the last place
MATCH_TOLERANCE = 1e-3  # relative distance at which a decomposition's input is "the same call"

# Ops whose result depends on the order of a sum: what another kernel or BLAS changes.
_SUMMING = {
    aten.mm, aten.bmm, aten.addmm, aten.addmm_, aten.baddbmm, aten.baddbmm_, aten.addbmm, aten.addbmm_,
    aten.mv, aten.addmv, aten.addmv_, aten.dot, aten.vdot, aten.sum, aten.mean, aten.linalg_vector_norm,
    aten.norm, aten._foreach_norm, aten.var, aten.std, aten.var_mean, aten.std_mean, aten.cumsum,
}


_STANCE_LOCK = threading.Lock()
_STANCE_HOLDERS = 0  # blocks inside force_eager(), in every thread
_STANCE_SET: Any = None  # the set_stance object of the first of them, which restores the stance before


@contextmanager
def force_eager() -> Iterator[None]:
    """Dynamo's ``force_eager`` stance while the block runs, and only then.

    ``torch.compiler.set_stance(...)`` sets the stance when it is *constructed*, not when entered:
    one built into a list of modes that is never entered (an error while copying the params)
    left every later ``torch.compile`` in the process running eagerly, silently. The stance is
    one per process, and threads check at once (ranks as threads): each ``set_stance`` restores
    the stance it found, so the block that left last could restore another's ``force_eager`` for
    good (seen in tests/test_dist_ddp.py). So the first block in sets it and the last one out
    puts back what the first found.
    """
    global _STANCE_HOLDERS, _STANCE_SET
    with _STANCE_LOCK:
        if _STANCE_HOLDERS == 0:
            _STANCE_SET = torch.compiler.set_stance("force_eager")
        _STANCE_HOLDERS += 1
    try:
        yield
    finally:
        with _STANCE_LOCK:
            _STANCE_HOLDERS -= 1
            if _STANCE_HOLDERS == 0:
                _STANCE_SET.__exit__(None, None, None)
                _STANCE_SET = None


# ------------------------------------------------------------------ probes


class Rounding(TorchDispatchMode):
    """Every summing op's floating result moved by up to ``ulps`` units in the last place (seeded).

    The noise is relative to ``|x| + mean|x|``: a sum that cancels is off by
    its terms' rounding, not its own, so small entries move as large ones do.
    """

    def __init__(self, seed: int, ulps: float = PROBE_ULPS) -> None:
        super().__init__()
        self.seed, self.ulps = seed, ulps
        self._pools: dict[torch.device, tuple[torch.Tensor, int]] = {}  # uniform noise, and where to read next

    def _uniform(self, n: int, device: torch.device) -> torch.Tensor:
        """``n`` values uniform in [-1, 1), read from a seeded pool at a moving offset: drawing a fresh
        tensor per op cost as much as the op itself on the large GEMMs of a step."""
        pool, offset = self._pools.get(device, (None, 0))
        if pool is None or pool.numel() < 2 * n + 1:
            gen = torch.Generator(device=device).manual_seed(self.seed)
            pool = torch.rand(max(2 * n + 1, 1 << 16), generator=gen, device=device, dtype=torch.float32) * 2 - 1
            offset = 0
        start = offset % (pool.numel() - n + 1)
        self._pools[device] = (pool, offset + 7919 * 31 + n)  # another window for the next op
        return pool[start : start + n]

    def _noise(self, x: torch.Tensor) -> torch.Tensor:
        mag = x.detach().float().abs()
        unit = float(torch.finfo(x.dtype).eps) / 2
        noise = mag.add_(mag.mean()).mul_(self._uniform(x.numel(), x.device).view(x.shape))
        return noise.mul_(unit * self.ulps).to(x.dtype)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket not in _SUMMING:
            return out
        with torch.no_grad():
            for leaf in pytree.tree_leaves(out):
                if isinstance(leaf, torch.Tensor) and leaf.is_floating_point() and leaf.numel():
                    leaf.add_(self._noise(leaf))
        return out


# ------------------------------------------------------------------ boundaries


def _decompositions() -> dict[Any, str]:
    """Callables whose outputs are ill-conditioned (bases of degenerate spaces, signs), by kind."""
    return {
        torch.linalg.eigh: "eigh", aten._linalg_eigh.default: "eigh",
        torch.linalg.qr: "qr", aten.linalg_qr.default: "qr",
        torch.linalg.svd: "svd", aten._linalg_svd.default: "svd", torch.svd: "svd-v",
    }


# Set while a reference (eager) run of hocompile's own checks is under way. A recorder around a whole
# compiled step must hear only the candidate's decompositions: the self-check's eager reference, run
# inside that step, made the same calls on eager's inputs, and matched at distance 0 they handed eager
# its own outputs back (SOAP under OPENBLAS_CORETYPE=Haswell: 0.81 of an update judged against 0).
_REFERENCE_RUN: contextvars.ContextVar[bool] = contextvars.ContextVar("hocompile_reference_run", default=False)


@contextmanager
def reference_run() -> Iterator[None]:
    """Decompositions made inside are eager's, not a candidate's: no :class:`Boundaries` records them."""
    token = _REFERENCE_RUN.set(True)
    try:
        yield
    finally:
        _REFERENCE_RUN.reset(token)


@dataclass
class _Call:
    kind: str
    options: str
    inputs: torch.Tensor  # [B, m, n]: one entry per matrix of the call
    outputs: list[torch.Tensor]  # each [B, ...]


@dataclass
class Boundaries(TorchFunctionMode):
    """Records the decompositions a step makes, or hands out recorded outputs (``substitute``).

    Matching is by kind, options and the nearest input (relative Frobenius
    distance ≤ ``MATCH_TOLERANCE``), matrix by matrix, so a stacked call in
    the candidate answers a loop of calls in eager and the other way round.
    """

    recorded: list[_Call] = field(default_factory=list)
    substitute: bool = False
    matched: int = 0
    unmatched: list[str] = field(default_factory=list)
    worst_input: float = 0.0  # largest relative input distance of a substituted match

    def __post_init__(self) -> None:
        super().__init__()
        self._kinds = _decompositions()

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        kind = self._kinds.get(func)
        out = func(*args, **kwargs)
        if kind is None or not args or not isinstance(args[0], torch.Tensor) or _is_traced(args[0]):
            return out
        x: torch.Tensor = args[0]
        options = repr((args[1:], sorted(kwargs.items())))
        batch = x.shape[:-2]
        leaves, spec = pytree.tree_flatten(out)
        flat_in = x.detach().reshape(-1, *x.shape[-2:])
        flat_out = [leaf.detach().reshape(-1, *leaf.shape[len(batch):]) for leaf in leaves]
        if not self.substitute:
            if _REFERENCE_RUN.get():
                return out
            self.recorded.append(_Call(kind, options, flat_in.clone(), [o.clone() for o in flat_out]))
            return out
        chosen = [self._find(kind, options, flat_in[b]) for b in range(flat_in.shape[0])]
        if any(c is None for c in chosen):
            self.unmatched.append(f"{kind} of {tuple(x.shape)}")
            return out
        self.matched += len(chosen)
        # Into tensors laid out as eager's own outputs: LAPACK's eigenvectors are column-major, and a
        # row-major copy of the same values sent the next matmul down another BLAS path that rounds
        # differently (a 1e-6 "difference" of eager from itself, on an AMD EPYC).
        new = [
            torch.empty_like(leaf).copy_(
                torch.stack([call.outputs[j][k] for call, k in chosen]).reshape(leaf.shape)  # type: ignore[misc]
            )
            for j, leaf in enumerate(leaves)
        ]
        return pytree.tree_unflatten(new, spec)

    def _find(self, kind: str, options: str, a: torch.Tensor) -> tuple[_Call, int] | None:
        best: tuple[float, _Call, int] | None = None
        scale = max(float(a.double().norm()), 1e-300)
        for call in self.recorded:
            if call.kind != kind or call.options != options or call.inputs.shape[1:] != a.shape:
                continue
            dist = (call.inputs.double() - a.double().to(call.inputs.device)).flatten(1).norm(dim=1) / scale
            k = int(dist.argmin())
            if best is None or float(dist[k]) < best[0]:
                best = (float(dist[k]), call, k)
        if best is None or best[0] > MATCH_TOLERANCE:
            return None
        self.worst_input = max(self.worst_input, best[0])
        return best[1], best[2]


def _is_traced(x: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(x) or type(x) is not torch.Tensor and not isinstance(x, torch.nn.Parameter)
