"""The correctness sections of gpu_check.py: "kernels" (each generated family) and "step" (a Muon step).

Single kernels (gram, sym_poly, gemm): the kernel and the fp64 reference sum
the same products in different orders; any fp32 order is within
``k * 2**-24 * sum|terms|`` of the exact sum, so the bound is twice that plus
one ulp of the rounded result (the contract of tests/test_triton_kernels.py).
fp32 cases must stay within the bound; half-precision cases within 2x of it
(tensor cores may truncate inside their fp32 accumulation). A whole
Newton–Schulz: error vs fp64 within 1.25x of the aten emulation's own error
plus a small floor. Pointwise: a compiled AdamW step, triton vs aten backend.

Step: torch.optim.Muon compiled with backend "triton" and "aten", and eager,
from the same params and grads for two steps. Precision fp32: triton within 2
bf16 ulps (of an update entry of size 1) of aten. Precision auto: the NS
result of step 1, recovered from the params, within 1.25x of eager's error vs
fp64 plus 1e-3 (bf16 summation orders differ visibly after five iterations).
"""

from __future__ import annotations

import ast
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

import hocompile
from hocompile.lowering.triton import module
from hocompile.lowering.triton.code import CodeWriter, KernelSource
from hocompile.lowering.triton.ns_kernels import (
    GemmSpec,
    GramSpec,
    NSCall,
    SymPolySpec,
    emit_newton_schulz,
    generate_gemm,
    generate_gram,
    generate_sym_poly,
)
from hocompile.lowering.triton.op_groups import allocations
from hocompile.ops.newton_schulz_math import newton_schulz, reference_fp64

ULP = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}
KJ = (3.4445, -4.775, 2.0315)
CUBIC = (1.5, -0.5, 0.0)
NS_FLOOR = 1e-5  # an fp32 NS is ~1e-6 from fp64: below that 1.25x of aten's error is noise
Result = dict[str, Any]


@dataclass(frozen=True)
class KernelEnv:
    device: torch.device
    arch: str  # tile-table architecture: "interpret" on CPU
    upcast: bool  # dot on fp32 copies (the interpreter only); False on GPU so dots use tensor cores
    cache_dir: Path
    batch: int  # sizes that are not tile multiples, batch > 1
    m: int
    k: int
    ns_small: tuple[int, int, int]  # (batch, m, n) of a whole NS
    ns_large: tuple[int, int, int]
    adamw_shapes: tuple[tuple[int, ...], ...]


