"""hocompile inside torch.compile (hocompile/dynamo/): ``backend="hocompile"`` runs hocompile's passes
on the graph Dynamo captures of ``opt.step``, with the same answers as ``compile_optimizer``:
bitwise with the Newton–Schulz passes off, NS fused with them on, and no recompiles over an lr
schedule when the lr is a tensor (Dynamo bakes Python floats: one recompile per new value)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

import hocompile
from hocompile.dynamo import BackendFallbackWarning, explain_last
from hocompile.dynamo.last import compiled_graphs
from tests.helpers import EXACT, zeropower_via_newtonschulz5

SHAPES = [(16, 8), (8, 16), (16, 16), (12,)]


class MuonWithAdamW(torch.optim.Optimizer):
    """A user's Muon for matrices and AdamW for the rest, written for torch.compile: the lr and the
    step count are tensors (Dynamo guards on Python numbers and would recompile as they change)."""

    def __init__(self, params: Any, lr: float = 0.02, betas: tuple[float, float] = (0.9, 0.95)) -> None:
        super().__init__(params, {"lr": torch.tensor(lr), "betas": betas, "eps": 1e-8, "momentum": 0.95})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            lr, (beta1, beta2) = group["lr"], group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if p.dim() == 2:
                    if not state:
                        state["momentum_buffer"] = torch.zeros_like(p)
                    buf = state["momentum_buffer"]
                    buf.lerp_(p.grad, 1 - group["momentum"])
                    update = zeropower_via_newtonschulz5(p.grad.lerp(buf, group["momentum"]), 5)
                    p.sub_(lr * max(1, p.size(-2) / p.size(-1)) ** 0.5 * update.to(p.dtype))
                else:
                    if not state:
                        state["step"] = torch.zeros(())
                        state["exp_avg"] = torch.zeros_like(p)
                        state["exp_avg_sq"] = torch.zeros_like(p)
                    state["step"].add_(1)
                    state["exp_avg"].lerp_(p.grad, 1 - beta1)
                    state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                    corrected = state["exp_avg"] / (1 - beta1 ** state["step"])
                    denom = (state["exp_avg_sq"] / (1 - beta2 ** state["step"])).sqrt_().add_(group["eps"])
                    p.sub_(lr * corrected / denom)


def _muon(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    matrices = [p for p in params if p.dim() == 2]
    return torch.optim.Muon(matrices, lr=torch.tensor(0.02), weight_decay=0.01)


def _params() -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]


def _grads(params: list[torch.nn.Parameter], step: int) -> None:
    gen = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)


RECOMPILES: list[int] = []  # graphs compiled after the second step of the last _run


def _run(make: Any, kind: str, steps: int, options: dict[str, Any], cache_dir: Path) -> list[torch.Tensor]:
    """``steps`` steps under a cosine lr schedule: "backend" (torch.compile(opt.step, backend="hocompile")),
    "wrapper" (compile_optimizer) or "eager"; the params after them. The first step creates the
    state (a graph of its own, as compile_optimizer's first step is); RECOMPILES[-1] counts the
    graphs compiled after the second."""
    params = _params()
    opt = make(params)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    if kind == "backend":
        step = torch.compile(opt.step, backend="hocompile", options={**options, "cache_dir": cache_dir})
    elif kind == "wrapper":
        step = hocompile.compile_optimizer(opt, cache_dir=cache_dir, **options).step
    else:
        step = opt.step
    settled = 0
    for k in range(steps):
        _grads(params, k)
        step()
        schedule.step()
        if k == 1:
            settled = compiled_graphs()
    RECOMPILES.append(compiled_graphs() - settled)
    return [p.detach().clone() for p in params]


pytestmark = pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step()` before `optimizer.step()`")


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Any:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_the_backend_is_registered() -> None:
    assert "hocompile" in torch._dynamo.list_backends()


@pytest.mark.parametrize("make", [_muon, MuonWithAdamW], ids=["torch.optim.Muon", "user Muon+AdamW"])
def test_backend_is_bitwise_with_compile_optimizer_with_ns_passes_off(make: Any, cache_dir: Path) -> None:
    through_backend = _run(make, "backend", 12, EXACT, cache_dir)
    assert RECOMPILES[-1] == 0, explain_last(4)  # no recompile as the lr moves
    wrapped = _run(make, "wrapper", 12, EXACT, cache_dir)
    eager = _run(make, "eager", 12, {}, cache_dir)
    for i, (a, b, c) in enumerate(zip(through_backend, wrapped, eager)):
        assert torch.equal(a, b), f"param {i}: backend differs from compile_optimizer"
        assert torch.equal(a, c), f"param {i}: backend differs from eager"


@pytest.mark.parametrize("make", [_muon, MuonWithAdamW], ids=["torch.optim.Muon", "user Muon+AdamW"])
def test_backend_fuses_newton_schulz_with_no_recompiles_over_a_cosine_schedule(make: Any, cache_dir: Path) -> None:
    through_backend = _run(make, "backend", 50, {}, cache_dir)
    assert RECOMPILES[-1] == 0, explain_last(4)
    text = explain_last()
    matrices = sum(1 for s in SHAPES if len(s) == 2)
    assert "fuse-newton-schulz" in text and "changed" in text, text
    record = hocompile.dynamo.last_records()[0]
    assert record.after["newton-schulz"] >= 1 and record.after["matmuls"] < record.before["matmuls"], text
    assert "newton_schulz" in record.final_graph, record.final_graph
    wrapped = _run(make, "wrapper", 50, {}, cache_dir)
    eager = _run(make, "eager", 50, {}, cache_dir)
    for i, (a, b, c) in enumerate(zip(through_backend, wrapped, eager)):
        # the same plan as the wrapper's (same passes on the same aten graph); against eager, the
        # plan's NS budget (bf16 NS, 50 steps of lr 0.02: a few bf16 ulps of the update per step)
        assert torch.allclose(a, b, rtol=0, atol=1e-5), f"param {i}: {(a - b).abs().max():.3g} from the wrapper"
        assert (a - c).abs().max() <= 0.02 * math.sqrt(matrices), f"param {i}: {(a - c).abs().max():.3g} from eager"


def test_options_reach_the_settings_and_unknown_ones_are_named(cache_dir: Path) -> None:
    params = _params()
    opt = _muon(params)
    _grads(params, 0)
    with pytest.raises(Exception, match="no_such_option"):
        torch.compile(opt.step, backend="hocompile", options={"no_such_option": 1})()
    torch._dynamo.reset()
    torch.compile(opt.step, backend="hocompile", options={"disable_passes": ["fuse-newton-schulz"]})()
    statuses = {r.name: r.status for r in hocompile.dynamo.last_records()[0].passes}
    assert statuses["fuse-newton-schulz"] == "disabled", explain_last()


def test_a_graph_outside_hocompiles_ir_runs_as_given_and_says_so(cache_dir: Path) -> None:
    """Dynamic shapes hand the graph symbolic sizes: hocompile plans static shapes, so the graph
    runs as AOTAutograd gave it, with a warning naming the reason; the values stay eager's."""
    x = torch.randn(5, 3)

    def f(t: torch.Tensor) -> torch.Tensor:
        return (t * 2).sum(0)

    with pytest.warns(BackendFallbackWarning, match="dynamic=False"):
        out = torch.compile(f, backend="hocompile", dynamic=True)(x)
    assert torch.equal(out, f(x))
    assert "left alone" in explain_last()


def test_a_whole_train_step_through_the_backend_either_lowering(cache_dir: Path) -> None:
    """Forward, backward and the Muon + AdamW steps: the forward and backward graphs (nothing to
    plan) run through hocompile's aten lowering or Inductor, the step's NS is fused either way."""
    from tests.test_inductor_passes import REL_TOL, _batches, _trainer

    batches = _batches(12)
    eager_step, _ = _trainer()
    eager = [float(eager_step(x, y)) for x, y in batches]
    for lowering in ("hocompile", "inductor"):
        torch._dynamo.reset()
        step, _ = _trainer()
        options = {"cache_dir": cache_dir, "lowering": lowering}
        before = compiled_graphs()
        no_cache = torch._functorch.config.patch(enable_autograd_cache=False)
        with torch._inductor.config.patch(fx_graph_cache=False), no_cache:  # a cache hit would skip the pass
            compiled = torch.compile(step, backend="hocompile", options=options)
            losses = [float(compiled(x, y)) for x, y in batches]
        worst = max(abs(a - b) / b for a, b in zip(losses, eager))
        assert worst <= REL_TOL, (lowering, worst)
        records = hocompile.dynamo.last_records(compiled_graphs() - before)
        route = "backend" if lowering == "hocompile" else "inductor pass"
        assert records and all(r.route == route for r in records), [r.route for r in records]
        assert sum(r.after.get("newton-schulz", 0) for r in records) == 4, hocompile.explain_last(8, graph=False)


def test_the_backend_lowers_to_triton_kernels(cache_dir: Path) -> None:
    """``options={"backend": "triton"}``: the graph's write-backs reach the Triton lowering as
    compile_optimizer's do (kernels under Triton's interpreter here; CUDA params pick it by default)."""
    triton = pytest.importorskip("triton")
    assert triton is not None
    options = {"backend": "triton", "disable_passes": EXACT["disable_passes"]}
    through_backend = _run(_muon, "backend", 3, options, cache_dir)
    assert "lowering: triton" in explain_last(graph=False), explain_last(graph=False)
    wrapped = _run(_muon, "wrapper", 3, options, cache_dir)
    for i, (a, b) in enumerate(zip(through_backend, wrapped)):
        assert torch.allclose(a, b, rtol=0, atol=1e-6), f"param {i}: {(a - b).abs().max():.3g} from the wrapper"
