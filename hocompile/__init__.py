"""hocompile: compile higher-order optimizer steps.

    opt = hocompile.compile_optimizer(torch.optim.Muon(params, lr=0.02))
    ...
    opt.step()
    print(hocompile.explain(opt))
"""

from __future__ import annotations

import difflib
import inspect
import os
from collections.abc import Mapping
from typing import Any, TypeVar, overload

import torch
from torch.distributed.tensor import DTensor

from .dynamo import explain_last, inductor_passes
from .errors import (
    BackendFallbackWarning,
    BlockwiseWarning,
    CacheWarning,
    CaptureError,
    CompiledHelperWarning,
    DistributedMismatchError,
    LinAlgFallbackWarning,
    RecompileLimitWarning,
    SelfCheckWarning,
    UnsupportedParameterError,
    VerificationError,
)
from .runtime import CompiledOptimizer
from .runtime.check.judgement import Verdict, judge_step
from .runtime.report.explain import explain
from .runtime.report.plan import plan
from .runtime.report.reports import Explanation, PlanReport, ProgramReport
from .runtime.wrappers import compile_wrapped, wrapped_slots
from .settings import Backend, Distributed, Fallback, Precision, Settings
from .targets import Target

__version__ = "0.1.0"


_Wrapper = TypeVar("_Wrapper")


# The two overloads say what comes back: a CompiledOptimizer for an optimizer, the wrapper itself for a
# training stack's wrapper; the keyword arguments are the implementation's (documented below).
@overload
def compile_optimizer(optimizer: torch.optim.Optimizer, **options: Any) -> CompiledOptimizer: ...


@overload
def compile_optimizer(optimizer: _Wrapper, **options: Any) -> _Wrapper: ...


