"""How a selected compiled step runs: strictly checked (``verify=``), self-checked on its schedule, or as is.

The three paths a compiled program's step takes, in this order:

1. while it has run fewer than ``verify`` steps (or it was loaded for a warm
   start and not yet checked): runtime/check/verify.py, against fp64 references;
2. on its self-check schedule (steps 1, 2, 4, …, then every 1,000th, within
   1 % of the program's step time): runtime/check/self_check.py checks it on
   copies first; the real step then runs compiled if it agreed and eagerly,
   from then on, if not;
3. otherwise: the compiled step, nothing else.
"""

from __future__ import annotations

import time
from typing import Any

from ...capture.trace import unwrapped_step
from ..entries import CompiledEntry, StepRunner, run_entry
from ..warm import discard_stale
from . import ranks as check_ranks
from . import self_check
from .verify import run_step, steps_to_verify


def run_checked(runner: StepRunner, entry: CompiledEntry, env: dict[str, Any] | None) -> None:
    record = entry.self_check
    record.runs += 1
    settings = runner.settings
    if record.runs == 1:
        record.skipped = self_check.skip_reason(entry, settings, runner.optimizer.param_groups)
        record.ranks = check_ranks.step_collective_group(entry, runner.optimizer.param_groups)
    # A step loaded for a warm start is trusted once its first step agrees with eager: by the self-check
    # where it can check it (sampled, no fp64 references), else by verify's first step (warm.py).
    warm_by_self_check = bool(entry.warm) and settings.self_check and not settings.verify and not record.skipped
    if not warm_by_self_check and entry.verification.steps < steps_to_verify(runner, entry):
        run_step(runner, entry, env)  # verify=: stricter, every step of the first N
        return
    if not settings.self_check or record.skipped:
        _timed_run(runner, entry, env)
        return
    ranks = record.ranks  # the step's own collectives: its ranks decide together
    if not (self_check.check_now_agreed(record, ranks) if ranks else self_check.check_now(record)):
        _timed_run(runner, entry, env)
        return
    inner = runner.optimizer
    assert entry.captured is not None
    step_env = runner.host_env(entry.captured) if env is None else env
    # An error of the compiled step on the copies (a LinAlgError on the data, a kernel failing) is raised
    # as the real step would raise it, with nothing written; eager's own errors come back as ``why``.
    why = self_check.check(inner, entry, settings, lambda view, e: run_entry(view, e, step_env), ranks)
    if ranks:
        why = check_ranks.group_verdict(why, ranks)
    if entry.warm and record.checks <= 1 and (why or record.skipped):
        # Not proven against eager: the record is discarded, this step runs eagerly, the next compiles.
        discard_stale(runner.forget, entry, f"differs from eager on its first step: {why}" if why else
                      f"could not be checked against eager ({record.skipped})")
        runner.counters.eager_fallbacks += 1
        unwrapped_step(inner)(inner)
        return
    if not why:
        _timed_run(runner, entry, step_env)
        return
    number = runner.number(entry)
    self_check.fail(entry, type(inner).__name__, number, why)
    runner.counters.eager_fallbacks += 1
    unwrapped_step(inner)(inner)


def _timed_run(runner: StepRunner, entry: CompiledEntry, env: dict[str, Any] | None) -> None:
    """The compiled step; its time is what the self-check's budget is a share of."""
    started = time.perf_counter()
    runner.run(entry, env)
    entry.self_check.step_seconds += time.perf_counter() - started
