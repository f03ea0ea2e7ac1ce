"""gpu_check's ``fence`` section: the Triton step's write fence and operand layouts, on the device.

- a launch failing midway (the k-th kernel of a steady-state Muon step raises, before or after it
  ran): params and state must be bitwise as before (lowering/triton/fence.py), and the step then
  retried must be bitwise the step without the failure;
- an eigh that does not converge (injected with a dispatch mode) in a Triton step of hocompile's
  Shampoo: a ``LinAlgFallbackWarning``, and that step bitwise eager's from the same state;
- strided inputs (transposed and sliced grads, a transposed param, views into one flat buffer) and
  a transposed twin joining its batch: the Triton step against the aten step, fp32 Newton–Schulz,
  within one bf16 ulp of the update per step (torch.optim.Muon rounds its NS result to bf16).

The same code runs in ``--smoke`` (CPU, the interpreter: the kernel entry patched is then
``InterpretedFunction.run`` instead of ``JITFunction.run``).
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import hocompile
from hocompile.optimizers import Shampoo

Result = dict[str, Any]


class KernelFailure(RuntimeError):
    pass


@contextmanager
def failing_launch(fail_at: int | None, after: bool = False) -> Iterator[list[str]]:
    """Count kernel launches (yields their names); launch ``fail_at`` raises (``after``: once it ran)."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    names: list[str] = []
    originals = {cls: cls.run for cls in (JITFunction, InterpretedFunction)}

    def wrap(run: Callable[..., Any]) -> Callable[..., Any]:
        def counted(fn: Any, *args: Any, **kwargs: Any) -> Any:
            index = len(names)
            names.append(fn.fn.__name__ if hasattr(fn, "fn") else fn.__name__)
            if index == fail_at and not after:
                raise KernelFailure(f"launch {index} failed")
            result = run(fn, *args, **kwargs)
            if index == fail_at:
                raise KernelFailure(f"launch {index} failed after running")
            return result

        return counted

    for cls, run in originals.items():
        cls.run = wrap(run)  # type: ignore[method-assign]
    try:
        yield names
    finally:
        for cls, run in originals.items():
            cls.run = run  # type: ignore[method-assign]


def _tensors(opt: Any, params: list[torch.Tensor]) -> list[torch.Tensor]:
    state = [v for p in params for v in opt.state[p].values() if isinstance(v, torch.Tensor)]
    return [*params, *state]


def _snapshot(opt: Any, params: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.detach().clone() for t in _tensors(opt, params)]


def _restore(opt: Any, params: list[torch.Tensor], saved: list[torch.Tensor]) -> None:
    for t, s in zip(_tensors(opt, params), saved):
        t.data.copy_(s)


def _bitwise(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x.reshape(-1), y.reshape(-1)) for x, y in zip(a, b))


