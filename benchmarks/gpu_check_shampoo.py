"""gpu_check's ``shampoo_family`` section (issue 12): SOAP, REKLS, MOP, PolarGrad and
hocompile's Shampoo, eager vs compiled (backend auto) on one GPT-2 layer's matrices: step times
and the compiled update's distance from eager's. Alone: ``gpu_check.py --sections env,shampoo_family``.

It first runs the ``factor_update`` and ``two_sided`` Triton kernels on their own (compiled for the
device, not interpreted): each against the op's torch arithmetic on the same GPU (fp32, true fp32
dots, so the error is fp32 rounding: within ``SF_KERNEL_TOL`` relative), and their time against it.
"""

from __future__ import annotations

import functools
import gc
import statistics
import traceback
from collections.abc import Callable
from typing import Any

import torch

import hocompile
from hocompile.runtime.check.judgement import Verdict, judge_step

SF_SHAPES = [(768, 2304), (768, 768), (768, 3072), (3072, 768)]
SF_SMOKE_SHAPES = [(16, 24), (24, 16)]  # a tall/wide pair: factors of both sides, a stacked factor_update
SMOKE_FAMILY = ("SOAP", "Shampoo")
SF_CHECK_STEPS = 3  # judged steps on distinct grads (SOAP/Shampoo build their bases at step 1)
# Each of those steps is judged against eager from the same state (hocompile/runtime/check/judgement.py): against
# eager's own spread there, with the step's eigh/qr outputs substituted where they can be matched. A tolerance
# on the trajectory judged rounding luck: SOAP's null-space eigenbasis is picked by rounding, so any change of
# summation order (the Triton kernels, OPENBLAS_CORETYPE under the interpreter) moved it by 0.1-2 of a step.


SF_KERNEL_TOL = 1e-5  # max |triton - torch| / max |torch|: fp32 dots (ieee) in another summation order


def _kernel_node(fn: Callable[..., Any], args: list[torch.Tensor], op: Any) -> Any:
    """The one ``op`` node of ``fn``'s graph after canonicalize and the issue-12 fuse passes."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from hocompile.passes import Canonicalize, FuseFactorUpdate, FuseTwoSided

    gm = Canonicalize()(make_fx(lambda *xs: (fn(*xs),), tracing_mode="fake")(*args)).gm
    FuseFactorUpdate()(gm)
    FuseTwoSided()(gm)
    (node,) = [n for n in gm.graph.nodes if n.target is op]
    return node


def _kernel_check(ctx: Any, out: dict[str, Any], shapes: list[tuple[int, int]], timed: Callable[..., Any]) -> None:
    """factor_update (left and right) and two_sided (SOAP's projection) per shape: error and time vs torch."""
    from hocompile.lowering.triton import call_group, module
    from hocompile.ops.factor_update import FACTOR_UPDATE
    from hocompile.ops.two_sided import TWO_SIDED
    from hocompile.targets import device_arch

    dev = torch.device(ctx.device)
    gen = torch.Generator(device=dev).manual_seed(40)
    results: dict[str, Any] = out.setdefault("kernels", {})
    for m, n in shapes:
        g = torch.randn(m, n, device=dev, generator=gen)
        ql, qr = (torch.linalg.qr(torch.randn(s, s, device=dev, generator=gen)).Q for s in (m, n))
        cases: dict[str, tuple[Callable[..., Any], list[torch.Tensor], Any, list[str]]] = {
            "factor_update_left": (
                lambda f, x: f.lerp(x @ x.T, 0.05),
                [ql @ ql.T, g],
                FACTOR_UPDATE.op,
                ["factor", "g"],
            ),
            "factor_update_right": (
                lambda f, x: f.lerp(x.T @ x, 0.05),
                [qr @ qr.T, g],
                FACTOR_UPDATE.op,
                ["factor", "g"],
            ),
            "two_sided": (
                lambda x, a, b: torch.tensordot(torch.tensordot(x, a, dims=[[0], [0]]), b, dims=[[0], [0]]),
                [g, ql, qr],
                TWO_SIDED.op,
                ["x", "left", "right"],
            ),
        }
        for case, (fn, args, op, fields) in cases.items():
            key = f"{case} {m}x{n}"
            try:
                node = _kernel_node(fn, args, op)
                emitter = FACTOR_UPDATE.lowering("triton") if op is FACTOR_UPDATE.op else TWO_SIDED.lowering("triton")
                text, scalars = call_group.standalone_text(emitter, node, fields, device_arch(dev))
                loaded, _ = module.load(text, ctx.cache_root / "sf-kernels")
                res = torch.empty(node.meta["val"].shape, device=dev)
                svals = [torch.tensor(float(s), device=dev) for s in scalars]
                want = fn(*args)
                got = loaded.run(*args, res, *svals, upcast=False)
                err = float((got - want).abs().max() / want.abs().max())
                run_triton = functools.partial(loaded.run, *args, res, *svals, upcast=False)
                t_tri = min(timed(ctx, run_triton)[0] for _ in range(5))
                t_torch = min(timed(ctx, functools.partial(fn, *args))[0] for _ in range(5))
                results[key] = {"rel_err": err, "triton_s": t_tri, "torch_s": t_torch}
                ok = ctx.check(f"shampoo_family kernels: {key} within {SF_KERNEL_TOL:g}", err <= SF_KERNEL_TOL)
                print(
                    f"    {key:<28} err {err:.1e} {'ok' if ok else 'FAIL'}  triton {t_tri * 1e3:.3f} ms  "
                    f"torch {t_torch * 1e3:.3f} ms",
                    flush=True,
                )
            except Exception as exc:  # noqa: BLE001
                results[key] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(limit=8)}
                ctx.check(f"shampoo_family kernels: {key} ran", False)
                print(f"    {key}: ERROR {results[key]['error']}", flush=True)
    ctx.save()


