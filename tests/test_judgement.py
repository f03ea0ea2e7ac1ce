"""The judgement itself (hocompile/runtime/check/judgement.py): a change of summation order passes, a wrong step fails.

The candidate step is the optimizer's own eager step run under :class:`Rounding` with another seed — what
another kernel or BLAS does to every sum — with or without an injected error: one element's update sign
flipped, the update scaled by 1 + 1e-3, or the decoupled weight decay dropped from the program. Each is
judged step by step (three steps, each from the state the candidate left) against eager from that state.

- Well-conditioned (emerging-optimizers Muon in fp32, 24×40): every step, every error caught.
- Ill-conditioned SOAP (16×24, eps 1e-3): eager's own update moves by O(1) of a step when the factor handed
  to ``eigh``/``qr`` moves at the rounding level (the wider factor's null space). Run with the candidate's
  decompositions substituted, what follows them is well-conditioned: every error is caught at every step.
- SOAP at its default eps 1e-8: on the first step the bases are G's singular vectors, so QᵀGQ's off-diagonal
  entries are rounding noise and Adam's g / (|g| + 1e-8) makes each a full ±1 of the update: eager's own
  spread there is ~0.3 of the update, larger than every injected error, so step 0 passes them all (and says
  so: the verdict's spread). From the second step on the accumulated moments dominate the noise and every
  error is caught.
"""

from __future__ import annotations

import typing
from collections.abc import Callable
from typing import Any

import pytest
import torch

from hocompile.runtime.check.judgement import Rounding, Verdict, judge_step

typing_extensions = pytest.importorskip("typing_extensions")
if not hasattr(typing, "override"):  # emerging-optimizers 0.3.0 imports typing.override (Python >= 3.12)
    typing.override = typing_extensions.override  # type: ignore[attr-defined]
eo_soap = pytest.importorskip("emerging_optimizers.soap")
eo_orth = pytest.importorskip("emerging_optimizers.orthogonalized_optimizers")

STEPS = 3
Inject = Callable[[torch.optim.Optimizer, torch.Tensor, torch.Tensor], None]


def _flip_one(opt: torch.optim.Optimizer, p: torch.Tensor, before: torch.Tensor) -> None:
    k = int((p - before).abs().flatten().argmax())  # the largest entry: a flip that always matters
    p.view(-1)[k] = before.view(-1)[k] - (p.view(-1)[k] - before.view(-1)[k])


def _scale(opt: torch.optim.Optimizer, p: torch.Tensor, before: torch.Tensor) -> None:
    p.copy_(before + (p - before) * (1 + 1e-3))


def _drop_weight_decay(opt: torch.optim.Optimizer, p: torch.Tensor, before: torch.Tensor) -> None:
    group = opt.param_groups[0]
    p.add_(before, alpha=group["lr"] * group["weight_decay"])  # undo p *= 1 - lr·wd (decoupled)


INJECTED: dict[str, Inject] = {"flipped sign": _flip_one, "1e-3 scale": _scale, "dropped term": _drop_weight_decay}


def _trajectory(build: Callable[[torch.nn.Parameter], torch.optim.Optimizer], shape: tuple[int, int],
                inject: Inject | None) -> list[Verdict]:
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(*shape))
    opt = build(p)
    gen = torch.Generator().manual_seed(1)
    verdicts = []
    for k in range(STEPS):
        p.grad = torch.randn(*shape, generator=gen) * 0.05

        def candidate(k: int = k) -> None:
            before = p.detach().clone()
            with torch.no_grad(), torch.compiler.set_stance("force_eager"), Rounding(seed=100 + k):
                opt.step()  # another summation order everywhere
            if inject is not None:
                with torch.no_grad():
                    inject(opt, p, before)

        verdicts.append(judge_step(opt, candidate))
    return verdicts


def _muon(p: torch.nn.Parameter) -> Any:
    return eo_orth.Muon([p], lr=0.02, weight_decay=0.1, fp32_matmul_prec="highest")


