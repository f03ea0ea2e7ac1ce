"""The Triton step's write fence (lowering/triton/fence.py): all or nothing.

A compiled Triton step is dozens of launches. Before the fence, the update
kernels wrote params and state in place as they went, so an error in a later
launch left a step half applied. Now every written-back value waits in the
step's own buffers and one commit after the last launch writes them. A
launch is made to fail by wrapping the interpreter's kernel entry
(``InterpretedFunction.run``): the k-th launch of a step raises, before or
after doing its work.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

import hocompile

pytest.importorskip("triton")
interpreted = pytest.mark.skipif(torch.cuda.is_available(), reason="runs CPU tensors in the interpreter")


class KernelFailure(RuntimeError):
    pass


class FailingLaunch:
    """Counts kernel launches; launch number ``fail_at`` raises (``after``: once it has run)."""

    def __init__(self, fail_at: int | None, after: bool = False) -> None:
        self.fail_at, self.after, self.count = fail_at, after, 0
        self.names: list[str] = []

    def wrap(self, run: Any) -> Any:
        def counted(fn: Any, *args: Any, **kwargs: Any) -> Any:
            index = self.count
            self.count += 1
            self.names.append(fn.fn.__name__)
            if index == self.fail_at and not self.after:
                raise KernelFailure(f"launch {index} ({fn.fn.__name__}) failed")
            result = run(fn, *args, **kwargs)
            if index == self.fail_at:
                raise KernelFailure(f"launch {index} ({fn.fn.__name__}) failed after running")
            return result

        return counted


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    from triton.runtime.interpreter import InterpretedFunction

    original = InterpretedFunction.run

    def install(failing: FailingLaunch) -> FailingLaunch:
        monkeypatch.setattr(InterpretedFunction, "run", failing.wrap(original))
        return failing

    yield install
    monkeypatch.setattr(InterpretedFunction, "run", original)


def _snapshot(opt: Any, params: list[torch.Tensor]) -> list[torch.Tensor]:
    state = [v for p in params for v in opt.state[p].values() if isinstance(v, torch.Tensor)]
    return [t.detach().clone() for t in (*params, *state)]


def _bitwise(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(x.dtype == y.dtype and torch.equal(x.view(-1), y.view(-1)) for x, y in zip(a, b))


def _restore(opt: Any, params: list[torch.Tensor], saved: list[torch.Tensor]) -> None:
    state = [v for p in params for v in opt.state[p].values() if isinstance(v, torch.Tensor)]
    for t, s in zip((*params, *state), saved):
        t.data.copy_(s)


# Wide, tall (it joins the wide batch transposed) and square, not all tile multiples (16).
SHAPES = [(16, 32), (16, 32), (32, 16), (24, 24)]


def _steady(cache_dir: Any) -> tuple[Any, list[torch.Tensor], list[torch.Tensor]]:
    """A Triton Muon step compiled for its steady state, fresh grads set, and its params and state."""
    gen = torch.Generator().manual_seed(7)
    params = [torch.nn.Parameter(torch.randn(*s, generator=gen)) for s in SHAPES]
    muon = torch.optim.Muon(params, lr=0.02, weight_decay=0.1)
    tri = hocompile.compile_optimizer(muon, backend="triton", precision="fp32", cache_dir=cache_dir)
    for _ in range(3):  # the first step, then the steady state's compile and one cached run
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        tri.step()
    return tri, list(params), _snapshot(tri, params)


@interpreted
def test_a_launch_failing_midway_writes_nothing(cache_dir: Any, launches: Any) -> None:
    tri, params, before = _steady(cache_dir)
    counting = launches(FailingLaunch(None))
    tri.step()
    total, names = counting.count, counting.names
    assert names[-1].startswith("writeback_") and sum(n.startswith("writeback_") for n in names) == 1, names
    # The first pre-Newton-Schulz kernel (it used to write the momentum in place), one in the
    # middle of Newton-Schulz, and the last update kernel before the commit; each raising before
    # it runs, or after (its stores done).
    for fail_at, after in [(0, True), (total // 2, False), (total // 2, True), (total - 2, False), (total - 2, True)]:
        _restore(tri, params, before)
        launches(FailingLaunch(fail_at, after))
        with pytest.raises(KernelFailure):
            tri.step()
        assert _bitwise(_snapshot(tri, params), before), f"launch {fail_at} ({names[fail_at]}) left a partial update"
    assert tri.counters.eager_fallbacks == 0  # not a linear-algebra failure: the error stands
    assert tri.history[-1].fenced
    assert "write fence: 8 write-back(s) after every launch" in hocompile.explain(tri)


@interpreted
def test_the_step_after_a_failed_one_is_the_step_that_failed(cache_dir: Any, launches: Any) -> None:
    """Nothing of a failed step lingers: retried with the same grads, it is bit for bit the step
    that would have run without the failure."""
    tri, params, before = _steady(cache_dir)
    launches(FailingLaunch(5, after=True))
    with pytest.raises(KernelFailure):
        tri.step()
    launches(FailingLaunch(None))
    tri.step()
    retried = _snapshot(tri, params)
    _restore(tri, params, before)
    tri.step()
    assert _bitwise(_snapshot(tri, params), retried)
    assert not _bitwise(retried, before)  # the step did change something


