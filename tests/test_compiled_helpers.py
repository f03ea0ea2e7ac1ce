"""Scion-style steps (Newton–Schulz in bf16 on ``grad.reshape(len(grad), -1)``, LIONS-EPFL/scion's
Spectral LMO): bitwise with eager with every pass off; and a torch.compile'd helper is said aloud.

Eager runs a torch.compile'd helper as Inductor's kernels, which round differently from its plain
Python. With Newton–Schulz fusion off the helper runs as the user compiled it (an opaque op), so the
step stays bitwise; with it on, the helper is traced through (its NS fused and planned) and the
step compiles with a CompiledHelperWarning and an explain() note naming the function.
"""

from __future__ import annotations

import copy
import types
from pathlib import Path
from typing import Any

import pytest
import torch

import hocompile

from .helpers import EVERY_PASS_OFF


def zeropower_via_newtonschulz5(G: torch.Tensor, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    a, b, c = (3.4445, -4.7750, 2.0315)
    X = G.bfloat16()
    X /= X.norm() + eps
    if G.size(0) > G.size(1):
        X = X.T
    for _ in range(steps):
        A = X @ X.T
        B = b * A + c * A @ A
        X = a * X + B @ X
    if G.size(0) > G.size(1):
        X = X.T
    return X


class Scion(torch.optim.Optimizer):
    def __init__(self, params: Any, lr: float = 0.02, momentum: float = 0.1, scale: float = 3.0, ns: Any = None):
        super().__init__(params, {"lr": lr, "momentum": momentum, "scale": scale})
        self.ns = ns or zeropower_via_newtonschulz5

    @torch.no_grad()
    def step(self) -> None:  # type: ignore[override]
        for group in self.param_groups:
            lr, momentum = group["lr"], group["momentum"]
            for p in group["params"]:
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad)
                buf = state["momentum_buffer"]
                buf.mul_(1 - momentum).add_(p.grad, alpha=momentum)
                g = self.ns(buf.reshape(len(buf), -1)).view(buf.shape)
                g *= (g.shape[0] / g[0].numel()) ** 0.5
                p.data.mul_(1 - lr)
                p.data.add_(group["scale"] * g, alpha=-lr)


SHAPES = [(32, 64), (64, 32), (24, 24), (16, 4, 6)]  # wide, tall, square, a conv-like 3-D weight


def _params() -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(*s, generator=gen)) for s in SHAPES]


def _grads(params: list[torch.nn.Parameter], k: int) -> None:
    gen = torch.Generator().manual_seed(100 + k)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)


def test_scion_bf16_ns_on_a_view_is_bitwise_with_every_pass_off(cache_dir: Path) -> None:
    eager_params, compiled_params = _params(), _params()
    eager = Scion(eager_params)
    compiled = hocompile.compile_optimizer(Scion(compiled_params), **EVERY_PASS_OFF, cache_dir=cache_dir)
    for k in range(10):
        if k == 4:  # an lr change, then a state_dict round trip
            for opt in (eager, compiled):
                opt.param_groups[0]["lr"] = 0.01
        if k == 7:
            compiled.load_state_dict(copy.deepcopy(eager.state_dict()))  # torch aliases same-dtype state
        for params in (eager_params, compiled_params):
            _grads(params, k)
        eager.step()
        compiled.step()
        for a, b in zip(eager_params, compiled_params):
            assert torch.equal(a, b), f"step {k}: {(a - b).abs().max()}"
        for p, q in zip(eager_params, compiled_params):
            assert torch.equal(eager.state[p]["momentum_buffer"], compiled.state[q]["momentum_buffer"])
    assert compiled.counters.eager_fallbacks == 0 and not compiled.counters.recompiles


def test_a_torch_compiled_helper_is_named_in_a_warning_and_in_explain(cache_dir: Path) -> None:
    # backend="aot_eager": Dynamo's and AOTAutograd's wrappers without Inductor's compile time. Only
    # backend="eager" (Dynamo running the same aten ops) goes unnamed (tests/test_host_state.py).
    ns = torch.compile(zeropower_via_newtonschulz5, backend="aot_eager")
    params = _params()
    # the default pipeline: NS fusion on, so the helper is traced through (opaque only where no pass
    # would replan it: the test above)
    compiled = hocompile.compile_optimizer(Scion(params, ns=ns), cache_dir=cache_dir)
    _grads(params, 0)
    with pytest.warns(hocompile.CompiledHelperWarning, match=r"zeropower_via_newtonschulz5 \(test_compiled_helpers"):
        compiled.step()
    assert "wrapped in torch.compile" in hocompile.explain(compiled)
    assert compiled.counters.eager_fallbacks == 0


