"""The self-check of a program whose step issues collectives: every rank of the group decides alike.

A step that calls collectives itself (Megatron's tensor-parallel Newton–Schulz: all-gathers or
all-reduces on its TP group; collectives.py compiles them) is checked on copies like any other:
the compiled program and eager's step each run on every rank's copies, and their collectives meet
the peers' on the copies. That holds only if every rank of the group checks at the same steps and
makes the same choices inside the check, and if they agree on the verdict (a rank running eagerly
beside one running the compiled program would issue other collectives). So, for such a program:

- a check comes due on the schedule alone (steps 1, 2, 4, …, then every 1,000th; the run counts are
  the same on every rank) and runs where every rank is within its time budget (one all-reduce, MIN;
  a program's first check always runs); a check beyond the budget is skipped, not postponed;
- whole members only (no leading-row slices), and eager's own GEMMs (no fp32-GEMM reference),
  whose second judgement would be one rank's choice;
- eager is re-run under another summation order on every rank if any rank needs it (MAX);
- the verdict is the group's (MAX): a rank that agreed falls back with the rank that did not.

Programs whose collectives hocompile planned (``distributed=``, DTensor routes) are not checked:
their eager step issues no collectives and a check would run the whole step eagerly on every rank.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ...capture.collectives import collective_launches
from ...ir.graph import ORIGIN
from ..records import RankGroup

if TYPE_CHECKING:
    from ..entries import CompiledEntry


def step_collective_group(entry: CompiledEntry, groups: list[dict[str, Any]]) -> RankGroup | None:
    """The process group of the collectives the user's step issues, as the capture recorded them; None
    where it issues none, or where a pass planned collectives of its own (``distributed=``, DTensor
    routes: a pass is their ``ORIGIN``), whose eager step is another program altogether. Asked once per
    program (the self-check's record keeps it), not per step."""
    captured = entry.captured
    if captured is None or captured.sharded:
        return None
    launches = collective_launches(captured.gm)
    if not launches or any(n.meta.get(ORIGIN, "capture") != "capture" for n in launches):
        return None
    device = next((p.device for g in groups for p in g["params"]), torch.device("cpu"))
    return RankGroup(str(launches[0].args[-1]), device)  # one group: the capture refuses several


def group_verdict(why: str, ranks: RankGroup) -> str:
    """The group's verdict: this rank's difference, or that another rank of the group saw one."""
    if ranks.any(bool(why)) and not why:
        return (f"another rank of its process group ({ranks.name}) saw its step differ from eager's; every "
                "rank falls back together, since ranks running different programs would issue different "
                "collectives")
    return why
