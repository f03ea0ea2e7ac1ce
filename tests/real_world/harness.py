"""Run one :class:`~tests.real_world.corpus.Case` eager and compiled, side by side, and say what happened.

Four copies of the case step in lockstep on identical grads, with the
learning rate changed before every step (``lr * (1 - 0.05 k)``, as a
scheduler would; a tensor lr is ``fill_``-ed, as torch's schedulers do):

- ``eager``: the optimizer as written;
- ``exact``: the same, with the module's ``NS_DTYPE`` set to float64 (the
  same Newton–Schulz polynomial evaluated without rounding);
- ``bitwise``: compiled with every pass off (``EVERY_PASS_OFF``), compared with
  eager bit for bit after every step (params, grads, optimizer state), with a
  state_dict round trip (eager's, deep-copied, loaded into both) halfway;
- ``default``: compiled with the default pipeline on a fixed CPU target
  (fp32 GEMMs fast, bf16 slow), whose trajectory error against ``exact`` is
  compared with eager's.

Functions decorated with ``@torch.compile`` run as the plain Python they wrap
in the eager copies (the module attributes are swapped for the originals for
the duration of the step): the reference is the code as written, not what
Inductor makes of it, whose fused pointwise ops round differently and would
take seconds per shape to build. The compiled copies step with the decorated
functions in place, so hocompile meets what a user's step calls (and says so: a
CompiledHelperWarning naming each such function, since there the compiled step
is the plain Python's arithmetic, not Inductor's).

If the first compiled step raises :class:`hocompile.CaptureError`, the harness
checks that nothing was changed and then runs ``fallback="eager"`` against a
fresh eager copy, bit for bit (also on the plain Python, for the same reason).
"""

from __future__ import annotations

import contextlib
import copy
import os
import tempfile
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import is_fake

import hocompile

from ..helpers import EVERY_PASS_OFF
from .corpus import CORPUS_MODULES, Case

STEPS = 10
AVX2_LIKE = hocompile.Target("avx2-like", {"fp32": 100.0, "bf16": 1.0, "fp16": 1.0})
EXACT: dict[str, Any] = {"disable_passes": ("fuse-newton-schulz", "choose-algorithm")}
ROUND_TRIP_AT = STEPS // 2
RATIO_BOUND = 1.25


@dataclass
class Outcome:
    """``kind``: "compiled" (ran every step), "refused" (CaptureError at step 1, nothing changed),
    "wrong" (a compiled step differs from eager where it must not) or "crash" (anything else)."""

    kind: str
    detail: str = ""
    bitwise: bool = False
    ratio: float | None = None  # worst compiled/eager trajectory error vs the exact-NS run, over matrices
    ratios: list[float] = field(default_factory=list)
    vector_rel_diff: float = 0.0  # default pipeline vs eager on 1-D params
    ns_ops: int | None = None  # newton_schulz ops in the steady-state compiled graph
    recompiles: list[str] = field(default_factory=list)
    fallback_bitwise: bool | None = None
    seconds: float = 0.0


def ensure_process_group() -> None:
    """A one-rank gloo group, for the optimizers that call torch.distributed themselves."""
    if dist.is_available() and not dist.is_initialized():
        store = Path(tempfile.mkdtemp(prefix="hocompile-pg-")) / "store"
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)


@contextlib.contextmanager
def plain_python() -> Iterator[None]:
    """``@torch.compile`` functions of the corpus run as the Python they wrap."""
    swapped = []
    for module in CORPUS_MODULES:
        for name, value in list(vars(module).items()):
            original = getattr(value, "_torchdynamo_orig_callable", None)
            if callable(original):
                swapped.append((module, name, value))
                setattr(module, name, original)
    try:
        yield
    finally:
        for module, name, value in swapped:
            setattr(module, name, value)


@contextlib.contextmanager
def exact_ns(case: Case) -> Iterator[None]:
    saved = case.ns_module.NS_DTYPE
    case.ns_module.NS_DTYPE = torch.float64
    try:
        yield
    finally:
        case.ns_module.NS_DTYPE = saved


def make_params(case: Case) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(*s, generator=g)) for s in case.shapes]


