# ruff: noqa: E501
"""Goldens: the full generated source of one kernel per matmul family, at a tiny canonical spec,
and of one pointwise kernel (the step wrapper's golden is test_triton_wrapper_golden.py).

Kept few on purpose (Helion's lesson: whole-kernel snapshots break on
every codegen tweak); numerics live in test_triton_kernels.py. Regenerate
with ``EXPECTTEST_ACCEPT=1 pytest tests/test_triton_goldens.py`` and review
the diff line by line.
"""

from __future__ import annotations

import torch
from expecttest import TestCase

from hocompile.lowering.triton.ns_kernels import (
    GemmSpec,
    GramSpec,
    SymPolySpec,
    generate_gemm,
    generate_gram,
    generate_sym_poly,
)

ORIGIN = "fuse-newton-schulz node newton_schulz_1"


class TestMatmulKernelGoldens(TestCase):
    def test_gram_normalize(self) -> None:
        spec = GramSpec(1, 16, 32, torch.bfloat16, "interpret", normalize=True)
        self.assertExpectedInline(
            generate_gram(spec, ORIGIN).source,
            """\
# kernel ns_gram_bf16_b1_16x32_norm_clamp: family gram; from fuse-newton-schulz node newton_schulz_1
# spec: GramSpec(batch=1, m=16, k=32, dtype=torch.bfloat16, arch='interpret', normalize=True, eps_mode='clamp', in_dtype=None)
# tile: BLOCK_M=16 BLOCK_N=16 BLOCK_K=16 num_warps=1 num_stages=1
@triton.jit
def ns_gram_bf16_b1_16x32_norm_clamp(
    x_ptr, out_ptr, x0_ptr, partials_ptr, P, eps_ptr,
    M: tl.constexpr, K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_P: tl.constexpr,
    UPCAST: tl.constexpr,  # interpreter: dot on fp32 copies of half-precision tiles
):
    pid = tl.program_id(0)
    batch = tl.program_id(1).to(tl.int64)
    pid_i = ((tl.sqrt((8 * pid + 1).to(tl.float32)) - 1.0) * 0.5).to(tl.int32)
    # the float square root may land one row off: fix it with exact integer tests
    pid_i = tl.where(pid_i * (pid_i + 1) // 2 > pid, pid_i - 1, pid_i)
    pid_i = tl.where((pid_i + 1) * (pid_i + 2) // 2 <= pid, pid_i + 1, pid_i)
    pid_j = pid - pid_i * (pid_i + 1) // 2
    rows_i = pid_i * BLOCK_M + tl.arange(0, BLOCK_M)
    rows_j = pid_j * BLOCK_M + tl.arange(0, BLOCK_M)
    x_base = x_ptr + batch * (M * K)
    sumsq = tl.zeros((BLOCK_P,), dtype=tl.float32)
    for p0 in range(0, P, BLOCK_P):
        offs_p = p0 + tl.arange(0, BLOCK_P)
        sumsq += tl.load(partials_ptr + batch * P + offs_p, mask=offs_p < P, other=0.0)
    norm = tl.sqrt_rn(tl.sum(sumsq, axis=0))
    norm = round_bf16(norm)
    eps = tl.load(eps_ptr)  # a device scalar, so CUDA-graph replay sees its current value
    denom = tl.where(norm < eps, eps, norm)  # max(norm, eps) that keeps a NaN norm, as clamp does
    denom = round_bf16(denom)
    x0_base = x0_ptr + batch * (M * K)
    acc = tl.zeros((BLOCK_M, BLOCK_M), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x_i_mask = (rows_i[:, None] < M) & (ks[None, :] < K)
        x_i = tl.load(x_base + rows_i[:, None] * K + ks[None, :], mask=x_i_mask, other=0.0)
        x_i = tl.math.div_rn(x_i.to(tl.float32), denom)  # true division, as eager divides
        x_i = round_bf16(x_i)
        # X0 for the next kernels: each block row has one diagonal tile, whose program writes it
        if pid_i == pid_j:
            tl.store(x0_base + rows_i[:, None] * K + ks[None, :], x_i.to(tl.bfloat16), mask=x_i_mask)
        if not UPCAST:
            x_i = x_i.to(tl.bfloat16)
        x_j_mask = (rows_j[:, None] < M) & (ks[None, :] < K)
        x_j = tl.load(x_base + rows_j[:, None] * K + ks[None, :], mask=x_j_mask, other=0.0)
        x_j = tl.math.div_rn(x_j.to(tl.float32), denom)  # true division, as eager divides
        x_j = round_bf16(x_j)
        if not UPCAST:
            x_j = x_j.to(tl.bfloat16)
        acc = tl.dot(x_i, tl.trans(x_j), acc)
    acc = round_bf16(acc)
    out_base = out_ptr + batch * (M * M)
    lower = (rows_i[:, None] < M) & (rows_j[None, :] <= rows_i[:, None])
    tl.store(out_base + rows_i[:, None] * M + rows_j[None, :], acc.to(tl.bfloat16), mask=lower)
    upper = (rows_i[None, :] < M) & (rows_j[:, None] < rows_i[None, :])
    tl.store(out_base + rows_j[:, None] * M + rows_i[None, :], tl.trans(acc).to(tl.bfloat16), mask=upper)


def launch_ns_gram_bf16_b1_16x32_norm_clamp(x, out, *, upcast, x0=None, partials=None, eps=None):
    grid = (1, 1)  # 1 lower-triangle tiles of 16x16, batch 1
    ns_gram_bf16_b1_16x32_norm_clamp[grid](
        x, out, x0, partials, partials.shape[1], eps,
        M=16, K=32, BLOCK_M=16, BLOCK_K=16, BLOCK_P=32, UPCAST=upcast, num_warps=1, num_stages=1,
    )
""",
        )

    def test_sym_poly(self) -> None:
        spec = SymPolySpec(1, 16, torch.bfloat16, "interpret")
        self.assertExpectedInline(
            generate_sym_poly(spec, ORIGIN).source,
            """\
# kernel ns_sym_poly_bf16_b1_16x16: family sym_poly; from fuse-newton-schulz node newton_schulz_1
# spec: SymPolySpec(batch=1, m=16, dtype=torch.bfloat16, arch='interpret', cubic=False)
# tile: BLOCK_M=16 BLOCK_N=16 BLOCK_K=16 num_warps=1 num_stages=1
@triton.jit
def ns_sym_poly_bf16_b1_16x16(
    a_ptr, out_ptr, a, b, c,
    M: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,  # interpreter: dot on fp32 copies of half-precision tiles
):
    # a, b, c are runtime arguments: one compiled kernel serves every iteration
    pid = tl.program_id(0)
    batch = tl.program_id(1).to(tl.int64)
    pid_i = ((tl.sqrt((8 * pid + 1).to(tl.float32)) - 1.0) * 0.5).to(tl.int32)
    # the float square root may land one row off: fix it with exact integer tests
    pid_i = tl.where(pid_i * (pid_i + 1) // 2 > pid, pid_i - 1, pid_i)
    pid_i = tl.where((pid_i + 1) * (pid_i + 2) // 2 <= pid, pid_i + 1, pid_i)
    pid_j = pid - pid_i * (pid_i + 1) // 2
    rows_i = pid_i * BLOCK_M + tl.arange(0, BLOCK_M)
    rows_j = pid_j * BLOCK_M + tl.arange(0, BLOCK_M)
    a_base = a_ptr + batch * (M * M)
    acc = tl.zeros((BLOCK_M, BLOCK_M), dtype=tl.float32)
    for k0 in range(0, M, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        left_mask = (rows_i[:, None] < M) & (ks[None, :] < M)
        left = tl.load(a_base + rows_i[:, None] * M + ks[None, :], mask=left_mask, other=0.0)
        right_mask = (ks[:, None] < M) & (rows_j[None, :] < M)
        right = tl.load(a_base + ks[:, None] * M + rows_j[None, :], mask=right_mask, other=0.0)
        if UPCAST:
            left = left.to(tl.float32)
            right = right.to(tl.float32)
        acc = tl.dot(left, right, acc)
    tile_mask = (rows_i[:, None] < M) & (rows_j[None, :] < M)
    tile = tl.load(a_base + rows_i[:, None] * M + rows_j[None, :], mask=tile_mask, other=0.0)
    # the order of newton_schulz._gram: (b A + a I) + c A^2, one rounding at the end
    res = b * tile.to(tl.float32) + tl.where(rows_i[:, None] == rows_j[None, :], a, 0.0)
    res = res + c * acc
    res = round_bf16(res)
    out_base = out_ptr + batch * (M * M)
    lower = (rows_i[:, None] < M) & (rows_j[None, :] <= rows_i[:, None])
    tl.store(out_base + rows_i[:, None] * M + rows_j[None, :], res.to(tl.bfloat16), mask=lower)
    upper = (rows_i[None, :] < M) & (rows_j[:, None] < rows_i[None, :])
    tl.store(out_base + rows_j[:, None] * M + rows_i[None, :], tl.trans(res).to(tl.bfloat16), mask=upper)


def launch_ns_sym_poly_bf16_b1_16x16(A, out, a, b, c, *, upcast):
    grid = (1, 1)  # 1 lower-triangle tiles of 16x16, batch 1
    ns_sym_poly_bf16_b1_16x16[grid](
        A, out, a, b, c,
        M=16, BLOCK_M=16, BLOCK_K=16, UPCAST=upcast, num_warps=1, num_stages=1,
    )
""",
        )

    def test_gemm_accumulate(self) -> None:
        spec = GemmSpec(1, 16, 32, 16, torch.bfloat16, "interpret", accumulate=True)
        self.assertExpectedInline(
            generate_gemm(spec, ORIGIN).source,
            """\
# kernel ns_gemm_bf16_b1_16x32x16_acc: family gemm; from fuse-newton-schulz node newton_schulz_1
# spec: GemmSpec(batch=1, m=16, n=32, k=16, dtype=torch.bfloat16, arch='interpret', out_dtype=None, accumulate=True, symmetric=False, r_dtype=None)
# tile: BLOCK_M=16 BLOCK_N=16 BLOCK_K=16 num_warps=1 num_stages=1
@triton.jit
def ns_gemm_bf16_b1_16x32x16_acc(
    l_ptr, r_ptr, out_ptr, alpha, c_ptr, beta,
    M: tl.constexpr, N: tl.constexpr, K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,  # interpreter: dot on fp32 copies of half-precision tiles
):
    pid = tl.program_id(0)
    batch = tl.program_id(1).to(tl.int64)
    pid_m = pid // tl.cdiv(N, BLOCK_N)
    pid_n = pid % tl.cdiv(N, BLOCK_N)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    l_base = l_ptr + batch * (M * K)
    r_base = r_ptr + batch * (K * N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        left_mask = (rows[:, None] < M) & (ks[None, :] < K)
        left = tl.load(l_base + rows[:, None] * K + ks[None, :], mask=left_mask, other=0.0)
        right_mask = (ks[:, None] < K) & (cols[None, :] < N)
        right = tl.load(r_base + ks[:, None] * N + cols[None, :], mask=right_mask, other=0.0)
        if UPCAST:
            left = left.to(tl.float32)
            right = right.to(tl.float32)
        acc = tl.dot(left, right, acc)
    res = alpha * acc
    out_offs = batch * (M * N)
    c_mask = (rows[:, None] < M) & (cols[None, :] < N)
    c = tl.load(c_ptr + out_offs + rows[:, None] * N + cols[None, :], mask=c_mask, other=0.0)
    res = res + beta * c.to(tl.float32)
    res = round_bf16(res)
    out_mask = (rows[:, None] < M) & (cols[None, :] < N)
    tl.store(out_ptr + out_offs + rows[:, None] * N + cols[None, :], res.to(tl.bfloat16), mask=out_mask)


def launch_ns_gemm_bf16_b1_16x32x16_acc(L, R, out, alpha, *, upcast, C=None, beta=0.0):
    grid = (2, 1)  # 1x2 tiles of 16x16, batch 1
    ns_gemm_bf16_b1_16x32x16_acc[grid](
        L, R, out, alpha, C, beta,
        M=16, N=32, K=16, BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, UPCAST=upcast, num_warps=1, num_stages=1,
    )
""",
        )


