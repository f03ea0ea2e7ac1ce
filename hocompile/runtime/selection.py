"""Which compiled step runs: the first candidate of the step's signature whose guards hold now.

A signature (guards.py) names the configuration; several compiled steps can share one (each
outcome of a branch on a Python number, a recompile after a guard on a hyperparameter failed).
:func:`select` tries them in compile order and says, where none holds, which guard failed and
whether it reads a number the step itself rewrites (then another compile is a branch variant,
not a recompile: compiled_optimizer.VARIANTS_PER_SIGNATURE).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..capture.container_trace import aliases_hold
from ..capture.slots import tensor_lookup
from ..capture.trace import CapturedStep
from .entries import CompiledEntry
from .stamped import broken_guard


@dataclass
class Selection:
    entry: CompiledEntry | None  # None: no candidate holds, compile
    env: dict[str, Any] | None = None  # the host values the selected step runs with (None: read them again)
    failed_guard: str = ""  # the last candidate's failed guard, described: the recompile's reason
    on_counter: bool = False  # that guard reads a number the step itself rewrites


def select(
    opt: torch.optim.Optimizer,
    candidates: list[CompiledEntry],
    host_env: Callable[[CapturedStep], dict[str, Any]],
) -> Selection:
    """The first of ``candidates`` (compiled steps of the step's signature) that may run on ``opt`` now."""
    found = Selection(None)
    for candidate in candidates:
        if candidate.captured is None:  # an eager fallback for this signature
            return Selection(candidate)
        captured = candidate.captured
        if captured.holds_containers and not _aliases_hold(opt, captured):
            found.failed_guard = "the tensors kept in containers are other inputs' tensors than when compiled"
            continue
        env = host_env(captured)
        if candidate.stamped is not None:  # per member too (runtime/stamped.py)
            broken = broken_guard(opt, candidate.stamped, env)
        else:
            broken = next((g for g in captured.guards if not g.holds(env)), None)
        if broken is None:
            return Selection(candidate, env)
        found.failed_guard = f"guard failed: {broken.describe()} no longer holds"
        counters = {slot.name() for slot in captured.lifted}
        counters |= {read.name for read in captured.reads}  # a value read on the host
        found.on_counter = bool(broken.lhs.inputs() & counters or broken.rhs.inputs() & counters)
    return found


def _aliases_hold(opt: torch.optim.Optimizer, captured: CapturedStep) -> bool:
    """The tensors kept in containers are the same inputs' tensors as when compiled (asked only of a
    step that keeps tensors in containers: the walk is per input)."""
    inputs = tuple(s for s in captured.inputs if s.kind != "carry")
    return aliases_hold(opt, inputs, captured.leaf_aliases, tensor_lookup(opt))