def compile_optimizer(  # type: ignore[misc]
    optimizer: Any,
    *,
    backend: str | Backend = "auto",
    precision: str | Precision = "auto",
    fallback: str | Fallback = "error",
    cache_dir: str | os.PathLike[str] | None = None,
    options: Mapping[str, Any] | None = None,
    **more: Any,
) -> Any:
    """Wrap ``optimizer`` so its ``step()`` runs as a compiled graph.

    Args:
        optimizer: any ``torch.optim.Optimizer`` (torch.optim.Muon, AdamW,
            SGD, emerging_optimizers.Muon, ...). It keeps working: the
            compiled optimizer shares its param groups and state. Returns a
            :class:`CompiledOptimizer`. Or an optimizer *wrapper* of a training
            stack (Megatron Core's ``FP32Optimizer``, ``ChainedOptimizer``,
            ``LayerWiseDistributedOptimizer``, ...): the torch optimizers inside
            it are compiled in place and the wrapper itself is returned, its
            own step (grad preparation, clipping, gathers) unchanged
            (hocompile/runtime/wrappers.py).
        backend, precision, fallback, cache_dir: the four settings most users
            set (below).
        options: every other setting, by name: ``options={"verify": 3}``. The
            same names are accepted as keywords (``verify=3``); a name given
            both ways, or one that is no option, raises ``TypeError``.

    Options (``Settings.resolve`` holds the names, their defaults and checks):
        fallback: ``"error"`` (default) raises :class:`CaptureError` when the
            step cannot be compiled; ``"eager"`` logs a warning and runs the
            eager step for that configuration instead.
        structural_keys: extra param-group keys whose float values select the
            program (like ``ns_coefficients``) rather than feed it numbers.
        precision: Newton–Schulz compute precision. ``"auto"`` keeps the
            eager optimizer's dtype where the target declares GEMM units for
            it (a CPU's ISA flags, a GPU's architecture: never a timing, so
            every process plans the same) and computes in fp32 where it does
            not (faster there, and more accurate); ``"fp32"``, ``"bf16"``,
            ``"fp16"`` force one.
        target: ``"auto"`` (measure this CPU, or read the GPU's row of the
            table), a GPU architecture (``"sm80"``, ``"sm90"``, ``"sm100"``)
            or a :class:`hocompile.targets.Target`.
        backend: ``"auto"`` (generated Triton kernels for CUDA params, aten
            for CPU params), ``"aten"``, or ``"triton"`` (on CPU params the
            kernels run in Triton's interpreter: for tests and tiny models).
        cuda_graphs: with the Triton backend, capture each steady-state step
            once and replay it as a CUDA graph. Learning-rate schedules and
            new grad tensors stay valid: kernels read scalars and addresses
            from device tables refreshed before every replay.
        autotune: with the Triton backend, time each matmul kernel's candidate
            tiles once and keep the fastest (persisted per architecture in the
            cache directory); off by default: the per-architecture table decides.
        error_budget: with ``precision="auto"``, the largest max-abs error
            against fp64 a Newton–Schulz schedule may have on the calibration
            inputs (default: per input, no worse than eager's own precision).
        schedule: an explicit per-iteration schedule for every Newton–Schulz
            op, e.g. ``"fp8_e4m3*2+bf16*3"`` or a list of format names.
        max_batch, max_stack_bytes: cap how many same-shaped matrices
            batch-by-shape stacks into one group (default 64) and the bytes a
            stack may hold (default: the target's, 256 MiB on CPUs, 4 GiB on
            GPUs), to bound the step's peak memory.
        verify: check each new compiled step against the eager step for its
            first N steps (``True``: 3; default: ``HOCOMPILE_VERIFY``, else
            off): eager runs on copies of params, grads and state, and every
            tensor must match bitwise where the compiled plan keeps eager's
            arithmetic, and stay within the Newton–Schulz error budget where
            it does not (see hocompile/runtime/check/verify.py). A mismatch raises
            :class:`VerificationError` naming the parameter, tensor, size of
            the difference and bound, with the optimizer holding eager's
            result for that step; with ``fallback="eager"`` it logs a warning
            and runs that compiled step's signature eagerly from then on.
            Later steps cost nothing extra.
        recompile_limit: how many recompiles one optimizer may make (a
            positive int, default 8, like torch.compile's). Past it a
            ``RecompileLimitWarning`` is issued once and every new
            configuration runs the eager step (explain() lists the reasons).
        fused_updates: run recognised AdamW/Adam and SGD-momentum updates with
            torch's fused CPU kernels (``torch._fused_adamw_``/``_fused_sgd_``):
            3-6x eager's for-loop here, within 1e-6 of eager but not bitwise,
            so off by default (default: ``HOCOMPILE_FUSED_UPDATES``, else off).
        distributed: how the step runs across torch.distributed ranks.
            ``"local"``: every rank computes the whole step (as without
            torch.distributed). ``"replicated"`` (DDP: params and grads the
            same on every rank): each rank orthogonalises a cost-balanced
            share of the matrices and one all-gather per dtype bucket brings
            the rest (bitwise the single-process step); every compile checks
            across ranks that the plan and the params and grads agree, and
            raises :class:`DistributedMismatchError` (writing nothing) if not.
            ``"auto"`` (default) is ``"local"`` for plain tensors: nothing in
            them proves their grads are replicated.
        process_group: the group the ranks share with ``"replicated"``
            (default: the default group).
        tp_mode: Newton–Schulz on a matrix sharded as a DTensor (``Shard(0)``
            or ``Shard(1)``): ``"auto"`` (default) picks per matrix by a cost
            model (shown in :func:`explain`) between ``"route"`` (the whole
            matrix to an owner rank by two all-to-alls), ``"duplicated"``
            (all-gather, full NS, keep the own slice) and ``"distributed"``
            (an all-reduce of the Gram per iteration); naming one forces it.
            ``"blockwise"`` (each shard alone: a different update, with a
            warning) only when named.
        stamp: trace the step on one representative of each parameter class
            (params of a group with the same shapes, dtypes and state layout)
            and run its program for every member, where a second trace with
            two members per class proves the step one program per param
            (default True; ``HOCOMPILE_STAMP=0`` turns it off). Compile time
            then follows the number of classes, not of params; a step that
            mixes params (a global grad norm) is traced whole, and
            :func:`explain` says why.
        warm_start: a new process with the same optimizer code, shapes and
            settings loads its compiled steps from ``cache_dir`` instead of
            tracing them, and checks each loaded step's first step against
            eager on copies (a mismatch recompiles); default False
            (``HOCOMPILE_WARM_START=1`` turns it on): loading and that
            check cost more than a cold compile at every size measured.
        self_check: check every compiled program against the eager step on
            its steps 1, 2, 4, …, 512 and every 1,000th after, on copies of
            two params per parameter class, before the real step runs
            (default True; ``HOCOMPILE_SELF_CHECK=0`` turns it off). A
            mismatch issues a :class:`SelfCheckWarning` naming the param,
            tensor and difference, and that program runs eagerly from then
            on; nothing of the compiled step is applied. Its cost, averaged
            over 1,000 steps, is in the README (benchmarks/self_check.py).
        cache_dir, dump_dir, disable_passes, debug: override the
            ``HOCOMPILE_CACHE_DIR``, ``HOCOMPILE_DUMP_DIR``,
            ``HOCOMPILE_DISABLE_PASSES`` and ``HOCOMPILE_DEBUG`` settings.

    Compilation happens on the first ``step()`` (the state it creates lazily
    is part of the first graph) and again only when guards change.
    """
    settings = Settings.resolve(**_options(options, more, backend=backend, precision=precision, fallback=fallback,
                                           cache_dir=cache_dir))
    slots = wrapped_slots(optimizer)
    if slots is not None:  # a training stack's wrapper: compile what it holds, keep its own step
        return compile_wrapped(optimizer, slots, lambda inner: _compile_one(inner, settings))
    return _compile_one(optimizer, settings)