def _round(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if dtype == torch.float32 else t.to(dtype).to(t.dtype)


def _load(kernels: list[KernelSource], body: str, cache_dir: Path) -> ModuleType:
    for kernel in kernels:
        ast.parse(kernel.source)
    loaded = module.load(module.assemble(kernels, body), cache_dir)
    return loaded[0] if isinstance(loaded, tuple) else loaded


def _randn(env: KernelEnv, *shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator(device=env.device).manual_seed(seed)
    return torch.randn(*shape, generator=gen, device=env.device).to(dtype)


def _rounded_error(
    got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, magnitude: torch.Tensor, terms: int
) -> Result:
    """Error of ``got`` vs ``ref`` (both one sum of ``terms`` terms rounded once to dtype) against the bound."""
    got, ref = got.double(), ref.double()
    tol = 2 * terms * 2.0**-24 * magnitude.double() + ULP[dtype] * torch.maximum(got.abs(), ref.abs())
    err = (got - ref).abs()
    ratio = (err / tol.clamp_min(1e-30)).nan_to_num(nan=float("inf")).max().item()
    limit = 1.0 if dtype == torch.float32 else 2.0
    return {
        "max_abs_err": err.nan_to_num(nan=float("inf")).max().item(),
        "ref_max": ref.abs().max().item(),
        "bound_ratio": ratio,
        "limit": limit,
        "nans": int(got.isnan().sum().item()),
        "passed": ratio <= limit,
    }


def _merge(*checks: Result, symmetric: bool | None = None) -> Result:
    out = dict(max(checks, key=lambda c: c["bound_ratio"]))
    out["passed"] = all(c["passed"] for c in checks) and symmetric is not False
    if symmetric is not None:
        out["symmetric"] = symmetric
    return out


def _partials(x: torch.Tensor, parts: int) -> torch.Tensor:
    """[batch, parts] fp32 partial sums of squares, as the producer kernel of x leaves them."""
    chunks = x.float().square().flatten(1).tensor_split(parts, dim=1)
    return torch.stack([chunk.sum(1) for chunk in chunks], 1)


GRAM_VARIANTS = {
    "plain": (False, "clamp", 0.0),
    "clamp": (True, "clamp", 1e-7),
    "clamp-hit": (True, "clamp", 1e3),
    "add": (True, "add", 0.5),
}


def gram_case(env: KernelEnv, dtype: torch.dtype, variant: str) -> Result:
    normalize, eps_mode, eps = GRAM_VARIANTS[variant]
    batch, m, k = env.batch, env.m, env.k
    spec = GramSpec(batch, m, k, dtype, env.arch, normalize=normalize, eps_mode=eps_mode)
    launch = getattr(_load([generate_gram(spec, "gpu_check")], "", env.cache_dir), f"launch_{spec.name}")
    x = _randn(env, batch, m, k, dtype=dtype, seed=0)
    out = torch.full((batch, m, m), float("nan"), dtype=dtype, device=env.device)
    checks = []
    if not normalize:
        launch(x, out, upcast=env.upcast)
        x0 = x.double()
    else:
        partials = _partials(x, 3)
        x0_out = torch.full_like(x, float("nan"))
        eps_t = torch.tensor(eps, dtype=torch.float32, device=env.device)
        launch(x, out, upcast=env.upcast, x0=x0_out, partials=partials, eps=eps_t)
        norm = _round(partials.sum(1).sqrt(), dtype)[:, None, None]  # newton_schulz.normalize's rounding points
        denom = _round(norm.clamp(min=eps) if eps_mode == "clamp" else norm + eps, dtype)
        x0 = _round(x.float() / denom, dtype).double()
        checks.append(_rounded_error(x0_out, x0, dtype, x0.abs(), terms=3 + 2))
    ref = _round((x0 @ x0.mT).float(), dtype)
    checks.append(_rounded_error(out, ref, dtype, x0.abs() @ x0.abs().mT, terms=k))
    return _merge(*checks, symmetric=torch.equal(out, out.mT))


def sym_poly_case(env: KernelEnv, dtype: torch.dtype, cubic: bool) -> Result:
    batch, m = env.batch, env.m
    a, b, c = KJ[0], KJ[1], 0.0 if cubic else KJ[2]
    spec = SymPolySpec(batch, m, dtype, env.arch, cubic=cubic)
    launch = getattr(_load([generate_sym_poly(spec, "gpu_check")], "", env.cache_dir), f"launch_{spec.name}")
    y = _randn(env, batch, m, m, dtype=torch.float32, seed=1)
    A = ((y + y.mT) / (4 * m**0.5)).to(dtype)  # exactly symmetric, spectral norm ~1 as in NS
    out = torch.full_like(A, float("nan"))
    launch(A, out, a, b, c, upcast=env.upcast)
    Ad = A.double()
    eye = torch.eye(m, device=env.device, dtype=torch.float64)
    ref = _round((b * Ad + a * eye + c * (Ad @ Ad)).float(), dtype)
    magnitude = abs(b) * Ad.abs() + abs(a) * eye + abs(c) * (Ad.abs() @ Ad.abs())
    return _merge(_rounded_error(out, ref, dtype, magnitude, terms=m + 3), symmetric=torch.equal(out, out.mT))


# name: (compute dtype, out dtype, accumulate, symmetric)
GEMM_CASES: dict[str, tuple[torch.dtype, torch.dtype | None, bool, bool]] = {
    "f32": (torch.float32, None, False, False),
    "f32-acc": (torch.float32, None, True, False),
    "f32-sym": (torch.float32, None, False, True),
    "f32-acc-sym": (torch.float32, None, True, True),
    "f32-to-bf16-acc": (torch.float32, torch.bfloat16, True, False),
    "bf16": (torch.bfloat16, None, False, False),
    "bf16-acc": (torch.bfloat16, None, True, False),
    "bf16-sym": (torch.bfloat16, None, False, True),
    "bf16-acc-sym": (torch.bfloat16, None, True, True),
    "bf16-to-f32-acc": (torch.bfloat16, torch.float32, True, False),
}


def gemm_case(env: KernelEnv, case: str) -> Result:
    dtype, out_dtype, accumulate, symmetric = GEMM_CASES[case]
    batch, m = env.batch, env.m
    n, k = (m, m) if symmetric else (env.k, env.k - 7)
    spec = GemmSpec(batch, m, n, k, dtype, env.arch, out_dtype=out_dtype, accumulate=accumulate, symmetric=symmetric)
    launch = getattr(_load([generate_gemm(spec, "gpu_check")], "", env.cache_dir), f"launch_{spec.name}")
    alpha, beta = 0.75, KJ[0]
    if symmetric:  # L = R = A: L @ R = A² is symmetric exactly
        y = _randn(env, batch, m, m, dtype=torch.float32, seed=2)
        L = R = ((y + y.mT) / (4 * m**0.5)).to(dtype)
        C = L
    else:
        L, R = _randn(env, batch, m, k, dtype=dtype, seed=3), _randn(env, batch, k, n, dtype=dtype, seed=4)
        C = _randn(env, batch, m, n, dtype=dtype, seed=5)
    out = torch.full((batch, m, n), float("nan"), dtype=out_dtype or dtype, device=env.device)
    if accumulate:
        launch(L, R, out, alpha, upcast=env.upcast, C=C, beta=beta)
    else:
        launch(L, R, out, alpha, upcast=env.upcast)
    Ld, Rd, Cd = L.double(), R.double(), C.double()
    exact = alpha * (Ld @ Rd) + (beta * Cd if accumulate else 0.0)
    ref = _round(exact.float(), dtype).to(out.dtype)
    magnitude = alpha * (Ld.abs() @ Rd.abs()) + (beta * Cd.abs() if accumulate else 0.0)
    check = out_dtype if out_dtype is not None and ULP[out_dtype] > ULP[dtype] else dtype
    result = _rounded_error(out, ref, check, magnitude, terms=k + 3)
    return _merge(result, symmetric=torch.equal(out, out.mT) if symmetric else None)


# name: (coefficients, algorithm, restarts, size ("small"/"large"), dtype, out dtype, eps mode)
NS_CASES: dict[str, tuple[tuple[float, float, float], str, tuple[int, ...], str, torch.dtype, torch.dtype, str]] = {
    "kj-standard-bf16-to-f32": (KJ, "standard", (), "small", torch.bfloat16, torch.float32, "clamp"),
    "kj-standard-bf16-large": (KJ, "standard", (), "large", torch.bfloat16, torch.bfloat16, "clamp"),
    "kj-standard-f32-add": (KJ, "standard", (), "small", torch.float32, torch.float32, "add"),
    "cubic-standard-bf16": (CUBIC, "standard", (), "small", torch.bfloat16, torch.float32, "clamp"),
    "kj-gram-f32": (KJ, "gram", (), "small", torch.float32, torch.float32, "clamp"),
    "kj-gram-f32-restart2-add": (KJ, "gram", (2,), "small", torch.float32, torch.bfloat16, "add"),
}


def ns_case(env: KernelEnv, case: str) -> Result:
    coeff, algorithm, restarts, size, dtype, out_dtype, eps_mode = NS_CASES[case]
    batch, m, n = env.ns_small if size == "small" else env.ns_large
    coefficients = [coeff] * 5
    body = CodeWriter()
    with body.indent():
        call = NSCall(x="x", partials="partials", P="3", eps="eps", out="out", upcast="upcast", prefix="ns0_",
                      batch=batch, m=m, n=n, coefficients=coefficients, out_dtype=out_dtype, eps_mode=eps_mode,
                      algorithm=algorithm, arch=env.arch, origin="gpu_check")
        emitted = emit_newton_schulz(body, call, dtype, restarts)
    w = CodeWriter()
    w.line("def run(x, eps, out, upcast):")
    with w.indent():
        w.line("partials = torch.stack([c.sum(1) for c in x.float().square().flatten(1).tensor_split(3, dim=1)], 1)")
        w.lines(allocations(emitted.buffers, "x.device"))  # the emitter's temporaries, before its launches
    w.extend(body)
    with w.indent():
        w.line("return out")
    kernels = emitted.kernels
    mod = _load(kernels, w.text(), env.cache_dir)
    x = _randn(env, batch, m, n, dtype=dtype, seed=6)
    out = torch.full((batch, m, n), float("nan"), dtype=out_dtype, device=env.device)
    mod.run(x, torch.tensor(1e-7, device=env.device), out, env.upcast)
    kw: dict[str, Any] = dict(
        eps_mode=eps_mode, compute_dtype=dtype, out_dtype=out_dtype, algorithm=algorithm, restarts=restarts
    )
    emulate = newton_schulz(x, coefficients, 1e-7, matmul="emulate", **kw)
    native = newton_schulz(x, coefficients, 1e-7, matmul="native", **kw)
    exact = reference_fp64(x, coefficients, 1e-7, eps_mode=eps_mode)

    def rel(y: torch.Tensor) -> float:
        return ((y.double() - exact).norm() / exact.norm()).item()

    err, err_emulate = rel(out), rel(emulate)
    return {
        "shape": [batch, m, n],
        "kernels": len(kernels),
        "rel_err_kernels": err,
        "rel_err_aten_emulate": err_emulate,
        "rel_err_aten_native": rel(native),
        "allowed": 1.25 * err_emulate + NS_FLOOR,
        "passed": err <= 1.25 * err_emulate + NS_FLOOR,
    }


def adamw_case(env: KernelEnv) -> Result:
    """The pointwise family: a compiled AdamW, triton vs aten backend, 3 steps, params and state."""
    gen = torch.Generator(device=env.device).manual_seed(7)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen, device=env.device)) for s in env.adamw_shapes]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    kw: dict[str, Any] = {"cache_dir": env.cache_dir}
    aten = hocompile.compile_optimizer(torch.optim.AdamW(params, lr=1e-2), backend="aten", **kw)
    tri = hocompile.compile_optimizer(torch.optim.AdamW(twins, lr=1e-2), backend="triton", **kw)
    for _ in range(3):
        for p, q in zip(params, twins):
            p.grad = torch.randn(p.shape, generator=gen, device=env.device)
            q.grad = p.grad.clone()
        aten.step()
        tri.step()
    pairs = list(zip(twins, params)) + [
        (tri.state[q][key], aten.state[p][key]) for p, q in zip(params, twins) for key in ("exp_avg", "exp_avg_sq")
    ]
    worst = max(((a - b).abs() / (1e-7 + 1e-6 * b.abs())).max().item() for a, b in pairs)
    lowered = tri.history[-1].lowered
    units = lowered.units if lowered is not None else []
    fused = any("2 member(s), 1 launch" in u for u in units)
    return {
        "max_diff_vs_allclose_tol": worst,
        "fused_twins": fused,
        "launches": getattr(lowered, "launches", None),
        "families": sorted({k.family for k in tri.kernels()}),
        "recompiles": list(tri.counters.recompiles),
        "passed": worst <= 1.0 and fused and not tri.counters.recompiles,
    }


