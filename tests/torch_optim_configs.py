"""Every torch.optim optimizer and variant, run eager and compiled side by side.

Shared by tests/test_torch_optim_sweep.py (which asserts the contract) and
benchmarks/torch_optim_support.py (which prints the support matrix).

The optimizers are discovered from ``torch.optim`` itself, and so are their
boolean flags (from the constructor's signature), so a torch upgrade that adds
an optimizer or a flag adds configs here instead of being silently skipped.
Per config: the base variant, ``foreach=True`` and ``fused=True`` where the
class takes them (fused only where torch has CPU kernels), and each boolean
flag flipped from its default, with and without foreach (maximize and amsgrad
with foreach are torch's test database's: db_configs). Hyperparameters are
non-default (weight decay and momentum on) so their branches are exercised.

A ``resumed`` variant compiles after one eager step, from its state_dict,
so the steady-state graph is the first one traced.

The contract (:func:`violation`): over :data:`STEPS` steps with the learning
rate changing every step, either params and every state entry match eager
bitwise with no recompile after the steady state (except a branch on a step
counter flipping: EXPECTED_RECOMPILES), or the first step raises
:class:`hocompile.CaptureError` / :class:`hocompile.UnsupportedParameterError`,
changing nothing, and naming either torch's own reason (eager rejects the
config too) or a documented limitation (LIMITATIONS).
"""

from __future__ import annotations

import copy
import inspect
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch

import hocompile

from .helpers import EVERY_PASS_OFF, EXACT, make_params

STEPS = 10
SHAPES = [(4, 3), (5,), (2, 3, 2)]
MATRIX_SHAPES = [(4, 3), (3, 5)]  # Muon orthogonalizes 2-D params only

# Non-default hyperparameters per optimizer. An optimizer missing here runs
# with its constructor's defaults (and still gets every variant).
HYPERPARAMETERS: dict[str, dict[str, Any]] = {
    "Adadelta": dict(lr=0.5, rho=0.8, eps=1e-5, weight_decay=0.01),
    "Adafactor": dict(lr=0.01, beta2_decay=-0.7, d=2.0, weight_decay=0.01),
    "Adagrad": dict(lr=0.05, lr_decay=0.01, weight_decay=0.01, initial_accumulator_value=0.1, eps=1e-8),
    "Adam": dict(lr=0.01, betas=(0.8, 0.99), eps=1e-7, weight_decay=0.01),
    "AdamW": dict(lr=0.01, betas=(0.8, 0.99), eps=1e-7, weight_decay=0.1),
    "Adamax": dict(lr=0.01, betas=(0.8, 0.99), eps=1e-7, weight_decay=0.01),
    "ASGD": dict(lr=0.01, lambd=1e-3, alpha=0.7, t0=4.0, weight_decay=0.01),  # mu < 1 from step 7
    "LBFGS": dict(lr=0.5, max_iter=3, history_size=4),
    "NAdam": dict(lr=0.01, betas=(0.8, 0.99), eps=1e-7, weight_decay=0.01, momentum_decay=0.005),
    "RAdam": dict(lr=0.01, betas=(0.8, 0.9), eps=1e-7, weight_decay=0.01),  # rectified from step 6
    "RMSprop": dict(lr=0.01, alpha=0.9, eps=1e-7, weight_decay=0.01, momentum=0.5),
    "Rprop": dict(lr=0.01, etas=(0.4, 1.3), step_sizes=(1e-5, 20)),  # the int max is torch's default style
    "SGD": dict(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.01),
    "SparseAdam": dict(lr=0.01, betas=(0.8, 0.99)),
    "Muon": dict(lr=0.02, weight_decay=0.05, momentum=0.9),
}

# Flags that need other hyperparameters to be valid when flipped.
FLAG_REQUIRES: dict[tuple[str, str], dict[str, Any]] = {
    ("SGD", "nesterov"): dict(dampening=0.0),  # nesterov needs momentum > 0 and no dampening
}

# String options worth a config of their own.
EXTRA_VARIANTS: dict[str, list[tuple[str, dict[str, Any]]]] = {
    "Muon": [("adjust_lr_fn=match_rms_adamw", dict(adjust_lr_fn="match_rms_adamw"))],
}