def _soap(eps: float) -> Callable[[torch.nn.Parameter], Any]:
    return lambda p: eo_soap.SOAP([p], lr=3e-3, eps=eps, weight_decay=0.1)


CONFIGS = {
    "well-conditioned Muon fp32 24x40": (_muon, (24, 40)),
    "ill-conditioned SOAP 16x24 eps 1e-3": (_soap(1e-3), (16, 24)),
}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_a_change_of_summation_order_passes(config: str) -> None:
    build, shape = CONFIGS[config]
    verdicts = _trajectory(build, shape, None)
    assert all(v.passed for v in verdicts), [v.describe() for v in verdicts]
    # Eager's own spread was measured, not assumed: the probes moved it (Rounding reached its sums).
    assert all(v.worst is not None and v.worst.spread > 0 for v in verdicts)


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("error", list(INJECTED))
def test_each_injected_error_fails_at_every_step(config: str, error: str) -> None:
    build, shape = CONFIGS[config]
    verdicts = _trajectory(build, shape, INJECTED[error])
    assert not any(v.passed for v in verdicts), [v.describe() for v in verdicts]
    assert all("g0.p0:" in v.describe() for v in verdicts)  # it names the param


def test_ill_conditioned_soap_is_judged_with_the_candidates_decompositions() -> None:
    """SOAP 16×24 eps 1e-3: the spread eager has through eigh/qr is O(1); substituted, it is rounding."""
    verdicts = _trajectory(_soap(1e-3), (16, 24), None)
    assert all(v.substituted > 0 and not v.unmatched for v in verdicts)
    assert max(v.worst.spread for v in verdicts if v.worst) < 1e-3
    loose = _unsubstituted_spread(_soap(1e-3), (16, 24))
    assert loose > 0.1, loose  # without the substitution eager cannot tell itself apart at all


def _unsubstituted_spread(build: Callable[[torch.nn.Parameter], Any], shape: tuple[int, int]) -> float:
    """Eager against itself under Rounding after two steps, decompositions left alone: the state's bases."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(*shape))
    outs = []
    for seed in (1, 2):
        q = torch.nn.Parameter(p.detach().clone())
        opt = build(q)
        gen = torch.Generator().manual_seed(1)
        for _ in range(2):
            q.grad = torch.randn(*shape, generator=gen) * 0.05
            with torch.no_grad(), torch.compiler.set_stance("force_eager"), Rounding(seed=seed):
                opt.step()
        outs.append(torch.cat([v.flatten() for v in opt.state[q].values() if isinstance(v, torch.Tensor)]))
    return float((outs[0] - outs[1]).norm() / outs[0].norm())


@pytest.mark.parametrize("error", list(INJECTED))
def test_default_eps_soap_catches_every_error_after_the_first_step(error: str) -> None:
    verdicts = _trajectory(_soap(1e-8), (16, 24), INJECTED[error])
    first, *later = verdicts
    # Step 0: eager's spread (~0.3 of the update, Adam normalising rounding noise) hides these errors,
    # and the verdict says how large that spread was.
    assert first.worst is not None and first.worst.spread > 0.05
    assert not any(v.passed for v in later), [v.describe() for v in later]


def test_default_eps_soap_passes_a_change_of_summation_order() -> None:
    verdicts = _trajectory(_soap(1e-8), (16, 24), None)
    assert all(v.passed for v in verdicts), [v.describe() for v in verdicts]


def test_exact_tensors_are_held_bitwise() -> None:
    """Where the plan keeps eager's arithmetic nothing but eager's bits passes, a one-ulp move included."""
    p = torch.nn.Parameter(torch.randn(8, 8))
    opt = torch.optim.AdamW([p], lr=1e-2)
    p.grad = torch.randn(8, 8)
    assert judge_step(opt, opt.step, exact=True).passed

    def one_ulp_off() -> None:
        opt.step()
        with torch.no_grad():
            p.view(-1)[3] = torch.nextafter(p.view(-1)[3], torch.tensor(float("inf")))

    verdict = judge_step(opt, one_ulp_off, exact=True)
    assert not verdict.passed and "bitwise" in verdict.describe()
    assert [t.name for t in verdict.failures] == ["g0.p0"]


def test_the_optimizer_keeps_the_candidates_result_and_its_own_objects() -> None:
    p = torch.nn.Parameter(torch.randn(6, 10))
    opt = eo_soap.SOAP([p], lr=3e-3, eps=1e-3)
    p.grad = torch.randn(6, 10)
    group, state = opt.param_groups[0], opt.state
    judge_step(opt, opt.step)
    want = p.detach().clone()
    assert opt.param_groups[0] is group and opt.param_groups[0]["params"][0] is p and opt.state is state
    assert set(opt.state[p]) >= {"exp_avg", "L", "R", "Q_L", "Q_R"}
    assert torch.equal(p.detach(), want)


class _EighOpt(torch.optim.Optimizer):
    """One ``eigh`` per param per step, on a factor of the grads: SOAP's boundary, reduced."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        super().__init__(params, {"lr": 0.1})

    @torch.no_grad()
    def step(self) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if "L" not in state:
                    state["L"] = torch.zeros(p.shape[0], p.shape[0])
                state["L"].mul_(0.9).add_(p.grad @ p.grad.T, alpha=0.1)
                _, q = torch.linalg.eigh(state["L"])
                p.add_(q.T @ q @ p.grad, alpha=-group["lr"])


