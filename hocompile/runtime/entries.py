"""What a CompiledOptimizer keeps per compiled step, its counters, the checks
around it, and how one compiled step runs on the optimizer's live objects:
the records explain() reads, kept apart from the optimizer's bookkeeping.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..capture.container_trace import write_containers
from ..capture.host_state import MISSING
from ..capture.trace import CapturedStep, host_env, slot_tensor, step_tensors
from ..distributed.sharded import like_param, local_tensor
from ..errors import LinAlgFallbackWarning, RecompileLimitWarning  # noqa: F401  (defined there, re-exported here)
from ..ir.graph import InputSlot
from ..lowering import LoweredStep
from ..passes import PassRecord
from ..settings import Settings
from .records import SelfCheck, Verification
from .stamped import StampedRun, run_stamped

# Attributes GradScaler sets on an optimizer whose step supports AMP scaling.
FORWARDED = frozenset({"grad_scale", "found_inf"})


def check_optimizer_like(obj: Any) -> None:
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


_COUNTER_KEYS = ("compiles", "cache_hits", "disk_hits", "eager_fallbacks", "recompiles", "variants", "warm_starts")


@dataclass
class Counters(Mapping[str, Any]):
    """compiles, cache hits (steps served by a compiled step), disk hits,
    eager fallbacks, and the reason of every recompile; reads like a dict."""

    compiles: int = 0
    cache_hits: int = 0
    disk_hits: int = 0
    eager_fallbacks: int = 0
    recompiles: list[str] = field(default_factory=list)
    # Compiles of another outcome of a host-selected branch (a guard on a Python
    # number such as ``step % k == 0``): expected, one per outcome, not recompiles.
    variants: list[str] = field(default_factory=list)
    # Compiled steps loaded from the cache directory's warm-start records instead of traced.
    warm_starts: int = 0
    # Steps run as torch runs them by design (fused_kernels.runs_as_is: torch's own fused step).
    as_is: int = 0

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
            "variants": list(self.variants),
            "warm_starts": self.warm_starts,
            "as_is": self.as_is,
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
    self_check: SelfCheck = field(default_factory=SelfCheck)  # the sampled check, on by default (self_check.py)
    fenced: bool = False  # a LinAlgError it raises has written nothing (lower_step.CompiledStep.fenced)
    # Traced on one representative per parameter class (classes/stamp.py): how its programs run per
    # member; else None, and ``stamp_note`` says why the step was traced whole.
    stamped: StampedRun | None = None
    stamp_note: str = ""
    # Loaded from this warm-start record (warm.py): its first step is checked against eager.
    warm: str = ""

    @classmethod
    def eager(cls, reason: str, why: str) -> CompiledEntry:
        """An entry for a signature that runs eagerly: compiled for ``reason``, not compiled because ``why``."""
        return cls(None, None, [], "", 0.0, 0.0, 0.0, reason, why)


@dataclass(frozen=True)
class StepRunner:
    """What the checks (``check/``) and the warm start need of a CompiledOptimizer, handed to them
    instead of the optimizer: the user's optimizer, the settings, the counters, the compiled steps so
    far, and three functions. The checks never see the CompiledOptimizer itself."""

    optimizer: torch.optim.Optimizer  # the user's own: eager's reference step runs on its copies
    settings: Settings
    counters: Counters
    history: list[CompiledEntry]  # every compiled step in order: a position is the step's number in messages
    run: Callable[[CompiledEntry, dict[str, Any] | None], None]  # the compiled step, on the live objects
    host_env: Callable[[CapturedStep], dict[str, Any]]  # the host values a captured step runs with now
    forget: Callable[[CompiledEntry], None]  # never select this compiled step again

    def number(self, entry: CompiledEntry) -> int:
        """``entry``'s position in the history, from 1 (0 where it is not there)."""
        return next((k for k, e in enumerate(self.history, start=1) if e is entry), 0)


def run_entry(opt: torch.optim.Optimizer, entry: CompiledEntry, env: dict[str, Any] | None) -> bool:
    """Run ``entry`` on ``opt``'s params and state and write every result back; True if it created state."""
    captured, lowered = entry.captured, entry.lowered
    assert captured is not None and lowered is not None
    if env is None:
        env = host_env(opt, captured)
    if entry.stamped is not None:
        return run_stamped(opt, entry.stamped, env)
    tensors: list[Any] = step_tensors(opt, captured.inputs, env)
    if captured.sharded:  # DTensors: the module runs on the local shards (their writes land in the DTensors)
        tensors = [local_tensor(t) for t in tensors]
    # Evaluated before anything runs: an error here leaves everything as it was.
    host_values = [(u.slot, u.value(env)) for u in captured.host_updates]
    outputs = lowered.run(tensors + list(captured.scalars(env)))
    # The generated code wrote most results in place already (writeback.py);
    # the rest (newly created state, views) is installed here.
    in_containers: dict[InputSlot, torch.Tensor] = {}
    for action, value in zip((captured.outputs[i] for i in lowered.kept), outputs):
        slot = action.slot
        if action.mode == "copy":
            local_tensor(slot_tensor(opt, slot)).copy_(value)
        elif slot.leaf >= 0:
            in_containers[slot] = value
        else:
            p = opt.param_groups[slot.group]["params"][slot.index]
            # New state of a DTensor param is a DTensor as eager makes it (state_dict, DCP)
            opt.state[p][slot.key] = like_param(value, p) if captured.sharded else value
    if in_containers or captured.trees:
        write_containers(opt, captured.trees, in_containers, dict(zip(captured.inputs, tensors)))
    # (a leaf of a container is new state only where the container is: a list the step grows is not)
    created = any(a.mode == "assign" and a.slot.leaf < 0 for a in captured.outputs)
    created = created or any(t.new for t in captured.trees)
    for g, i in captured.clears_grads:
        opt.param_groups[g]["params"][i].grad = None
    for host_slot, value in host_values:
        created = created or host_slot.read(opt) is MISSING
        host_slot.write(opt, value)
    return created