def cases(env: KernelEnv) -> Iterator[tuple[str, Callable[[], Result]]]:
    dtypes = {"f32": torch.float32, "bf16": torch.bfloat16}
    for short, dtype in dtypes.items():
        for variant in GRAM_VARIANTS:
            yield f"gram-{short}-{variant}", lambda d=dtype, v=variant: gram_case(env, d, v)  # type: ignore[misc]
    for short, dtype in dtypes.items():
        for cubic in (False, True):
            name = f"sym_poly-{short}-{'cubic' if cubic else 'quintic'}"
            yield name, lambda d=dtype, c=cubic: sym_poly_case(env, d, c)  # type: ignore[misc]
    for case in GEMM_CASES:
        yield f"gemm-{case}", lambda c=case: gemm_case(env, c)  # type: ignore[misc]
    for case in NS_CASES:
        yield f"ns-{case}", lambda c=case: ns_case(env, c)  # type: ignore[misc]
    yield "pointwise-adamw", lambda: adamw_case(env)


def describe(result: Result) -> str:
    if "bound_ratio" in result:
        sym = "" if "symmetric" not in result else f", symmetric {result['symmetric']}"
        return f"max err {result['max_abs_err']:.3g} ({result['bound_ratio']:.3g}x bound, limit {result['limit']}){sym}"
    if "rel_err_kernels" in result:
        return (
            f"rel err vs fp64 {result['rel_err_kernels']:.3g} (aten emulate {result['rel_err_aten_emulate']:.3g}, "
            f"native {result['rel_err_aten_native']:.3g}; allowed {result['allowed']:.3g})"
        )
    return ", ".join(f"{k} {v}" for k, v in result.items() if k != "passed")


