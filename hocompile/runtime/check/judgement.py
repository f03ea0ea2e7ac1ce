"""One judgement for "is this compiled step right?": held against eager's own spread, not rounding luck.

A tolerance against eager judges nothing on a step that eager itself cannot
repeat: emerging-optimizers' SOAP moves its update by 0.97 of a step when the
factor handed to ``eigh`` moves by 1e-7 (16×24, eps 1e-3: rounding picks the
eigenbasis of the wider factor's null space), and at eps 1e-8 by 1.17× when the
gradients move by 1e-7. A compiled step that sums in another order (Triton's
dots, another BLAS kernel) lands anywhere in that spread. So the judgement asks
what eager does at *this* point, from the very same starting state:

- **Exact** tensors (where the plan keeps eager's arithmetic): bitwise, NaNs
  where eager has them. Nothing else is asked of them.
- **The others**: the candidate's distance from eager, ``‖c − e‖``, against
  eager's own spread: eager re-run ``probes`` times under :class:`Rounding`,
  which perturbs the result of every summing op (GEMMs, sums, norms) by a
  couple of units in the last place, as another summation order would. The
  bound is ``SPREAD_FACTOR · spread + FLOOR · ‖update‖ + 2u‖e‖``, so a
  well-conditioned step (spread ~1e-7 of the update) is held to rounding and
  an ill-conditioned one only as far as eager cannot tell itself apart.
- **Boundaries**: the ill-conditioned outputs of ``eigh``/``qr``/``svd`` are
  where the spread comes from, and what follows them is usually well
  conditioned. So the candidate's decompositions are recorded
  (:class:`Boundaries`, main-thread ``torch.linalg`` calls) and, when every
  decomposition eager makes finds a recorded one on a matching input, eager
  and its probes run with the candidate's outputs substituted. The spread
  then measures what follows the boundaries, and a wrong sign, scale or term
  there shows. All or nothing: one unmatched call and no output is
  substituted, since a half-substituted reference would be tighter than the
  step allows. Decompositions inside hocompile's fused linear-algebra ops run
  on worker threads and are not recorded yet: there the judgement falls back
  to eager's spread through the decompositions (looser, never wrong).

What it cannot do: catch an error smaller than eager's own spread. The
verdict reports that spread, so "passed at 0.9 of the update" reads as what it
is. References run op by op (``torch.compiler`` stance ``force_eager``), so
an optimizer's ``torch.compile``'d helpers are judged by their Python code.
Both modes live in judgement_modes.py.
"""

from __future__ import annotations

import copy
import math
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

from ...capture.trace import unwrapped_step
from .eager_copies import put_back
from .judgement_modes import Boundaries, Rounding, force_eager

SPREAD_FACTOR = 4.0  # the candidate may sit this far beyond the farthest probe
FLOOR = 1e-5  # ‖update‖ share always allowed: fp32 rounding of an update computed another way
PROBES = 3


# ------------------------------------------------------------------ the verdict


@dataclass(frozen=True)
class TensorVerdict:
    """One tensor: ``error`` and ``spread`` as shares of its update (‖e − t0‖, or ‖e‖ where that is 0)."""

    name: str
    exact: bool
    error: float
    spread: float
    bound: float
    problem: str = ""


@dataclass(frozen=True)
class Verdict:
    """The judgement of one step: per tensor, and whether eager ran with the candidate's boundaries."""

    tensors: tuple[TensorVerdict, ...]
    substituted: int  # decomposition outputs (per matrix) eager ran with from the candidate
    unmatched: tuple[str, ...]  # eager's decompositions no recorded one matched (then none substituted)
    probes: int

    @property
    def passed(self) -> bool:
        return not any(t.problem for t in self.tensors)

    @property
    def failures(self) -> tuple[TensorVerdict, ...]:
        return tuple(t for t in self.tensors if t.problem)

    @property
    def worst(self) -> TensorVerdict | None:
        """The tensor closest to (or furthest past) its bound."""
        judged = [t for t in self.tensors if not t.exact]
        if not judged:
            return None
        return max(judged, key=lambda t: t.error / t.bound if t.bound > 0 else math.inf * (t.error > 0))

    def describe(self) -> str:
        exact = sum(t.exact for t in self.tensors)
        head = f"{'passed' if self.passed else 'FAILED'}: {exact} tensor(s) bitwise"
        worst = self.worst
        if worst is not None:
            head += (
                f", {len(self.tensors) - exact} against eager's spread (worst {worst.name}: "
                f"{worst.error:.2g} of its update, eager's spread {worst.spread:.2g}, bound {worst.bound:.2g})"
            )
        if self.substituted:
            head += f"; eager ran with the step's {self.substituted} decomposition output(s)"
        elif self.unmatched:
            head += f"; decompositions not substituted ({self.unmatched[0]} unmatched)"
        return "\n".join([head] + [f"  {t.name}: {t.problem}" for t in self.failures])


