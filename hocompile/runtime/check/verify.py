"""verify=N: the first N steps of every new compiled step are checked against eager.

A pass, a lowering or a stale cache entry that computes the wrong step must
not go unnoticed. While a compiled step (a :class:`CompiledEntry`) has run
fewer than N steps, each step also runs the optimizer's own eager step on
copies of the params, grads and state (hooks not run, Python-level changes
to param groups and optimizer attributes put back), runs the compiled step
on the real ones, and compares every param, grad and state tensor. Past N
it costs one integer comparison.

Error model, per tensor:

- **Eager's arithmetic kept** (the tensor depends on no ``hocompile::`` op
  of the final graph): bitwise equal on the aten lowering, which runs
  eager's own aten ops in eager's order with host scalars computed in
  eager's double-precision order (measured: AdamW, Adam, AMSGrad and four
  SGD variants differ by exactly 0 over 20 steps, so tests/test_parity.py's
  1e-6 is looser than it needs to be). The Triton lowering's pointwise
  kernels round in their own order (FMA contraction):
  ``max|c − e| ≤ 8 u max|e|``, u the unit roundoff of the tensor's dtype.
- **Plan-dependent** (downstream of e.g. ``hocompile::newton_schulz``): no
  bound on ``‖c − e‖`` alone is honest: eager's bf16 NS is 1.5–8 u from the
  exact polynomial on full-rank inputs but 25–200 % on rank-deficient ones
  (null-space rounding noise grows with the polynomial's slope at 0, a⁵ ≈ 500
  for Keller Jordan's coefficients), where a correct fp32 plan then differs
  from eager by 30–90 %. So three fp64 references of the step are computed
  (reference_step.py): x, eager's program re-captured from the optimizer
  (independent of every pass); y, the compiled graph with the plan's own ops
  (Gram NS, blocks) in fp64; z, the compiled graph with each plan op as
  standard NS in the coarser of eager's nominal precision and the plan's.
  With t0 the value before the step:

  1. **Algebra**: ``‖y − x‖ ≤ 1e-6 ‖x − t0‖``: the plan computes eager's
     function. Measured ≤ 4e-12 for correct plans (Gram NS included, rank-2
     grads included); ≥ 2e-2 for a dropped iteration and ≥ 6e-4 for one
     coefficient off by 0.1 %, whatever the grads' rank.
  2. **Precision**: ``‖c − x‖ ≤ R max(‖e − x‖, ‖z − y‖) + F ‖x − t0‖ + 2 u ‖x‖``:
     no further from the exact step than eager's own arithmetic, or eager's
     program in the precision it asked for, on this very input (the planner's
     default budget: no worse than eager's own precision).
     R = 2: the contract's 1.25 with room for one matrix's spread (a plan
     rounding exactly like eager sits at 1/R); F = 1e-5, the fp32 floor of
     test_newton_schulz.py; u of the tensor's dtype, for storing x in it.
     Measured on CPU plans (torch/user/emerging Muon, fp32 Gram, bf16,
     tall/wide/square, Gaussian and rank-1/2 grads): at most 0.5 of the
     bound. It found two plans outside the budget, since fixed in the
     planner: fp32 Gram NS against an fp32 eager on rank-2 grads (12–40×
     eager's error) and sm90's fp8*1+fp16*4 schedule on ≤ 16-row matrices
     (≤ 3.3×); tests/test_verify.py and test_precision_plans.py keep them out.

A stamped step (classes/stamp.py) runs one program per parameter class, so
its references are computed per class (reference_classes.py) on a sample of
each class's members (the first, the last and two between): a wrong program
shows on any member; every member's plan-independent tensors are still
compared bitwise. A step loaded for a warm start (warm.py) is verified on
its first step whatever ``verify`` says; there a mismatch deletes the record
and the next step compiles afresh.

On a mismatch the optimizer is given eager's result for the step (params,
grads and state tensors), so nothing is left half-updated and training may
go on; then :class:`VerificationError`, or with ``fallback="eager"`` a
warning and that compiled step runs eagerly from then on.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import torch

from ...capture.containers import describe_spec, flatten, holds_tensors
from ...capture.stand_ins import tensor_attributes
from ...capture.trace import capture, unwrapped_step
from ...errors import VerificationError  # noqa: F401  (defined there, re-exported here)
from ...ir.graph import InputSlot
from ...settings import Fallback
from ..records import ALGEBRA_TOLERANCE, Verification
from ..warm import discard_stale
from .eager_copies import Mirror, eager_step
from .judgement import nonfinite_difference
from .judgement_modes import reference_run
from .reference_classes import expand_host_slots, stamped_planned, stamped_references
from .reference_step import References, plan_dependent_slots

if TYPE_CHECKING:  # for annotations only: compiled_optimizer and entries import this module
    from ..entries import CompiledEntry, StepRunner

log = logging.getLogger("hocompile")

NS_FACTOR = 2.0  # R
UPDATE_FLOOR = 1e-5  # F
POINTWISE_UNITS = {"aten": 0.0}  # bitwise; any other lowering: OTHER_POINTWISE_UNITS u
OTHER_POINTWISE_UNITS = 8.0


def steps_to_verify(runner: StepRunner, entry: CompiledEntry) -> int:
    """``verify=N``, and at least the first step of a step loaded for a warm start (warm.py)."""
    return max(runner.settings.verify, 1 if entry.warm else 0)


def run_step(runner: StepRunner, entry: CompiledEntry, env: dict[str, Any] | None) -> None:
    """Run ``entry`` on ``opt``; checked against eager while it has run fewer than ``verify`` steps."""
    if entry.verification.steps >= steps_to_verify(runner, entry):
        runner.run(entry, env)
        return
    _verified_step(runner, entry, env)


def _verified_step(runner: StepRunner, entry: CompiledEntry, env: dict[str, Any] | None) -> None:
    record = entry.verification
    inner = runner.optimizer
    assert entry.captured is not None and entry.lowered is not None
    started = time.perf_counter()
    stamped = entry.stamped  # per parameter class (reference_classes.py)
    if record.planned is None:
        record.planned = stamped_planned(stamped) if stamped is not None else plan_dependent_slots(entry)
    host_slots = [update.slot for update in entry.captured.host_updates]
    if stamped is not None:
        host_slots = expand_host_slots(stamped, host_slots)
    try:
        with reference_run():  # eager's decompositions, not the step's (judgement_modes.py)
            refs = References()
            if record.planned and stamped is not None:
                refs = stamped_references(runner, entry, record.planned)
            elif record.planned:
                # Read before anything is written: the references and pre-step values
                # come from the real tensors; eager then runs on copies.
                if record.reference is None:
                    record.reference = capture(inner, runner.settings.structural_keys)
                refs = References.compute(runner, entry, record.reference, record.planned)
            mirror = eager_step(inner, host_slots)
    except Exception as exc:  # nothing was written yet
        message = f"could not verify compiled step against eager: {type(exc).__name__}: {exc}"
        if entry.warm:  # a loaded step that cannot be checked is not trusted: this step runs eagerly
            discard_stale(runner.forget, entry, f"could not be checked against eager ({type(exc).__name__}: {exc})")
            runner.counters.eager_fallbacks += 1
            unwrapped_step(inner)(inner)
            return
        if runner.settings.fallback != Fallback.EAGER or isinstance(exc, VerificationError):
            raise VerificationError(message) from exc
        log.warning("hocompile: %s; running it eagerly", message)
        entry.fallback = message
        runner.counters.eager_fallbacks += 1
        unwrapped_step(inner)(inner)
        return
    ran = time.perf_counter()
    runner.run(entry, env)
    checking = time.perf_counter()
    problems = _compare(inner, mirror, record.planned, refs, entry.lowered.backend, record)
    for host_slot, want in mirror.host.items():
        got = host_slot.read(inner)
        if type(got) is not type(want) or got != want:
            problems.append(("Python state", [f"{host_slot.describe()} is {got!r}, eager's is {want!r}"]))
    record.steps += 1
    # What checking cost besides the compiled step itself (eager on copies, references, comparing).
    record.seconds += (ran - started) + (time.perf_counter() - checking)
    number = runner.number(entry)
    if not problems:
        n = steps_to_verify(runner, entry)
        if record.steps >= n:
            record.reference = None  # the fp64 program is not needed any more
        log.info("hocompile: compiled step #%d, verified step %d/%d against eager: %s", number, record.steps, n,
                 record.summary())
        return
    mirror.install(inner)
    lines = [f"hocompile: compiled step #{number} ({entry.reason}) differs from eager on verified step {record.steps}:"]
    lines += [f"  {where}: {'; '.join(diffs)}" for where, diffs in problems]
    lines.append("The optimizer holds eager's result for this step (params, grads and state).")
    record.failed = "\n".join(lines)
    if entry.warm:
        discard_stale(runner.forget, entry, "differs from eager on its first step:\n" + "\n".join(lines[1:-1]))
        return
    if runner.settings.fallback == Fallback.EAGER:
        entry.fallback = "verification against eager failed: " + lines[1].strip()
        runner.counters.eager_fallbacks += 1
        log.warning("%s This compiled step runs eagerly from now on.", record.failed)
        return
    raise VerificationError(record.failed + " Pass fallback='eager' to run it eagerly instead.")


def _compare(
    opt: torch.optim.Optimizer,
    mirror: Mirror,
    planned: frozenset[InputSlot],
    refs: References,
    backend: str,
    record: Verification,
) -> list[tuple[str, list[str]]]:
    """Every param, grad and state entry: compiled (``opt``) against eager (``mirror``)."""
    check = _Checker(planned, refs, POINTWISE_UNITS.get(backend, OTHER_POINTWISE_UNITS))
    problems: list[tuple[str, list[str]]] = []
    for g, (group, copies) in enumerate(zip(opt.param_groups, mirror.params)):
        for i, (p, c) in enumerate(zip(group["params"], copies)):
            diffs = [
                check("param", InputSlot.param(g, i), p, c),
                check("grad", InputSlot.grad(g, i), p.grad, c.grad),
            ]
            real, eager = opt.state.get(p, {}), mirror.state.get(c, {})
            if set(real) != set(eager):
                diffs.append(f"state keys {sorted(map(str, real))} vs eager's {sorted(map(str, eager))}")
            for key in [k for k in real if k in eager]:
                diffs += _check_entry(check, InputSlot.state(g, i, key), real[key], eager[key])
            diffs += [
                check(f".{key}", InputSlot.param_attribute(g, i, key), value, getattr(c, key, None))
                for key, value in tensor_attributes(p)
            ]
            if any(diffs):
                shape = "×".join(str(s) for s in p.shape) or "scalar"
                problems.append((f"param_groups[{g}]['params'][{i}] (shape {shape})", [d for d in diffs if d]))
    for g, (group, tensors) in enumerate(zip(opt.param_groups, mirror.group_tensors)):
        diffs = [
            check(f"[{key!r}]", InputSlot.group_entry(g, key), group.get(key), want) for key, want in tensors.items()
        ]
        if any(diffs):
            problems.append((f"param_groups[{g}]", [d for d in diffs if d]))
    for key, want in mirror.attr_tensors.items():
        diff = check(f"attribute {key!r}", InputSlot.attribute(key), vars(opt).get(key), want)
        if diff:
            problems.append(("the optimizer", [diff]))
    record.exact, record.budgeted, record.unsampled = check.exact_count, check.budgeted, check.unsampled
    record.worst_pointwise = max(record.worst_pointwise, check.worst_pointwise)
    record.worst_algebra = max(record.worst_algebra, check.worst_algebra)
    if check.budgeted and (not record.worst_bound or check.worst_share > record.worst / record.worst_bound):
        record.worst, record.worst_bound = check.worst, check.worst_bound
    return problems


def _check_entry(check: _Checker, slot: InputSlot, got: Any, want: Any) -> list[str]:
    """One state entry; a container of tensors leaf by leaf (containers.py)."""
    what = f"state[{slot.key!r}]"
    if isinstance(got, torch.Tensor) or not (holds_tensors(got) or holds_tensors(want)):
        return [check(what, slot, got, want)]
    (got_leaves, got_spec, paths), (want_leaves, want_spec, _) = flatten(got), flatten(want)
    if got_spec.signature() != want_spec.signature():
        return [f"{what} is a {describe_spec(got_spec)}, eager's a {describe_spec(want_spec)} (or their values differ)"]
    return [
        check(what + path, slot.leaf_at(j, path), a, b)
        for j, (a, b, path) in enumerate(zip(got_leaves, want_leaves, paths))
    ]


class _Checker:
    """One compiled/eager pair at a time, under the error model of the module docstring."""

    def __init__(self, planned: frozenset[InputSlot], refs: References, units: float) -> None:
        self.planned, self.refs, self.units = planned, refs, units
        self.exact_count = self.budgeted = self.unsampled = 0
        self.worst = self.worst_bound = self.worst_share = self.worst_algebra = self.worst_pointwise = 0.0

    def __call__(self, what: str, slot: InputSlot, got: Any, want: Any) -> str:
        if got is None or want is None:
            if got is None and want is None:
                return ""
            return f"{what} is {'None' if got is None else 'set'}, eager's is {'None' if want is None else 'set'}"
        if not isinstance(got, torch.Tensor) or not isinstance(want, torch.Tensor):
            same = type(got) is type(want) and (got == want or got != got and want != want)
            return "" if same else f"{what} is {got!r}, eager's is {want!r}"
        if got.shape != want.shape or got.dtype != want.dtype:
            return f"{what} is {got.dtype} {tuple(got.shape)}, eager's is {want.dtype} {tuple(want.shape)}"
        if slot in self.refs.unsampled:
            self.unsampled += 1
            return ""
        if slot in self.planned:
            return self._budget(what, slot, got, want)
        return self._pointwise(what, got, want)

    def _pointwise(self, what: str, got: torch.Tensor, want: torch.Tensor) -> str:
        self.exact_count += 1
        if not got.is_floating_point():
            return "" if torch.equal(got, want) else f"{what} differs from eager's (integer values, bound: equal)"
        same = (got == want) | (got.isnan() & want.isnan())
        if bool(same.all()):
            return ""
        diff = torch.where(same, 0.0, (got.double() - want.double()).abs()).max().item()
        scale = max(want.double().abs().max().item(), torch.finfo(want.dtype).tiny)
        self.worst_pointwise = max(self.worst_pointwise, diff / scale)
        if self.units == 0.0:
            return (
                f"{what} differs where the plan keeps eager's arithmetic: max |Δ| {diff:.3g} "
                f"({diff / scale:.3g} of max |eager|), bound: bitwise equal"
            )
        bound = self.units * float(torch.finfo(want.dtype).eps) / 2
        if diff / scale <= bound:
            return ""
        return f"{what} differs: max |Δ| {diff / scale:.3g} of max |eager|, bound {bound:.3g} ({self.units:g} ulps)"

    def _budget(self, what: str, slot: InputSlot, got: torch.Tensor, want: torch.Tensor) -> str:
        self.budgeted += 1
        c, e = got.double(), want.double()
        t0 = self.refs.before.get(slot, torch.zeros_like(c))
        x = self.refs.exact.get(slot, t0)
        y, z = self.refs.plan.get(slot, x), self.refs.nominal.get(slot, x)
        finite = c.isfinite() & e.isfinite() & x.isfinite() & y.isfinite() & z.isfinite()
        if not bool(finite.all()):
            if not torch.equal(c.isfinite(), e.isfinite()):
                return f"{what} is {nonfinite_difference(got, want)}"
            c, e, x, y, z, t0 = (torch.where(finite, v, 0.0) for v in (c, e, x, y, z, t0))
        update = (x - t0).norm().item()
        scale = update if update > 0 else max(x.norm().item(), 1e-300)
        algebra = (y - x).norm().item()
        self.worst_algebra = max(self.worst_algebra, algebra / scale)
        if algebra > ALGEBRA_TOLERANCE * update + 4 * 2.0**-53 * x.norm().item():
            return (
                f"{what}: the compiled plan computes another function than eager's step: evaluated in fp64, "
                f"it is {algebra / scale:.3g}·‖update‖ from eager's (bound {ALGEBRA_TOLERANCE:g}·‖update‖; "
                "check the plan's coefficients, iterations, eps and transposes)"
            )
        err_c, err_e, err_z = (c - x).norm().item(), (e - x).norm().item(), (z - y).norm().item()
        u_store = float(torch.finfo(want.dtype).eps) / 2
        bound = NS_FACTOR * max(err_e, err_z) + UPDATE_FLOOR * update + 2 * u_store * x.norm().item()
        share = err_c / bound if bound > 0 else (0.0 if err_c == 0 else float("inf"))
        if share >= self.worst_share:
            self.worst, self.worst_bound, self.worst_share = err_c / scale, bound / scale, share
        if err_c <= bound:
            return ""
        return (
            f"{what} is {err_c / scale:.3g}·‖update‖ from the fp64 evaluation of eager's step, beyond the "
            f"Newton–Schulz budget {bound / scale:.3g}·‖update‖ (eager's own error {err_e / scale:.3g}, "
            f"eager's program at its precision {err_z / scale:.3g}; ‖compiled − eager‖ "
            f"{(c - e).norm().item() / scale:.3g})"
        )
