"""The drop-in contract under real use: AMP, threads, torch.compile, copies, recompile storms, our own bugs."""

from __future__ import annotations

import copy
import datetime
import io
import pickle
import threading
from typing import Any

import pytest
import torch

import hocompile
from hocompile.passes.base import Pass, PassResult
from hocompile.runtime.compiled_optimizer import RecompileLimitWarning

from .helpers import EXACT, Pair, make_params

SHAPES = [(4, 3), (6, 2)]
FUSED = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, fused=True),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
}


def _scaled_steps(pair: Pair, steps: int = 5) -> None:
    """GradScaler drives both optimizers; one step has an inf grad (skipped by the fused kernel)."""
    scalers = [torch.amp.GradScaler("cpu", init_scale=1024.0) for _ in range(2)]
    gen = torch.Generator().manual_seed(2)
    for step in range(steps):
        for pe, pc in zip(pair.eager_params, pair.compiled_params):
            g = torch.randn(pe.shape, generator=gen) * 1024
            if step == 2:
                g.view(-1)[0] = float("inf")
            pe.grad, pc.grad = g.clone(), g.clone()
        for scaler, opt in zip(scalers, (pair.eager, pair.compiled)):
            scaler.scale(torch.ones(()))  # what scaler.scale(loss) does first: create the scale
            scaler.step(opt)
            scaler.update()


class _OwnStepSGD(torch.optim.SGD):
    def step(self, closure=None):  # a step of its own: compiled, the fused kernel captured
        return super().step(closure)


class _OwnStepAdamW(torch.optim.AdamW):
    def step(self, closure=None):
        return super().step(closure)


OWN_STEP = {
    "sgd": lambda ps: _OwnStepSGD(ps, lr=0.1, momentum=0.9, fused=True),
    "adamw": lambda ps: _OwnStepAdamW(ps, lr=1e-2, fused=True),
}


@pytest.mark.parametrize("name", sorted(FUSED))
def test_grad_scaler_with_a_fused_optimizer_matches_eager(name: str, cache_dir) -> None:
    # torch.optim's own fused step runs as is; a class of its own around it is compiled, torch's
    # kernel inside (fused_kernels.py) with GradScaler's grad_scale and found_inf as tensor inputs:
    # both bitwise eager's fused step, the inf step skipped alike.
    pair = Pair(FUSED[name], SHAPES, cache_dir)
    _scaled_steps(pair)
    assert pair.max_rel_diff() == 0.0
    assert pair.compiled.counters.as_is == 5 and pair.compiled.counters.compiles == 0
    pair = Pair(OWN_STEP[name], SHAPES, cache_dir)
    _scaled_steps(pair)
    assert pair.max_rel_diff() == 0.0
    assert pair.compiled.counters.eager_fallbacks == 0 and pair.compiled.counters.compiles == 2
    assert "hocompile_torch.fused_" in str(pair.compiled.history[-1].captured.gm.code)


def test_tensor_attributes_are_inputs_not_constants(cache_dir) -> None:
    """A tensor the optimizer holds as an attribute (and replaces) is read fresh every step."""

    class ScaledSGD(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, dict(lr=0.1))
            self.scale = torch.tensor(1.0)

        @torch.no_grad()
        def step(self, closure=None):
            for p in self.param_groups[0]["params"]:
                p.add_(p.grad * self.scale, alpha=-self.param_groups[0]["lr"])

    pair = Pair(ScaledSGD, SHAPES, cache_dir, **EXACT)
    for step in range(4):
        for opt in (pair.eager, pair.compiled.optimizer):
            opt.scale = torch.tensor(0.5**step)
        pair.step()
    assert pair.max_rel_diff() == 0.0