def run_cases(env: KernelEnv, out: dict[str, Any], save: Callable[[], None], time_left: Callable[[], float]) -> None:
    """Run every case into ``out["cases"]``, saving after each; skip what the budget leaves no time for."""
    results: dict[str, Result] = out.setdefault("cases", {})
    for name, fn in cases(env):
        if time_left() <= 0:
            results[name] = {"skipped": "time budget", "passed": None}
            continue
        start = time.perf_counter()
        try:
            result = fn()
        except Exception as exc:  # noqa: BLE001 - recorded, and the next case runs
            result = {"error": f"{type(exc).__name__}: {exc}", "passed": False}
        result["seconds"] = round(time.perf_counter() - start, 3)
        results[name] = result
        status = "PASS" if result["passed"] else "FAIL"
        detail = result.get("error") or describe(result)
        print(f"  [{status}] {name:<32} {detail}  ({result['seconds']:.1f} s)", flush=True)
        save()
    ran = [r for r in results.values() if r.get("passed") is not None]
    out["passed"] = sum(bool(r["passed"]) for r in ran)
    out["failed"] = [n for n, r in results.items() if r.get("passed") is False]
    out["skipped"] = [n for n, r in results.items() if r.get("passed") is None]


def _muon(variant: str, params: list[torch.nn.Parameter], kw: dict[str, Any], precision: str, cache: Path) -> Any:
    opt = torch.optim.Muon(params, **kw)
    if variant in ("aten", "triton"):
        return hocompile.compile_optimizer(opt, backend=variant, precision=precision, cache_dir=cache)
    return opt


