"""Classes the differential fuzzer (tests/fuzz_steps.py) found once its patterns grew to what training
code does between steps (noise, Python-int counters, bf16 params among fp32 ones); each stays here.

- **A compile moved the random stream.** Planning times GEMMs on random inputs (the CPU's calibration,
  stack-members): a step that draws noise (``randn_like``) then drew other numbers than eager's from
  its first step on. Compiling now keeps the CPU and CUDA random states (snapshot.random_state_kept).
- **Noise a host read depends on.** A read's program runs ahead of the rest of the step: its draws
  came out of the stream in another order, and the self-check and the eager fallback then started from
  the moved stream. Refused, naming the read and the op.
- **bf16 ``_foreach_mul_`` is not its functional form** (torch 2.13, CPU): the in-place foreach kernel
  rounds the scalar to bf16 first, where ``_foreach_mul`` + ``copy_`` (and ``mul``/``mul_``) compute
  in fp32, so the functionalised step differed by a bf16 unit (the self-check caught it and ran the
  program eagerly). The capture now tags the functional node of each in-place foreach call and the
  lowering runs it with the in-place kernel on copies (hocompile/capture/inplace_foreach.py).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

import hocompile
from hocompile import CaptureError
from hocompile.capture.inplace_foreach import on_copies

from .helpers import EVERY_PASS_OFF


class Noisy(torch.optim.Optimizer):
    def __init__(self, params: list[torch.nn.Parameter], read: bool = False) -> None:
        super().__init__(params, {"lr": 0.05})
        self.read = read

    @torch.no_grad()
    def step(self) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                g = p.grad + 1e-3 * torch.randn_like(p.grad)
                if self.read and g.abs().max().item() > 2.5:
                    g = g * 0.5
                p.add_(g, alpha=-group["lr"])


class Bf16Decay(torch.optim.Optimizer):
    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        super().__init__(params, {"lr": 0.05, "beta": 0.9, "wd": 0.01})

    @torch.no_grad()
    def step(self) -> None:  # type: ignore[override]
        for group in self.param_groups:
            self.decay(group["params"], 1 - self.lr(group) * group["wd"])

    @staticmethod
    def lr(group: dict) -> float:
        """A bias-corrected lr from a tensor counter read with ``.item()``: a new scalar each step."""
        group.setdefault("k", torch.tensor(0.0))
        group["k"] += 1
        return group["lr"] / (1 - group["beta"] ** group["k"].item())

    @staticmethod
    def decay(params: list[torch.Tensor], factor: float) -> None:
        torch._foreach_mul_(params, factor)


def _params(dtype: torch.dtype = torch.float32) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(*s, generator=gen).to(dtype)) for s in [(6, 4), (6, 4), (3, 6)]]


def _run(make: type, compiled: bool, tmp_path: Path, dtype: torch.dtype = torch.float32, **options: object) -> list:
    torch.manual_seed(1234)
    params = _params(dtype)
    opt = make(params)
    if compiled:
        opt = hocompile.compile_optimizer(opt, cache_dir=tmp_path, **options)
    gen = torch.Generator().manual_seed(1)
    for _ in range(4):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(dtype)
        opt.step()
    return [p.detach().clone() for p in params] + [torch.randn(3)]  # and where the stream stands


@pytest.mark.parametrize("options", [{}, EVERY_PASS_OFF], ids=["default", "passes-off"])
def test_a_step_that_draws_noise_draws_eagers_numbers(options: dict, tmp_path: Path) -> None:
    want = _run(Noisy, False, tmp_path)
    got = _run(Noisy, True, tmp_path / "c", **options)
    assert all(torch.equal(a, b) for a, b in zip(want, got))


def test_noise_a_host_read_depends_on_is_refused_before_anything_changes(tmp_path: Path) -> None:
    params = _params()
    for p in params:
        p.grad = torch.randn(p.shape)
    before = [p.detach().clone() for p in params]
    opt = hocompile.compile_optimizer(Noisy(params, read=True), cache_dir=tmp_path)
    state = torch.get_rng_state()
    with pytest.raises(CaptureError, match=r"draws random numbers \(aten.randn_like.default\).*host read 0 at .*\.py"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, params))
    assert torch.equal(state, torch.get_rng_state())


class Bf16FunctionalDecay(Bf16Decay):
    """The functional spelling: eager's ``_foreach_mul`` computes in fp32, and so must the step."""

    @staticmethod
    def decay(params: list[torch.Tensor], factor: float) -> None:
        for p, new in zip(params, torch._foreach_mul(params, factor)):
            p.copy_(new)


@pytest.mark.parametrize("make", [Bf16Decay, Bf16FunctionalDecay], ids=["in-place", "functional"])
@pytest.mark.parametrize("options", [{}, EVERY_PASS_OFF], ids=["default", "passes-off"])
def test_bf16_foreach_runs_the_overload_eager_called(make: type, options: dict, tmp_path: Path) -> None:
    want = _run(make, False, tmp_path, torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("error", hocompile.SelfCheckWarning)
        got = _run(make, True, tmp_path / "c", torch.bfloat16, **options)
    assert all(torch.equal(a, b) for a, b in zip(want, got))


def test_the_in_place_kernel_is_what_the_generated_step_calls(tmp_path: Path) -> None:
    params = _params(torch.bfloat16)
    for p in params:
        p.grad = torch.ones_like(p)
    opt = hocompile.compile_optimizer(Bf16Decay(params), cache_dir=tmp_path, self_check=False)
    opt.step()
    assert "_foreach_mul_on_copies(" in opt.history[-1].lowered.source
    scalar = 0.9973684210526316  # one whose bf16 rounding changes the product
    x = torch.randn(4096, generator=torch.Generator().manual_seed(0)).bfloat16()
    inplace = x.clone()
    torch._foreach_mul_([inplace], scalar)
    assert not torch.equal(torch._foreach_mul([x], scalar)[0], inplace)  # the premise: two kernels
    assert torch.equal(on_copies("_foreach_mul_.Scalar")([x], scalar)[0], inplace)


def test_a_record_loaded_from_disk_keeps_the_in_place_kernel(tmp_path: Path) -> None:
    """The tag travels in the warm-start record (graph_codec keeps it): the loaded step is eager's too."""
    want = _run(Bf16Decay, False, tmp_path, torch.bfloat16)
    first = _run(Bf16Decay, True, tmp_path / "c", torch.bfloat16, warm_start=True)
    params = _params(torch.bfloat16)
    loaded = hocompile.compile_optimizer(Bf16Decay(params), cache_dir=tmp_path / "c", warm_start=True)
    gen = torch.Generator().manual_seed(1)
    for _ in range(4):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(torch.bfloat16)
        loaded.step()
    assert all(entry.warm for entry in loaded.history)  # every program came from the record
    assert "_foreach_mul_on_copies(" in loaded.history[-1].lowered.source
    assert all(torch.equal(a, b) for a, b in zip(want, first))
    assert all(torch.equal(a, p) for a, p in zip(want, params))
