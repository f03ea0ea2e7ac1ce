"""Expect tests on printed graphs. Update with EXPECTTEST_ACCEPT=1."""

from __future__ import annotations

import torch
from expecttest import TestCase

from hocompile.capture.group_hypers import STRUCTURAL_KEYS
from hocompile.capture.trace import capture
from hocompile.ir.graph import print_graph
from hocompile.passes import BatchByShape, Canonicalize, ChooseAlgorithm, FuseNewtonSchulz, Pass, run_pipeline
from hocompile.targets import Target

# A fixed target so plans do not depend on the machine running the tests:
# fp32 GEMMs 100x faster than bf16, like this project's AVX2 CPUs.
AVX2_LIKE = Target("test-cpu", {"fp32": 100.0, "bf16": 1.0, "fp16": 1.0})
# A target where one bmm over a stack beats a loop of mm (a GPU).
BATCHING = Target("test-gpu", {"fp32": 100.0, "bf16": 400.0, "fp16": 400.0}, prefers_batched=True)


def _graph(
    opt: torch.optim.Optimizer, params: list[torch.Tensor], passes: tuple[Pass, ...], warm: bool = True
) -> str:
    gen = torch.Generator().manual_seed(0)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    if warm:
        opt.step()  # create the state, so the graph is the steady-state one
    gm = capture(opt, STRUCTURAL_KEYS).gm
    gm, _ = run_pipeline(gm, passes)
    return print_graph(gm)


def _muon() -> tuple[torch.optim.Optimizer, list[torch.Tensor]]:
    params = [torch.zeros(6, 4), torch.zeros(4, 4)]
    return torch.optim.Muon(params, lr=0.02, weight_decay=0.1, ns_steps=2), params


