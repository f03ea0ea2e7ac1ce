"""CompiledOptimizer: a drop-in for the optimizer it wraps.

``param_groups``, ``state`` and ``defaults`` *are* the wrapped optimizer's
objects, so ``state_dict()`` is the eager format, schedulers that edit
``param_groups`` work unchanged, and the eager optimizer can take over at any
time. Each ``step()``:

1. computes the guard signature (params, grads, state, structural options);
2. finds a compiled step for it whose hyperparameter branches still hold, or
   validates the inputs and compiles one (capture -> passes -> lowering);
3. evaluates the host scalars from the live hyperparameters, runs the graph
   functionally, and only then writes every result back.

An error at any point before the write-back leaves params and state as they
were.
"""

from __future__ import annotations

import logging
import threading
import time
import warnings
from collections.abc import Callable
from itertools import chain
from typing import Any

import torch
from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

from ..capture import CapturedStep, capture, slot_tensor, unwrapped_step
from ..graph import decisions, graph_stats, print_graph
from ..host_scalars import CaptureError, is_float
from ..host_state import MISSING, HostSlot
from ..lowering import LoweredStep, cache_key, lower_to_aten
from ..passes import Pass, PassRecord, default_pipeline, run_pipeline
from ..settings import Settings
from ..targets import resolve_target
from .cache import DiskCache
from .entries import (
    _FORWARDED,
    CompiledEntry,
    Counters,
    RecompileLimitWarning,
    _check_optimizer_like,
    _kernel_formats,
)
from .guards import Signature, describe_change, signature
from .validate import UnsupportedParameterError, validate
from .verify import run_step

__all__ = ["CompiledEntry", "CompiledOptimizer", "Counters", "RecompileLimitWarning", "_kernel_formats"]


log = logging.getLogger("hocompile")

# Target calibration times the machine (two at once would measure each other)
# and writes its file; tracing has its own lock in capture.py.
_COMPILE_LOCK = threading.RLock()


