# ruff: noqa: E501
"""Golden of a generated step wrapper: buffers, labelled tables and launches of a mixed Muon + AdamW step.

The wrapper is what a reader of the generated module sees first; this golden
shows every change to it (issue 11, item 6: no unread stores, one labelled
table per launch, no allocation in ``launch()``). Generated for sm90 without
running it. Regenerate with ``EXPECTTEST_ACCEPT=1 pytest
tests/test_triton_wrapper_golden.py`` and review the diff line by line.
"""

from __future__ import annotations

import torch
from expecttest import TestCase


class MuonAdamW(torch.optim.Optimizer):
    """torch.optim's Muon (functional form) on the 2-D params and its AdamW on the rest: one optimizer."""

    def __init__(self, params: list[torch.nn.Parameter], lr: float = 0.02, adam_lr: float = 1e-3) -> None:
        matrices = [p for p in params if p.dim() == 2]
        others = [p for p in params if p.dim() != 2]
        super().__init__([{"params": matrices, "lr": lr}, {"params": others, "lr": adam_lr}], {})

    @torch.no_grad()
    def step(self, closure: object = None) -> None:
        from torch.optim._muon import muon
        from torch.optim.adamw import adamw

        mats, rest = self.param_groups
        params = [p for p in mats["params"] if p.grad is not None]
        bufs = [self.state[p].setdefault("momentum_buffer", torch.zeros_like(p)) for p in params]
        muon(
            params, [p.grad for p in params], bufs, lr=mats["lr"], weight_decay=0.1, momentum=0.95, nesterov=True,
            ns_coefficients=(3.4445, -4.775, 2.0315), ns_steps=2, eps=1e-7, adjust_lr_fn=None, has_complex=False,
        )
        params = [p for p in rest["params"] if p.grad is not None]
        states = [self.state[p] for p in params]
        for p, s in zip(params, states):
            if not s:
                s.update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
        adamw(
            params, [p.grad for p in params], [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states],
            [], [s["step"] for s in states], foreach=False, amsgrad=False, beta1=0.9, beta2=0.999,
            lr=rest["lr"], weight_decay=0.01, eps=1e-8, maximize=False,
        )


def mixed_step_wrapper() -> str:
    """The generated wrapper (sm90, not run) of MuonAdamW's steady-state step: two 16x32 and one 32x16
    matrix (one Newton–Schulz group of 3, the tall one joining transposed) and a bias of 32."""
    from hocompile.capture.trace import capture
    from hocompile.lowering.triton.wrapper import generate_wrapper
    from hocompile.passes import default_pipeline, run_pipeline
    from hocompile.settings import Settings
    from hocompile.targets import gpu_target

    params = [torch.nn.Parameter(torch.zeros(shape)) for shape in ((16, 32), (16, 32), (32, 16), (32,))]
    opt = MuonAdamW(params)
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()  # create the state: the golden is the steady-state step
    with torch.no_grad():
        captured = capture(opt, Settings().structural_keys)
    gm, _ = run_pipeline(captured.gm, default_pipeline(gpu_target("sm90"), force_batch=True), frozenset(), None)
    placeholders = {s: i for i, s in enumerate(captured.inputs)}
    copy_into = [placeholders[a.slot] if a.mode == "copy" else None for a in captured.outputs]
    plan = generate_wrapper(gm, copy_into, "sm90", upcast="False")
    units = "\n".join(f"#   {unit}" for unit in plan.units)
    return f"# {plan.launches} launches per step, graph safe: {plan.graph_safe}\n{units}\n\n{plan.body}"