class TestPrintedGraphs(TestCase):
    def test_muon_two_params_captured(self) -> None:
        opt, params = _muon()
        self.assertExpectedInline(_graph(opt, params, (Canonicalize(),)), """\
graph step(
  p0_0: fp32[6, 4]  # param_groups[0]['params'][0]
  g0_0: fp32[6, 4]  # param_groups[0]['params'][0].grad
  s0_0_momentum_buffer: fp32[6, 4]  # state[param_groups[0]['params'][0]]['momentum_buffer']
  p0_1: fp32[4, 4]  # param_groups[0]['params'][1]
  g0_1: fp32[4, 4]  # param_groups[0]['params'][1].grad
  s0_1_momentum_buffer: fp32[4, 4]  # state[param_groups[0]['params'][1]]['momentum_buffer']
  h0: fp64 (host) = 1 - g0.momentum
  h1: fp64 (host) = g0.momentum
  h2: fp64 (host) = g0.eps
  h3: fp64 (host) = 1 - (g0.lr * g0.weight_decay)
  h4: fp64 (host) = -(g0.lr * 1.224744871391589)
  h5: fp64 (host) = -(g0.lr * 1.0)
):
  t0: fp32[6, 4] = aten.lerp.Scalar(s0_0_momentum_buffer, g0_0, h0)  # capture
  t1: fp32[6, 4] = aten.lerp.Scalar(g0_0, t0, h1)  # capture
  t2: bf16[6, 4] = aten._to_copy(t1, dtype=bf16)  # capture
  t3: bf16[4, 6] = aten.permute(t2, [1, 0])  # capture
  t4: bf16[] = aten.linalg_vector_norm(t3)  # capture
  t5: bf16[] = aten.clamp(t4, h2)  # capture
  t6: bf16[4, 6] = aten.div.Tensor(t3, t5)  # capture
  t7: bf16[6, 4] = aten.permute(t6, [1, 0])  # capture
  t8: bf16[4, 4] = aten.mm(t6, t7)  # capture
  t9: bf16[4, 4] = aten.addmm(t8, t8, t8, beta=-4.775, alpha=2.0315)  # capture
  t10: bf16[4, 6] = aten.addmm(t6, t9, t6, beta=3.4445)  # capture
  t11: bf16[6, 4] = aten.permute(t10, [1, 0])  # capture
  t12: bf16[4, 4] = aten.mm(t10, t11)  # capture
  t13: bf16[4, 4] = aten.addmm(t12, t12, t12, beta=-4.775, alpha=2.0315)  # capture
  t14: bf16[4, 6] = aten.addmm(t10, t13, t10, beta=3.4445)  # capture
  t15: bf16[6, 4] = aten.permute(t14, [1, 0])  # capture
  t16: fp32[6, 4] = aten.mul.Tensor(p0_0, h3)  # capture
  t17: fp32[6, 4] = aten.add.Tensor(t16, t15, alpha=h4)  # capture
  t18: fp32[4, 4] = aten.lerp.Scalar(s0_1_momentum_buffer, g0_1, h0)  # capture
  t19: fp32[4, 4] = aten.lerp.Scalar(g0_1, t18, h1)  # capture
  t20: bf16[4, 4] = aten._to_copy(t19, dtype=bf16)  # capture
  t21: bf16[] = aten.linalg_vector_norm(t20)  # capture
  t22: bf16[] = aten.clamp(t21, h2)  # capture
  t23: bf16[4, 4] = aten.div.Tensor(t20, t22)  # capture
  t24: bf16[4, 4] = aten.permute(t23, [1, 0])  # capture
  t25: bf16[4, 4] = aten.mm(t23, t24)  # capture
  t26: bf16[4, 4] = aten.addmm(t25, t25, t25, beta=-4.775, alpha=2.0315)  # capture
  t27: bf16[4, 4] = aten.addmm(t23, t26, t23, beta=3.4445)  # capture
  t28: bf16[4, 4] = aten.permute(t27, [1, 0])  # capture
  t29: bf16[4, 4] = aten.mm(t27, t28)  # capture
  t30: bf16[4, 4] = aten.addmm(t29, t29, t29, beta=-4.775, alpha=2.0315)  # capture
  t31: bf16[4, 4] = aten.addmm(t27, t30, t27, beta=3.4445)  # capture
  t32: fp32[4, 4] = aten.mul.Tensor(p0_1, h3)  # capture
  t33: fp32[4, 4] = aten.add.Tensor(t32, t31, alpha=h5)  # capture
  return (t17, t0, t33, t18)
""")

    def test_muon_two_params_after_fuse_newton_schulz(self) -> None:
        opt, params = _muon()
        self.assertExpectedInline(_graph(opt, params, (Canonicalize(), FuseNewtonSchulz())), """\
graph step(
  p0_0: fp32[6, 4]  # param_groups[0]['params'][0]
  g0_0: fp32[6, 4]  # param_groups[0]['params'][0].grad
  s0_0_momentum_buffer: fp32[6, 4]  # state[param_groups[0]['params'][0]]['momentum_buffer']
  p0_1: fp32[4, 4]  # param_groups[0]['params'][1]
  g0_1: fp32[4, 4]  # param_groups[0]['params'][1].grad
  s0_1_momentum_buffer: fp32[4, 4]  # state[param_groups[0]['params'][1]]['momentum_buffer']
  h0: fp64 (host) = 1 - g0.momentum
  h1: fp64 (host) = g0.momentum
  h2: fp64 (host) = g0.eps
  h3: fp64 (host) = 1 - (g0.lr * g0.weight_decay)
  h4: fp64 (host) = -(g0.lr * 1.224744871391589)
  h5: fp64 (host) = -(g0.lr * 1.0)
):
  t0: fp32[6, 4] = aten.lerp.Scalar(s0_0_momentum_buffer, g0_0, h0)  # capture
  t1: fp32[6, 4] = aten.lerp.Scalar(g0_0, t0, h1)  # capture
  t2: bf16[6, 4] = hocompile.newton_schulz(t1, [(3.4445, -4.775, 2.0315)x2], eps=h2 clamp, transpose, bf16->bf16, standard, native)  # fuse-newton-schulz
  t3: fp32[6, 4] = aten.mul.Tensor(p0_0, h3)  # capture
  t4: fp32[6, 4] = aten.add.Tensor(t3, t2, alpha=h4)  # capture
  t5: fp32[4, 4] = aten.lerp.Scalar(s0_1_momentum_buffer, g0_1, h0)  # capture
  t6: fp32[4, 4] = aten.lerp.Scalar(g0_1, t5, h1)  # capture
  t7: bf16[4, 4] = hocompile.newton_schulz(t6, [(3.4445, -4.775, 2.0315)x2], eps=h2 clamp, wide, bf16->bf16, standard, native)  # fuse-newton-schulz
  t8: fp32[4, 4] = aten.mul.Tensor(p0_1, h3)  # capture
  t9: fp32[4, 4] = aten.add.Tensor(t8, t7, alpha=h5)  # capture
  return (t4, t0, t9, t5)
""")

    def test_muon_after_choose_algorithm(self) -> None:
        params = [torch.zeros(8, 32), torch.zeros(8, 8)]
        opt = torch.optim.Muon(params, lr=0.02)
        passes = (Canonicalize(), FuseNewtonSchulz(), ChooseAlgorithm(target=AVX2_LIKE))
        self.assertExpectedInline(_graph(opt, params, passes), """\
graph step(
  p0_0: fp32[8, 32]  # param_groups[0]['params'][0]
  g0_0: fp32[8, 32]  # param_groups[0]['params'][0].grad
  s0_0_momentum_buffer: fp32[8, 32]  # state[param_groups[0]['params'][0]]['momentum_buffer']
  p0_1: fp32[8, 8]  # param_groups[0]['params'][1]
  g0_1: fp32[8, 8]  # param_groups[0]['params'][1].grad
  s0_1_momentum_buffer: fp32[8, 8]  # state[param_groups[0]['params'][1]]['momentum_buffer']
  h0: fp64 (host) = 1 - g0.momentum
  h1: fp64 (host) = g0.momentum
  h2: fp64 (host) = g0.eps
  h3: fp64 (host) = 1 - (g0.lr * g0.weight_decay)
  h4: fp64 (host) = -(g0.lr * 1.0)
):
  t0: fp32[8, 32] = aten.lerp.Scalar(s0_0_momentum_buffer, g0_0, h0)  # capture
  t1: fp32[8, 32] = aten.lerp.Scalar(g0_0, t0, h1)  # capture
  t2: bf16[8, 32] = hocompile.newton_schulz(t1, [(3.4445, -4.775, 2.0315)x5], eps=h2 clamp, wide, fp32->bf16, gram, native)  # fuse-newton-schulz; choose-algorithm: gram fp32, 256 ns predicted (vs standard 461 ns), no fast bf16 GEMM here
  t3: fp32[8, 32] = aten.mul.Tensor(p0_0, h3)  # capture
  t4: fp32[8, 32] = aten.add.Tensor(t3, t2, alpha=h4)  # capture
  t5: fp32[8, 8] = aten.lerp.Scalar(s0_1_momentum_buffer, g0_1, h0)  # capture
  t6: fp32[8, 8] = aten.lerp.Scalar(g0_1, t5, h1)  # capture
  t7: bf16[8, 8] = hocompile.newton_schulz(t6, [(3.4445, -4.775, 2.0315)x5], eps=h2 clamp, wide, fp32->bf16, standard, native)  # fuse-newton-schulz; choose-algorithm: standard fp32, 154 ns predicted (vs gram 195 ns), no fast bf16 GEMM here
  t8: fp32[8, 8] = aten.mul.Tensor(p0_1, h3)  # capture
  t9: fp32[8, 8] = aten.add.Tensor(t8, t7, alpha=h4)  # capture
  return (t4, t0, t9, t5)
""")

    def test_muon_after_batch_by_shape(self) -> None:
        # 8x4 is tall: it joins the 4x8 batch through a transpose; 4x4 stays alone.
        params = [torch.zeros(8, 4), torch.zeros(4, 8), torch.zeros(4, 4)]
        opt = torch.optim.Muon(params, lr=0.02, ns_steps=2)
        passes = (Canonicalize(), FuseNewtonSchulz(), BatchByShape(target=BATCHING))
        self.assertExpectedInline(_graph(opt, params, passes), """\
graph step(
  p0_0: fp32[8, 4]  # param_groups[0]['params'][0]
  g0_0: fp32[8, 4]  # param_groups[0]['params'][0].grad
  s0_0_momentum_buffer: fp32[8, 4]  # state[param_groups[0]['params'][0]]['momentum_buffer']
  p0_1: fp32[4, 8]  # param_groups[0]['params'][1]
  g0_1: fp32[4, 8]  # param_groups[0]['params'][1].grad
  s0_1_momentum_buffer: fp32[4, 8]  # state[param_groups[0]['params'][1]]['momentum_buffer']
  p0_2: fp32[4, 4]  # param_groups[0]['params'][2]
  g0_2: fp32[4, 4]  # param_groups[0]['params'][2].grad
  s0_2_momentum_buffer: fp32[4, 4]  # state[param_groups[0]['params'][2]]['momentum_buffer']
  h0: fp64 (host) = 1 - g0.momentum
  h1: fp64 (host) = g0.momentum
  h2: fp64 (host) = g0.eps
  h3: fp64 (host) = 1 - (g0.lr * g0.weight_decay)
  h4: fp64 (host) = -(g0.lr * 1.4142135623730951)
  h5: fp64 (host) = -(g0.lr * 1.0)
):
  t0: fp32[8, 4] = aten.lerp.Scalar(s0_0_momentum_buffer, g0_0, h0)  # capture
  t1: fp32[8, 4] = aten.lerp.Scalar(g0_0, t0, h1)  # capture
  t2: fp32[8, 4] = aten.mul.Tensor(p0_0, h3)  # capture
  t3: fp32[4, 8] = aten.permute(t1, [1, 0])  # batch-by-shape
  t4: fp32[4, 8] = aten.lerp.Scalar(s0_1_momentum_buffer, g0_1, h0)  # capture
  t5: fp32[4, 8] = aten.lerp.Scalar(g0_1, t4, h1)  # capture
  t6: fp32[2, 4, 8] = aten.stack([t3, t5])  # batch-by-shape
  t7: bf16[2, 4, 8] = hocompile.newton_schulz(t6, [(3.4445, -4.775, 2.0315)x2], eps=h2 clamp, wide, bf16->bf16, standard, native)  # batch-by-shape
  t8: (bf16[4, 8], bf16[4, 8]) = aten.unbind.int(t7)  # batch-by-shape
  t9: bf16[4, 8] = getitem(t8, 0)  # batch-by-shape
  t10: bf16[8, 4] = aten.permute(t9, [1, 0])  # batch-by-shape
  t11: fp32[8, 4] = aten.add.Tensor(t2, t10, alpha=h4)  # capture
  t12: fp32[4, 8] = aten.mul.Tensor(p0_1, h3)  # capture
  t13: bf16[4, 8] = getitem(t8, 1)  # batch-by-shape
  t14: fp32[4, 8] = aten.add.Tensor(t12, t13, alpha=h5)  # capture
  t15: fp32[4, 4] = aten.lerp.Scalar(s0_2_momentum_buffer, g0_2, h0)  # capture
  t16: fp32[4, 4] = aten.lerp.Scalar(g0_2, t15, h1)  # capture
  t17: bf16[4, 4] = hocompile.newton_schulz(t16, [(3.4445, -4.775, 2.0315)x2], eps=h2 clamp, wide, bf16->bf16, standard, native)  # fuse-newton-schulz
  t18: fp32[4, 4] = aten.mul.Tensor(p0_2, h3)  # capture
  t19: fp32[4, 4] = aten.add.Tensor(t18, t17, alpha=h5)  # capture
  return (t11, t0, t14, t4, t19, t15)
""")

    def test_adamw_two_params_captured(self) -> None:
        params = [torch.zeros(6, 4), torch.zeros(4)]
        opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)
        self.assertExpectedInline(_graph(opt, params, (Canonicalize(),)), """\
graph step(
  p0_0: fp32[6, 4]  # param_groups[0]['params'][0]
  g0_0: fp32[6, 4]  # param_groups[0]['params'][0].grad
  s0_0_exp_avg: fp32[6, 4]  # state[param_groups[0]['params'][0]]['exp_avg']
  s0_0_exp_avg_sq: fp32[6, 4]  # state[param_groups[0]['params'][0]]['exp_avg_sq']
  s0_0_step: fp32[]  # state[param_groups[0]['params'][0]]['step']
  p0_1: fp32[4]  # param_groups[0]['params'][1]
  g0_1: fp32[4]  # param_groups[0]['params'][1].grad
  s0_1_exp_avg: fp32[4]  # state[param_groups[0]['params'][1]]['exp_avg']
  s0_1_exp_avg_sq: fp32[4]  # state[param_groups[0]['params'][1]]['exp_avg_sq']
  s0_1_step: fp32[]  # state[param_groups[0]['params'][1]]['step']
  h0: fp64 (host) = 1 - (g0.lr * g0.weight_decay)
  h1: fp64 (host) = 1 - g0.betas[0]
  h2: fp64 (host) = g0.betas[1]
  h3: fp64 (host) = 1 - g0.betas[1]
  h4: fp64 (host) = (1 - (g0.betas[1] ** f32((g0.p0.state.step + 1)))) ** 0.5
  h5: fp64 (host) = g0.eps
  h6: fp64 (host) = -(g0.lr / (1 - (g0.betas[0] ** f32((g0.p0.state.step + 1)))))
  h7: fp64 (host) = (1 - (g0.betas[1] ** f32((g0.p1.state.step + 1)))) ** 0.5
  h8: fp64 (host) = -(g0.lr / (1 - (g0.betas[0] ** f32((g0.p1.state.step + 1)))))
):
  t0: fp32[] = aten.add.Tensor(s0_0_step, 1)  # capture
  t1: fp32[6, 4] = aten.mul.Tensor(p0_0, h0)  # capture
  t2: fp32[6, 4] = aten.lerp.Scalar(s0_0_exp_avg, g0_0, h1)  # capture
  t3: fp32[6, 4] = aten.mul.Tensor(s0_0_exp_avg_sq, h2)  # capture
  t4: fp32[6, 4] = aten.addcmul(t3, g0_0, g0_0, value=h3)  # capture
  t5: fp32[6, 4] = aten.sqrt(t4)  # capture
  t6: fp32[6, 4] = aten.div.Tensor(t5, h4)  # capture
  t7: fp32[6, 4] = aten.add.Tensor(t6, h5)  # capture
  t8: fp32[6, 4] = aten.addcdiv(t1, t2, t7, value=h6)  # capture
  t9: fp32[] = aten.add.Tensor(s0_1_step, 1)  # capture
  t10: fp32[4] = aten.mul.Tensor(p0_1, h0)  # capture
  t11: fp32[4] = aten.lerp.Scalar(s0_1_exp_avg, g0_1, h1)  # capture
  t12: fp32[4] = aten.mul.Tensor(s0_1_exp_avg_sq, h2)  # capture
  t13: fp32[4] = aten.addcmul(t12, g0_1, g0_1, value=h3)  # capture
  t14: fp32[4] = aten.sqrt(t13)  # capture
  t15: fp32[4] = aten.div.Tensor(t14, h7)  # capture
  t16: fp32[4] = aten.add.Tensor(t15, h5)  # capture
  t17: fp32[4] = aten.addcdiv(t10, t11, t16, value=h8)  # capture
  return (t8, t2, t4, t0, t17, t11, t13, t9)
""")

    def test_adamw_first_step_creates_state(self) -> None:
        params = [torch.zeros(3)]
        opt = torch.optim.AdamW(params, lr=1e-3)
        self.assertExpectedInline(_graph(opt, params, (Canonicalize(),), warm=False), """\
graph step(
  p0_0: fp32[3]  # param_groups[0]['params'][0]
  g0_0: fp32[3]  # param_groups[0]['params'][0].grad
  h0: fp64 (host) = 1 - (g0.lr * g0.weight_decay)
  h1: fp64 (host) = 1 - g0.betas[0]
  h2: fp64 (host) = g0.betas[1]
  h3: fp64 (host) = 1 - g0.betas[1]
  h4: fp64 (host) = (1 - (g0.betas[1] ** 1.0)) ** 0.5
  h5: fp64 (host) = g0.eps
  h6: fp64 (host) = -(g0.lr / (1 - (g0.betas[0] ** 1.0)))
):
  t0: fp32[] = constant(0.0)  # capture
  t1: fp32[3] = aten.zeros_like(p0_0, pin_memory=False, memory_format=preserve_format)  # capture
  t2: fp32[3] = aten.zeros_like(p0_0, pin_memory=False, memory_format=preserve_format)  # capture
  t3: fp32[] = aten.add.Tensor(t0, 1)  # capture
  t4: fp32[3] = aten.mul.Tensor(p0_0, h0)  # capture
  t5: fp32[3] = aten.lerp.Scalar(t1, g0_0, h1)  # capture
  t6: fp32[3] = aten.mul.Tensor(t2, h2)  # capture
  t7: fp32[3] = aten.addcmul(t6, g0_0, g0_0, value=h3)  # capture
  t8: fp32[3] = aten.sqrt(t7)  # capture
  t9: fp32[3] = aten.div.Tensor(t8, h4)  # capture
  t10: fp32[3] = aten.add.Tensor(t9, h5)  # capture
  t11: fp32[3] = aten.addcdiv(t4, t5, t10, value=h6)  # capture
  return (t3, t5, t7, t11)
""")

    def test_safety_factor_with_hyperparameter_eps_after_fuse_newton_schulz(self) -> None:
        # ‖X‖·1.05 clamped at the group's eps: s folds into iteration 1 (a/s, b/s³, c/s⁵) and, since
        # eps/s is no host scalar, the input is scaled by s instead; the rest of the program is one op.
        from .test_ns_spellings import SpellingMuon, torch_style_with_safety

        params = [torch.zeros(6, 4)]
        opt = SpellingMuon(params, torch_style_with_safety)
        self.assertExpectedInline(_graph(opt, params, (Canonicalize(), FuseNewtonSchulz())), """\
graph step(
  p0_0: fp32[6, 4]  # param_groups[0]['params'][0]
  g0_0: fp32[6, 4]  # param_groups[0]['params'][0].grad
  s0_0_momentum_buffer: fp32[6, 4]  # state[param_groups[0]['params'][0]]['momentum_buffer']
  h0: fp64 (host) = 1 - g0.momentum
  h1: fp64 (host) = g0.momentum
  h2: fp64 (host) = g0.eps
  h3: fp64 (host) = (-g0.lr) * 1.224744871391589
):
  t0: fp32[6, 4] = aten.lerp.Scalar(s0_0_momentum_buffer, g0_0, h0)  # capture
  t1: fp32[6, 4] = aten.lerp.Scalar(g0_0, t0, h1)  # capture
  t2: fp32[6, 4] = aten.mul.Tensor(t1, 1.05)  # fuse-newton-schulz
  t3: fp32[6, 4] = hocompile.newton_schulz(t2, [(3.2804761904761905, -4.124824532987798, 1.591733407180674) + (3.4445, -4.775, 2.0315)x4], eps=h2 clamp, transpose, bf16->fp32, standard, native)  # fuse-newton-schulz
  t4: fp32[6, 4] = aten.add.Tensor(p0_0, t3, alpha=h3)  # capture
  return (t4, t0)
""")