def _options(options: Mapping[str, Any] | None, more: dict[str, Any], **common: Any) -> dict[str, Any]:
    """compile_optimizer's settings by name: the common keywords, ``options=`` and the other keywords."""
    given = dict(options or {})
    known = [name for name in inspect.signature(Settings.resolve).parameters if name not in common]
    twice = sorted(set(given) & set(more))
    if twice:
        raise TypeError(f"compile_optimizer() got {', '.join(map(repr, twice))} both in options= and as a keyword")
    given.update(more)
    for name in given:
        if name in common:
            raise TypeError(f"compile_optimizer() takes {name!r} as a keyword of its own, not in options=")
        if name not in known:
            close = difflib.get_close_matches(name, [*known, *common], n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise TypeError(f"compile_optimizer() got an unknown option {name!r}{hint}; options are {', '.join(known)}")
    return {**common, **given}


def _compile_one(optimizer: torch.optim.Optimizer, settings: Settings) -> CompiledOptimizer:
    if settings.distributed == Distributed.REPLICATED and not (
        torch.distributed.is_available() and torch.distributed.is_initialized()
    ):
        raise ValueError("distributed='replicated' needs torch.distributed initialised (dist.init_process_group) first")
    if settings.distributed == Distributed.REPLICATED and any(
        isinstance(p, DTensor) for g in optimizer.param_groups for p in g["params"]
    ):
        raise ValueError(
            "distributed='replicated' is for plain tensors that are the same on every rank (DDP); "
            "these params are DTensors (FSDP2): leave distributed='auto'"
        )
    return CompiledOptimizer(optimizer, settings)


__all__ = [
    "Backend",
    "BackendFallbackWarning",
    "BlockwiseWarning",
    "CacheWarning",
    "CaptureError",
    "CompiledHelperWarning",
    "CompiledOptimizer",
    "Distributed",
    "Explanation",
    "DistributedMismatchError",
    "Fallback",
    "LinAlgFallbackWarning",
    "PlanReport",
    "Precision",
    "ProgramReport",
    "RecompileLimitWarning",
    "SelfCheckWarning",
    "Settings",
    "Target",
    "UnsupportedParameterError",
    "Verdict",
    "VerificationError",
    "compile_optimizer",
    "explain",
    "explain_last",
    "inductor_passes",
    "judge_step",
    "plan",
]
