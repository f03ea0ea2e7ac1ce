"""The self-check, on by default: every compiled program is checked against eager, on a schedule.

Whatever a capture, a pass or a lowering gets wrong on code no one here wrote
(a Python attribute the trace did not see, a branch frozen at trace time, a
wrong plan), it shows as a step that differs from eager's. So each compiled
program's steps 1, 2, 4, 8, …, 512, and then every 1,000th, are run twice on
copies before the real step: once as compiled, once as the optimizer's own
eager step, from the same state. Only then does the real step run, compiled if
the two agree and eagerly if not, so a mismatch leaves nothing half-applied.

- **A few members per class.** A stamped step (classes/stamp.py) runs one
  program per parameter class, proved separable: each member's update
  depends on itself and the step's shared values only. So the check runs both
  steps on a view of the optimizer holding copies of some members of every
  class: the first and last on a program's first check (the members the
  stamp's proof traced), then one a check, a different one each time, so
  the checks walk through each class. A step traced whole is checked whole.
- **Huge elementwise members, first check on a slice.** A program's first
  check runs a member of millions of elements whose class program is
  elementwise (AdamW's embedding) on its leading rows (check_slices.py);
  its later checks run it whole.
- **Within the plan's budget** (judgement.py): where the plan keeps eager's
  arithmetic, bitwise on the aten lowering (8 units in the last place on the
  others, whose pointwise kernels contract to FMAs); downstream of a planned
  op (``hocompile::newton_schulz``), bitwise eager's or within 4× eager's own
  spread at that point (eager re-run under another summation order, on the
  members whose planned tensors are not eager's bits) plus 1e-5 of the
  update. Where the user opted out of eager's precision (``precision=``,
  ``schedule=``, ``error_budget=``), planned tensors are only held finite
  where eager's are: ``verify=`` checks those plans against fp64.
  The Python state the step rewrites (counters in state, groups, attributes)
  must be equal.
- **Within 1 % of the step time.** A check that comes due when the program's
  checks so far, and one more like the last, would cost more than 1 % of its
  compiled steps' time (plus a second in all) waits until the steps have paid
  for it; explain() counts the postponed ones. A program's first check
  always runs.
- **Eager's bf16 GEMMs in fp32 where the CPU has no bf16 units** (check_gemms.py): products of
  the bf16 values summed in fp32 and rounded once, as aten's own slow path computes them but ~60x
  faster; only where every bf16 GEMM of the program is inside a planned op (judged against eager's
  spread, never bitwise), and a difference seen so is judged again against eager's own run.
- **A mismatch** warns (:class:`SelfCheckWarning`, naming the class, the
  tensor and the difference) and that program runs eagerly from then on.
- **Collectives the step issues itself** (collectives.py) are checked by every
  rank of their group at the same steps, with the same choices and one verdict
  (check_ranks.py). **Not checked**: programs whose collectives hocompile
  planned (``distributed=``) or over DTensor shards (a rank that checks alone
  would desynchronise the group), and CUDA-graph replays (they run on the
  addresses they captured). explain() says so.

The views run with the CPU and CUDA random states restored after each, so
checking does not move a training run's random stream. Cost: a check runs the
compiled program once and eager once on the sampled members, and eager once
more under another summation order where planned tensors are not eager's
bits; benchmarks/self_check.py measures it against the step.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ...capture.trace import unwrapped_step
from ...errors import SelfCheckWarning  # noqa: F401  (defined there, re-exported here)
from ...ir.declined import Declined
from ...ir.graph import InputSlot
from ..records import BUDGET, RankGroup, SelfCheck
from .compare import compare as _compare
from .compare import confirmed
from .gemms import HalfGemmsInFp32, fp32_reference_dtypes
from .judgement_modes import Boundaries, Rounding, force_eager, reference_run
from .ranks import step_collective_group
from .reference_classes import stamped_planned
from .reference_step import plan_dependent_slots
from .slices import first_check_slices
from .view import UnfaithfulView, View, ViewResult, same_bits

if TYPE_CHECKING:
    from ...settings import Settings
    from ..entries import CompiledEntry

log = logging.getLogger("hocompile")

CHECK_EVERY = 1000  # past the doubling steps, one check per this many steps
# A program's checks may cost this share of its compiled steps' time, plus FREE_SECONDS in all;
# a check due beyond that waits until the steps have paid for it (its first check always runs).
FREE_SECONDS = 1.0
PROBES = 1  # eager re-runs under another summation order, where a planned tensor is not eager's bits
POINTWISE_ULPS = 8.0  # non-aten lowerings, where the plan keeps eager's arithmetic


def due(run: int) -> bool:
    """Whether a program's ``run``-th step (1-based) is checked: 1, 2, 4, …, 512, then every 1,000th."""
    return (run < CHECK_EVERY and run & (run - 1) == 0) or run % CHECK_EVERY == 0