def _shampoo_family() -> dict[str, Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]]:
    import typing

    import typing_extensions

    if not hasattr(typing, "override"):  # emerging-optimizers 0.3.0 imports typing.override (Python >= 3.12)
        typing.override = typing_extensions.override  # type: ignore[attr-defined]
    from emerging_optimizers.orthogonalized_optimizers import MOP, PolarGrad
    from emerging_optimizers.soap import REKLS, SOAP

    from hocompile.optimizers import Shampoo

    # eps 1e-3, not the default 1e-8: at step 1 the eigenbases are G's singular vectors, so QᵀGQ is
    # diagonal up to rounding, and Adam's g / (|g| + eps) makes an off-diagonal entry of rounding noise a
    # full +-1 of the update. The judgement stays honest there (eager's own spread on that step is ~0.3 of
    # the update, tests/test_judgement.py) but can then catch only errors above it: eps above the noise
    # keeps every judged step sharp (spread ~1e-6 of the update).
    return {
        "SOAP": lambda ps: SOAP(ps, lr=3e-3, eps=1e-3),
        "REKLS": lambda ps: REKLS(ps, lr=3e-3, eps=1e-3),
        "MOP": lambda ps: MOP(ps, lr=3e-4),
        "PolarGrad": lambda ps: PolarGrad(ps, lr=3e-4),
        # epsilon 1e-6, not 1e-12, for the same reason: at step 1 the wider side's factor GᵀG is
        # rank-deficient, its zero eigenvalues come out as ±1e-8 of rounding, and (λ + 1e-12)^(-1/4) turns
        # that into a 10x difference of the root: eager's own spread, within which nothing is judged.
        "Shampoo": lambda ps: Shampoo(ps, lr=3e-3, epsilon=1e-6, precondition_frequency=10),
    }


def _sf_run(
    ctx: Any,
    name: str,
    build: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer],
    compiled: bool,
    p0: list[torch.Tensor],
    grads: list[list[torch.Tensor]],
    timed: Callable[..., Any],
) -> tuple[dict[str, Any], list[Verdict]]:
    """SF_CHECK_STEPS steps (the first two timed: capture/compile; compiled ones then judged against eager
    from the same state), then timed steady steps cycling the grads."""
    params = [torch.nn.Parameter(p.clone()) for p in p0]
    opt: Any = build(params)
    if compiled:  # backend auto is triton on a GPU; the smoke run takes the same path, interpreted
        backend = "triton" if ctx.smoke else "auto"
        opt = hocompile.compile_optimizer(opt, backend=backend, cache_dir=ctx.cache_root / f"sf-{name}")

    def call(k: int) -> tuple[float, float | None]:
        for p, g in zip(params, grads[k % len(grads)]):
            p.grad = g
        return timed(ctx, opt.step)

    # Every checked step of the compiled optimizer is judged (its first two timed: capture and compile).
    calls: list[tuple[float, float | None]] = []
    verdicts: list[Verdict] = []
    for k in range(SF_CHECK_STEPS):
        if not compiled:
            calls.append(call(k))
            continue
        for p, g in zip(params, grads[k % len(grads)]):
            p.grad = g
        verdicts.append(judge_step(opt.optimizer, lambda: calls.append(timed(ctx, opt.step))))
    res: dict[str, Any] = {"first_call_s": calls[0][0], "second_call_s": calls[1][0]}
    reps = 1 if ctx.smoke else 20  # Shampoo: two refresh periods, so the mean is its amortised step
    times = [call(k) for k in range(reps)]
    res.update(median_s=statistics.median(t[0] for t in times), mean_s=statistics.fmean(t[0] for t in times))
    if ctx.cuda:
        res["median_device_s"] = statistics.median(t[1] for t in times if t[1] is not None)
    if compiled:
        res.update(backend=opt.backend, counters=opt.counters.as_dict())
    return res, verdicts