def launch_failure_case(device: torch.device, shapes: list[tuple[int, int]], cache: Path) -> Result:
    gen = torch.Generator(device=device).manual_seed(50)
    params = [torch.nn.Parameter(torch.randn(*s, generator=gen, device=device)) for s in shapes]
    muon = torch.optim.Muon(params, lr=0.02, weight_decay=0.1, ns_steps=2)
    tri = hocompile.compile_optimizer(muon, backend="triton", precision="fp32", cache_dir=cache)
    for _ in range(3):  # first step, the steady state's compile, a cached run
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen, device=device)
        tri.step()
    before = _snapshot(tri, params)
    with failing_launch(None) as names:
        tri.step()
    expected = _snapshot(tri, params)
    total = len(names)
    res: Result = {"launches": total, "commit_last": names[-1].startswith("writeback_"), "cases": {}}
    for fail_at, after in [(0, True), (total // 2, False), (total - 2, True)]:
        _restore(tri, params, before)
        raised = False
        with failing_launch(fail_at, after):
            try:
                tri.step()
            except KernelFailure:
                raised = True
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        unchanged = _bitwise(_snapshot(tri, params), before)
        res["cases"][f"{names[fail_at]}{' (after)' if after else ''}"] = {"raised": raised, "unchanged": unchanged}
    _restore(tri, params, before)
    tri.step()  # retried: bitwise the step without the failure
    res["retry_bitwise"] = _bitwise(_snapshot(tri, params), expected)
    failed_cleanly = all(c["raised"] and c["unchanged"] for c in res["cases"].values())
    res["passed"] = res["commit_last"] and res["retry_bitwise"] and failed_cleanly
    return res


class FailingEigh(TorchDispatchMode):
    """Every float32 eigh raises LinAlgError (hocompile::inverse_root by eigh included), as LAPACK or
    cuSOLVER does on data it cannot diagonalise."""

    def __init__(self) -> None:
        super().__init__()
        self.failed = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        aten = torch.ops.aten
        root = func is torch.ops.hocompile.inverse_root.default
        method = str((kwargs or {}).get("method", args[3] if len(args) > 3 else "eigh")) if root else ""
        if (func in (aten._linalg_eigh.default, aten.linalg_eigh.default) or method == "eigh") and (
            args[0].dtype == torch.float32
        ):
            self.failed += 1
            raise torch.linalg.LinAlgError("linalg.eigh: injected: the algorithm failed to converge")
        return func(*args, **(kwargs or {}))


def eigh_fallback_case(device: torch.device, shapes: list[tuple[int, int]], cache: Path) -> Result:
    gen = torch.Generator(device=device).manual_seed(51)
    params = [torch.nn.Parameter(torch.randn(*s, generator=gen, device=device)) for s in shapes]
    compiled = hocompile.compile_optimizer(
        Shampoo(params, lr=0.01, precondition_frequency=1), backend="triton", cache_dir=cache
    )

    def step(opt: Any, ps: list[torch.nn.Parameter], seed: int) -> None:
        g = torch.Generator(device=device).manual_seed(100 + seed)
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g, device=device)
        opt.step()

    for k in range(3):
        step(compiled, params, k)
    twin_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    twin = Shampoo(twin_params, lr=0.01, precondition_frequency=1)
    twin.load_state_dict(copy.deepcopy(compiled.optimizer.state_dict()))
    with FailingEigh():
        step(twin, twin_params, 3)
    with FailingEigh() as mode, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step(compiled, params, 3)
    warned = any(issubclass(w.category, hocompile.LinAlgFallbackWarning) for w in caught)
    lowered = compiled.history[-1].lowered
    res: Result = {
        "backend": lowered.backend if lowered is not None else None,
        "eigh_failures_injected": mode.failed,
        "warned": warned,
        "eager_fallbacks": compiled.counters.eager_fallbacks,
        "bitwise_eager": _bitwise(_tensors(compiled.optimizer, params), _tensors(twin, twin_params)),
    }
    res["passed"] = bool(res["backend"] == "triton" and mode.failed and warned and res["bitwise_eager"])
    return res


LAYOUTS = [("dense", "transposed"), ("transposed", "strided"), ("view", "view"), ("dense", "dense")]


def _laid_out(value: torch.Tensor, layout: str, flat: torch.Tensor, offset: int) -> torch.Tensor:
    rows, cols = value.shape
    if layout == "transposed":
        return value.mT.contiguous().mT
    if layout == "strided":
        wide = torch.zeros(rows, 2 * cols, device=value.device)
        wide[:, ::2] = value
        return wide[:, ::2]
    if layout == "view":
        view = flat[offset : offset + value.numel()].view(rows, cols)
        view.copy_(value)
        return view
    return value.clone()


def _placed(values: list[torch.Tensor], layouts: list[str]) -> list[torch.Tensor]:
    flat = torch.zeros(sum(v.numel() for v in values) + 3, device=values[0].device)
    out, offset = [], 3
    for value, layout in zip(values, layouts):
        out.append(_laid_out(value, layout, flat, offset))
        offset += value.numel()
    return out


def layouts_case(device: torch.device, shapes: list[tuple[int, int]], cache: Path) -> Result:
    """Param and grad layouts cycle through LAYOUTS; ``shapes`` should hold a tall/wide twin pair."""
    gen = torch.Generator(device=device).manual_seed(52)
    initial = [torch.randn(*s, generator=gen, device=device) for s in shapes]
    layouts = [LAYOUTS[k % len(LAYOUTS)] for k in range(len(shapes))]
    lr, sets, opts = 0.02, [], []
    for backend in ("aten", "triton"):
        params = [torch.nn.Parameter(t) for t in _placed(initial, [p for p, _ in layouts])]
        muon = torch.optim.Muon(params, lr=lr, weight_decay=0.1, ns_steps=2)
        opts.append(hocompile.compile_optimizer(muon, backend=backend, precision="fp32", cache_dir=cache))
        sets.append(params)
    worst = 0.0
    for step in range(1, 3):
        grads = [torch.randn(*s, generator=gen, device=device) for s in shapes]
        for params in sets:
            for p, g in zip(params, _placed(grads, [g for _, g in layouts])):
                p.grad = g
        for opt in opts:
            opt.step()
        for (m, n), a, t in zip(shapes, *sets):
            ulp = lr * max(1.0, m / n) ** 0.5 * 2**-7  # one bf16 ulp of an update entry below 2
            bound = step * ulp + 4 * torch.finfo(torch.float32).eps * a.detach().abs().max().item()
            worst = max(worst, (a - t).abs().max().item() / bound)
    lowered = opts[1].history[-1].lowered
    return {
        "layouts": [list(pair) for pair in layouts],
        "max_diff_vs_bound": worst,
        "backend": lowered.backend if lowered is not None else None,
        "passed": worst <= 1.0 and lowered is not None and lowered.backend == "triton",
    }


def section(ctx: Any, out: dict[str, Any]) -> None:
    """Run the three cases into ``out``; a failure is recorded and the next case runs."""
    small = [(16, 20), (16, 20), (20, 16), (16, 16)] if ctx.smoke else [(200, 333), (200, 333), (333, 200), (256, 256)]
    shampoo = [(16, 20), (16, 16)] if ctx.smoke else [(256, 384), (384, 384)]
    cases: dict[str, Callable[[], Result]] = {
        "launch_failure": lambda: launch_failure_case(ctx.device, small, ctx.cache_root / "fence"),
        "eigh_fallback": lambda: eigh_fallback_case(ctx.device, shampoo, ctx.cache_root / "fence-shampoo"),
        "layouts": lambda: layouts_case(ctx.device, small, ctx.cache_root / "fence-layouts"),
    }
    for name, run in cases.items():
        try:
            res = run()
        except Exception as exc:  # noqa: BLE001 - recorded, and the next case runs
            res = {"error": f"{type(exc).__name__}: {exc}", "passed": False}
        out[name] = res
        detail = res.get("error") or ", ".join(f"{k} {v}" for k, v in res.items() if k not in ("passed", "cases"))
        print(f"  [{'PASS' if res['passed'] else 'FAIL'}] {name}: {detail}", flush=True)
        ctx.check(f"fence: {name}", bool(res["passed"]))
        ctx.save()