_NOT_FLAGS = frozenset({"foreach", "fused"})
# Flags torch's test database (db_configs) runs with foreach=True wherever the optimizer has them:
# the sweep flips them single-tensor and fused only.
_IN_THE_DATABASE = frozenset({"maximize", "amsgrad"})


def discover_optimizers() -> list[type[torch.optim.Optimizer]]:
    """Every Optimizer subclass torch.optim exports, by name."""
    found = {
        name: obj
        for name in dir(torch.optim)
        if inspect.isclass(obj := getattr(torch.optim, name))
        and issubclass(obj, torch.optim.Optimizer)
        and obj is not torch.optim.Optimizer
    }
    return [found[name] for name in sorted(found, key=str.lower)]


def _fused_on_cpu() -> bool:
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    return "cpu" in _get_fused_kernels_supported_devices()


@dataclass(frozen=True)
class Config:
    optimizer: str
    variant: str  # "base", "foreach", "fused", "maximize", "foreach+amsgrad", ...
    kwargs: dict[str, Any] = field(hash=False)
    shapes: tuple[tuple[int, ...], ...] = field(hash=False)
    resumed: bool = False  # compile after one eager step, from its state_dict (a checkpoint)

    @property
    def id(self) -> str:
        return f"{self.optimizer}-{self.variant}"

    def make(self, params: list[torch.Tensor]) -> torch.optim.Optimizer:
        # Deep-copied: a tensor lr must not be shared by the eager and the compiled optimizer.
        return getattr(torch.optim, self.optimizer)(params, **copy.deepcopy(self.kwargs))


def configs() -> list[Config]:
    out: list[Config] = []
    for cls in discover_optimizers():
        name = cls.__name__
        sig = inspect.signature(cls.__init__).parameters
        base = dict(HYPERPARAMETERS.get(name, {}))
        shapes = tuple(MATRIX_SHAPES if name == "Muon" else SHAPES)
        flags = [k for k, p in sig.items() if isinstance(p.default, bool) and k not in _NOT_FLAGS]
        modes = [("", {"foreach": False} if "foreach" in sig else {})]
        if "foreach" in sig:
            modes.append(("foreach", {"foreach": True}))
        if "fused" in sig and _fused_on_cpu():
            modes.append(("fused", {"fused": True}))
        for mode, mode_kw in modes:
            out.append(Config(name, mode or "base", {**base, **mode_kw}, shapes))
            if not mode:
                # The steady-state graph straight away, as when training resumes from a checkpoint.
                out.append(Config(name, "resumed", {**base, **mode_kw}, shapes, resumed=True))
            for flag in flags:
                if mode == "foreach" and flag in _IN_THE_DATABASE:
                    continue  # test_torch_optim_db.py runs foreach with it (CI's time)
                kw = {**base, **mode_kw, flag: not sig[flag].default, **FLAG_REQUIRES.get((name, flag), {})}
                label = f"{flag}={not sig[flag].default}" if sig[flag].default else flag
                out.append(Config(name, f"{mode}+{label}" if mode else label, kw, shapes))
        for label, extra in EXTRA_VARIANTS.get(name, []):
            out.append(Config(name, label, {**base, **extra}, shapes))
    return [cfg for cfg in out if _constructible(cfg)]


def _impls(cls: type[torch.optim.Optimizer], supported: tuple[str, ...], fused_on: tuple[str, ...]) -> list[
        tuple[str, dict[str, bool]]]:
    if "foreach" not in inspect.signature(cls.__init__).parameters:
        return [("", {})]
    out = [("for-loop", {"foreach": False})]
    if "foreach" in supported:
        out.append(("foreach", {"foreach": True}))
    if "fused" in supported and "cpu" in fused_on:
        out.append(("fused", {"fused": True}))
    return out