def test_threads_compiling_at_once_match_eager(cache_dir) -> None:
    """make_fx keeps global state: four threads compiling the same optimizer must not trip on each other."""
    results: dict[int, list[torch.Tensor]] = {}
    errors: list[BaseException] = []

    def train(k: int) -> None:
        try:
            params = make_params(SHAPES)
            opt = hocompile.compile_optimizer(torch.optim.AdamW(params, lr=1e-2), cache_dir=cache_dir, **EXACT)
            for step in range(3):
                for j, p in enumerate(params):
                    p.grad = torch.full_like(p, 0.1 * (step + j + 1))
                opt.step()
            assert opt.counters.eager_fallbacks == 0
            results[k] = params
        except BaseException as exc:  # re-raised in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=train, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    eager = make_params(SHAPES)
    opt = torch.optim.AdamW(eager, lr=1e-2)
    for step in range(3):
        for j, p in enumerate(eager):
            p.grad = torch.full_like(p, 0.1 * (step + j + 1))
        opt.step()
    for params in results.values():
        torch.testing.assert_close(params, eager, rtol=0, atol=0)


class _Broken(Pass):
    """A pass with a bug of ours."""

    name = "broken"

    def __call__(self, gm: torch.fx.GraphModule) -> PassResult:
        raise IndexError("a bug in a pass")


def test_an_internal_error_falls_back_loudly(cache_dir, caplog) -> None:
    settings = hocompile.Settings.resolve(cache_dir=cache_dir, fallback="eager")
    params, eager_params = make_params(SHAPES), make_params(SHAPES)
    opt = hocompile.CompiledOptimizer(torch.optim.SGD(params, lr=0.1), settings, pipeline=(_Broken(),))
    eager = torch.optim.SGD(eager_params, lr=0.1)
    for p, q in zip(params, eager_params):
        p.grad, q.grad = torch.ones_like(p), torch.ones_like(q)
    with caplog.at_level("WARNING", logger="hocompile"):
        opt.step()
    eager.step()
    torch.testing.assert_close(params, eager_params, rtol=0, atol=0)
    assert "internal error while compiling: IndexError: a bug in a pass" in hocompile.explain(opt)
    assert "internal error" in caplog.text
    strict = hocompile.CompiledOptimizer(torch.optim.SGD(params, lr=0.1), pipeline=(_Broken(),))
    with pytest.raises(IndexError):
        strict.step()


def test_step_inside_a_torch_compiled_training_step(cache_dir) -> None:
    pair = Pair(lambda ps: torch.optim.AdamW(ps, lr=1e-2), SHAPES, cache_dir)

    @torch.compile(backend="eager")
    def train_step(x: torch.Tensor) -> torch.Tensor:
        pair.compiled.step()
        return x * 2

    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        for pe, pc in zip(pair.eager_params, pair.compiled_params):
            g = torch.randn(pe.shape, generator=gen)
            pe.grad, pc.grad = g.clone(), g.clone()
        pair.eager.step()
        assert train_step(torch.ones(2)).tolist() == [2.0, 2.0]
    assert pair.max_rel_diff() <= 1e-6
    assert pair.compiled.counters.compiles == 2  # first step + steady state, no eager fallback
    assert pair.compiled.counters.eager_fallbacks == 0


class RenumberedSGD(torch.optim.Optimizer):
    """An int option the user changes every step: structural, so every change is a new program."""

    def __init__(self, params):
        super().__init__(params, dict(lr=0.1, repeat=1))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                for _ in range(group["repeat"] % 3 + 1):
                    p.add_(p.grad, alpha=-group["lr"])