def test_an_inductor_compiled_helper_is_bitwise_with_every_pass_off(cache_dir: Path) -> None:
    """Scion as its authors ship it: the NS helper under torch.compile (Inductor). With every pass off
    the helper runs as the user compiled it (an opaque hocompile_torch::compiled_call: eager's
    kernels), so the step is bitwise eager's; before, the trace ran its plain Python (~1e-3 apart
    after one step on these shapes) and said so in a CompiledHelperWarning."""
    ns = torch.compile(zeropower_via_newtonschulz5)
    gen = torch.Generator().manual_seed(0)
    shapes = [(16, 8), (4, 2, 6)]
    eager_params = [torch.nn.Parameter(torch.randn(*s, generator=gen)) for s in shapes]
    compiled_params = [torch.nn.Parameter(p.detach().clone()) for p in eager_params]
    eager = Scion(eager_params, ns=ns)
    compiled = hocompile.compile_optimizer(Scion(compiled_params, ns=ns), **EVERY_PASS_OFF, cache_dir=cache_dir)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", hocompile.CompiledHelperWarning)  # opaque: nothing to warn about
        for k in range(4):
            if k == 2:
                for opt in (eager, compiled):
                    opt.param_groups[0]["lr"] = 0.01
            for params in (eager_params, compiled_params):
                _grads(params, k)
            eager.step()
            compiled.step()
            for a, b in zip(eager_params, compiled_params):
                assert torch.equal(a, b), f"step {k}: {(a - b).abs().max()}"
    assert "hocompile_torch::compiled_call" in hocompile.explain(compiled)
    assert compiled.counters.eager_fallbacks == 0 and not compiled.counters.recompiles


# Lion as emerging-optimizers ships it: an Inductor-compiled update that takes the group's betas and
# writes the momentum in place, reached as a module attribute, from a step under @torch.no_grad().
# Inductor's lerp rounds unlike aten's (~5e-8 of the momentum): traced through, the momentum was
# not eager's, and the self-check fell back on every run.
@torch.no_grad()
def _lion_update(grad: torch.Tensor, exp_avg: torch.Tensor, *, betas: tuple[float, float], step: int) -> torch.Tensor:
    beta1, beta2 = betas
    update = exp_avg.lerp(grad, 1 - beta1)
    exp_avg.lerp_(grad, 1 - beta2)
    return torch.sign(update) / (1 - beta2**step)  # a step counter, an int in eager (LaProp's, SOAP's)


lion_helpers = types.ModuleType("lion_helpers")
lion_helpers.update = torch.compile(_lion_update)  # type: ignore[attr-defined]


class CompiledLion(torch.optim.Optimizer):
    def __init__(self, params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.99)) -> None:
        super().__init__(params, {"lr": lr, "betas": betas})

    @torch.no_grad()
    def step(self) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if not state:
                    state["exp_avg"], state["step"] = torch.zeros_like(p), 0
                state["step"] += 1
                update = lion_helpers.update(p.grad, state["exp_avg"], betas=group["betas"], step=state["step"])
                p.add_(update, alpha=-group["lr"])


def test_a_compiled_helper_taking_hyperparameters_and_writing_in_place_runs_as_compiled(cache_dir: Path) -> None:
    """The default pipeline: no matrix products in the helper, so it runs as the user compiled it (an
    opaque op; the betas and the step counter its arguments, this step's values, the counter an int
    as in eager), and the step is bitwise eager's,
    momentum included, through an lr and a betas change; nothing falls back, nothing warns."""
    import warnings

    gen = torch.Generator().manual_seed(0)
    shapes = [(64, 48), (48,), (7, 9)]
    eager_params = [torch.nn.Parameter(torch.randn(*s, generator=gen)) for s in shapes]
    compiled_params = [torch.nn.Parameter(p.detach().clone()) for p in eager_params]
    eager = CompiledLion(eager_params)
    compiled = hocompile.compile_optimizer(CompiledLion(compiled_params), cache_dir=cache_dir)
    with warnings.catch_warnings():
        warnings.simplefilter("error", hocompile.CompiledHelperWarning)
        warnings.simplefilter("error", hocompile.SelfCheckWarning)
        for k in range(6):
            if k == 3:
                for opt in (eager, compiled):
                    opt.param_groups[0]["lr"] = 5e-4
                    opt.param_groups[0]["betas"] = (0.95, 0.98)
            for params in (eager_params, compiled_params):
                _grads(params, k)
            eager.step()
            compiled.step()
            for p, q in zip(eager_params, compiled_params):
                assert torch.equal(p, q), f"step {k}: {(p - q).abs().max()}"
                assert torch.equal(eager.state[p]["exp_avg"], compiled.state[q]["exp_avg"]), f"step {k}"
    assert "hocompile_torch::compiled_call" in hocompile.explain(compiled)
    assert compiled.counters.eager_fallbacks == 0 and not compiled.counters.recompiles