class CompiledOptimizer(torch.optim.Optimizer):
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
        if not isinstance(optimizer, torch.optim.Optimizer):
            try:
                _check_optimizer_like(optimizer)
            except TypeError as exc:
                if self._settings.fallback != "eager":
                    raise
                self._passthrough = str(exc)
                log.warning("hocompile: every step of %s runs eagerly: %s", type(optimizer).__name__, exc)
        self._pipeline_override = pipeline
        self._pipeline_cache: tuple[Pass, ...] | None = None
        self._disk = DiskCache(self._settings.cache_dir)
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

    # -- the wrapped optimizer's own objects -------------------------------
    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self._inner

    @property  # type: ignore[override]
    def param_groups(self) -> list[dict[str, Any]]:
        return self._inner.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self._inner.param_groups = value

    @property  # type: ignore[override]
    def state(self) -> Any:
        return self._inner.state

    @state.setter
    def state(self, value: Any) -> None:
        self._inner.state = value

    @property  # type: ignore[override]
    def defaults(self) -> dict[str, Any]:
        return self._inner.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self._inner.defaults = value

    def __getattr__(self, name: str) -> Any:
        # Hook dicts and anything else Optimizer methods expect live on the
        # wrapped optimizer. `_inner` itself must not recurse (unpickling).
        if name == "_inner":
            raise AttributeError(name)
        return getattr(self._inner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        # GradScaler hands a fused optimizer its scale and inf flag as
        # attributes; the wrapped step is what reads them (as graph inputs).
        if name in _FORWARDED:
            setattr(self._inner, name, value)
        else:
            object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        if name in _FORWARDED:
            delattr(self._inner, name)
        else:
            object.__delattr__(self, name)

    # copy.deepcopy, pickle and torch.save: the wrapped optimizer (params and
    # state) and the settings travel; compiled steps are rebuilt (or found in
    # the disk cache) on the copy's first step.
    def __getstate__(self) -> dict[str, Any]:  # type: ignore[override]
        return {"optimizer": self._inner, "settings": self._settings, "pipeline": self._pipeline_override}

    def __setstate__(self, state: dict[str, Any]) -> None:
        CompiledOptimizer.__init__(self, state["optimizer"], state["settings"], state["pipeline"])

    def __repr__(self) -> str:
        return f"CompiledOptimizer({self._inner!r})"

    def state_dict(self) -> dict[str, Any]:
        return self._inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._inner.load_state_dict(state_dict)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._inner.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        # The next step's signature differs, so it recompiles with that reason.
        self._inner.add_param_group(param_group)

    @property
    def pipeline(self) -> tuple[Pass, ...]:
        """The passes this optimizer's steps go through (target calibrated on first use)."""
        if self._pipeline_cache is None:
            if self._pipeline_override is not None:
                self._pipeline_cache = self._pipeline_override
            else:
                target = resolve_target(self._settings.target, self._settings.cache_dir, self._device())
                triton = self.backend == "triton"
                settings = self._settings
                self._pipeline_cache = default_pipeline(
                    target, settings.precision, force_batch=triton, error_budget=settings.error_budget,
                    schedule=settings.schedule, kernel_formats=_kernel_formats(triton, self._device()),
                    max_batch=settings.max_batch, max_stack_bytes=settings.max_stack_bytes,
                )
        return self._pipeline_cache

    def _device(self) -> torch.device:
        params = [p for g in self._inner.param_groups for p in g["params"]]
        return params[0].device if params else torch.device("cpu")

    @property
    def backend(self) -> str:
        """ "triton" or "aten": the setting, with "auto" resolved by the params' device."""
        if self._settings.backend != "auto":
            return self._settings.backend
        if self._device().type != "cuda":
            return "aten"
        try:
            import triton  # noqa: F401
        except ImportError:
            log.warning("hocompile: CUDA params but triton is not installed: lowering to aten")
            return "aten"
        return "triton"

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
        own_post = getattr(self._inner, "_optimizer_step_post_hooks", {})
        for post_hook in chain(own_post.values(), _global_optimizer_post_hooks.values()):
            post_hook(self, args, kwargs)
        return loss

    def _step(self) -> None:
        if not any(p.grad is not None for g in self._inner.param_groups for p in g["params"]):
            # Nothing to compile: the eager step is what eager does here (for
            # torch.optim, nothing; a custom step may still tick a counter).
            unwrapped_step(self._inner)(self._inner)
            return
        structural = self._settings.structural_keys
        sig = signature(self._inner, structural, self._lifted)
        candidates = self._entries.get(sig, [])
        env: dict[str, float] | None = None
        entry: CompiledEntry | None = None
        failed_guard = ""
        for candidate in candidates:
            if candidate.captured is None:  # an eager fallback for this signature
                entry = candidate
                break
            env = self._host_env(candidate.captured)
            broken = next((g for g in candidate.captured.guards if not g.holds(env)), None)
            if broken is None:
                entry = candidate
                break
            failed_guard = f"guard failed: {broken.describe()} no longer holds"
        if entry is None and not candidates and self._eager_by_coarse:
            # This configuration differs from one that could not be captured only in
            # Python numbers (a counter the step bumps): it runs eagerly too, no retry.
            entry = self._eager_by_coarse.get(signature(self._inner, structural, self._lifted, coarse=True))
        if entry is None:
            reason = failed_guard or (
                "first step" if self._last_signature is None else describe_change(self._last_signature, sig)
            )
            # Right after a step that created state (tensors, or Python keys such as
            # a new group["step"]), the steady-state compile is expected, not a recompile.
            expected = self._created_state and reason.startswith(("state of", "param_groups[", "optimizer attribute"))
            if expected:
                reason = "steady state: the previous step created the optimizer state"
            entry = self._compile(sig, reason, expected)
            sig = signature(self._inner, structural, self._lifted)
            env = None
        else:
            self.counters.cache_hits += 1
        self._last_signature = sig
        self._created_state = False
        self.steps += 1
        if entry.captured is None or entry.fallback:
            self.counters.eager_fallbacks += 1
            keys_before = self._state_keys()
            unwrapped_step(self._inner)(self._inner)
            # An eager step that created state makes the next compile the
            # expected steady-state one, exactly as a compiled first step does.
            self._created_state = self._state_keys() != keys_before
            return
        run_step(self, entry, env)  # self._run, checked against eager for the first `verify` steps

    def _state_keys(self) -> list[tuple[Any, ...]]:
        """The keys of every state entry, group and attribute: what a first step creates."""
        opt = self._inner
        keys: list[tuple[Any, ...]] = [tuple(vars(opt))]
        keys += [tuple(g) for g in opt.param_groups]
        return keys + [tuple(opt.state.get(p, ())) for g in opt.param_groups for p in g["params"]]

    def _host_env(self, captured: CapturedStep) -> dict[str, Any]:
        """The host inputs' live values, each of the type the user set (int, float, numpy scalar)."""
        env: dict[str, Any] = {}
        for g, group in enumerate(self._inner.param_groups):
            for key, value in group.items():
                if is_float(value):
                    env[f"g{g}.{key}"] = value
                elif isinstance(value, (tuple, list)) and value and is_float(value[0]):
                    for i, v in enumerate(value):
                        env[f"g{g}.{key}[{i}]"] = v
        for counter in captured.counters:
            env[counter.name] = slot_tensor(self._inner, counter.slot).item()
        for slot in captured.lifted:
            env[slot.name()] = slot.read(self._inner)
        return env

    def _run(self, entry: CompiledEntry, env: dict[str, float] | None) -> None:
        captured, lowered = entry.captured, entry.lowered
        assert captured is not None and lowered is not None
        if env is None:
            env = self._host_env(captured)
        opt = self._inner
        tensors: list[Any] = [slot_tensor(opt, s) for s in captured.inputs]
        # Evaluated before anything runs: an error here leaves everything as it was.
        host_values = [(u.slot, u.value(env)) for u in captured.host_updates]
        outputs = lowered.run(tensors + list(captured.scalars(env)))
        # The generated code wrote most results in place already (writeback.py);
        # the rest (newly created state, views) is installed here.
        for action, value in zip((captured.outputs[i] for i in lowered.kept), outputs):
            slot = action.slot
            if action.mode == "copy":
                slot_tensor(opt, slot).copy_(value)
            else:
                p = opt.param_groups[slot.group]["params"][slot.index]
                opt.state[p][slot.key] = value
        created = any(a.mode == "assign" for a in captured.outputs)
        for g, i in captured.clears_grads:
            opt.param_groups[g]["params"][i].grad = None
        for host_slot, value in host_values:
            created = created or host_slot.read(opt) is MISSING
            host_slot.write(opt, value)
        self._created_state = created

    def _compile(self, sig: Signature, reason: str, expected: bool = False) -> CompiledEntry:
        try:
            validate(self._inner)
        except CaptureError as exc:  # a configuration we cannot trace (fused=True, LBFGS...)
            return self._eager_entry(sig, reason, expected, exc)
        limit = self._settings.recompile_limit
        if self.counters.compiles and not expected and len(self.counters.recompiles) >= limit:
            return self._over_limit(sig, reason, limit)
        with _COMPILE_LOCK:  # one compile at a time per process (see _COMPILE_LOCK)
            try:
                return self._compile_locked(sig, reason, expected)
            except (CaptureError, UnsupportedParameterError):
                raise
            except Exception as exc:
                if self._settings.fallback != "eager":
                    raise
                # A bug of ours, not the user's: say so, loudly, and stay correct.
                message = f"internal error while compiling: {type(exc).__name__}: {exc}"
                log.warning("hocompile: running %s eagerly after an %s", type(self._inner).__name__, message)
                entry = CompiledEntry(None, None, [], "", 0.0, 0.0, 0.0, reason, message)
                return self._remember(sig, entry, expected)

    def _eager_entry(self, sig: Signature, reason: str, expected: bool, exc: CaptureError) -> CompiledEntry:
        """``fallback="eager"``: this configuration runs the eager step; otherwise the error stands."""
        if self._settings.fallback != "eager":
            raise exc
        log.warning("hocompile: running %s eagerly: %s", type(self._inner).__name__, exc)
        entry = CompiledEntry(None, None, [], "", 0.0, 0.0, 0.0, reason, str(exc))
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
        entry = CompiledEntry(None, None, [], "", 0.0, 0.0, 0.0, reason, message)
        self._entries.setdefault(sig, []).append(entry)
        self.history.append(entry)
        return entry

    def _compile_locked(self, sig: Signature, reason: str, expected: bool) -> CompiledEntry:
        start = time.perf_counter()
        n_params = sum(1 for g in self._inner.param_groups for p in g["params"] if p.grad is not None)
        name = type(self._inner).__name__
        log.info("hocompile: compiling %s step (%d params with grads): %s", name, n_params, reason)
        try:
            captured = capture(self._inner, self._settings.structural_keys)
        except CaptureError as exc:
            return self._eager_entry(sig, reason, expected, exc)
        gm = captured.gm
        dump = self._settings.dump_dir
        dump_here = dump / f"compile-{self.counters.compiles + 1:03d}" if dump is not None else None
        pass_start = time.perf_counter()
        gm, records = run_pipeline(gm, self.pipeline, self._settings.disabled_passes, dump_here)
        pass_seconds = time.perf_counter() - pass_start
        identity = ";".join(p.identity() for p in self.pipeline if p.name not in self._settings.disabled_passes)
        # The statuses are printed in the module's header: the key must cover them.
        statuses = ",".join(f"{r.name}:{r.status}" for r in records)
        key = cache_key(gm, f"{identity};backend={self.backend};{statuses}")
        final = print_graph(gm)
        plans, final_stats = decisions(gm), graph_stats(gm)
        lower_start = time.perf_counter()
        header = self._header(key, records)
        index_of = {slot: i for i, slot in enumerate(captured.inputs)}
        copy_into = [index_of[a.slot] if a.mode == "copy" else None for a in captured.outputs]
        if self.backend == "triton":
            lowered = self._lower_triton(gm, key, header, copy_into)
        else:
            lowered = lower_to_aten(gm, key, self._disk, header, copy_into)
        lower_seconds = time.perf_counter() - lower_start
        self.counters.disk_hits += int(lowered.from_disk)
        if dump_here is not None:
            (dump_here / "lowered.py").write_text(lowered.source)
            for kernel in lowered.kernels:
                (dump_here / "kernels").mkdir(exist_ok=True)
                (dump_here / "kernels" / f"{kernel.name}.py").write_text(kernel.source)
        if self._settings.debug >= 2:
            log.debug("hocompile final graph:\n%s", final)
        entry = CompiledEntry(
            captured,
            lowered,
            records,
            final,
            time.perf_counter() - start,
            pass_seconds,
            lower_seconds,
            reason,
            decisions=plans,
            final_stats=final_stats,
        )
        log.info("hocompile: compiled in %.2f s (cache key %s)", entry.compile_seconds, key[:16])
        return self._remember(sig, entry, expected)

    def _lower_triton(self, gm: Any, key: str, header: str, copy_into: list[int | None]) -> LoweredStep:
        from ..lowering.triton import lower_to_triton

        settings = self._settings
        module = lower_to_triton(
            gm, settings.cache_dir, header, copy_into, self._device(), settings.cuda_graphs, settings.autotune
        )
        return LoweredStep(
            module.run,
            module.path,
            key,
            module.from_disk,
            module.source,
            module.kept,
            "triton",
            module.kernels,
            module.launches,
            module.units,
            settings.cuda_graphs and module.graph_safe,
        )

    def _remember(self, sig: Signature, entry: CompiledEntry, expected: bool) -> CompiledEntry:
        if self.counters.compiles and not expected:
            self.counters.recompiles.append(entry.reason)
            log.info("hocompile: recompiling %s: %s", type(self._inner).__name__, entry.reason)
        self.counters.compiles += 1
        if entry.captured is not None and not self._lifted.issuperset(entry.captured.lifted):
            # The step rewrites Python numbers it had not been seen to: from now
            # on they are host inputs, and the signature leaves their values out.
            self._lifted |= frozenset(entry.captured.lifted)
            sig = signature(self._inner, self._settings.structural_keys, self._lifted)
        self._entries.setdefault(sig, []).append(entry)
        self.history.append(entry)
        return entry

    def _header(self, key: str, records: list[PassRecord]) -> str:
        passes = ", ".join(f"{r.name} ({r.status})" for r in records) or "none"
        return "\n".join(
            [
                f"# Generated by hocompile for {type(self._inner).__module__}.{type(self._inner).__name__}.step",
                f"# cache key {key[:16]}; passes: {passes}",
                "# forward(self, <tensor inputs>, <host scalars>) -> outputs written back by the runtime",
            ]
        )