def test_recompiles_are_capped_then_eager(cache_dir) -> None:
    pair = Pair(RenumberedSGD, SHAPES, cache_dir, recompile_limit=3)
    with pytest.warns(RecompileLimitWarning, match="recompile limit \\(3\\) reached"):
        for step in range(8):
            for opt in (pair.eager, pair.compiled):
                opt.param_groups[0]["repeat"] = step
            pair.step()
    assert pair.max_rel_diff() == 0.0
    assert len(pair.compiled.counters.recompiles) == 3
    assert pair.compiled.counters.eager_fallbacks == 4
    assert "recompile limit (3) reached" in hocompile.explain(pair.compiled)


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save"])
def test_copies_are_working_compiled_optimizers(how: str, cache_dir) -> None:
    pair = Pair(lambda ps: torch.optim.AdamW(ps, lr=1e-2), SHAPES, cache_dir)
    pair.step()
    if how == "deepcopy":
        clone = copy.deepcopy(pair.compiled)
    elif how == "pickle":
        clone = pickle.loads(pickle.dumps(pair.compiled))
    else:
        buffer = io.BytesIO()
        torch.save(pair.compiled, buffer)
        buffer.seek(0)
        clone = torch.load(buffer, weights_only=False)
    assert isinstance(clone, hocompile.CompiledOptimizer)
    params = clone.param_groups[0]["params"]
    assert all(p is not q for p, q in zip(params, pair.compiled_params))
    eager = copy.deepcopy(pair.eager)
    for p, q in zip(params, eager.param_groups[0]["params"]):
        p.grad, q.grad = torch.ones_like(p), torch.ones_like(q)
    clone.step()
    eager.step()
    torch.testing.assert_close(params, eager.param_groups[0]["params"], rtol=0, atol=0)
    pair.step()  # the original is untouched by its copy
    assert pair.max_rel_diff() <= 1e-6


def _all_gathering_step_on(world: int, rank: int, cache_dir: str, port: int) -> float:
    """A Muon-style step that all-gathers its updates across ranks (the pattern of several public Muons)."""
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=world, rank=rank,
        timeout=datetime.timedelta(seconds=60),  # a rank stuck in a collective fails, never hangs CI
    )
    try:

        class GatheringSGD(torch.optim.Optimizer):
            def __init__(self, params):
                super().__init__(params, dict(lr=0.1))

            @torch.no_grad()
            def step(self, closure=None):
                params = self.param_groups[0]["params"]
                size, me = dist.get_world_size(), dist.get_rank()
                for base in range(0, len(params), size):
                    if base + me < len(params):
                        p = params[base + me]
                        p.add_(p.grad.sign(), alpha=-self.param_groups[0]["lr"])
                    chunk = params[base:base + size]
                    padded = chunk + [torch.empty_like(chunk[-1])] * (size - len(chunk))
                    dist.all_gather(padded, params[min(base + me, len(params) - 1)])

        pair = Pair(GatheringSGD, [(3, 2), (3, 2)], cache_dir, fallback="error")
        for _ in range(3):
            pair.step()
        return pair.max_rel_diff()
    finally:
        dist.destroy_process_group()


def test_collectives_in_the_step_on_one_rank(cache_dir) -> None:
    assert _all_gathering_step_on(1, 0, str(cache_dir), 29517) == 0.0


def _across_on_rank(rank: int, cache_dir: str, port: int, messages: Any) -> None:
    # Always answer, so a regression fails the test instead of hanging it.
    try:
        messages.put(f"max relative difference {_all_gathering_step_on(2, rank, cache_dir, port)}")
    except BaseException as exc:
        messages.put(f"{type(exc).__name__}: {exc}")


def test_collectives_across_ranks_are_compiled_not_skipped(cache_dir) -> None:
    """The gather of every rank's updates is a functional collective in the compiled step: each rank
    ends with its peers' updates, bitwise eager's (skipped, the other rank's params would be stale)."""
    import torch.multiprocessing as mp

    context = mp.get_context("spawn")
    messages = context.SimpleQueue()
    mp.start_processes(_across_on_rank, args=(str(cache_dir), 29519, messages), nprocs=2, start_method="spawn")
    seen = [messages.get() for _ in range(2)]
    assert seen == ["max relative difference 0.0"] * 2, seen


class _OwnsAnSGD(torch.optim.Optimizer):
    """A wrapper whose step delegates to an owned optimizer (sharing its group dicts)."""

    def __init__(self, params):
        super().__init__(list(params), dict(lr=0.1))
        self.inner = torch.optim.SGD(self.param_groups, lr=0.1, momentum=0.9)
        self.inner.param_groups = self.param_groups

    @torch.no_grad()
    def step(self, closure=None):
        self.inner.step()