class TestStepWrapperGolden(TestCase):
    def test_muon_adamw_step_wrapper(self) -> None:
        # Buffers (one allocation per group, none in launch()), one labelled table per
        # fused launch, and the launches in order: review a diff here line by line.
        self.assertExpectedInline(mixed_step_wrapper(), """\
# 15 launches per step, graph safe: True
#   pw_lerp_lerp_ws_16x32_88009e: 2 member(s), 1 launch
#   pw_lerp_lerp_ws_32x16_de7886: 1 member(s), 1 launch
#   newton-schulz group 0: 3 x 16x32 standard, 6 launches
#   pw_mul_add_16x32_2efab5: 2 member(s), 1 launch
#   pw_mul_add_32x16_685db5: 1 member(s), 1 launch
#   pw_add_scalar_2b4735: 1 member(s), 1 launch
#   pw_mul_lerp_mul_addcmul_sqrt_div_add_addcdiv_32_563a28: 1 member(s), 1 launch
#   pw_lerp_16x32_27b295: 2 member(s), 1 launch
#   pw_lerp_32x16_77c2d6: 1 member(s), 1 launch
#   write fence: 10 write-back(s) after every launch; 10 staged (0.012 MiB: 0.008 MiB in dead step buffers, 0.004 MiB new); commit: 1 launch(es) from the pointer table

def _carve(host, offset, shape, dtype):
    \"\"\"A stage in ``host``'s bytes from ``offset``: no launch after the stage's own touches ``host``.\"\"\"
    count = 1
    for s in shape:
        count *= s
    return host.view(-1).view(torch.uint8)[offset:offset + count * dtype.itemsize].view(dtype).view(shape)


def _laid_out(x, transposed):
    \"\"\"``x`` in the layout its kernel reads it by (row-major, or the transpose of a row-major matrix).\"\"\"
    if transposed:
        return x if x.mT.is_contiguous() else x.mT.contiguous().mT
    return x if x.is_contiguous() else x.contiguous()


def all_dense(*args):
    \"\"\"Every tensor argument is row-major: the kernels may index it by address.\"\"\"
    return all(a.is_contiguous() for a in args if isinstance(a, torch.Tensor))


def _dense_step(step, self, args, written):
    \"\"\"``step`` on contiguous copies of strided inputs; the copies of inputs it writes are copied back
    after its commit (a failed step has then written nothing).\"\"\"
    dense = [a.contiguous() if isinstance(a, torch.Tensor) else a for a in args]
    outputs = step(self, *dense)
    for i in written:
        if dense[i] is not args[i]:
            args[i].copy_(dense[i])
    return outputs


def buffers(self, dev):
    \"\"\"Every buffer of the step, allocated once per step (once for good under a CUDA graph).\"\"\"
    # newton_schulz group 0: 3 x 16x32, fp32 in
    ws0 = torch.empty((3, 16, 32), dtype=torch.bfloat16, device=dev)
    part0 = torch.empty((3, 1), dtype=torch.float32, device=dev)
    out0 = torch.empty((3, 16, 32), dtype=torch.bfloat16, device=dev)
    # its kernels' temporaries (newton_schulz emitter)
    g0_buf0 = torch.empty((3, 16, 16), dtype=torch.bfloat16, device=dev)
    g0_buf1 = torch.empty((3, 16, 32), dtype=torch.bfloat16, device=dev)
    g0_buf2 = torch.empty((3, 16, 16), dtype=torch.bfloat16, device=dev)
    g0_buf3 = torch.empty((3, 16, 32), dtype=torch.bfloat16, device=dev)
    # write fence: where each written-back value waits for the commit (fence.py)
    fence = torch.empty((4096,), dtype=torch.uint8, device=dev)
    st0 = _carve(ws0, 0, (16, 32), torch.float32)  # by unit 3; ws0 is dead after unit 2
    st1 = _carve(g0_buf1, 0, (16, 32), torch.float32)  # by unit 3; g0_buf1 is dead after unit 2
    st2 = _carve(g0_buf3, 0, (32, 16), torch.float32)  # by unit 4; g0_buf3 is dead after unit 2
    st3 = _carve(ws0, 2048, (), torch.float32)  # by unit 5; ws0 is dead after unit 2
    st4 = _carve(ws0, 2176, (32,), torch.float32)  # by unit 6; ws0 is dead after unit 2
    st5 = _carve(ws0, 2304, (32,), torch.float32)  # by unit 6; ws0 is dead after unit 2
    st6 = _carve(ws0, 2432, (32,), torch.float32)  # by unit 6; ws0 is dead after unit 2
    st7 = _carve(out0, 0, (16, 32), torch.float32)  # by unit 7; out0 is dead after unit 4
    st8 = _carve(fence, 0, (16, 32), torch.float32)  # by unit 7; new bytes
    st9 = _carve(fence, 2048, (32, 16), torch.float32)  # by unit 8; new bytes
    return (ws0, part0, out0, g0_buf0, g0_buf1, g0_buf2, g0_buf3, st0, st1, st2, st3, st4, st5, st6, st7, st8, st9, )


# Where each fused launch's table starts in the one device pointer table tables() builds.
PW0 = 0  # pw0: pw_lerp_lerp_ws_16x32_88009e
PW1 = 8  # pw1: pw_lerp_lerp_ws_32x16_de7886
PW2 = 12  # pw2: pw_mul_add_16x32_2efab5
PW3 = 22  # pw3: pw_mul_add_32x16_685db5
PW4 = 27  # pw4: pw_add_scalar_2b4735
PW5 = 29  # pw5: pw_mul_lerp_mul_addcmul_sqrt_div_add_addcdiv_32_563a28
PW6 = 39  # pw6: pw_lerp_16x32_27b295
PW7 = 45  # pw7: pw_lerp_32x16_77c2d6
WB32 = 48  # wb32: writeback_int32_p1


def tables(B, p0_0, g0_0, s0_0_momentum_buffer, p0_1, g0_1, s0_1_momentum_buffer, p0_2, g0_2, s0_2_momentum_buffer, p1_0, g1_0, s1_0_exp_avg, s1_0_exp_avg_sq, s1_0_step, h0, h1, h2, h3, h4, h5):
    \"\"\"Host lists: a pointer table per fused launch (per member: operand addresses, then scalar
    indices), concatenated; and the scalar values (host scalars, then constants).\"\"\"
    (ws0, part0, out0, g0_buf0, g0_buf1, g0_buf2, g0_buf3, st0, st1, st2, st3, st4, st5, st6, st7, st8, st9, ) = B
    # pw0: pw_lerp_lerp_ws_16x32_88009e, 2 member(s) x [x0, x1, ws, part]
    pw0 = [
        s0_0_momentum_buffer.data_ptr(), g0_0.data_ptr(), ws0.data_ptr() + 0, part0.data_ptr() + 0,  # member 0
        s0_1_momentum_buffer.data_ptr(), g0_1.data_ptr(), ws0.data_ptr() + 1024, part0.data_ptr() + 4,  # member 1
    ]
    # pw1: pw_lerp_lerp_ws_32x16_de7886, 1 member(s) x [x0, x1, ws, part]
    pw1 = [
        s0_2_momentum_buffer.data_ptr(), g0_2.data_ptr(), ws0.data_ptr() + 2048, part0.data_ptr() + 8,  # member 0
    ]
    # pw2: pw_mul_add_16x32_2efab5, 2 member(s) x [x0, x1, o0, s0, s1]
    pw2 = [
        p0_0.data_ptr(), out0.data_ptr() + 0, st0.data_ptr(), 0, 1,  # member 0
        p0_1.data_ptr(), out0.data_ptr() + 1024, st1.data_ptr(), 0, 1,  # member 1
    ]
    # pw3: pw_mul_add_32x16_685db5, 1 member(s) x [x0, x1, o0, s0, s1]
    pw3 = [
        p0_2.data_ptr(), out0.data_ptr() + 2048, st2.data_ptr(), 0, 2,  # member 0
    ]
    # pw4: pw_add_scalar_2b4735, 1 member(s) x [x0, o0]
    pw4 = [
        s1_0_step.data_ptr(), st3.data_ptr(),  # member 0
    ]
    # pw5: pw_mul_lerp_mul_addcmul_sqrt_div_add_addcdiv_32_563a28, 1 member(s) x [x0, x1, x2, x3, o0, o1, o2, s0, s1, s2]
    pw5 = [
        p1_0.data_ptr(), s1_0_exp_avg.data_ptr(), g1_0.data_ptr(), s1_0_exp_avg_sq.data_ptr(), st4.data_ptr(), st5.data_ptr(), st6.data_ptr(), 3, 4, 5,  # member 0
    ]
    # pw6: pw_lerp_16x32_27b295, 2 member(s) x [x0, x1, o0]
    pw6 = [
        s0_0_momentum_buffer.data_ptr(), g0_0.data_ptr(), st7.data_ptr(),  # member 0
        s0_1_momentum_buffer.data_ptr(), g0_1.data_ptr(), st8.data_ptr(),  # member 1
    ]
    # pw7: pw_lerp_32x16_77c2d6, 1 member(s) x [x0, x1, o0]
    pw7 = [
        s0_2_momentum_buffer.data_ptr(), g0_2.data_ptr(), st9.data_ptr(),  # member 0
    ]
    # wb32: writeback_int32_p1, 10 write-back(s) x [source, destination, numel]
    wb32 = [
        st0.data_ptr(), p0_0.data_ptr(), 512,  # member 0
        st7.data_ptr(), s0_0_momentum_buffer.data_ptr(), 512,  # member 1
        st1.data_ptr(), p0_1.data_ptr(), 512,  # member 2
        st8.data_ptr(), s0_1_momentum_buffer.data_ptr(), 512,  # member 3
        st2.data_ptr(), p0_2.data_ptr(), 512,  # member 4
        st9.data_ptr(), s0_2_momentum_buffer.data_ptr(), 512,  # member 5
        st6.data_ptr(), p1_0.data_ptr(), 32,  # member 6
        st4.data_ptr(), s1_0_exp_avg.data_ptr(), 32,  # member 7
        st5.data_ptr(), s1_0_exp_avg_sq.data_ptr(), 32,  # member 8
        st3.data_ptr(), s1_0_step.data_ptr(), 1,  # member 9
    ]
    return [*pw0, *pw1, *pw2, *pw3, *pw4, *pw5, *pw6, *pw7, *wb32], [h0, h1, h2, h3, h4, h5, 1e-07]


def launch(self, B, ptrs, scal, p0_0, g0_0, s0_0_momentum_buffer, p0_1, g0_1, s0_1_momentum_buffer, p0_2, g0_2, s0_2_momentum_buffer, p1_0, g1_0, s1_0_exp_avg, s1_0_exp_avg_sq, s1_0_step, h0, h1, h2, h3, h4, h5):
    \"\"\"The launches, then the commit; reads addresses and scalars from device tables (graph safe).\"\"\"
    dev = p0_0.device
    (ws0, part0, out0, g0_buf0, g0_buf1, g0_buf2, g0_buf3, st0, st1, st2, st3, st4, st5, st6, st7, st8, st9, ) = B
    launch_pw_lerp_lerp_ws_16x32_88009e(ptrs, PW0, scal, 2)
    launch_pw_lerp_lerp_ws_32x16_de7886(ptrs, PW1, scal, 1)
    # Newton-Schulz (standard, 2 iterations) on ws0: 3 x 16x32, bf16 -> bf16; partials part0 [3, 1]
    # iteration 1: a=3.4445, b=-4.775, c=2.0315
    launch_ns_gram_bf16_b3_16x32_norm_clamp(ws0, g0_buf0, upcast=False, x0=g0_buf1, partials=part0, eps=scal[6])
    launch_ns_sym_poly_bf16_b3_16x16(g0_buf0, g0_buf2, 0.0, -4.775, 2.0315, upcast=False)
    launch_ns_gemm_bf16_b3_16x32x16_acc(g0_buf2, g0_buf1, g0_buf3, 1.0, upcast=False, C=g0_buf1, beta=3.4445)
    # iteration 2: a=3.4445, b=-4.775, c=2.0315
    launch_ns_gram_bf16_b3_16x32(g0_buf3, g0_buf0, upcast=False)
    launch_ns_sym_poly_bf16_b3_16x16(g0_buf0, g0_buf2, 0.0, -4.775, 2.0315, upcast=False)
    launch_ns_gemm_bf16_b3_16x32x16_acc(g0_buf2, g0_buf3, out0, 1.0, upcast=False, C=g0_buf3, beta=3.4445)
    launch_pw_mul_add_16x32_2efab5(ptrs, PW2, scal, 2)
    launch_pw_mul_add_32x16_685db5(ptrs, PW3, scal, 1)
    launch_pw_add_scalar_2b4735(ptrs, PW4, scal, 1)
    launch_pw_mul_lerp_mul_addcmul_sqrt_div_add_addcdiv_32_563a28(ptrs, PW5, scal, 1)
    launch_pw_lerp_16x32_27b295(ptrs, PW6, scal, 2)
    launch_pw_lerp_32x16_77c2d6(ptrs, PW7, scal, 1)
    # write fence: every launch above has run; only now are params and state written
    launch_writeback_int32_p1(ptrs, WB32, 10)
    return ()


def forward(self, p0_0, g0_0, s0_0_momentum_buffer, p0_1, g0_1, s0_1_momentum_buffer, p0_2, g0_2, s0_2_momentum_buffer, p1_0, g1_0, s1_0_exp_avg, s1_0_exp_avg_sq, s1_0_step, h0, h1, h2, h3, h4, h5):
    # The kernels index tensors by address, row-major: a strided input runs on a copy.
    if not all_dense(p0_0, g0_0, s0_0_momentum_buffer, p0_1, g0_1, s0_1_momentum_buffer, p0_2, g0_2, s0_2_momentum_buffer, p1_0, g1_0, s1_0_exp_avg, s1_0_exp_avg_sq, s1_0_step):
        return _dense_step(forward, self, [p0_0, g0_0, s0_0_momentum_buffer, p0_1, g0_1, s0_1_momentum_buffer, p0_2, g0_2, s0_2_momentum_buffer, p1_0, g1_0, s1_0_exp_avg, s1_0_exp_avg_sq, s1_0_step, h0, h1, h2, h3, h4, h5], (0, 2, 3, 5, 6, 8, 9, 11, 12, 13))
    dev = p0_0.device
    B = buffers(self, dev)
    host_ptrs, host_scal = tables(B, p0_0, g0_0, s0_0_momentum_buffer, p0_1, g0_1, s0_1_momentum_buffer, p0_2, g0_2, s0_2_momentum_buffer, p1_0, g1_0, s1_0_exp_avg, s1_0_exp_avg_sq, s1_0_step, h0, h1, h2, h3, h4, h5)
    ptrs = torch.tensor(host_ptrs, dtype=torch.int64, device=dev)
    scal = torch.tensor(host_scal, dtype=torch.float32, device=dev)
    return launch(self, B, ptrs, scal, p0_0, g0_0, s0_0_momentum_buffer, p0_1, g0_1, s0_1_momentum_buffer, p0_2, g0_2, s0_2_momentum_buffer, p1_0, g1_0, s1_0_exp_avg, s1_0_exp_avg_sq, s1_0_step, h0, h1, h2, h3, h4, h5)
""")