@pytest.mark.parametrize(
    ("options", "calls"),
    [({"self_check": False}, 1), ({}, 2), ({"self_check": False, "verify": 1}, 1)],
    ids=["plain", "self-check", "verify"],
)
def test_a_recorder_around_a_compiled_step_hears_only_the_candidates_decompositions(
    options: dict[str, Any], calls: int
) -> None:
    """hocompile's own eager references (the self-check's, verify's mirror) run inside a compiled step.
    Recorded too, they matched eager's calls at distance 0 and handed eager its own outputs back: SOAP
    under OPENBLAS_CORETYPE=Haswell was judged 0.81 of an update off against a spread of 0. The candidate's
    calls are the real run's and, under the self-check, its run on the sample's copies."""
    import hocompile
    from hocompile.runtime.check.judgement_modes import Boundaries

    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(24, 16))
    opt = hocompile.compile_optimizer(_EighOpt([p]), **options)
    heard = []
    for _ in range(3):
        p.grad = torch.randn(24, 16)
        recorder = Boundaries()
        with recorder:
            opt.step()
        heard.append(len(recorder.recorded))
    assert heard == [calls] * 3


@pytest.mark.parametrize("batch", [(), (3,)])
def test_substituted_decompositions_keep_eagers_own_layout(batch: tuple[int, ...]) -> None:
    """Handed to eager, a recorded eigh output has the strides eager's own output has (LAPACK's
    eigenvectors are column-major). A row-major copy of the same values sent the next matmul down
    another BLAS path: on an AMD EPYC, eager "differed from itself" by 1e-6 and the self-check failed
    hocompile's Shampoo with every pass off."""
    from hocompile.runtime.check.judgement_modes import Boundaries

    g = torch.randn(*batch, 12, 12, generator=torch.Generator().manual_seed(0))
    a = g @ g.mT + torch.eye(12)
    own = torch.linalg.eigh(a)
    recorder = Boundaries()
    with recorder:
        torch.linalg.eigh(a)
    with Boundaries(recorder.recorded, substitute=True) as substitute:
        handed = torch.linalg.eigh(a)
    assert substitute.matched == (batch[0] if batch else 1)
    for mine, theirs in zip(own, handed):
        assert torch.equal(mine, theirs) and mine.stride() == theirs.stride(), (mine.stride(), theirs.stride())