def db_configs() -> list[Config]:
    """torch's own test database (common_optimizers.optim_db): each OptimizerInput it ships for
    the CPU × for-loop / foreach / fused where the optimizer has them (tests/test_torch_optim_db.py)."""
    from torch.testing._internal.common_optimizers import optim_db

    out = []
    for info in optim_db:
        cls = cast(type[torch.optim.Optimizer], info.optim_cls)  # torch annotates it as an instance
        shapes = tuple(MATRIX_SHAPES if cls is torch.optim.Muon else SHAPES)
        for given in info.optim_inputs_func(device="cpu", dtype=torch.float32):
            assert given.params is None, f"{cls.__name__} {given.desc}: an input with its own params"
            for impl, impl_kw in _impls(cls, info.supported_impls, info.supports_fused_on):
                label = given.desc.replace(" ", "_") + (f"+{impl}" if impl else "")
                out.append(Config(cls.__name__, label, {**given.kwargs, **impl_kw}, shapes))
    return out


def _constructible(cfg: Config) -> bool:
    """False for combinations torch's constructor rejects (fused with differentiable)."""
    try:
        cfg.make([torch.zeros(s) for s in cfg.shapes])
    except (ValueError, RuntimeError):
        return False
    return True


# -- the contract ---------------------------------------------------------------

# Configs hocompile refuses by design, and what the refusal must say.
LIMITATIONS: list[tuple[Callable[[Config], bool], str]] = [
    (lambda c: c.optimizer == "LBFGS", "closure"),
]

# A branch on optimizer state (a step counter) is a guard: it recompiles once,
# when it flips (scalars.Guard), and both programs stay cached. Allowed for
# these only, at most this many times per pipeline; never for lr changes.
EXPECTED_RECOMPILES: dict[str, tuple[int, str]] = {
    # rho_t > 5 switches the rectified update on (step 6 with beta2 = 0.9)
    "RAdam": (1, "rectification starts at step 6"),
    # `mu != 1` flips when averaging starts (max(1, step - t0) is a host expression, not a branch)
    "ASGD": (1, "averaging starts after step t0 + 1"),
}


def expected_refusal(cfg: Config) -> str | None:
    """What a refusal of ``cfg`` must name, if hocompile refuses it by design."""
    return next((reason for applies, reason in LIMITATIONS if applies(cfg)), None)


@dataclass
class Outcome:
    """What a config did: "bitwise", "refused" (at the first step, nothing changed),
    "wrong" (silently differs from eager) or "crash" (any other error)."""

    kind: str
    detail: str = ""
    eager_error: str = ""  # for refusals: what eager raises on the same step, if anything
    recompiles: list[str] = field(default_factory=list)
    pipelines: tuple[str, ...] = ()  # the pipelines checked bitwise


def violation(cfg: Config, outcome: Outcome) -> str | None:
    """None when ``outcome`` meets the contract, else how it breaks it."""
    if outcome.kind == "bitwise":
        most, _ = EXPECTED_RECOMPILES.get(cfg.optimizer, (0, ""))
        on_state = all(r.startswith("guard failed") and ".state." in r for r in outcome.recompiles)
        if not on_state or len(outcome.recompiles) > most * len(outcome.pipelines):
            return f"recompiles after the steady state: {outcome.recompiles}"
        return None
    if outcome.kind != "refused":
        return f"{outcome.kind.upper()}: {outcome.detail}"
    if outcome.eager_error and outcome.eager_error in outcome.detail:
        return None  # torch itself rejects this config; the refusal passes its reason on
    reason = expected_refusal(cfg)
    if reason is not None and reason in outcome.detail:
        return None
    expected = "compile" if reason is None else f"refuse naming {reason!r}"
    return f"REFUSED, but should {expected}: {outcome.detail}"


def summary(cfg: Config, outcome: Outcome) -> str:
    """One support-matrix cell."""
    if (broken := violation(cfg, outcome)) is not None:
        return f"**fails**: {_first_sentence(broken)}"
    if outcome.kind == "refused":
        if outcome.eager_error and outcome.eager_error in outcome.detail:
            return f"refused, as eager: {_first_sentence(outcome.eager_error)}"
        return f"refused: {_first_sentence(outcome.detail.split(': ', 1)[-1])}"
    if outcome.recompiles:
        per_pipeline = len(outcome.recompiles) // len(outcome.pipelines)
        return f"bitwise ({per_pipeline} recompile: {EXPECTED_RECOMPILES[cfg.optimizer][1]})"
    return "bitwise"


