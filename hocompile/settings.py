"""User settings: explicit arguments win over environment variables.

- ``HOCOMPILE_DEBUG``: 0 quiet (default), 1 log compiles and recompiles,
  2 also log each pass and print the final graph.
- ``HOCOMPILE_DUMP_DIR``: write graphs before/after each pass and the lowered
  module there.
- ``HOCOMPILE_CACHE_DIR``: where generated modules live (default
  ``~/.cache/hocompile``).
- ``HOCOMPILE_DISABLE_PASSES``: comma-separated pass names to skip.
- ``HOCOMPILE_VERIFY``: check each new compiled step against eager for its
  first steps (runtime/check/verify.py): ``1``/``true``/``on`` for the default
  number (3), another integer N for N steps, ``0``/``false``/``off`` (or
  unset) for none.
- ``HOCOMPILE_SELF_CHECK``: ``0``/``false``/``off`` turns off the sampled
  check of every compiled program against eager on its steps 1, 2, 4, …,
  512 and every 1,000th after (runtime/check/self_check.py); on by default.
- ``HOCOMPILE_STAMP``: ``0``/``false``/``off`` traces every param of a step
  instead of one representative per parameter class (classes/stamp.py); on
  by default.
- ``HOCOMPILE_WARM_START``: ``1``/``true``/``on`` loads compiled steps of
  earlier processes from the cache directory and keeps them there
  (runtime/warm.py). Off by default: loading plus the first step's check
  against eager cost more than a cold compile at every size measured
  (benchmarks/scale.py: 3.8 s against 1.7 s at 48 matrices, 71 s against
  5.7 s at Qwen3's count), and a warm start must cost less or stay off.
- ``HOCOMPILE_FUSED_UPDATES``: ``1``/``true``/``on`` runs AdamW and
  SGD-momentum updates on the aten lowering with torch's fused CPU kernels
  (3-4x faster, within 1e-6 of eager but not bitwise; lowering/fused_updates.py).
  Off by default: the aten lowering is otherwise bitwise eager for these.

The choices among names (backend, fallback, precision) are enums whose
values are the strings users pass: ``Backend("triton")``, and a member
compares equal to its string, so ``settings.backend == "triton"`` holds.
"""

from __future__ import annotations

import enum
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .capture.group_hypers import STRUCTURAL_KEYS
from .diskcache import default_cache_dir
from .precision.calibrate import parse_schedule_key
from .precision.emulate import FORMATS
from .targets import Target

DEFAULT_VERIFY_STEPS = 3
_VERIFY_ON = ("1", "true", "yes", "on")
_VERIFY_OFF = ("", "0", "false", "no", "off")