class _CachesATensor(torch.optim.Optimizer):
    def __init__(self, params):
        super().__init__(params, dict(lr=0.1))
        self.cache: list[torch.Tensor] = []

    @torch.no_grad()
    def step(self, closure=None):
        if not self.cache:
            self.cache.append(torch.zeros(()))
        for p in self.param_groups[0]["params"]:
            p.add_(p.grad, alpha=-self.param_groups[0]["lr"])


def test_a_tensor_cache_the_step_fills_compiles(cache_dir) -> None:
    """Before: refused (the step changes opt.cache). A container on the optimizer is substituted now
    (hocompile/capture/container_trace.py): the step that fills it compiles, bitwise eager."""
    pair = Pair(_CachesATensor, SHAPES, cache_dir)
    for _ in range(3):
        pair.step()
    assert pair.max_rel_diff() == 0.0
    assert pair.compiled.counters.eager_fallbacks == 0
    assert len(pair.compiled.optimizer.cache) == 1 and len(pair.eager.cache) == 1


@pytest.mark.parametrize("factory, where", [(_OwnsAnSGD, "opt.inner.state")])
def test_state_kept_outside_what_capture_substitutes_is_refused(factory, where: str, cache_dir) -> None:
    """Before: the wrapper compiled, its momentum restarted every step and fake tensors leaked into it."""
    pair = Pair(factory, SHAPES, cache_dir)
    for p in pair.compiled_params:
        p.grad = torch.ones_like(p)
    with pytest.raises(hocompile.CaptureError, match=f"the step changes {where}"):
        pair.compiled.step()
    opt = pair.compiled.optimizer
    assert not getattr(opt, "cache", []) and not getattr(opt, "inner", opt).state
    pair = Pair(factory, SHAPES, cache_dir, fallback="eager")
    for _ in range(3):
        pair.step()
    assert pair.max_rel_diff() == 0.0


class RefreshEveryK(torch.optim.Optimizer):
    """A refresh every k steps chosen on a Python counter (Shampoo's and SOAP's pattern)."""

    def __init__(self, params: Any, lr: float = 0.1, k: int = 3) -> None:
        super().__init__(params, {"lr": lr, "k": k})
        self.n = 0

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        self.n += 1
        for group in self.param_groups:
            for p in group["params"]:
                scale = 2.0 if self.n % group["k"] == 0 else 1.0
                p.add_(p.grad, alpha=-group["lr"] * scale)


class NewBranchEveryStep(RefreshEveryK):
    """A branch whose outcome is new at every step: each step fails every earlier guard."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        self.n += 1
        j = next(j for j in range(1000) if self.n <= j)
        for group in self.param_groups:
            for p in group["params"]:
                p.add_(p.grad, alpha=-group["lr"] / j)


def test_host_branch_outcomes_are_variants_not_recompiles(cache_dir) -> None:
    pair = Pair(RefreshEveryK, SHAPES, cache_dir, recompile_limit=1)
    for _ in range(12):
        pair.step()
    assert pair.max_rel_diff() == 0.0
    counters = pair.compiled.counters
    assert counters.recompiles == [] and counters.eager_fallbacks == 0
    assert counters.compiles == 2 and len(counters.variants) == 1 and "% 3" in counters.variants[0]


def test_a_branch_new_every_step_stops_counting_as_variants(cache_dir) -> None:
    pair = Pair(NewBranchEveryStep, SHAPES, cache_dir, recompile_limit=2)
    with pytest.warns(RecompileLimitWarning):
        for _ in range(10):
            pair.step()
    assert pair.max_rel_diff() == 0.0
    counters = pair.compiled.counters
    assert len(counters.variants) == 3  # the first compile, then three more outcomes as variants
    assert len(counters.recompiles) == 2 and counters.eager_fallbacks >= 1