def _step_precision(
    p0: list[torch.Tensor], grads: tuple[list[torch.Tensor], ...], kw: dict[str, Any], precision: str, cache: Path
) -> Result:
    lr, wd, mom = kw["lr"], kw["weight_decay"], kw["momentum"]
    scales = [lr * max(1.0, p.shape[0] / p.shape[1]) ** 0.5 for p in p0]
    nesterov = [g.lerp(torch.zeros_like(g).lerp_(g, 1 - mom), mom) for g in grads[0]]  # step 1's NS input
    exact = [reference_fp64(x, [KJ] * kw["ns_steps"], 1e-7, transpose=x.shape[0] > x.shape[1]) for x in nesterov]
    res: Result = {}
    after: dict[str, list[list[torch.Tensor]]] = {}
    for variant in ("eager", "aten", "triton"):
        params = [torch.nn.Parameter(p.clone()) for p in p0]
        opt = _muon(variant, params, kw, precision, cache)
        after[variant] = []
        for step_grads in grads:
            for p, g in zip(params, step_grads):
                p.grad = g.clone()
            opt.step()
            after[variant].append([p.detach().clone() for p in params])
        # O = (p0 (1 - lr wd) - p1) / (lr scale): the orthogonalised update of step 1
        updates = [(a.double() * (1 - lr * wd) - b.double()) / s for a, b, s in zip(p0, after[variant][0], scales)]
        res[f"ns_rel_err_{variant}"] = [((u - e).norm() / e.norm()).item() for u, e in zip(updates, exact)]
        if variant == "triton":
            lowered = opt.history[-1].lowered
            res["triton"] = {
                "backend": lowered.backend,
                "launches": lowered.launches,
                "units": lowered.units,
                "compiles": opt.counters.compiles,
                "recompiles": list(opt.counters.recompiles),
                "families": sorted({k.family for k in opt.kernels()}),
                "explain": hocompile.explain(opt),
            }
    # differences in bf16 ulps of an update entry of size 1 (torch.optim.Muon's NS result is bf16), per step
    units = [s * 2.0**-8 for s in scales]
    for other in ("aten", "eager"):
        res[f"max_diff_triton_vs_{other}_ulps"] = [
            max(((a - b).abs().max() / u).item() for a, b, u in zip(sa, sb, units))
            for sa, sb in zip(after["triton"], after[other])
        ]
    if precision == "fp32":
        passed = max(res["max_diff_triton_vs_aten_ulps"]) <= 2.0
    else:
        passed = all(t <= 1.25 * e + 1e-3 for t, e in zip(res["ns_rel_err_triton"], res["ns_rel_err_eager"]))
    res["passed"] = passed and res["triton"]["backend"] == "triton" and not res["triton"]["recompiles"]
    return res