def _within_budget(record: SelfCheck) -> bool:
    """A check like the last one (on whole members: a first check on slices costs a fraction of a
    whole one) fits the budget; a program's first check always does."""
    expected = record.each[-1] * record.whole_over_checked if record.each else 0.0
    return record.checks == 0 or record.seconds + expected <= BUDGET * record.step_seconds + FREE_SECONDS


def check_now(record: SelfCheck) -> bool:
    """Whether this step of the program is checked: due on the schedule (or postponed earlier), and
    within the budget with a check like the last one. A check that costs more than the schedule can pay
    (eager's for-loop AdamW on GPT-2's 38M-element embedding costs 20 compiled steps) runs later
    rather than not at all: it waits for the credit. A program's first check always runs."""
    if not (record.pending or due(record.runs)):
        return False
    if _within_budget(record):
        record.pending = False
        return True
    if not record.pending:
        record.postponed += 1
    record.pending = True
    return False


def check_now_agreed(record: SelfCheck, ranks: RankGroup) -> bool:
    """check_now for a step with its own collectives (check/ranks.py): every rank checks it or none.
    Due on the schedule alone, and within every rank's budget; beyond it, skipped, not postponed."""
    if not due(record.runs):
        return False
    if ranks.all(_within_budget(record)):
        return True
    record.postponed += 1  # skipped: the next due step asks again
    return False


def skip_reason(entry: CompiledEntry, settings: Settings, opt_groups: list[dict[str, Any]]) -> str:
    """Why ``entry`` cannot be checked on copies ('' where it can)."""
    captured = entry.captured
    assert captured is not None
    if captured.sharded:
        return "its params are DTensor shards: a check on one rank alone would desynchronise the group"
    collectives = any("c10d" in str(n.target) or "wait_tensor" in str(n.target) for n in captured.gm.graph.nodes)
    if collectives and not step_collective_group(entry, opt_groups):  # the step's own: all ranks check alike
        return "it issues collectives: a check on one rank alone would desynchronise the group"
    if any(p.device.type == "meta" for g in opt_groups for p in g["params"]):
        return "its params are on the meta device: there are no values to compare"
    if settings.cuda_graphs:
        return "cuda_graphs=True replays on the addresses it captured, not on copies"
    return ""


def check(
    opt: torch.optim.Optimizer,
    entry: CompiledEntry,
    settings: Settings,
    run: Callable[[torch.optim.Optimizer, CompiledEntry], Any],
    ranks: RankGroup | None = None,
) -> str:
    """Check ``entry`` against eager on copies of a sample of ``opt``'s params; '' if it agrees, else why not.

    ``run(view, entry)`` runs a compiled entry on an optimizer (the view). ``opt`` is left as it was.
    ``ranks``: the process group of the step's own collectives, whose ranks all check this step and
    take every choice inside the check together (check_ranks.py).
    """
    record = entry.self_check
    started = time.perf_counter()
    keep, remapped = _sample(opt, entry, record.checks)
    # A program's first check: huge elementwise members on their leading rows (check_slices.py). Whatever
    # the slice does not settle (a difference, an error on it) is settled by the check on the whole.
    rows = first_check_slices(opt, entry, keep) if record.checks == 0 and ranks is None else {}
    outcome: tuple[list[str], str] | Declined | None = None
    if rows:
        try:
            outcome = _check_on(View(keep, rows), opt, entry, remapped, settings, run, sliced=True, ranks=ranks)
        except Exception as exc:  # noqa: BLE001 - the slice cannot stand for the member: checked whole
            log.info("self-check on row slices not possible (%s: %s); checking whole", type(exc).__name__, exc)
        if not isinstance(outcome, tuple) or outcome[0]:
            outcome, rows = None, {}
    if outcome is None:
        outcome = _check_on(View(keep), opt, entry, remapped, settings, run, sliced=False, ranks=ranks)
    if isinstance(outcome, Declined):
        return outcome.reason
    problems, worst = outcome
    record.checks += 1
    record.members, record.of = sum(map(len, keep)), sum(len(g["params"]) for g in opt.param_groups)
    record.sliced = len(rows)
    record.whole_over_checked = _whole_over_checked(opt, keep, rows)
    record.worst = worst
    record.each.append(time.perf_counter() - started)
    record.seconds += record.each[-1]
    return "; ".join(problems[:3]) + (f"; and {len(problems) - 3} more" if len(problems) > 3 else "")