def judge(
    candidate: dict[str, torch.Tensor],
    reference: dict[str, torch.Tensor],
    probes: list[dict[str, torch.Tensor]],
    before: dict[str, torch.Tensor],
    exact: Callable[[str], bool] = lambda name: False,
) -> list[TensorVerdict]:
    """Per tensor: ``candidate`` against ``reference`` and the spread of ``probes`` around it."""
    out: list[TensorVerdict] = []
    for name, want in reference.items():
        got = candidate.get(name)
        if got is None or got.shape != want.shape or got.dtype != want.dtype:
            what = "missing" if got is None else f"{got.dtype} {tuple(got.shape)}"
            out.append(TensorVerdict(name, False, math.inf, 0.0, 0.0, f"is {what}, eager's {want.dtype} "
                                     f"{tuple(want.shape)}"))
            continue
        if exact(name) or not want.is_floating_point():
            same = torch.equal(got, want) or bool(((got == want) | (got.isnan() & want.isnan())).all())
            out.append(TensorVerdict(name, True, 0.0 if same else math.inf, 0.0, 0.0,
                                     "" if same else "differs where eager's arithmetic is kept (bound: bitwise)"))
            continue
        out.append(judge_tensor(name, got, want, [p[name] for p in probes], before.get(name)))
    return out


def nonfinite_difference(got: torch.Tensor, want: torch.Tensor) -> str:
    """Which side is non-finite, and how much of it: the first thing to know when reading such a report."""
    bad_got, bad_want = int((~got.isfinite()).sum()), int((~want.isfinite()).sum())
    return (f"non-finite in {bad_got} of {got.numel()} values where eager's has {bad_want} "
            "(nan or inf at other places)")


def judge_tensor(
    name: str, got: torch.Tensor, want: torch.Tensor, probes: list[torch.Tensor], t0: torch.Tensor | None
) -> TensorVerdict:
    c, e = got.detach().double(), want.detach().double()
    if not torch.equal(c.isfinite(), e.isfinite()):
        return TensorVerdict(name, False, math.inf, 0.0, 0.0, nonfinite_difference(got, want))
    finite = e.isfinite()
    c, e = torch.where(finite, c, 0.0), torch.where(finite, e, 0.0)
    start = torch.zeros_like(e) if t0 is None else torch.where(finite, t0.detach().double().to(e.device), 0.0)
    update = float((e - start).norm())
    scale = update if update > 0 else max(float(e.norm()), 1e-300)
    spread = max((float((torch.where(finite, p.double(), 0.0) - e).norm()) for p in probes), default=0.0)
    unit = float(torch.finfo(want.dtype).eps) / 2
    bound = SPREAD_FACTOR * spread + FLOOR * update + 2 * unit * float(e.norm())
    error = float((c - e).norm())
    problem = ""
    if error > bound:
        problem = (f"{error / scale:.3g} of its update from eager's, beyond {bound / scale:.3g} "
                   f"({SPREAD_FACTOR:g}× eager's own spread {spread / scale:.3g} + {FLOOR:g})")
    return TensorVerdict(name, False, error / scale, spread / scale, bound / scale, problem)


# ------------------------------------------------------------------ an optimizer's step