def step_check(
    p0: list[torch.Tensor],
    g1: list[torch.Tensor],
    g2: list[torch.Tensor],
    kw: dict[str, Any],
    cache: Path,
    out: dict[str, Any],
    save: Callable[[], None],
) -> list[str]:
    """Both precisions into ``out``; returns the names of the failed checks."""
    out["shapes"] = [list(p.shape) for p in p0]
    failed = []
    for precision in ("fp32", "auto"):
        try:
            res = out[precision] = _step_precision(p0, (g1, g2), kw, precision, cache)
            print(
                f"  [{'PASS' if res['passed'] else 'FAIL'}] precision {precision}: triton vs aten "
                f"{max(res['max_diff_triton_vs_aten_ulps']):.3g} ulps, vs eager "
                f"{max(res['max_diff_triton_vs_eager_ulps']):.3g} ulps; NS rel err vs fp64 triton "
                f"{max(res['ns_rel_err_triton']):.3g}, aten {max(res['ns_rel_err_aten']):.3g}, eager "
                f"{max(res['ns_rel_err_eager']):.3g}; {res['triton']['launches']} launches",
                flush=True,
            )
        except Exception as exc:  # noqa: BLE001 - recorded, and the other precision runs
            res = out[precision] = {"error": f"{type(exc).__name__}: {exc}", "passed": False}
            print(f"  [FAIL] precision {precision}: {res['error']}", flush=True)
        if not res["passed"]:
            failed.append(f"precision {precision}")
        save()
    return failed