def _first_sentence(text: str, limit: int = 160) -> str:
    text = text.split("; ")[0].split("\n")[0].split(": ['")[0].replace("|", "\\|")
    return text if len(text) <= limit else text[: limit - 1] + "…"


# -- running one config ---------------------------------------------------------


def pipelines_for(cfg: Config) -> dict[str, dict[str, Any]]:
    """Every pass off is eager's arithmetic; Muon with the NS passes off (EXACT: the other passes
    on) keeps it too; optimizers without a Newton–Schulz op must be bitwise under the default
    pipeline as well."""
    if cfg.optimizer == "Muon":
        return {"every pass off": EVERY_PASS_OFF, "exact": EXACT}
    return {"every pass off": EVERY_PASS_OFF, "default": {}}



def _snapshot(opt: torch.optim.Optimizer) -> list[Any]:
    """Params, grads, state and group options, deep-copied for comparison."""

    def copy(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return v.detach().clone()
        if isinstance(v, (list, tuple)):
            return type(v)(copy(x) for x in v)
        if isinstance(v, dict):
            return {k: copy(x) for k, x in v.items()}
        return v

    snap: list[Any] = []
    for group in opt.param_groups:
        snap.append({k: copy(v) for k, v in group.items() if k != "params"})
        for p in group["params"]:
            snap += [copy(p), copy(p.grad), copy(dict(opt.state.get(p, {})))]
    return snap


def _differences(a: Any, b: Any, where: str = "") -> list[str]:
    """Where two snapshots differ (tensors bitwise, NaN equal to NaN)."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.is_sparse or b.is_sparse:
            a, b = a.to_dense(), b.to_dense()
        if a.shape != b.shape or a.dtype != b.dtype:
            return [f"{where}: {tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}"]
        if torch.equal(a, b) or (a.is_floating_point() and torch.equal(a.nan_to_num(), b.nan_to_num())):
            return []
        diff = (a.double() - b.double()).abs().max().item() if a.is_floating_point() else "-"
        return [f"{where}: max abs diff {diff:.3g}" if isinstance(diff, float) else f"{where} differs"]
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{where}: keys {sorted(a)} vs {sorted(b)}"]
        return [d for k in a for d in _differences(a[k], b[k], f"{where}[{k!r}]")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _differences(x, y, f"{where}[{i}]")]
    if type(a) is not type(b) or a != b:
        return [f"{where}: {a!r} vs {b!r}"]
    return []


def _describe(snapshot_index: int, opt: torch.optim.Optimizer) -> str:
    """Which param/grad/state a snapshot index is (for readable diffs)."""
    i = 0
    for g, group in enumerate(opt.param_groups):
        if i == snapshot_index:
            return f"param_groups[{g}]"
        i += 1
        for j, _ in enumerate(group["params"]):
            for what in ("param", "grad", "state"):
                if i == snapshot_index:
                    return f"g{g}.p{j}.{what}"
                i += 1
    return f"[{snapshot_index}]"


def _diff(eager: torch.optim.Optimizer, compiled: torch.optim.Optimizer) -> list[str]:
    a, b = _snapshot(eager), _snapshot(compiled)
    out = []
    for k, (x, y) in enumerate(zip(a, b)):
        out += [_describe(k, eager) + d for d in _differences(x, y)]
    return out


def _grad(cfg: Config, shape: torch.Size, gen: torch.Generator) -> torch.Tensor:
    """A random gradient; for SparseAdam a sparse one over a random half of the rows (an
    nn.Embedding(sparse=True)'s gradient), so the rows it touches change every step."""
    g = torch.randn(shape, generator=gen)
    if cfg.optimizer != "SparseAdam":
        return g
    rows = torch.rand(shape[0], generator=gen) < 0.5
    return (g * rows.view(-1, *[1] * (len(shape) - 1))).to_sparse(1)


def run(cfg: Config, cache_dir: Path, compile_kw: dict[str, Any], steps: int = STEPS) -> Outcome:
    """Step eager and compiled copies of ``cfg`` with identical grads and lrs."""
    eager_params = make_params(cfg.shapes)
    compiled_params = [p.clone() for p in eager_params]
    eager = cfg.make(eager_params)
    inner = cfg.make(compiled_params)
    gen = torch.Generator().manual_seed(1)
    if cfg.resumed:
        for pe in eager_params:
            pe.grad = _grad(cfg, pe.shape, gen)
        try:
            eager.step()
        except Exception:  # noqa: BLE001 - torch rejects the config: the compiled step must too
            pass
        with torch.no_grad():
            for pe, pc in zip(eager_params, compiled_params):
                pc.copy_(pe)
        inner.load_state_dict(copy.deepcopy(eager.state_dict()))
    compiled = hocompile.compile_optimizer(inner, cache_dir=cache_dir, **compile_kw)
    lr0 = eager.param_groups[0]["lr"]
    for step in range(steps):
        if step == steps // 2:  # a state_dict round trip (eager's, deep-copied: torch keeps tensors as they are)
            compiled.load_state_dict(copy.deepcopy(eager.state_dict()))
        lr = lr0 * (1.0 - 0.05 * step)  # a scheduler: a new float every step
        for group in eager.param_groups + compiled.param_groups:
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(lr)  # a tensor lr is scheduled in place (as LRScheduler does)
            else:
                group["lr"] = lr
        for pe, pc in zip(eager_params, compiled_params):
            pe.grad = _grad(cfg, pe.shape, gen)
            pc.grad = pe.grad.clone()
        before = _snapshot(compiled)
        try:
            compiled.step()
        except (hocompile.CaptureError, hocompile.UnsupportedParameterError) as exc:
            message = f"{type(exc).__name__}: {exc}"
            if step != 0:
                return Outcome("crash", f"refused at step {step + 1}, after running the first: {message}")
            if changed := _differences(before, _snapshot(compiled)):
                return Outcome("crash", f"refused, but changed {changed[:3]}: {message}")
            try:
                eager.step()
                eager_error = ""
            except Exception as eager_exc:  # noqa: BLE001 - torch rejecting the config is an answer
                eager_error = str(eager_exc)
            return Outcome("refused", message, eager_error=eager_error)
        except Exception as exc:  # noqa: BLE001 - classified, not swallowed
            frame = traceback.extract_tb(exc.__traceback__)[-1]
            where = f"{Path(frame.filename).name}:{frame.lineno}"
            return Outcome("crash", f"step {step + 1}: {type(exc).__name__}: {exc} (at {where})")
        try:
            eager.step()
        except Exception as exc:  # noqa: BLE001
            return Outcome("wrong", f"compiled ran step {step + 1}, eager raises {type(exc).__name__}: {exc}")
        if diffs := _diff(eager, compiled):
            return Outcome("wrong", f"after step {step + 1}: " + "; ".join(diffs[:4]))
    return Outcome("bitwise", recompiles=list(compiled.counters.recompiles))


def check(cfg: Config, cache_dir: Path, only: str | None = None) -> Outcome:
    """``cfg`` under every pipeline it must be bitwise in (``only``: the one named, or with
    ``"last"`` the last of them: the default one, or EXACT for Muon); the first non-bitwise
    outcome wins."""
    pipelines = pipelines_for(cfg)
    if only is not None:
        name = list(pipelines)[-1] if only == "last" else only
        pipelines = {name: pipelines[name]}
    checked: list[str] = []
    recompiles: list[str] = []
    for name, compile_kw in pipelines.items():
        outcome = run(cfg, cache_dir, compile_kw)
        if outcome.kind != "bitwise":
            if outcome.kind in ("wrong", "crash"):
                outcome.detail = f"[{name} pipeline] {outcome.detail}"
            return outcome
        checked.append(name)
        recompiles += outcome.recompiles
    return Outcome("bitwise", recompiles=recompiles, pipelines=tuple(checked))


def iter_outcomes(cache_dir: Path, cfgs: list[Config] | None = None) -> Iterator[tuple[Config, Outcome]]:
    for cfg in configs() if cfgs is None else cfgs:
        yield cfg, check(cfg, cache_dir)
