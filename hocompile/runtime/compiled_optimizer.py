"""CompiledOptimizer: a drop-in for the optimizer it wraps.

``param_groups``, ``state`` and ``defaults`` *are* the wrapped optimizer's
objects, so ``state_dict()`` is the eager format, schedulers that edit
``param_groups`` work unchanged, and the eager optimizer can take over at any
time. Each ``step()``:

1. computes the guard signature (params, grads, state, structural options);
2. finds a compiled step for it whose hyperparameter branches still hold, or
   validates the inputs and compiles one (compile_step.py: capture -> passes
   -> lowering, the driver plan() shares);
3. evaluates the host scalars from the live hyperparameters, runs the graph
   functionally, and only then writes every result back (entries.run_entry).

An error at any point before the write-back leaves params and state as they
were.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from itertools import chain
from typing import Any

import torch
from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

from ..capture.fused_kernels import runs_as_is
from ..capture.host_state import HostSlot
from ..capture.trace import CapturedStep, unwrapped_step
from ..errors import CaptureError, UnsupportedParameterError
from ..passes import Pass
from ..settings import Fallback, Settings
from .check.checked_run import run_checked
from .compile_step import compile_step, params_device, resolve_backend, step_pipeline
from .drop_in import DropIn
from .entries import (
    CompiledEntry,
    Counters,
    LinAlgFallbackWarning,
    RecompileLimitWarning,
    StepRunner,
    check_optimizer_like,
    host_env,
    run_entry,
)
from .fast_guard import FastGuard
from .guards import Signature, describe_change, signature
from .selection import Selection, select
from .validate import validate

__all__ = ["CompiledEntry", "CompiledOptimizer", "Counters", "LinAlgFallbackWarning", "RecompileLimitWarning"]


# Programs one signature may hold for the outcomes of host-number branches before
# further ones count as recompiles (a guard on a value that changes every step).
VARIANTS_PER_SIGNATURE = 4

log = logging.getLogger("hocompile")


class CompiledOptimizer(DropIn):
    """Runs the wrapped optimizer's step as a compiled graph."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        settings: Settings | None = None,
        pipeline: tuple[Pass, ...] | None = None,
    ) -> None:
        # Optimizer.__init__ is deliberately not called: it would copy the
        # param groups, and ours must stay the wrapped optimizer's own.
        if isinstance(optimizer, CompiledOptimizer):
            raise TypeError("this optimizer is already compiled")
        self._inner = optimizer
        self._settings = settings or Settings.resolve()
        # Set when the object is not optimizer-like and fallback="eager": every
        # step is its own, and this says why (explain() shows it).
        self._passthrough = ""
        self._as_is = ""  # why the step runs as torch runs it (fused_kernels.runs_as_is), once seen
        if not isinstance(optimizer, torch.optim.Optimizer):
            try:
                check_optimizer_like(optimizer)
            except TypeError as exc:
                if self._settings.fallback != Fallback.EAGER:
                    raise
                self._passthrough = str(exc)
                log.warning("hocompile: every step of %s runs eagerly: %s", type(optimizer).__name__, exc)
        self._pipeline_override = pipeline
        self._pipeline_cache: tuple[Pass, ...] | None = None
        self._entries: dict[Signature, list[CompiledEntry]] = {}
        # Steps that could not be captured, by coarse signature (every Python number masked)
        self._eager_by_coarse: dict[Signature, CompiledEntry] = {}
        self._last_signature: Signature | None = None
        self.history: list[CompiledEntry] = []
        self.counters = Counters()
        self.steps = 0
        # Python numbers the step rewrites (host_state.py): host inputs of the
        # compiled steps, so their values are left out of the guard signature.
        self._lifted: frozenset[HostSlot] = frozenset()
        self._warned_limit = False
        # Set when a step created optimizer state (eager's lazy first-step
        # init): the next step needs the steady-state graph, which is expected
        # and not counted as a recompile.
        self._created_state = False
        # The last step's signature, checked without recomputing it (fast_guard.py).
        self._fast: FastGuard | None = None
        # What the checks and the warm start get of this optimizer (entries.StepRunner), made once.
        self._runner = StepRunner(optimizer, self._settings, self.counters, self.history, self._run, self._host_env,
                                  self._forget)

    # -- what explain() reads ----------------------------------------------
    @property
    def passthrough(self) -> str:
        """Why every step runs eagerly ('' when steps compile): explain() reports it."""
        return self._passthrough

    @property
    def as_is(self) -> str:
        """Why the step runs as torch runs it (torch's own fused kernel), once seen; else ''."""
        return self._as_is

    # copy.deepcopy, pickle and torch.save: the wrapped optimizer (params and
    # state) and the settings travel; compiled steps are rebuilt (or found in
    # the disk cache) on the copy's first step.
    def __getstate__(self) -> dict[str, Any]:  # type: ignore[override]
        return {"optimizer": self._inner, "settings": self._settings, "pipeline": self._pipeline_override}

    def __setstate__(self, state: dict[str, Any]) -> None:
        CompiledOptimizer.__init__(self, state["optimizer"], state["settings"], state["pipeline"])

    def __repr__(self) -> str:
        return f"CompiledOptimizer({self._inner!r})"

    @property
    def pipeline(self) -> tuple[Pass, ...]:
        """The passes this optimizer's steps go through (target calibrated on first use)."""
        if self._pipeline_cache is None:
            if self._pipeline_override is not None:
                self._pipeline_cache = self._pipeline_override
            else:
                device = params_device(self._inner)
                backend = resolve_backend(self._settings, device)
                self._pipeline_cache = step_pipeline(self._settings, device, backend)[0]
        return self._pipeline_cache

    @property
    def backend(self) -> str:
        """ "triton" or "aten": the setting, with "auto" resolved by the params' device."""
        return resolve_backend(self._settings, params_device(self._inner))

    def kernels(self) -> list[Any]:
        """Every generated Triton kernel of the compiled steps (name, family, spec, origin, source)."""
        seen: dict[str, Any] = {}
        for entry in self.history:
            for kernel in entry.lowered.kernels if entry.lowered is not None else []:
                seen.setdefault(kernel.name, kernel)
        return list(seen.values())

    # -- stepping ----------------------------------------------------------
    @torch.compiler.disable(recursive=True)
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        # Opaque to Dynamo: inside a torch.compile'd training step this runs as
        # one call (a graph break), the way an eager optimizer's fused kernel would.
        # Eager's order: pre-hooks, then the step (which calls the closure), then post-hooks.
        if self._passthrough:
            self.counters.eager_fallbacks += 1
            self.steps += 1
            return self._inner.step() if closure is None else self._inner.step(closure)
        args: tuple[Any, ...] = (self,) if closure is None else (self, closure)
        kwargs: dict[str, Any] = {}
        own_pre = getattr(self._inner, "_optimizer_step_pre_hooks", {})
        hooks = chain(_global_optimizer_pre_hooks.values(), own_pre.values())
        for pre_hook in hooks:
            result = pre_hook(self, args, kwargs)
            if result is not None:
                if not (isinstance(result, tuple) and len(result) == 2):
                    raise RuntimeError(
                        f"{pre_hook} must return None or a tuple of (new_args, new_kwargs), but got {result}."
                    )
                args, kwargs = result
        closure = args[1] if len(args) > 1 else kwargs.get("closure")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with torch.no_grad():
            self._step()
        if hasattr(self._inner.step, "_wrapped_by_lr_sched"):
            # An LR scheduler made before the wrap watches the inner step, which the compiled step
            # replaces: record the call as its wrapper would, or its first step() warns of a
            # "lr_scheduler.step() before optimizer.step()" that did not happen.
            self._inner._opt_called = True  # type: ignore[attr-defined]
        own_post = getattr(self._inner, "_optimizer_step_post_hooks", {})
        for post_hook in chain(own_post.values(), _global_optimizer_post_hooks.values()):
            post_hook(self, args, kwargs)
        return loss

    def _step(self) -> None:
        if self._runs_as_torch_runs_it():
            return
        structural = self._settings.structural_keys
        fast = self._fast
        if fast is not None and fast.holds(self._inner):  # the signature of the last step, unchanged
            sig, candidates = fast.sig, fast.candidates
        else:
            fast = None
            sig = signature(self._inner, structural, self._lifted)
            candidates = self._entries.get(sig, [])
        selected = select(self._inner, candidates, self._host_env)
        entry, env = selected.entry, selected.env
        if entry is None and not candidates and self._eager_by_coarse:
            # This configuration differs from one that could not be captured only in
            # Python numbers (a counter the step bumps): it runs eagerly too, no retry.
            entry = self._eager_by_coarse.get(signature(self._inner, structural, self._lifted, coarse=True))
        if entry is None:
            entry = self._compile_missing(sig, len(candidates), selected)
            sig = signature(self._inner, structural, self._lifted)
            env = None
            fast = None
        else:
            self.counters.cache_hits += 1
        if fast is None and entry.captured is not None and not entry.fallback and sig in self._entries:
            self._fast = FastGuard(self._inner, sig, structural, self._lifted, self._entries[sig])
        self._last_signature = sig
        self._created_state = False
        self.steps += 1
        self._run_selected(entry, env)

    def _runs_as_torch_runs_it(self) -> bool:
        """Steps that run eagerly by design, with nothing to select: torch's own fused step, or no grads."""
        if why := runs_as_is(self._inner):  # torch's own fused step: one kernel, run as torch runs it
            self._as_is = why
            self.counters.as_is += 1
            self.steps += 1
            unwrapped_step(self._inner)(self._inner)
            return True
        if not any(p.grad is not None for g in self._inner.param_groups for p in g["params"]):
            # Nothing to compile: the eager step is what eager does here (for
            # torch.optim, nothing; a custom step may still tick a counter).
            unwrapped_step(self._inner)(self._inner)
            return True
        return False

    def _compile_missing(self, sig: Signature, candidates: int, selected: Selection) -> CompiledEntry:
        """A new compiled step for ``sig``, where none of its ``candidates`` holds; why, as explain() says it."""
        reason = selected.failed_guard or (
            "first step" if self._last_signature is None else describe_change(self._last_signature, sig)
        )
        # Right after a step that created state (tensors, or Python keys such as
        # a new group["step"]), the steady-state compile is expected, not a recompile.
        expected = self._created_state and reason.startswith(("state of", "param_groups[", "optimizer attribute"))
        if expected:
            reason = "steady state: the previous step created the optimizer state"
        # Another outcome of a branch on a number the step itself counts (a refresh
        # every k steps, a warm-up): one program per outcome, a variant while a
        # signature has few. A changed hyperparameter, or a guard that fails with
        # every new value, is a recompile.
        variant = selected.on_counter and not expected and candidates < VARIANTS_PER_SIGNATURE
        return self._compile(sig, reason, expected, variant)

    def _run_selected(self, entry: CompiledEntry, env: dict[str, Any] | None) -> None:
        """``entry``'s step: eagerly where it is an eager fallback, else compiled (and checked on its steps)."""
        if entry.captured is None or entry.fallback:
            self.counters.eager_fallbacks += 1
            keys_before = self._state_keys()
            unwrapped_step(self._inner)(self._inner)
            # An eager step that created state makes the next compile the
            # expected steady-state one, exactly as a compiled first step does.
            self._created_state = self._state_keys() != keys_before
            return
        try:
            run_checked(self._runner, entry, env)  # checked against eager on verify='s and the self-check's steps
        except torch.linalg.LinAlgError as exc:
            if not entry.fenced:
                raise
            # The data, not the plan: eager retries such a failure in float64 (SOAP,
            # Shampoo) in an `except` no trace can see. Nothing was written back yet.
            message = f"{type(exc).__name__}: {exc}".splitlines()[0]
            name = type(self._inner).__name__
            log.warning("hocompile: %s in a compiled %s step; running this step eagerly", message, name)
            warnings.warn(f"{message}: this step of {name} ran eagerly", LinAlgFallbackWarning, 3)  # as from _step
            self.counters.eager_fallbacks += 1
            unwrapped_step(self._inner)(self._inner)

    def _state_keys(self) -> list[tuple[Any, ...]]:
        """The keys of every state entry, group and attribute: what a first step creates."""
        opt = self._inner
        keys: list[tuple[Any, ...]] = [tuple(vars(opt))]
        keys += [tuple(g) for g in opt.param_groups]
        return keys + [tuple(opt.state.get(p, ())) for g in opt.param_groups for p in g["params"]]

    def _host_env(self, captured: CapturedStep) -> dict[str, Any]:
        return host_env(self._inner, captured)

    def _run(self, entry: CompiledEntry, env: dict[str, float] | None) -> None:
        self._created_state = run_entry(self._inner, entry, env)

    def _compile(self, sig: Signature, reason: str, expected: bool = False, variant: bool = False) -> CompiledEntry:
        try:
            validate(self._inner)
        except CaptureError as exc:  # a configuration we cannot trace (fused=True, LBFGS...)
            return self._eager_entry(sig, reason, expected, exc)
        limit = self._settings.recompile_limit
        if self.counters.compiles and not (expected or variant) and len(self.counters.recompiles) >= limit:
            return self._over_limit(sig, reason, limit)
        try:
            return self._compile_new(sig, reason, expected, variant)
        except (CaptureError, UnsupportedParameterError):
            raise
        except Exception as exc:
            if self._settings.fallback != Fallback.EAGER:
                raise
            # A bug of ours, not the user's: say so, loudly, and stay correct.
            message = f"internal error while compiling: {type(exc).__name__}: {exc}"
            log.warning("hocompile: running %s eagerly after an %s", type(self._inner).__name__, message)
            entry = CompiledEntry.eager(reason, message)
            return self._remember(sig, entry, expected)

    def _eager_entry(self, sig: Signature, reason: str, expected: bool, exc: CaptureError) -> CompiledEntry:
        """``fallback="eager"``: this configuration runs the eager step; otherwise the error stands."""
        if self._settings.fallback != Fallback.EAGER:
            raise exc
        log.warning("hocompile: running %s eagerly: %s", type(self._inner).__name__, exc)
        entry = CompiledEntry.eager(reason, str(exc))
        coarse = signature(self._inner, self._settings.structural_keys, self._lifted, coarse=True)
        self._eager_by_coarse.setdefault(coarse, entry)
        return self._remember(sig, entry, expected)

    def _over_limit(self, sig: Signature, reason: str, limit: int) -> CompiledEntry:
        """Like torch.compile's recompile_limit: past it, new configurations run eagerly."""
        message = (
            f"recompile limit ({limit}) reached; this configuration runs eagerly. Last change: {reason}. "
            "Recompiles usually mean a value that changes every step is part of the program: see "
            "explain(opt) for the reasons, or raise compile_optimizer(..., recompile_limit=)"
        )
        if not self._warned_limit:
            warnings.warn(f"hocompile: {type(self._inner).__name__}: {message}", RecompileLimitWarning, stacklevel=4)
            self._warned_limit = True
        log.warning("hocompile: %s", message)
        entry = CompiledEntry.eager(reason, message)
        self._entries.setdefault(sig, []).append(entry)
        self.history.append(entry)
        return entry

    def _compile_new(self, sig: Signature, reason: str, expected: bool, variant: bool = False) -> CompiledEntry:
        """Compile this configuration (compile_step.py); a step that cannot be captured runs eagerly."""
        n_params = sum(1 for g in self._inner.param_groups for p in g["params"] if p.grad is not None)
        name = type(self._inner).__name__
        log.info("hocompile: compiling %s step (%d params with grads): %s", name, n_params, reason)
        dump = self._settings.dump_dir
        dump_here = dump / f"compile-{self.counters.compiles + 1:03d}" if dump is not None else None
        try:
            step = compile_step(
                self._inner,
                self._settings,
                pipeline=self.pipeline,
                dump_dir=dump_here,
                lifted=self._lifted,
                warm_start=True,
            )
        except CaptureError as exc:
            return self._eager_entry(sig, reason, expected, exc)
        assert step.lowered is not None
        self.counters.disk_hits += int(step.lowered.from_disk)
        entry = CompiledEntry(
            step.captured,
            step.lowered,
            step.records,
            step.final_graph,
            step.seconds,
            step.pass_seconds,
            step.lower_seconds,
            reason,
            decisions=step.decisions,
            final_stats=step.final_stats,
            fenced=step.fenced,
            stamped=step.stamped,
            stamp_note=step.stamp_note,
            warm=step.warm,
        )
        if step.warm:
            self.counters.warm_starts += 1
        log.info("hocompile: compiled in %.2f s (cache key %s)", entry.compile_seconds, step.key[:16])
        return self._remember(sig, entry, expected, variant)

    def _forget(self, entry: CompiledEntry) -> None:
        """Never select ``entry`` again (a stale warm-start record: runtime/check/verify.py)."""
        for candidates in self._entries.values():
            candidates[:] = [c for c in candidates if c is not entry]
        self._fast = None

    def _remember(self, sig: Signature, entry: CompiledEntry, expected: bool, variant: bool = False) -> CompiledEntry:
        self._fast = None  # built again for the signature the next step finds
        if variant:
            self.counters.variants.append(entry.reason)
            log.info("hocompile: compiling another branch outcome of %s: %s", type(self._inner).__name__, entry.reason)
        elif self.counters.compiles and not expected:
            self.counters.recompiles.append(entry.reason)
            log.info("hocompile: recompiling %s: %s", type(self._inner).__name__, entry.reason)
        self.counters.compiles += 1
        lifted = frozenset(entry.captured.lifted) if entry.captured is not None else frozenset()
        if entry.stamped is not None:  # a representative's Python state stands for its class's members
            lifted = frozenset(s for slot in lifted for s in entry.stamped.stamp.member_slots(slot))
        if not self._lifted.issuperset(lifted):
            # The step rewrites Python numbers it had not been seen to: from now
            # on they are host inputs, and the signature leaves their values out.
            self._lifted |= lifted
            sig = signature(self._inner, self._settings.structural_keys, self._lifted)
        self._entries.setdefault(sig, []).append(entry)
        self.history.append(entry)
        return entry