def _whole_over_checked(opt: torch.optim.Optimizer, keep: list[list[int]], rows: dict[tuple[int, int], slice]) -> float:
    """How many times more elements the kept members hold than a check with ``rows`` ran on."""
    whole = checked = 0
    for g, members in enumerate(keep):
        for i in members:
            p = opt.param_groups[g]["params"][i]
            part = rows.get((g, i))
            whole += p.numel()
            checked += p.numel() if part is None else (part.stop - part.start) * (p.numel() // max(1, p.shape[0]))
    return whole / checked if checked else 1.0


def _check_on(
    view: View,
    opt: torch.optim.Optimizer,
    entry: CompiledEntry,
    remapped: CompiledEntry,
    settings: Settings,
    run: Callable[[torch.optim.Optimizer, CompiledEntry], Any],
    sliced: bool,
    ranks: RankGroup | None = None,
) -> tuple[list[str], str] | Declined:
    """The compiled step and eager's on ``view``: (problems, the worst planned tensor), or the check's
    answer without comparing (Declined('') not checkable, with why in the record; eager's error). ``sliced``:
    every error is raised (the caller checks whole instead)."""
    record = entry.self_check
    planned = _planned(entry, settings.fused_updates)
    opted_out = settings.precision != "auto" or bool(settings.schedule) or settings.error_budget is not None
    recorder = Boundaries()
    try:
        with recorder:  # an error here is the compiled step's own: raised as the real step would (nothing written)
            got = view.run(opt, lambda o: run(o, remapped))
    except UnfaithfulView as exc:  # copies cannot stand for what the optimizer holds: not checked, and said
        if sliced:
            raise
        record.skipped = f"the check's copies cannot hold what it holds: {exc}"
        return Declined("")
    step, recorded = unwrapped_step(opt), recorder.recorded

    def boundaries() -> list[Any]:  # the compiled step's decompositions handed to eager (judgement.py)
        return [Boundaries(recorded, substitute=True)] if recorded else []

    units = 0.0 if entry.lowered is None or entry.lowered.backend == "aten" else POINTWISE_ULPS

    def judged(slow: frozenset[torch.dtype]) -> tuple[list[str], str]:
        """Eager's runs (``slow``: their GEMMs of these dtypes in fp32, check_gemms.py) and the judgement."""
        nonlocal recorded

        def gemms() -> list[Any]:
            return [HalfGemmsInFp32(slow)] if slow else []

        with reference_run():  # eager's decompositions: not the step's, for a judgement around this step
            modes = boundaries()
            reference = view.run(opt, step, [*gemms(), *modes])
            unmatched = bool(modes) and modes[0].unmatched
            if ranks.any(unmatched) if ranks else unmatched:  # all or nothing: a half-substituted eager
                # is tighter than allowed
                recorded = []
                reference = view.run(opt, step, gemms())
            probes: list[ViewResult] = []
            differ = _differ(got, reference, planned)
            if (ranks.any(bool(differ)) if ranks else differ) and not opted_out:
                # Eager's spread, where it is needed: the members whose planned tensors are not eager's bits.
                # Op by op (a torch.compile'd helper by its Python code), or Rounding would not reach its ops.
                around = view if entry.stamped is None else view.only(differ, opt)
                probes = [
                    around.run(opt, step, [*boundaries(), *gemms(), Rounding(1 + k), force_eager()])
                    for k in range(PROBES)
                ]
        outcome = _compare(got, reference, probes, planned, units, opted_out)
        if outcome[0] and ranks is None:  # (with collectives a second eager run would be one rank's choice)
            outcome = confirmed(outcome, got, reference, lambda: view.run(opt, step, [*gemms(), *boundaries()]),
                                 lambda again: _compare(got, again, probes, planned, units, opted_out), record)
        return outcome

    try:
        assert entry.captured is not None
        # not with collectives: its second judgement would be one rank's choice
        slow = frozenset() if ranks else fp32_reference_dtypes(entry.captured.gm, _traces_compiled_helpers(entry))
        outcome: tuple[list[str], str] | None = None
        if slow:
            try:
                outcome = judged(slow)
            except Exception as exc:  # noqa: BLE001 - settled by eager's own run, which raises what eager raises
                log.info("self-check with fp32 GEMMs not possible (%s: %s)", type(exc).__name__, exc)
        if outcome is None or outcome[0]:  # a difference seen beside the faster reference: judged against eager's
            outcome = judged(frozenset())
    except Exception as exc:  # noqa: BLE001 - eager's own error: the real eager step raises it again
        if sliced:
            raise
        return Declined(f"eager's step could not run on copies ({type(exc).__name__}: {exc})")
    return outcome


def _traces_compiled_helpers(entry: CompiledEntry) -> bool:
    """Whether the capture traced a torch.compile'd helper by its Python code (eager runs Inductor's
    kernels there: executed_files.compiled_helpers_note). Helpers run as compiled are graph ops."""
    assert entry.captured is not None
    return any("wrapped in torch.compile" in note for note in entry.captured.notes)


def _differ(got: ViewResult, want: ViewResult, planned: Callable[[str], bool]) -> set[tuple[int, int]]:
    """The members (group, index) with a planned tensor that is not bitwise eager's."""
    out: set[tuple[int, int]] = set()
    for name, a in got.tensors.items():
        b = want.tensors.get(name)
        if planned(got.entry(name)) and b is not None and not same_bits(a, b):
            head, _, rest = name.partition(".")
            index = rest[1:].split(".", 1)[0].split("[", 1)[0]
            if head.startswith("g") and rest.startswith("p") and index.isdigit():
                out.add((int(head[1:]), int(index)))
            else:  # a group or attribute tensor: every member may need it
                out |= {(g, i) for g, keep in enumerate(got.keep) for i in keep}
    return out


def fail(entry: CompiledEntry, optimizer_name: str, number: int, why: str) -> None:
    """Record a failed check and warn: the program runs eagerly from now on."""
    record = entry.self_check
    record.failed = why
    entry.fallback = f"self-check against eager failed on step {record.runs}: {why}"
    message = (
        f"hocompile: compiled step #{number} of {optimizer_name} ({entry.reason}) differs from eager on its "
        f"self-checked step {record.runs}: {why}. This step and every later one of this program run eagerly "
        "(the optimizer holds eager's result; nothing of the compiled step was applied). "
        "compile_optimizer(..., self_check=False) or HOCOMPILE_SELF_CHECK=0 turns the check off."
    )
    log.warning("%s", message)
    warnings.warn(message, SelfCheckWarning, stacklevel=4)


# ------------------------------------------------------------------ which members


def _sample(
    opt: torch.optim.Optimizer, entry: CompiledEntry, checks: int
) -> tuple[list[list[int]], CompiledEntry]:
    """Per group, the original indices the view keeps; and ``entry`` renumbered for that view."""
    run = entry.stamped
    groups = opt.param_groups
    if run is None:  # traced whole: checked whole
        return [list(range(len(g["params"]))) for g in groups], entry
    keep: list[set[int]] = [set() for _ in groups]
    picks: list[list[int]] = []
    for cls in run.stamp.classes:
        members = cls.members
        if checks == 0:  # a program's first check: its first and last members, as the stamp's proof traced
            chosen = sorted({members[0], members[-1]})
        else:  # then one a check, another each time: over a run, the checks walk through the class
            chosen = [members[(checks * 7919) % len(members)]]
        picks.append(chosen)
        keep[cls.group] |= set(chosen)
    for g, group in enumerate(groups):  # the stamp's proof ran with every param without a grad in the view
        keep[g] |= {i for i, p in enumerate(group["params"]) if p.grad is None}
    kept = [sorted(k) for k in keep]
    position = [{i: pos for pos, i in enumerate(k)} for k in kept]
    classes = tuple(
        dataclasses.replace(cls, members=tuple(position[cls.group][i] for i in chosen))
        for cls, chosen in zip(run.stamp.classes, picks)
    )
    stamp = dataclasses.replace(run.stamp, classes=classes)
    remapped = dataclasses.replace(entry, stamped=dataclasses.replace(run, stamp=stamp, _memo={}))
    return kept, remapped


def _planned(entry: CompiledEntry, fused_updates: bool) -> Callable[[str], bool]:
    """Whether a tensor (by its entry's name in ``_View``) may differ from eager by rounding: downstream of a
    planned op, or anywhere in a step whose torch.compile'd helpers were traced by their Python code
    (eager runs Inductor's kernels there, which round otherwise: executed_files.compiled_helpers_note),
    or with ``fused_updates=True`` (torch's fused AdamW/SGD kernels: within 1e-6 of eager, not bitwise)."""
    assert entry.captured is not None
    if _traces_compiled_helpers(entry) or fused_updates:
        return lambda name: True
    slots = stamped_planned(entry.stamped) if entry.stamped is not None else plan_dependent_slots(entry)
    names = frozenset(_slot_name(s) for s in slots)
    return names.__contains__


def _slot_name(slot: InputSlot) -> str:
    if slot.kind == "param":
        return f"g{slot.group}.p{slot.index}"
    if slot.kind == "grad":
        return f"g{slot.group}.p{slot.index}.grad"
    if slot.kind == "state":
        return f"g{slot.group}.p{slot.index}.{slot.key}"
    if slot.kind == "pattr":
        return f"g{slot.group}.p{slot.index}.@{slot.key}"
    if slot.kind == "group":
        return f"g{slot.group}.{slot.key}"
    return f"attr.{slot.key}"