class Copy:
    """One copy of the case: its params, the optimizer (maybe compiled), the base learning rates."""

    def __init__(self, case: Case, compile_kw: dict[str, Any] | None = None, cache_dir: Any = None) -> None:
        self.case = case
        self.params = make_params(case)
        self.inner = case.build(self.params)
        self.lr_slots = _lr_slots(self.inner)
        self.opt: Any = self.inner
        if compile_kw is not None:
            self.opt = hocompile.compile_optimizer(self.inner, cache_dir=cache_dir, **compile_kw)

    def prepare(self, grads: list[torch.Tensor], step: int) -> None:
        for p, g in zip(self.params, grads):
            p.grad = g.clone()
        factor = 1.0 - 0.05 * step
        for holder, key, base in self.lr_slots:
            value = base * factor
            current = holder[key] if isinstance(holder, dict) else getattr(holder, key)
            if isinstance(current, torch.Tensor):
                current.fill_(value)
            elif isinstance(holder, dict):
                holder[key] = value
            else:
                setattr(holder, key, value)
        if self.case.before_step is not None:
            self.case.before_step(self.inner, step)

    def snapshot(self) -> dict[str, Any]:
        return snapshot(self.inner, self.params, self.case.scratch)


def _lr_slots(opt: Any) -> list[tuple[Any, str, float]]:
    if hasattr(opt, "param_groups"):
        return [(g, "lr", float(g["lr"])) for g in opt.param_groups if "lr" in g]
    return [(cfg, "lr", float(cfg.lr)) for cfg in getattr(opt, "param_cfgs", {}).values()]


def snapshot(opt: Any, params: list[torch.Tensor], scratch: frozenset[str] = frozenset()) -> dict[str, Any]:
    """Params, grads, optimizer state and group values of ``opt``, copied, by readable path."""
    names = {id(p): f"p{i}" for i, p in enumerate(params)}
    out: dict[str, Any] = {}
    for i, p in enumerate(params):
        out[f"p{i}"] = p.detach().clone()
        out[f"p{i}.grad"] = None if p.grad is None else p.grad.detach().clone()
    _collect(opt, "", names, scratch, out, set())
    return out


def _collect(obj: Any, prefix: str, names: dict[int, str], scratch: frozenset[str], out: dict[str, Any],
             seen: set[int]) -> None:
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.optim.Optimizer):
        for p, state in obj.state.items():
            for key, value in state.items():
                out[f"{prefix}state[{names.get(id(p), '?')}][{key!r}]"] = _copy(value)
        for g, group in enumerate(obj.param_groups):
            for key, value in group.items():
                if key != "params" and key not in scratch:
                    out[f"{prefix}param_groups[{g}][{key!r}]"] = _copy(value)
    for attr, value in vars(obj).items():
        if isinstance(value, torch.optim.Optimizer):
            _collect(value, f"{prefix}{attr}.", names, scratch, out, seen)
        elif isinstance(value, (list, tuple)) and value and isinstance(value[0], torch.optim.Optimizer):
            for i, sub in enumerate(value):
                _collect(sub, f"{prefix}{attr}[{i}].", names, scratch, out, seen)
        elif attr == "param_states" and isinstance(value, dict):
            for p, state in value.items():
                for key, v in state.items():
                    out[f"{prefix}{attr}[{names.get(id(p), '?')}][{key!r}]"] = _copy(v)


def _copy(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (list, tuple)):
        return type(value)(_copy(v) for v in value)
    return value


def leaked_fakes(obj: Any, path: str = "opt", seen: set[int] | None = None, depth: int = 0) -> list[str]:
    """Where ``obj`` (an optimizer and what it holds) keeps tracing-time fake tensors (bare or functional)."""
    seen = set() if seen is None else seen
    if id(obj) in seen or depth > 6:
        return []
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return [path] if is_fake(obj) else []
    found: list[str] = []
    if isinstance(obj, dict):
        for key, value in obj.items():
            if isinstance(key, torch.Tensor) and is_fake(key):
                found.append(f"{path}[<FakeTensor key>]")
            found += leaked_fakes(value, f"{path}[{key if isinstance(key, (str, int)) else '<tensor>'}]", seen,
                                  depth + 1)
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            found += leaked_fakes(value, f"{path}[{i}]", seen, depth + 1)
    elif hasattr(obj, "__dict__") and not isinstance(obj, type) and type(obj).__module__ != "torch._C":
        for attr, value in vars(obj).items():
            found += leaked_fakes(value, f"{path}.{attr}", seen, depth + 1)
    return found


def differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """Where two snapshots differ: tensors bit for bit (NaN equal to NaN), the rest with ==."""
    out = [f"{k}: only in {'the first' if k in a else 'the second'}" for k in sorted(set(a) ^ set(b))]
    for key in a.keys() & b.keys():
        x, y = a[key], b[key]
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
            if x.shape != y.shape or x.dtype != y.dtype:
                out.append(f"{key}: {tuple(x.shape)} {x.dtype} vs {tuple(y.shape)} {y.dtype}")
            elif not (torch.equal(x, y) or torch.equal(x.nan_to_num(), y.nan_to_num())):
                diff = (x.double() - y.double()).abs().max().item() if x.is_floating_point() else "-"
                out.append(f"{key}: max abs diff {diff:.3g}" if isinstance(diff, float) else f"{key} differs")
        elif isinstance(x, (list, tuple)) and isinstance(y, (list, tuple)):
            if len(x) != len(y) or any(differences({"v": u}, {"v": v}) for u, v in zip(x, y)):
                out.append(f"{key} differs")
        elif type(x) is not type(y) or x != y:
            out.append(f"{key}: {x!r} vs {y!r}")
    return sorted(out)


def _grads(case: Case, gen: torch.Generator) -> list[torch.Tensor]:
    return [torch.randn(*s, generator=gen) for s in case.shapes]


def _where(exc: BaseException) -> str:
    frame = traceback.extract_tb(exc.__traceback__)[-1]
    return f"{type(exc).__name__}: {str(exc)[:600]} (at {Path(frame.filename).name}:{frame.lineno})"


def run(case: Case, cache_dir: Any = None, steps: int = STEPS) -> Outcome:
    """Everything the contract checks for ``case``, measured (see the module docstring)."""
    start = time.perf_counter()
    if case.distributed:
        ensure_process_group()
    cache_dir = cache_dir or tempfile.mkdtemp(prefix="hocompile-rw-")
    outcome = _run(case, cache_dir, steps)
    outcome.seconds = time.perf_counter() - start
    return outcome


def _run(case: Case, cache_dir: Any, steps: int) -> Outcome:
    eager, exact = Copy(case), Copy(case)
    try:
        bitwise = Copy(case, EVERY_PASS_OFF, cache_dir)
        default = Copy(case, {"target": AVX2_LIKE}, cache_dir)
    except (hocompile.CaptureError, TypeError) as exc:  # refused already by compile_optimizer(), saying why
        return _refused(case, cache_dir, steps, f"compile_optimizer(): {exc}")
    except Exception as exc:  # noqa: BLE001 - classified, not swallowed
        return Outcome("crash", f"compile_optimizer() raised {_where(exc)}")
    gen = torch.Generator().manual_seed(1)
    for k in range(steps):
        grads = _grads(case, gen)
        if k == ROUND_TRIP_AT and hasattr(eager.inner, "state_dict"):
            _round_trip(eager, bitwise)
        for each in (eager, exact, bitwise, default):
            each.prepare(grads, k)
        with plain_python():
            eager.opt.step()
            with exact_ns(case):
                exact.opt.step()
        before = bitwise.snapshot()
        try:
            # as eager above: the corpus's torch.compile'd helpers as their plain Python (with them
            # compiled, every pass off runs them as opaque ops: tests/test_compiled_helpers.py)
            with plain_python():
                bitwise.opt.step()
        except hocompile.CaptureError as exc:
            if k > 0:
                return Outcome("crash", f"refused at step {k + 1}, after compiling the first: {exc}")
            if changed := differences(before, bitwise.snapshot()):
                return Outcome("crash", f"refused, but the failed step changed {changed[:3]}: {exc}")
            if fakes := leaked_fakes(bitwise.inner):
                return Outcome("crash", f"refused, but the failed capture left FakeTensors in {fakes[:3]}: {exc}")
            return _refused(case, cache_dir, steps, str(exc))
        except Exception as exc:  # noqa: BLE001
            return Outcome("crash", f"[exact pipeline] step {k + 1}: {_where(exc)}")
        if fakes := leaked_fakes(bitwise.inner):
            return Outcome("wrong", f"[exact pipeline] step {k + 1} left FakeTensors in {fakes[:3]}")
        if diffs := differences(eager.snapshot(), bitwise.snapshot()):
            return Outcome("wrong", f"[exact pipeline] after step {k + 1}: " + "; ".join(diffs[:4]))
        try:
            default.opt.step()
        except Exception as exc:  # noqa: BLE001
            return Outcome("crash", f"[default pipeline] step {k + 1}: {_where(exc)}", bitwise=True)
    outcome = Outcome("compiled", bitwise=True)
    outcome.recompiles = list(bitwise.opt.counters.recompiles) + list(default.opt.counters.recompiles)
    outcome.ns_ops = default.opt.history[-1].final_stats.get("newton-schulz", 0)
    _trajectory(eager, exact, default, outcome)
    return outcome


