"""The self-check's own reference: a difference is confirmed against a second eager run before it fails.

Only eager's side is run again (self_check._confirmed): where eager's two runs on copies differ from
each other, eager was not reproducible at that moment and the compiled result, kept from the first
run, is judged against the second. A compiled result that differs once still fails, and so does one
that differs from an eager step that reproduces itself. The failure this answers was seen once per
few CI runs on one CPU kind: emerging-optimizers' SOAP, whose check's eager reference came out
non-finite in every value of a param while the compiled step was finite.

Faults are injected into the results the check's runs hand back (View.run): the first run of a check
is the compiled program on copies, the later ones eager's step on copies.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

import hocompile
from hocompile import SelfCheckWarning
from hocompile.runtime.check.view import View, ViewResult

SHAPES = [(16, 8), (8, 16), (12, 12)]


def _poisoned(result: ViewResult) -> ViewResult:
    for name, t in result.tensors.items():
        if t.is_floating_point():
            result.tensors[name] = torch.full_like(t, float("nan"))
    return result


def _inject(monkeypatch: Any, compiled: bool = False, eager: set[int] | None = None) -> list[str]:
    """Poison the compiled run's result, and eager's runs with these numbers (1-based, in the order
    they run); returns the runs seen ("compiled"/"eager"). The compiled program runs on copies with no
    modes; eager's step with a list of them (possibly empty). How many eager runs a check makes
    depends on the CPU kind (a first judgement with half-precision GEMMs in fp32: check_gemms.py)."""
    real = View.run
    seen: list[str] = []

    def run(self: View, opt: Any, fn: Any, modes: Any = None) -> ViewResult:
        role = "compiled" if modes is None else "eager"
        seen.append(role)
        out = real(self, opt, fn, modes)
        bad = compiled if role == "compiled" else seen.count("eager") in (eager or set())
        return _poisoned(out) if bad else out

    monkeypatch.setattr(View, "run", run)
    return seen


def _pair(cache_dir: Any) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter], Any, Any]:
    gen = torch.Generator().manual_seed(0)
    start = [torch.randn(*s, generator=gen) for s in SHAPES]
    ep = [torch.nn.Parameter(t.clone()) for t in start]
    cp = [torch.nn.Parameter(t.clone()) for t in start]
    eager = torch.optim.AdamW(ep, lr=1e-2)
    compiled = hocompile.compile_optimizer(torch.optim.AdamW(cp, lr=1e-2), cache_dir=cache_dir)
    return ep, cp, eager, compiled


def _step(ep: list[torch.nn.Parameter], cp: list[torch.nn.Parameter], eager: Any, compiled: Any) -> None:
    gen = torch.Generator().manual_seed(7)
    for a, b in zip(ep, cp):
        g = torch.randn(a.shape, generator=gen)
        a.grad, b.grad = g.clone(), g.clone()
    eager.step()
    compiled.step()


def test_an_eager_reference_that_does_not_reproduce_itself_is_run_again(cache_dir: Any, monkeypatch: Any) -> None:
    ep, cp, eager, compiled = _pair(cache_dir)
    seen = _inject(monkeypatch, eager={1})  # the check's first eager run comes out all nan
    with warnings.catch_warnings():
        warnings.simplefilter("error", SelfCheckWarning)
        _step(ep, cp, eager, compiled)
    assert seen == ["compiled", "eager", "eager"], seen  # eager again, then judged against that run
    (entry,) = compiled.history
    assert entry.self_check.checks == 1 and not entry.self_check.failed
    assert entry.self_check.irreproducible == 1
    assert "did not reproduce itself on 1 check(s)" in entry.self_check.describe()
    assert compiled.counters.as_dict()["eager_fallbacks"] == 0
    assert all(torch.equal(a, b) for a, b in zip(ep, cp))


@pytest.mark.parametrize("bad", ["compiled", "eager"], ids=["compiled-once", "eager-reproducibly"])
def test_a_difference_that_a_second_eager_run_confirms_still_fails(bad: str, cache_dir: Any,
                                                                   monkeypatch: Any) -> None:
    """The compiled result differing once is not re-run (it would be passed by luck), and an eager step
    that gives the same bits twice is eager's answer."""
    ep, cp, eager, compiled = _pair(cache_dir)
    seen = _inject(monkeypatch, compiled=bad == "compiled", eager=set(range(1, 9)) if bad == "eager" else None)
    with pytest.warns(SelfCheckWarning, match="differs from eager"):
        _step(ep, cp, eager, compiled)
    assert seen.count("compiled") == 1 and seen.count("eager") % 2 == 0, seen  # each reference confirmed
    (entry,) = compiled.history
    assert entry.self_check.failed and entry.self_check.irreproducible == 0
    assert all(torch.equal(a, b) for a, b in zip(ep, cp))  # the real step ran eagerly


def test_the_confirmation_costs_nothing_when_the_check_agrees(cache_dir: Any, monkeypatch: Any) -> None:
    ep, cp, eager, compiled = _pair(cache_dir)
    seen = _inject(monkeypatch)
    _step(ep, cp, eager, compiled)
    assert seen == ["compiled", "eager"], seen