def test_steps_calling_compiled_helpers_stamp_per_class(cache_dir: Path) -> None:
    """The op's key is a digest of the call, so members of a class give one program: the step is traced
    on one and two members per class, not per param (400 Lion params: 15 s -> 3 s first step)."""
    gen = torch.Generator().manual_seed(1)
    shapes = [(32, 16), (16,)] * 6
    eager_params = [torch.nn.Parameter(torch.randn(*s, generator=gen)) for s in shapes]
    compiled_params = [torch.nn.Parameter(p.detach().clone()) for p in eager_params]
    eager = CompiledLion(eager_params)
    compiled = hocompile.compile_optimizer(CompiledLion(compiled_params), cache_dir=cache_dir)
    for k in range(3):
        for params in (eager_params, compiled_params):
            _grads(params, k)
        eager.step()
        compiled.step()
        assert all(torch.equal(p, q) for p, q in zip(eager_params, compiled_params)), f"step {k}"
    assert all(e.stamped is not None for e in compiled.history), hocompile.explain(compiled)
    assert compiled.counters.eager_fallbacks == 0


def test_the_lowered_step_calls_a_helper_in_place_on_contiguous_tensors_and_on_copies_otherwise(
    cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lowered module calls the helper itself, not through the dispatcher: on the step's own
    momentum where every input is contiguous (its write-back dropped), on a copy of what it writes
    otherwise (a transposed param: the plain module). Bitwise eager's either way."""
    gen = torch.Generator().manual_seed(2)
    eager_params = [
        torch.nn.Parameter(torch.randn(32, 16, generator=gen)),
        torch.nn.Parameter(torch.randn(24, 40, generator=gen).t()),  # not contiguous: the plain module
    ]
    compiled_params = [torch.nn.Parameter(p.detach().clone(memory_format=torch.preserve_format)) for p in eager_params]
    assert not compiled_params[1].is_contiguous()
    eager = CompiledLion(eager_params)
    compiled = hocompile.compile_optimizer(CompiledLion(compiled_params), cache_dir=cache_dir)
    from hocompile.capture import compiled_calls

    clones: list[str] = []
    run = compiled_calls._run

    def spy(*args: Any, **kwargs: Any) -> Any:
        clones.append(kwargs.get("clone", "all"))
        return run(*args, **kwargs)

    monkeypatch.setattr(compiled_calls, "_run", spy)
    for k in range(4):
        for params in (eager_params, compiled_params):
            gen_k = torch.Generator().manual_seed(50 + k)
            for p in params:  # grads with the params' own layout
                g = torch.randn(p.shape[::-1] if not p.is_contiguous() else p.shape, generator=gen_k)
                p.grad = g.t() if not p.is_contiguous() else g
        eager.step()
        compiled.step()
        for p, q in zip(eager_params, compiled_params):
            assert torch.equal(p, q), f"step {k}"
            assert torch.equal(eager.state[p]["exp_avg"], compiled.state[q]["exp_avg"]), f"step {k}"
    assert compiled.counters.eager_fallbacks == 0
    source = compiled.history[-1].lowered.source
    assert "call_in_place(" in source and "torch.ops.hocompile_torch.compiled_call" not in source, source
    assert "exp_avg.copy_(" not in source, source  # the momentum's write-back is the helper's own write
    # The transposed param makes the step run the plain module: the helper on a copy of the momentum.
    assert "written" in clones and "none" not in clones, clones


def test_a_helper_whose_argument_is_read_after_the_call_is_not_called_in_place() -> None:
    """The rewrite's guards, on graphs a pass could produce: the momentum's old value read after the
    call, or a view of it passed beside it. Such a call copies what it writes (call_directly) and keeps
    its write-back."""
    import operator

    import torch.fx as fx

    from hocompile.capture import compiled_calls as ch
    from hocompile.lowering.helper_calls import call_helpers

    for read_after, view_beside in ((False, False), (True, False), (False, True)):
        arguments = ((torch.ones(2), torch.ones(2)), {"betas": (0.9, 0.99), "step": 1})
        _, spec = torch.utils._pytree.tree_flatten(arguments)
        record = ch.CompiledCall(lion_helpers.update, _lion_update, spec, [ch.TENSOR_SLOT] * 2 + [ch.SCALAR_SLOT] * 3,
                          mutated=[1], outputs=1, int_scalars=[False, False, True])
        key = ch.call_key(record)
        graph = fx.Graph()
        grad, avg, h = graph.placeholder("grad"), graph.placeholder("avg"), graph.placeholder("h")
        for n in (grad, avg):
            n.meta["val"] = torch.ones(2)
        tensors = [grad, avg]
        if view_beside:  # a view of the momentum passed beside it: writing it in place would change the view
            tensors.append(graph.call_function(torch.ops.aten.view.default, (avg, [2])))
        call = graph.call_function(torch.ops.hocompile_torch.compiled_call.default, (tensors, [h, h, h], key))
        update = graph.call_function(operator.getitem, (call, 0))
        new_avg = graph.call_function(operator.getitem, (call, 1))
        copied = graph.call_function(torch.ops.aten.copy.default, (avg, new_avg))
        late = graph.call_function(torch.ops.aten.mul.Tensor, (avg, 2.0)) if read_after else update
        back = graph.call_function(torch.ops.aten.copy_.default, (avg, copied))
        back.meta["hocompile.origin"] = "writeback"
        graph.output((update, late))
        done = call_helpers(graph, in_place=True)
        targets = [n.target for n in graph.nodes if n.op == "call_function"]
        if read_after or view_beside:
            assert not done and ch.call_directly in targets and torch.ops.aten.copy_.default in targets
        else:
            assert done == [call.name] and ch.call_in_place in targets and torch.ops.aten.copy_.default not in targets


def test_a_calls_arguments_are_rebuilt_as_pytree_would() -> None:
    """The generated argument builder (pytree's unflatten, without its cost per call) gives what
    pytree gives, for tuples, lists, dicts, None, ints in eager, constants; other containers use pytree."""
    import collections

    from hocompile.capture import compiled_calls as ch

    pair = collections.namedtuple("pair", "a b")
    t0, t1 = torch.ones(2), torch.zeros(3)
    structures = [
        ((t0, [t1, ch.SCALAR_SLOT]), {"betas": (ch.SCALAR_SLOT, ch.SCALAR_SLOT), "step": ch.SCALAR_SLOT, "flag": True}),
        ((None, t0, "name", (t1,)), {3: ch.SCALAR_SLOT, "nested": {"x": [t0, None]}}),
        ((pair(t0, ch.SCALAR_SLOT),), {}),
    ]
    for structure in structures:
        leaves, spec = torch.utils._pytree.tree_flatten(structure)
        constants = [ch.TENSOR_SLOT if isinstance(x, torch.Tensor) else x for x in leaves]
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        scalars = [0.5 + i for i, x in enumerate(leaves) if x is ch.SCALAR_SLOT]
        record = ch.CompiledCall(None, None, spec, constants, int_scalars=[i % 2 == 1 for i in range(len(scalars))])
        built = ch._builder(record)(tensors, scalars)
        expected = ch._arguments(record, tensors, scalars)
        assert repr(built) == repr(expected)
        assert [type(x) for x in torch.utils._pytree.tree_leaves(built)] == [
            type(x) for x in torch.utils._pytree.tree_leaves(expected)
        ]


@torch.no_grad()
def _masked_update(grad: torch.Tensor, exp_avg: torch.Tensor, mask: torch.Tensor | None, beta: float) -> torch.Tensor:
    exp_avg.lerp_(grad, 1 - beta)
    return exp_avg.sign() if mask is None else exp_avg.sign() * mask


masked_helpers = types.ModuleType("masked_helpers")
masked_helpers.update = torch.compile(_masked_update)  # type: ignore[attr-defined]


class MaskedSign(torch.optim.Optimizer):
    """A helper called with an argument left None (pytree's leaf, like a tensor's place)."""

    def __init__(self, params: Any, lr: float = 1e-3) -> None:
        super().__init__(params, {"lr": lr, "beta": 0.9})

    @torch.no_grad()
    def step(self) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                p.add_(masked_helpers.update(p.grad, state["exp_avg"], None, group["beta"]), alpha=-group["lr"])


def test_a_helper_called_with_a_none_argument_runs_as_compiled(cache_dir: Path) -> None:
    gen = torch.Generator().manual_seed(3)
    eager_params = [torch.nn.Parameter(torch.randn(16, 8, generator=gen)), torch.nn.Parameter(torch.randn(8))]
    compiled_params = [torch.nn.Parameter(p.detach().clone()) for p in eager_params]
    eager = MaskedSign(eager_params)
    compiled = hocompile.compile_optimizer(MaskedSign(compiled_params), cache_dir=cache_dir)
    for k in range(3):
        for params in (eager_params, compiled_params):
            _grads(params, k)
        eager.step()
        compiled.step()
        assert all(torch.equal(p, q) for p, q in zip(eager_params, compiled_params)), f"step {k}"
    assert "compiled_call" in hocompile.explain(compiled)
    assert compiled.counters.eager_fallbacks == 0