def _round_trip(eager: Copy, compiled: Copy) -> None:
    """Eager's state_dict loaded into both (deep-copied: torch keeps same-dtype tensors as they are)."""
    saved = eager.inner.state_dict()
    eager.inner.load_state_dict(copy.deepcopy(saved))
    compiled.opt.load_state_dict(copy.deepcopy(saved))
    for each in (eager, compiled):  # load_state_dict makes new group dicts: the schedule follows them
        each.lr_slots = [(holder, key, base) for (holder, key, _), (_, _, base)
                         in zip(_lr_slots(each.inner), each.lr_slots, strict=True)]


def _trajectory(eager: Copy, exact: Copy, default: Copy, outcome: Outcome) -> None:
    for e, x, c in zip(eager.params, exact.params, default.params):
        if e.ndim >= 2:
            eager_err, compiled_err = (e - x).norm().item(), (c - x).norm().item()
            outcome.ratios.append(compiled_err / eager_err if eager_err > 0 else float("inf"))
        else:
            rel = ((c - e).abs().max() / e.abs().max().clamp_min(1e-30)).item()
            outcome.vector_rel_diff = max(outcome.vector_rel_diff, rel)
    outcome.ratio = max(outcome.ratios) if outcome.ratios else None


def _refused(case: Case, cache_dir: Any, steps: int, message: str) -> Outcome:
    outcome = Outcome("refused", message)
    with plain_python():
        eager = Copy(case)
        try:
            fallback = Copy(case, {**EXACT, "fallback": "eager"}, cache_dir)
        except Exception as exc:  # noqa: BLE001
            outcome.fallback_bitwise = False
            outcome.detail += f" | fallback='eager' failed: compile_optimizer() raised {_where(exc)}"
            return outcome
        gen = torch.Generator().manual_seed(1)
        for k in range(steps):
            grads = _grads(case, gen)
            eager.prepare(grads, k)
            fallback.prepare(grads, k)
            eager.opt.step()
            try:
                fallback.opt.step()
            except Exception as exc:  # noqa: BLE001
                outcome.fallback_bitwise = False
                outcome.detail += f" | fallback='eager' raised at step {k + 1}: {_where(exc)}"
                return outcome
            if diffs := differences(eager.snapshot(), fallback.snapshot()):
                outcome.fallback_bitwise = False
                outcome.detail += f" | fallback='eager' differs after step {k + 1}: {'; '.join(diffs[:3])}"
                return outcome
    outcome.fallback_bitwise = True
    return outcome


def violation(case: Case, outcome: Outcome) -> str | None:
    """None when ``outcome`` meets the contract for ``case``, else how it breaks it."""
    if outcome.kind == "refused":
        if not case.refusal_ok(outcome.detail):
            return f"REFUSED, but nothing in this step justifies it (or the message does not say why): {outcome.detail}"
        if not outcome.fallback_bitwise:
            return f"refused cleanly, but fallback='eager' does not match eager: {outcome.detail}"
        return None
    if outcome.kind != "compiled":
        return f"{outcome.kind.upper()}: {outcome.detail}"
    problems = []
    if outcome.ns_ops != case.ns_ops:
        problems.append(f"{outcome.ns_ops} newton_schulz ops after passes, expected {case.ns_ops}")
    unexplained = list(outcome.recompiles)
    for reason in case.expected_recompiles:  # at most one of each per pipeline (two pipelines)
        for _ in range(2):
            match = next((r for r in unexplained if reason in r), None)
            if match is not None:
                unexplained.remove(match)
    if unexplained:
        problems.append(f"recompiles under an lr schedule: {unexplained}")
    worst = [r for r in outcome.ratios if not r <= RATIO_BOUND]
    if worst:
        problems.append(f"trajectory error {max(worst):.2f}x eager's against the exact-NS run (bound {RATIO_BOUND})")
    if outcome.vector_rel_diff > 1e-6:
        problems.append(f"1-D params differ from eager by {outcome.vector_rel_diff:.2g} relative")
    return "; ".join(problems) or None


def device_count_note() -> str:
    return f"torch {torch.__version__}, {os.cpu_count()} CPUs"