class _Choice(str, enum.Enum):
    """A named option: its value is the user's string, and it prints as that string (cache keys, logs)."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


class Backend(_Choice):
    AUTO = "auto"  # Triton for CUDA params (when triton is installed), aten otherwise
    ATEN = "aten"
    TRITON = "triton"


class Fallback(_Choice):
    ERROR = "error"  # a step that cannot be compiled raises
    EAGER = "eager"  # ... or runs eagerly, with a warning


class Distributed(_Choice):
    """How a step runs across torch.distributed ranks (hocompile/distributed/replicated.py)."""

    AUTO = "auto"  # "local" for plain tensors: nothing proves their grads are the same on every rank
    LOCAL = "local"  # each rank computes the whole step, as without torch.distributed
    REPLICATED = "replicated"  # DDP: params and grads identical on every rank; each computes a share


class Precision(_Choice):
    """Newton–Schulz compute precision: "auto" or a name of hocompile.ir.dtypes."""

    AUTO = "auto"
    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"
    FP64 = "fp64"


# The accepted strings, for messages and for callers that validate names.
BACKENDS = tuple(b.value for b in Backend)
FALLBACKS = tuple(f.value for f in Fallback)
PRECISIONS = tuple(p.value for p in Precision)
DISTRIBUTED = tuple(d.value for d in Distributed)
# Newton–Schulz on a sharded matrix (passes/route_sharded.py, distributed/tp_plan.py): the cost model
# picks ("auto"), or every such call routes whole to an owner, or runs one tensor-parallel mode
# ("blockwise" changes the update: only on this request, with a warning).
TP_MODES = ("auto", "route", "duplicated", "distributed", "blockwise")


@dataclass(frozen=True)
class Settings:
    cache_dir: Path = field(default_factory=default_cache_dir)
    dump_dir: Path | None = None
    disabled_passes: frozenset[str] = frozenset()
    debug: int = 0
    fallback: Fallback = Fallback.ERROR
    structural_keys: frozenset[str] = STRUCTURAL_KEYS
    precision: Precision = Precision.AUTO
    target: str | Target = "auto"
    backend: Backend = Backend.AUTO
    cuda_graphs: bool = False
    autotune: bool = False
    error_budget: float | None = None
    schedule: tuple[str, ...] = ()
    max_batch: int | None = None
    max_stack_bytes: int | None = None
    verify: int = 0  # steps checked against eager after each compile (runtime/check/verify.py)
    recompile_limit: int = 8
    fused_updates: bool = False  # see HOCOMPILE_FUSED_UPDATES above
    distributed: Distributed = Distributed.AUTO
    process_group: str | None = None  # its group_name (a name pickles; a ProcessGroup does not); None: default
    tp_mode: str = "auto"  # NS of a sharded (DTensor) matrix: "auto" (cost model) or one of TP_MODES' others
    stamp: bool = True  # trace one representative per parameter class where the step is proved separable
    warm_start: bool = False  # load compiled steps of earlier processes from cache_dir (runtime/warm.py)
    self_check: bool = True  # check each program against eager on a sample of its steps (runtime/check/self_check.py)

    def __post_init__(self) -> None:
        # Settings(...) built directly may hold the plain strings: store the members
        # (ValueError names an unknown one).
        object.__setattr__(self, "fallback", Fallback(self.fallback))
        object.__setattr__(self, "precision", Precision(self.precision))
        object.__setattr__(self, "backend", Backend(self.backend))
        object.__setattr__(self, "distributed", Distributed(self.distributed))

    @staticmethod
    def resolve(
        *,
        cache_dir: str | os.PathLike[str] | None = None,
        dump_dir: str | os.PathLike[str] | None = None,
        disable_passes: tuple[str, ...] | list[str] | None = None,
        debug: int | None = None,
        fallback: str | Fallback = "error",
        structural_keys: tuple[str, ...] | list[str] = (),
        precision: str | Precision = "auto",
        target: str | Target = "auto",
        backend: str | Backend = "auto",
        cuda_graphs: bool = False,
        autotune: bool = False,
        error_budget: float | None = None,
        schedule: tuple[str, ...] | list[str] | str = (),
        max_batch: int | None = None,
        max_stack_bytes: int | None = None,
        verify: bool | int | None = None,
        recompile_limit: int = 8,
        fused_updates: bool | None = None,
        distributed: str | Distributed = "auto",
        process_group: Any = None,
        tp_mode: str = "auto",
        stamp: bool | None = None,
        warm_start: bool | None = None,
        self_check: bool | None = None,
    ) -> Settings:
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
        if error_budget is not None and not error_budget > 0:
            raise ValueError(f"error_budget must be a positive max-abs error, got {error_budget!r}")
        for name, cap in (("max_batch", max_batch), ("max_stack_bytes", max_stack_bytes)):
            if cap is not None and (not isinstance(cap, int) or cap < 1):
                raise ValueError(f"{name} must be a positive int, got {cap!r}")
        if isinstance(recompile_limit, bool) or not isinstance(recompile_limit, int) or recompile_limit < 1:
            raise ValueError(f"recompile_limit must be a positive int, got {recompile_limit!r}")
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if fallback not in FALLBACKS:
            raise ValueError(f"fallback must be one of {FALLBACKS}, got {fallback!r}")
        if distributed not in DISTRIBUTED:
            raise ValueError(f"distributed must be one of {DISTRIBUTED}, got {distributed!r}")
        if process_group is not None and not hasattr(process_group, "group_name"):
            kind = type(process_group).__name__
            raise TypeError(f"process_group must be a torch.distributed ProcessGroup, got {kind}")
        if tp_mode not in TP_MODES:
            raise ValueError(f"tp_mode must be one of {TP_MODES}, got {tp_mode!r}")
        env_dump = os.environ.get("HOCOMPILE_DUMP_DIR")
        env_disabled = os.environ.get("HOCOMPILE_DISABLE_PASSES", "")
        env_debug = os.environ.get("HOCOMPILE_DEBUG", "0")
        try:
            debug_level = int(env_debug) if debug is None else debug
        except ValueError as exc:
            raise ValueError(f"HOCOMPILE_DEBUG must be an integer level, got {env_debug!r}") from exc
        disabled = disable_passes if disable_passes is not None else env_disabled.split(",")
        settings = Settings(
            cache_dir=Path(cache_dir) if cache_dir is not None else default_cache_dir(),
            dump_dir=Path(dump_dir) if dump_dir is not None else (Path(env_dump) if env_dump else None),
            disabled_passes=frozenset(d.strip() for d in disabled if d.strip()),
            debug=debug_level,
            fallback=Fallback(fallback),
            structural_keys=STRUCTURAL_KEYS | frozenset(structural_keys),
            precision=Precision(precision),
            target=target,
            backend=Backend(backend),
            cuda_graphs=cuda_graphs,
            autotune=autotune,
            error_budget=error_budget,
            schedule=_schedule(schedule),
            max_batch=max_batch,
            max_stack_bytes=max_stack_bytes,
            fused_updates=(
                os.environ.get("HOCOMPILE_FUSED_UPDATES", "").strip().lower() in _VERIFY_ON
                if fused_updates is None
                else bool(fused_updates)
            ),
            verify=_verify_steps(verify),
            recompile_limit=recompile_limit,
            distributed=Distributed(distributed),
            process_group=str(process_group.group_name) if process_group is not None else None,
            tp_mode=tp_mode,
            stamp=(
                os.environ.get("HOCOMPILE_STAMP", "").strip().lower() not in _VERIFY_OFF[1:]
                if stamp is None
                else bool(stamp)
            ),
            warm_start=(
                os.environ.get("HOCOMPILE_WARM_START", "").strip().lower() not in _VERIFY_OFF
                if warm_start is None
                else bool(warm_start)
            ),
            self_check=(
                os.environ.get("HOCOMPILE_SELF_CHECK", "").strip().lower() not in _VERIFY_OFF[1:]
                if self_check is None
                else bool(self_check)
            ),
        )
        if debug_level:
            logging.getLogger("hocompile").setLevel(logging.DEBUG if debug_level >= 2 else logging.INFO)
        return settings


def _verify_steps(verify: bool | int | None) -> int:
    """``verify=`` (or ``HOCOMPILE_VERIFY`` when it is None) as a number of steps; True: the default."""
    if verify is None:
        env = os.environ.get("HOCOMPILE_VERIFY", "").strip().lower()
        if env in _VERIFY_ON:
            return DEFAULT_VERIFY_STEPS
        if env in _VERIFY_OFF:
            return 0
        if not env.isdigit():
            raise ValueError(f"HOCOMPILE_VERIFY must be 1/true/on, 0/false/off or a number of steps, got {env!r}")
        return int(env)
    if isinstance(verify, bool):
        return DEFAULT_VERIFY_STEPS if verify else 0
    if not isinstance(verify, int) or verify < 0:
        raise ValueError(f"verify must be True, False or a number of steps >= 0, got {verify!r}")
    return verify


def _schedule(schedule: tuple[str, ...] | list[str] | str) -> tuple[str, ...]:
    """One format per iteration; ``"fp8_e4m3*2+bf16*3"`` is accepted too."""
    formats = parse_schedule_key(schedule) if isinstance(schedule, str) and schedule else tuple(schedule)
    unknown = [f for f in formats if f not in FORMATS]
    if unknown:
        raise ValueError(f"schedule: unknown format(s) {unknown}; known: {sorted(FORMATS)}")
    return formats
