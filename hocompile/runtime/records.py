"""What a compiled step's checks saw, kept on its entry (``CompiledEntry.verification`` and
``.self_check``) and read by explain(); and the one number a record prints from each check's policy.

The records are plain data beside the entries that hold them: the checks (``check/``) write them,
the entries and the reports read them, and neither side imports the other for it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..capture.trace import CapturedStep
from ..ir.graph import InputSlot

# verify=N: the plan's algebra (its fp64 program beside eager's) may differ by this share of the update.
ALGEBRA_TOLERANCE = 1e-6  # ‖y − x‖ / ‖x − t0‖
# A program's self-checks may cost this share of its compiled steps' time (plus check/self_check.py's
# FREE_SECONDS in all); a check due beyond that waits until the steps have paid for it.
BUDGET = 0.01


@dataclass(frozen=True)
class RankGroup:
    """The process group of the step's own collectives, and the device its agreements travel on (an
    NCCL group all-reduces CUDA tensors only: the params' device, as the step's collectives use)."""

    name: str
    device: torch.device

    def all(self, flag: bool) -> bool:
        """``flag`` on every rank of the group (each rank calls this at the same point)."""
        return self._reduce(flag, torch.distributed.ReduceOp.MIN)

    def any(self, flag: bool) -> bool:
        """``flag`` on some rank of the group (each rank calls this at the same point)."""
        return self._reduce(flag, torch.distributed.ReduceOp.MAX)

    def _reduce(self, flag: bool, op: Any) -> bool:
        from torch.distributed import distributed_c10d as c10d

        value = torch.tensor([int(flag)], dtype=torch.int64, device=self.device)
        torch.distributed.all_reduce(value, op=op, group=c10d._resolve_process_group(c10d.GroupName(self.name)))
        return bool(value.item())


@dataclass
class Verification:
    """What verification saw for one compiled step (``CompiledEntry.verification``)."""

    steps: int = 0
    exact: int = 0  # tensors compared bitwise (or to ulps) on the last verified step
    budgeted: int = 0  # tensors compared against the Newton–Schulz budget
    unsampled: int = 0  # plan-dependent tensors of members a stamped step's check leaves out
    seconds: float = 0.0  # spent checking (eager on copies, references, comparing), the compiled step not counted
    worst: float = 0.0  # ‖c − x‖ / ‖x − t0‖ of the budgeted tensor closest to its bound
    worst_bound: float = 0.0  # that tensor's bound, same units
    worst_algebra: float = 0.0  # max ‖y − x‖ / ‖x − t0‖
    worst_pointwise: float = 0.0  # max|c − e| / max|e| over the other tensors
    failed: str = ""
    reference: CapturedStep | None = field(default=None, repr=False)  # eager's program, for the fp64 run
    planned: frozenset[InputSlot] | None = field(default=None, repr=False)

    def describe(self) -> str:
        if self.failed:
            return f"verification against eager failed on step {self.steps}: {self.failed.splitlines()[1].strip()}"
        return f"verified {self.steps} step(s) against eager: {self.summary()}"

    def summary(self) -> str:
        text = f"{self.exact} tensor(s) "
        ulps = f"within ulps (max rel diff {self.worst_pointwise:.2g})"
        text += "bitwise equal" if self.worst_pointwise == 0.0 else ulps
        if self.unsampled:
            text += f", {self.unsampled} left out (members of classes checked on a sample)"
        if self.budgeted:
            text += (
                f", {self.budgeted} within the Newton–Schulz budget (max ‖compiled − exact‖ "
                f"{self.worst:.2g} of the update, bound {self.worst_bound:.2g}; plan algebra "
                f"{self.worst_algebra:.1g}, bound {ALGEBRA_TOLERANCE:g})"
            )
        return text


@dataclass
class SelfCheck:
    """What the self-check saw of one compiled program (``CompiledEntry.self_check``)."""

    runs: int = 0  # steps this program was selected for
    checks: int = 0
    seconds: float = 0.0  # spent checking, the real step not counted
    each: list[float] = field(default_factory=list)  # seconds of each check, in order
    step_seconds: float = 0.0  # the program's compiled steps (checked or not), what the budget is a share of
    pending: bool = False  # a check came due and waits for the budget
    postponed: int = 0  # checks that came due beyond the budget and ran later
    members: int = 0  # members the last check ran (of ``of``)
    ranks: RankGroup | None = None  # the step's own collectives' group: checked by its ranks together
    sliced: int = 0  # ... of which on their leading rows only (a first check: check_slices.py)
    whole_over_checked: float = 1.0  # the last check's members' elements / the elements it ran on
    of: int = 0
    worst: str = ""  # the last check's tensor closest to its bound
    skipped: str = ""  # why this program is not checked
    failed: str = ""
    irreproducible: int = 0  # checks whose first eager run on copies differed from its second (self_check._confirmed)

    def describe(self) -> str:
        if self.skipped:
            return f"self-check: not checked ({self.skipped})"
        if self.failed:
            return f"self-check FAILED on step {self.runs}: {self.failed}"
        if not self.checks:
            return "self-check: not run yet"
        each = self.seconds / self.checks
        head = f"self-check: {self.checks} step(s) checked against eager "
        head += f"by every rank of process group {self.ranks.name} together " if self.ranks else ""
        head += f"({self.members} of {self.of} params on the last"
        head += f", {self.sliced} of them on leading rows, " if self.sliced else ", "
        head += f"{each * 1e3:.1f} ms per check"
        if self.postponed:
            share = self.seconds / self.step_seconds if self.step_seconds else 0.0
            head += f"; {self.postponed} postponed to keep within {BUDGET:.0%} of step time, now {share:.1%}"
        if self.irreproducible:
            head += (f"; eager's own step did not reproduce itself on {self.irreproducible} check(s): "
                     "judged against its second run")
        return head + f"); {self.worst or 'all bitwise'}"