class TestPointwiseKernelGolden(TestCase):
    def test_muon_momentum_nesterov_feed(self) -> None:
        # The region before Newton–Schulz in torch.optim.Muon's steady-state
        # step on one 4x6 matrix: momentum lerp, nesterov lerp, the cast and
        # stacked store into the NS workspace, the norm partials.
        from hocompile.capture.trace import capture
        from hocompile.lowering.triton.op_groups import Workspace, find_op_groups
        from hocompile.lowering.triton.pointwise import generate_pointwise, region_spec
        from hocompile.lowering.triton.regions import find_regions
        from hocompile.passes import default_pipeline, run_pipeline
        from hocompile.settings import Settings
        from hocompile.targets import gpu_target

        param = torch.nn.Parameter(torch.zeros(4, 6))
        opt = torch.optim.Muon([param], lr=0.02)
        param.grad = torch.zeros_like(param)
        opt.state[param]["momentum_buffer"] = torch.zeros_like(param)
        with torch.no_grad():
            captured = capture(opt, Settings().structural_keys)
        gm, _ = run_pipeline(captured.gm, default_pipeline(gpu_target("sm90"), force_batch=True), frozenset(), None)
        groups, refs = find_op_groups(gm)
        region = next(r for r in find_regions(gm, groups) if r.feed is not None)
        workspace = Workspace(torch.bfloat16, norm_partials=True)  # the NS compute dtype's
        spec = region_spec(region, {n: r.transposed for n, r in refs.items()}, workspace, "interpret")
        self.assertExpectedInline(generate_pointwise(spec, "capture nodes lerp, lerp_1").source, """\
# kernel pw_lerp_lerp_ws_4x6_783d0c: family pointwise; from capture nodes lerp, lerp_1
# shape [4, 6]; row = 2 inputs, 1 outputs, workspace + norm partials, 2 scalar indices
# tile BLOCK=64 num_warps=1
@triton.jit
def pw_lerp_lerp_ws_4x6_783d0c(ptrs, base, scal, N, C, R, WIDTH: tl.constexpr, BLOCK: tl.constexpr):
    member = tl.program_id(1)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    row = ptrs + base + member * WIDTH
    x0_ptr = tl.load(row + 0).to(tl.pointer_type(tl.float32))
    x0 = tl.load(x0_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    x1_ptr = tl.load(row + 1).to(tl.pointer_type(tl.float32))
    x1 = tl.load(x1_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    s0 = tl.load(scal + tl.load(row + 5))
    s1 = tl.load(scal + tl.load(row + 6))
    v0 = tl.where(tl.abs(s0) < 0.5, x0 + s0 * (x1 - x0), x1 - (x1 - x0) * (1.0 - s0))  # aten.lerp.Scalar
    v1 = tl.where(tl.abs(s1) < 0.5, x1 + s1 * (v0 - x1), v0 - (v0 - x1) * (1.0 - s1))  # aten.lerp.Scalar
    o0_ptr = tl.load(row + 2).to(tl.pointer_type(tl.float32))
    tl.store(o0_ptr + offs, v0.to(tl.float32), mask=mask)
    # op-group input: rounded to bf16 (the op's cast), stacked, norm partials
    f = v1
    f = round_bf16(f)
    f_ptr = tl.load(row + 3).to(tl.pointer_type(tl.bfloat16))
    tl.store(f_ptr + offs, f.to(tl.bfloat16), mask=mask)
    part_ptr = tl.load(row + 4).to(tl.pointer_type(tl.float32))
    tl.store(part_ptr + tl.program_id(0), tl.sum(tl.where(mask, f * f, 0.0), axis=0))


def launch_pw_lerp_lerp_ws_4x6_783d0c(ptrs, base, scal, members):
    grid = (triton.cdiv(24, 64), members)
    pw_lerp_lerp_ws_4x6_783d0c[grid](ptrs, base, scal, 24, 6, 4, WIDTH=7, BLOCK=64, num_warps=1)
""")