def section(
    ctx: Any,
    out: dict[str, Any],
    make: Callable[..., Any],
    timed: Callable[..., Any],
    time_limit: Callable[..., Any],
) -> None:
    """The shampoo_family section; ``make``/``timed``/``time_limit`` are gpu_check's helpers."""
    shapes = SF_SMOKE_SHAPES if ctx.smoke else SF_SHAPES
    p0, *grads = make(ctx, shapes, seed=30, count=1 + SF_CHECK_STEPS)
    grads = [[g * 0.05 for g in gs] for gs in grads]
    out.update(shapes=shapes, check_steps=SF_CHECK_STEPS, judged="against eager's spread (runtime/check/judgement.py)")
    if ctx.cuda:  # the interpreter would take minutes at these shapes; tests/test_factor_triton.py covers CPU
        _kernel_check(ctx, out, shapes, timed)
    family = _shampoo_family()
    if ctx.smoke:  # the section's code path once per kind (eigenbasis, inverse root): each interpreted
        # optimizer costs ~6 s of CI, and every one has its own Triton test (tests/test_*triton*.py)
        family = {name: family[name] for name in SMOKE_FAMILY}
    for name, build in family.items():
        limit = ctx.left() - ctx.reserve_after("shampoo_family") - 5
        if limit < 30:
            out[name] = {"skipped": f"{limit:.0f} s of the budget left"}
            print(f"    {name}: skipped ({out[name]['skipped']})", flush=True)
            continue
        res: dict[str, Any] = out.setdefault(name, {})
        guard = {"expired": False}
        try:
            with time_limit(limit) as guard:
                res["eager"], _ = _sf_run(ctx, name, build, False, p0, grads, timed)
                res["hocompile"], verdicts = _sf_run(ctx, name, build, True, p0, grads, timed)
        except Exception as exc:  # noqa: BLE001
            res.update(error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc(limit=8))
            res["timed_out"] = guard["expired"]
            ctx.check(f"shampoo_family: {name} ran", False)
            print(f"    {name}: ERROR {res['error']}", flush=True)
            ctx.save()
            continue
        eager, comp = res["eager"], res["hocompile"]
        worst = [v.worst for v in verdicts if v.worst is not None]
        err = max((w.error for w in worst), default=0.0)
        res.update(
            judged=[v.describe() for v in verdicts],
            max_update_diff_vs_eager=err,
            max_eager_spread=max((w.spread for w in worst), default=0.0),
            vs_eager=eager["median_s"] / comp["median_s"],
        )
        ok = ctx.check(f"shampoo_family: {name} judged against eager's spread", all(v.passed for v in verdicts))
        for v in verdicts:
            if not v.passed:
                print(f"    {name}: {v.describe()}", flush=True)
        print(
            f"  {name:<10} eager {eager['median_s'] * 1e3:8.3f} ms  hocompile ({comp['backend']}) "
            f"{comp['median_s'] * 1e3:8.3f} ms  x{res['vs_eager']:.2f}  (mean {eager['mean_s'] * 1e3:.3f} / "
            f"{comp['mean_s'] * 1e3:.3f} ms)  first call {comp['first_call_s']:.1f} s  d-update {err:.2e} "
            f"(eager's own spread {res['max_eager_spread']:.1e}) "
            f"{'ok' if ok else 'FAIL'}  compiles {comp['counters']['compiles']}",
            flush=True,
        )
        gc.collect()
        if ctx.cuda:
            torch.cuda.empty_cache()
        ctx.save()