def step_tensors(opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every tensor a step may change, by name: params, group entries, state entries (containers' leaves)."""
    out: dict[str, torch.Tensor] = {}
    for g, group in enumerate(opt.param_groups):
        for key, value in group.items():
            if key != "params" and isinstance(value, torch.Tensor):
                out[f"g{g}.{key}"] = value
        for i, p in enumerate(group["params"]):
            out[f"g{g}.p{i}"] = p
            for key, value in opt.state.get(p, {}).items():
                leaves, _ = pytree.tree_flatten(value)
                for j, leaf in enumerate(leaves):
                    if isinstance(leaf, torch.Tensor):
                        out[f"g{g}.p{i}.{key}" + (f"[{j}]" if len(leaves) > 1 else "")] = leaf
    return out


def _clones(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in tensors.items()}


class _Snapshot:
    """The optimizer's params (grads attached), groups, state and attributes, to run eager from again."""

    def __init__(self, opt: torch.optim.Optimizer) -> None:
        self.payload = copy.deepcopy(
            ([dict(g) for g in opt.param_groups], [[opt.state.get(p) for p in g["params"]] for g in opt.param_groups])
        )
        # deepcopy drops .grad and a Parameter's Python attributes (is_qkv, partition_dim): kept
        # beside, attached to each run's fresh params.
        self.attributes = [[dict(p.__dict__) for p in g["params"]] for g in opt.param_groups]
        self.grads = [[None if p.grad is None else p.grad.detach().clone() for p in g["params"]]
                      for g in opt.param_groups]
        self.attrs = {k: _copied(v) for k, v in vars(opt).items() if k not in ("param_groups", "state", "defaults")}

    @contextmanager
    def installed(self, opt: torch.optim.Optimizer) -> Iterator[None]:
        groups, states = copy.deepcopy(self.payload)
        attrs = {k: _copied(v) for k, v in self.attrs.items()}
        saved_groups = [dict(g) for g in opt.param_groups]
        saved_state, saved_attrs = opt.state, dict(vars(opt))
        try:
            state: dict[torch.Tensor, Any] = {}
            for group, fresh, fresh_states, grads, attributes in zip(
                opt.param_groups, groups, states, self.grads, self.attributes
            ):
                for p, grad, attrs in zip(fresh["params"], grads, attributes):
                    p.grad = None if grad is None else grad.clone()
                    p.__dict__.update(attrs)
                group.clear()
                group.update(fresh)
                state.update({p: s for p, s in zip(fresh["params"], fresh_states) if s is not None})
            opt.state = defaultdict(dict, state)
            for key, value in attrs.items():
                setattr(opt, key, value)
            yield
        finally:
            put_back(opt, saved_state, saved_groups, saved_attrs)


def _copied(value: Any) -> Any:
    """A deep copy where Python can make one (counters, lists, configs); the object itself where not (locks, groups)."""
    try:
        return copy.deepcopy(value)
    except Exception:  # noqa: BLE001 - an attribute a step cannot change in place keeps its identity
        return value


def _eager(opt: torch.optim.Optimizer, snap: _Snapshot, modes: list[Any]) -> dict[str, torch.Tensor]:
    with snap.installed(opt), torch.no_grad(), force_eager():
        for mode in modes:
            mode.__enter__()
        try:
            unwrapped_step(opt)(opt)
        finally:
            for mode in reversed(modes):
                mode.__exit__(None, None, None)
        return _clones(step_tensors(opt))


def judge_step(
    optimizer: torch.optim.Optimizer,
    candidate: Callable[[], Any],
    *,
    exact: bool | Callable[[str], bool] = False,
    probes: int = PROBES,
    boundaries: bool = True,
) -> Verdict:
    """Run ``candidate()`` — a step of ``optimizer``'s params and state in place, such as a compiled
    optimizer's ``step`` — and judge it against ``optimizer``'s own eager step from the same state.

    ``exact``: True (or a predicate over tensor names) where the plan keeps eager's arithmetic: those
    tensors must be bitwise eager's. ``boundaries``: record the candidate's decompositions and run eager
    with them where every one matches (module docstring). The optimizer keeps the candidate's result.
    """
    before = _clones(step_tensors(optimizer))
    snap = _Snapshot(optimizer)
    recorder = Boundaries()
    if boundaries:
        with recorder:
            candidate()
    else:
        candidate()
    got = _clones(step_tensors(optimizer))
    sub = Boundaries(recorder.recorded, substitute=True) if recorder.recorded else None
    reference = _eager(optimizer, snap, [sub] if sub else [])
    if sub is not None and sub.unmatched:  # all or nothing
        unmatched, sub = tuple(sub.unmatched), None
        reference = _eager(optimizer, snap, [])
    else:
        unmatched = ()
    runs = []
    for k in range(probes):
        modes: list[Any] = [Rounding(seed=1 + k)]
        if sub is not None:
            modes.insert(0, Boundaries(recorder.recorded, substitute=True))
        runs.append(_eager(optimizer, snap, modes))
    is_exact = exact if callable(exact) else (lambda name: bool(exact))
    tensors = judge(got, reference, runs, before, is_exact)
    return Verdict(tuple(tensors), sub.matched if sub is not None else 0, unmatched, probes)
