"""What a CompiledOptimizer keeps per compiled step, its counters, and the checks
around it: the records explain() reads, kept apart from the runtime logic.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..capture import CapturedStep
from ..lowering import LoweredStep
from ..passes import PassRecord
from .verify import Verification


def _kernel_formats(triton: bool, device: torch.device) -> frozenset[str] | None:
    """The NS formats the Triton lowering has kernels for on ``device``; None (all) for aten."""
    if not triton:
        return None
    from ..lowering.triton import device_arch
    from ..lowering.triton.ns_scheduled import schedule_formats

    return schedule_formats(device_arch(device))




# Attributes GradScaler sets on an optimizer whose step supports AMP scaling.
_FORWARDED = frozenset({"grad_scale", "found_inf"})


def _check_optimizer_like(obj: Any) -> None:
    """An object that is not a torch.optim.Optimizer compiles if it has what the capture rebinds."""
    missing = []
    if not callable(getattr(obj, "step", None)):
        missing.append("a step() method")
    groups = getattr(obj, "param_groups", None)
    if not (isinstance(groups, list) and all(isinstance(g, dict) and "params" in g for g in groups)):
        missing.append("param_groups (a list of dicts, each with 'params')")
    if not isinstance(vars(obj).get("state") if hasattr(obj, "__dict__") else None, dict):
        missing.append("state (a dict attribute keyed by param, which the capture can rebind)")
    if missing:
        raise TypeError(
            f"compile_optimizer expects a torch.optim.Optimizer or an object like one; "
            f"{type(obj).__name__} lacks {', '.join(missing)}"
        )


class RecompileLimitWarning(UserWarning):
    """An optimizer recompiled ``recompile_limit`` times; new configurations run eagerly."""


_COUNTER_KEYS = ("compiles", "cache_hits", "disk_hits", "eager_fallbacks", "recompiles")


@dataclass
class Counters(Mapping[str, Any]):
    """compiles, cache hits (steps served by a compiled step), disk hits,
    eager fallbacks, and the reason of every recompile; reads like a dict."""

    compiles: int = 0
    cache_hits: int = 0
    disk_hits: int = 0
    eager_fallbacks: int = 0
    recompiles: list[str] = field(default_factory=list)

    def __getitem__(self, key: str) -> Any:
        if key not in _COUNTER_KEYS:
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self) -> Iterator[str]:
        return iter(_COUNTER_KEYS)

    def __len__(self) -> int:
        return len(_COUNTER_KEYS)

    def as_dict(self) -> dict[str, Any]:
        return {
            "compiles": self.compiles,
            "cache_hits": self.cache_hits,
            "disk_hits": self.disk_hits,
            "eager_fallbacks": self.eager_fallbacks,
            "recompiles": list(self.recompiles),
        }


@dataclass
class CompiledEntry:
    """One compiled step and how it was made (what explain() reports)."""

    captured: CapturedStep | None
    lowered: LoweredStep | None
    passes: list[PassRecord]
    final_graph: str
    compile_seconds: float
    pass_seconds: float
    lower_seconds: float
    reason: str  # why it was compiled: "first step" or the recompile reason
    fallback: str = ""  # non-empty: this signature runs eagerly, and why
    decisions: list[str] = field(default_factory=list)  # per-op plans, for explain()
    final_stats: dict[str, int] = field(default_factory=dict)
    verification: Verification = field(default_factory=Verification)  # verify=N: steps checked against eager
