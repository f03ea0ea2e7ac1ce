# ruff: noqa: E501
"""Issue 12: the Shampoo family's steady-state graphs after the default pipeline. Update with EXPECTTEST_ACCEPT=1.

Shampoo is shown with both root methods (eigh, and the coupled Newton iteration on its
refresh step). Each optimizer gets two tiny params, one wide (4, 6) and one tall (6, 4), takes its first
step eagerly (that step creates the state; SOAP's also takes eigh, whatever ``use_eigh``
says), and the next step is captured: the graph a compiled optimizer compiles in steady
state. It then runs through ``default_pipeline`` for a fixed target (``AVX2_LIKE``; also
``BATCHING`` for one optimizer per batchable family: polar, power_qr, Newton-Schulz).

A golden holds what every pass did (name, changed/unchanged, summary) and the final graph:
whole for the short ones (MOP, PolarGrad); for the long ones (SOAP, REKLS, Shampoo: 60 to
200 ops) only the lines a pass made (the recognised ops and what feeds and unpacks them)
plus a count of every op in the graph, so that a fusion that stops firing shows up as a
changed count without a 200-line diff.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable

import pytest
import torch
from expecttest import TestCase

import tests.helpers  # noqa: F401  (typing.override for emerging-optimizers on Python 3.11)
from hocompile.capture.group_hypers import STRUCTURAL_KEYS
from hocompile.capture.trace import capture
from hocompile.ir.graph import print_graph
from hocompile.optimizers import Shampoo
from hocompile.passes import PassRecord, default_pipeline, run_pipeline
from hocompile.targets import Target
from tests.test_expect_graphs import AVX2_LIKE, BATCHING

soap = pytest.importorskip("emerging_optimizers.soap")
orthogonalized = pytest.importorskip("emerging_optimizers.orthogonalized_optimizers")

Factory = Callable[[list[torch.Tensor]], torch.optim.Optimizer]

# expecttest writes printable ASCII only: the pass summaries' typography, spelled out.
_PLAIN = {"\u2013": "-", "\u00d7": "x", "\u2192": "->", "\u1d40": "^T", "\u2026": "..."}
_OP = re.compile(r"^  t\d+: .*? = ([\w.]+)\(")


def _ascii(text: str) -> str:
    for char, plain in _PLAIN.items():
        text = text.replace(char, plain)
    # Fail here, naming the character, rather than in expecttest's writer.
    assert text.isascii(), f"add to _PLAIN: {sorted({c for c in text if not c.isascii()})}"
    return text


def _steady(factory: Factory, target: Target, eager_steps: int = 1) -> tuple[list[PassRecord], str]:
    """The pass records and printed final graph of step ``eager_steps + 1``."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(4, 6, generator=gen), torch.randn(6, 4, generator=gen)]
    opt = factory(params)
    # emerging's SOAP family torch.compiles its Adam update: eager code here, the same
    # state, and no Dynamo compile (4 s) in a test about hocompile's graphs.
    with torch.compiler.set_stance("force_eager"):
        for _ in range(eager_steps):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen)
            opt.step()
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    gm, records = run_pipeline(capture(opt, STRUCTURAL_KEYS).gm, default_pipeline(target))
    return records, print_graph(gm)


def _passes(records: list[PassRecord]) -> list[str]:
    return ["passes:"] + [f"  {r.name}: {r.status}: {r.summary}" for r in records]


def _full(factory: Factory, target: Target) -> str:
    records, graph = _steady(factory, target)
    return _ascii("\n".join(_passes(records)) + "\n" + graph)


def _summary(factory: Factory, target: Target, eager_steps: int = 1) -> str:
    """Pass records, the body lines a pass made (provenance other than capture), op counts."""
    records, graph = _steady(factory, target, eager_steps)
    body = graph.split("\n):\n", 1)[1].splitlines()
    ops = Counter(m.group(1) for line in body if (m := _OP.match(line)))
    made = [line for line in body if _OP.match(line) and not line.endswith("  # capture")]
    lines = _passes(records)
    lines.append(f"made by passes ({len(made)} of {sum(ops.values())} ops):")
    lines += made
    lines.append("op counts:")
    lines += [f"  {op} x{n}" for op, n in sorted(ops.items())]
    return _ascii("\n".join(lines) + "\n")


def _soap_qr(ps: list[torch.Tensor]) -> torch.optim.Optimizer:
    return soap.SOAP(ps, lr=0.01)


def _rekls(ps: list[torch.Tensor]) -> torch.optim.Optimizer:
    return soap.REKLS(ps, lr=0.01)


def _mop(ps: list[torch.Tensor]) -> torch.optim.Optimizer:
    return orthogonalized.MOP(ps, lr=0.02)


def _polargrad(ps: list[torch.Tensor]) -> torch.optim.Optimizer:
    return orthogonalized.PolarGrad(ps, lr=0.02)


def _shampoo(ps: list[torch.Tensor]) -> torch.optim.Optimizer:
    # Refreshes on steps 1, 3, 5, ...: step 2 keeps the roots, step 3 recomputes them.
    return Shampoo(ps, lr=0.01, precondition_frequency=2)


def _shampoo_newton(ps: list[torch.Tensor]) -> torch.optim.Optimizer:
    # The coupled Newton root (3 iterations: short enough to read, long enough to count).
    return Shampoo(ps, lr=0.01, precondition_frequency=2, root_method="newton", newton_iterations=3)


class TestShampooFamilyGraphs(TestCase):
    def test_soap_qr_steady(self) -> None:
        self.assertExpectedInline(_summary(_soap_qr, AVX2_LIKE), """\
passes:
  canonicalize: changed: removed 56 identity/copy ops and 0 dead nodes
  fuse-newton-schulz: unchanged: no Newton-Schulz chain found; declined 4: mm: X X^T product outside any recognised Newton-Schulz chain ...
  fuse-polar: unchanged: no svd -> U @ Vh found
  fuse-eigenbasis: changed: fused 4 eigenbasis refresh(es)
  fuse-factor-update: changed: fused 4 factor update(s)
  fuse-inverse-root: unchanged: no eigh or coupled-Newton inverse root found
  fuse-two-sided: changed: fused 8 two-sided product(s)
  batch-by-shape: unchanged: test-cpu does not gain from stacking (a loop of mm is as fast there); batching would only add copies and memory
  choose-algorithm: unchanged: no Newton-Schulz op to plan
  choose-precision: unchanged: no Newton-Schulz op to plan
made by passes (24 of 44 ops):
  t0: fp32[4, 4] = hocompile.factor_update(s0_0_L, g0_0 @ g0_0^T, lerp, weight=h0)  # fuse-factor-update
  t1: fp32[6, 6] = hocompile.factor_update(s0_0_R, g0_0^T @ g0_0, lerp, weight=h0)  # fuse-factor-update
  t2: fp32[4, 6] = hocompile.two_sided(s0_0_Q_L @ s0_0_exp_avg @ s0_0_Q_R^T, tensordot)  # fuse-two-sided
  t3: fp32[4, 4] = aten.mm(t0, s0_0_Q_L)  # fuse-eigenbasis
  t4: i64[4] = hocompile.rayleigh_order(t3, s0_0_Q_L, descending)  # fuse-eigenbasis
  t6: fp32[6, 6] = aten.mm(t1, s0_0_Q_R)  # fuse-eigenbasis
  t7: i64[6] = hocompile.rayleigh_order(t6, s0_0_Q_R, descending)  # fuse-eigenbasis
  t9: fp32[4, 4] = hocompile.power_qr(t3, columns=t4, householder)  # fuse-eigenbasis
  t10: fp32[6, 6] = hocompile.power_qr(t6, columns=t7, householder)  # fuse-eigenbasis
  t11: fp32[4, 6] = hocompile.two_sided(t9^T @ t2 @ t10, tensordot)  # fuse-two-sided
  t13: fp32[4, 6] = hocompile.two_sided(t9^T @ g0_0 @ t10, tensordot)  # fuse-two-sided
  t20: fp32[4, 6] = hocompile.two_sided(t9 @ t15 @ t10^T, tensordot)  # fuse-two-sided
  t22: fp32[6, 6] = hocompile.factor_update(s0_1_L, g0_1 @ g0_1^T, lerp, weight=h7)  # fuse-factor-update
  t23: fp32[4, 4] = hocompile.factor_update(s0_1_R, g0_1^T @ g0_1, lerp, weight=h7)  # fuse-factor-update
  t24: fp32[6, 4] = hocompile.two_sided(s0_1_Q_L @ s0_1_exp_avg @ s0_1_Q_R^T, tensordot)  # fuse-two-sided
  t25: fp32[6, 6] = aten.mm(t22, s0_1_Q_L)  # fuse-eigenbasis
  t26: i64[6] = hocompile.rayleigh_order(t25, s0_1_Q_L, descending)  # fuse-eigenbasis
  t28: fp32[4, 4] = aten.mm(t23, s0_1_Q_R)  # fuse-eigenbasis
  t29: i64[4] = hocompile.rayleigh_order(t28, s0_1_Q_R, descending)  # fuse-eigenbasis
  t31: fp32[6, 6] = hocompile.power_qr(t25, columns=t26, householder)  # fuse-eigenbasis
  t32: fp32[4, 4] = hocompile.power_qr(t28, columns=t29, householder)  # fuse-eigenbasis
  t33: fp32[6, 4] = hocompile.two_sided(t31^T @ t24 @ t32, tensordot)  # fuse-two-sided
  t35: fp32[6, 4] = hocompile.two_sided(t31^T @ g0_1 @ t32, tensordot)  # fuse-two-sided
  t42: fp32[6, 4] = hocompile.two_sided(t31 @ t37 @ t32^T, tensordot)  # fuse-two-sided
op counts:
  aten.add.Tensor x4
  aten.copy x4
  aten.index_select x4
  aten.mm x4
  getitem x6
  hocompile.factor_update x4
  hocompile.power_qr x4
  hocompile.rayleigh_order x4
  hocompile.two_sided x8
  hocompile_torch.compiled_call x2
""")

    def test_soap_qr_steady_batched(self) -> None:
        self.assertExpectedInline(_summary(_soap_qr, BATCHING), """\
passes:
  canonicalize: changed: removed 56 identity/copy ops and 0 dead nodes
  fuse-newton-schulz: unchanged: no Newton-Schulz chain found; declined 4: mm: X X^T product outside any recognised Newton-Schulz chain ...
  fuse-polar: unchanged: no svd -> U @ Vh found
  fuse-eigenbasis: changed: fused 4 eigenbasis refresh(es)
  fuse-factor-update: changed: fused 4 factor update(s)
  fuse-inverse-root: unchanged: no eigh or coupled-Newton inverse root found
  fuse-two-sided: changed: fused 8 two-sided product(s)
  batch-by-shape: changed: 4 ops in 2 batched op(s)
  choose-algorithm: unchanged: no Newton-Schulz op to plan
  choose-precision: unchanged: no Newton-Schulz op to plan
made by passes (32 of 52 ops):
  t0: fp32[4, 4] = hocompile.factor_update(s0_0_L, g0_0 @ g0_0^T, lerp, weight=h0)  # fuse-factor-update
  t1: fp32[6, 6] = hocompile.factor_update(s0_0_R, g0_0^T @ g0_0, lerp, weight=h0)  # fuse-factor-update
  t2: fp32[4, 6] = hocompile.two_sided(s0_0_Q_L @ s0_0_exp_avg @ s0_0_Q_R^T, tensordot)  # fuse-two-sided
  t3: fp32[4, 4] = aten.mm(t0, s0_0_Q_L)  # fuse-eigenbasis
  t4: i64[4] = hocompile.rayleigh_order(t3, s0_0_Q_L, descending)  # fuse-eigenbasis
  t6: fp32[6, 6] = aten.mm(t1, s0_0_Q_R)  # fuse-eigenbasis
  t7: i64[6] = hocompile.rayleigh_order(t6, s0_0_Q_R, descending)  # fuse-eigenbasis
  t9: fp32[4, 4] = hocompile.factor_update(s0_1_R, g0_1^T @ g0_1, lerp, weight=h7)  # fuse-factor-update
  t10: fp32[4, 4] = aten.mm(t9, s0_1_Q_R)  # fuse-eigenbasis
  t11: fp32[2, 4, 4] = aten.stack([t3, t10])  # batch-by-shape
  t12: i64[4] = hocompile.rayleigh_order(t10, s0_1_Q_R, descending)  # fuse-eigenbasis
  t13: i64[2, 4] = aten.stack([t4, t12])  # batch-by-shape
  t14: fp32[2, 4, 4] = hocompile.power_qr(t11, columns=t13, householder)  # batch-by-shape
  t15: (fp32[4, 4], fp32[4, 4]) = aten.unbind.int(t14)  # batch-by-shape
  t16: fp32[4, 4] = getitem(t15, 0)  # batch-by-shape
  t17: fp32[6, 6] = hocompile.factor_update(s0_1_L, g0_1 @ g0_1^T, lerp, weight=h7)  # fuse-factor-update
  t18: fp32[6, 6] = aten.mm(t17, s0_1_Q_L)  # fuse-eigenbasis
  t19: fp32[2, 6, 6] = aten.stack([t6, t18])  # batch-by-shape
  t20: i64[6] = hocompile.rayleigh_order(t18, s0_1_Q_L, descending)  # fuse-eigenbasis
  t21: i64[2, 6] = aten.stack([t7, t20])  # batch-by-shape
  t22: fp32[2, 6, 6] = hocompile.power_qr(t19, columns=t21, householder)  # batch-by-shape
  t23: (fp32[6, 6], fp32[6, 6]) = aten.unbind.int(t22)  # batch-by-shape
  t24: fp32[6, 6] = getitem(t23, 0)  # batch-by-shape
  t25: fp32[4, 6] = hocompile.two_sided(t16^T @ t2 @ t24, tensordot)  # fuse-two-sided
  t27: fp32[4, 6] = hocompile.two_sided(t16^T @ g0_0 @ t24, tensordot)  # fuse-two-sided
  t34: fp32[4, 6] = hocompile.two_sided(t16 @ t29 @ t24^T, tensordot)  # fuse-two-sided
  t36: fp32[6, 4] = hocompile.two_sided(s0_1_Q_L @ s0_1_exp_avg @ s0_1_Q_R^T, tensordot)  # fuse-two-sided
  t39: fp32[6, 6] = getitem(t23, 1)  # batch-by-shape
  t40: fp32[4, 4] = getitem(t15, 1)  # batch-by-shape
  t41: fp32[6, 4] = hocompile.two_sided(t39^T @ t36 @ t40, tensordot)  # fuse-two-sided
  t43: fp32[6, 4] = hocompile.two_sided(t39^T @ g0_1 @ t40, tensordot)  # fuse-two-sided
  t50: fp32[6, 4] = hocompile.two_sided(t39 @ t45 @ t40^T, tensordot)  # fuse-two-sided
op counts:
  aten.add.Tensor x4
  aten.copy x4
  aten.index_select x4
  aten.mm x4
  aten.stack x4
  aten.unbind.int x2
  getitem x10
  hocompile.factor_update x4
  hocompile.power_qr x2
  hocompile.rayleigh_order x4
  hocompile.two_sided x8
  hocompile_torch.compiled_call x2
""")

    def test_rekls_steady(self) -> None:
        self.assertExpectedInline(_summary(_rekls, AVX2_LIKE), """\
passes:
  canonicalize: changed: removed 58 identity/copy ops and 0 dead nodes
  fuse-newton-schulz: unchanged: no Newton-Schulz chain found
  fuse-polar: unchanged: no svd -> U @ Vh found
  fuse-eigenbasis: unchanged: no sort-by-diag(Q^TLQ) -> qr(L Q) found
  fuse-factor-update: unchanged: no Gram lerp/addmm of a Kronecker factor found; declined 4: lerp: the product is not the Gram of one matrix (G G^T or G^T G) (REKLS's KL-Shampoo G C G^T is not covered) ...
  fuse-inverse-root: unchanged: no eigh or coupled-Newton inverse root found
  fuse-two-sided: changed: fused 8 two-sided product(s); declined 4: mm_3: X mm_1 is itself a product: a longer chain, no projection ...
  batch-by-shape: unchanged: test-cpu does not gain from stacking (a loop of mm is as fast there); batching would only add copies and memory
  choose-algorithm: unchanged: no Newton-Schulz op to plan
  choose-precision: unchanged: no Newton-Schulz op to plan
made by passes (8 of 132 ops):
  t32: fp32[4, 6] = hocompile.two_sided(s0_0_Q_L @ s0_0_exp_avg @ s0_0_Q_R^T, tensordot)  # fuse-two-sided
  t55: fp32[4, 6] = hocompile.two_sided(t51^T @ t32 @ t54, tensordot)  # fuse-two-sided
  t57: fp32[4, 6] = hocompile.two_sided(t51^T @ g0_0 @ t54, tensordot)  # fuse-two-sided
  t64: fp32[4, 6] = hocompile.two_sided(t51 @ t59 @ t54^T, tensordot)  # fuse-two-sided
  t98: fp32[6, 4] = hocompile.two_sided(s0_1_Q_L @ s0_1_exp_avg @ s0_1_Q_R^T, tensordot)  # fuse-two-sided
  t121: fp32[6, 4] = hocompile.two_sided(t117^T @ t98 @ t120, tensordot)  # fuse-two-sided
  t123: fp32[6, 4] = hocompile.two_sided(t117^T @ g0_1 @ t120, tensordot)  # fuse-two-sided
  t130: fp32[6, 4] = hocompile.two_sided(t117 @ t125 @ t120^T, tensordot)  # fuse-two-sided
op counts:
  aten._linalg_eigh x4
  aten.add.Tensor x4
  aten.clamp_min x4
  aten.copy x4
  aten.flip x4
  aten.index_select x4
  aten.lerp.Scalar x4
  aten.mm x20
  aten.mul.Tensor x16
  aten.permute x24
  aten.pow.Tensor_Scalar x4
  aten.sort x4
  aten.sum.dim_IntList x8
  aten.unsqueeze x4
  getitem x14
  hocompile.two_sided x8
  hocompile_torch.compiled_call x2
""")

    def test_mop_steady(self) -> None:
        self.assertExpectedInline(_full(_mop, AVX2_LIKE), """\
passes:
  canonicalize: unchanged: nothing to remove
  fuse-newton-schulz: unchanged: no Newton-Schulz chain found
  fuse-polar: changed: fused 2 polar factor(s) (svd)
  fuse-eigenbasis: unchanged: no sort-by-diag(Q^TLQ) -> qr(L Q) found
  fuse-factor-update: unchanged: no Gram lerp/addmm of a Kronecker factor found
  fuse-inverse-root: unchanged: no eigh or coupled-Newton inverse root found
  fuse-two-sided: unchanged: no A X B chain of two products found
  batch-by-shape: unchanged: test-cpu does not gain from stacking (a loop of mm is as fast there); batching would only add copies and memory
  choose-algorithm: unchanged: no Newton-Schulz op to plan
  choose-precision: unchanged: no Newton-Schulz op to plan
graph step(
  p0_0: fp32[4, 6]  # param_groups[0]['params'][0]
  g0_0: fp32[4, 6]  # param_groups[0]['params'][0].grad
  s0_0_momentum_buffer: fp32[4, 6]  # state[param_groups[0]['params'][0]]['momentum_buffer']
  p0_1: fp32[6, 4]  # param_groups[0]['params'][1]
  g0_1: fp32[6, 4]  # param_groups[0]['params'][1].grad
  s0_1_momentum_buffer: fp32[6, 4]  # state[param_groups[0]['params'][1]]['momentum_buffer']
  h0: fp64 (host) = (-g0.weight_decay) * g0.lr
  h1: fp64 (host) = 1 - g0.momentum
  h2: fp64 (host) = -g0.lr
):
  t0: fp32[4, 6] = aten.add.Tensor(p0_0, p0_0, alpha=h0)  # capture
  t1: fp32[4, 6] = aten.lerp.Scalar(s0_0_momentum_buffer, g0_0, h1)  # capture
  t2: fp32[4, 6] = hocompile.polar(t1, svd, scale=nuclear)  # fuse-polar
  t3: fp32[4, 6] = aten.mul.Tensor(t2, 1.0)  # capture
  t4: fp32[4, 6] = aten.add.Tensor(t0, t3, alpha=h2)  # capture
  t5: fp32[6, 4] = aten.add.Tensor(p0_1, p0_1, alpha=h0)  # capture
  t6: fp32[6, 4] = aten.lerp.Scalar(s0_1_momentum_buffer, g0_1, h1)  # capture
  t7: fp32[6, 4] = hocompile.polar(t6, svd, scale=nuclear)  # fuse-polar
  t8: fp32[6, 4] = aten.mul.Tensor(t7, 1.0)  # capture
  t9: fp32[6, 4] = aten.add.Tensor(t5, t8, alpha=h2)  # capture
  return (t4, t1, t9, t6)
""")

    def test_mop_steady_batched(self) -> None:
        self.assertExpectedInline(_full(_mop, BATCHING), """\
passes:
  canonicalize: unchanged: nothing to remove
  fuse-newton-schulz: unchanged: no Newton-Schulz chain found
  fuse-polar: changed: fused 2 polar factor(s) (svd)
  fuse-eigenbasis: unchanged: no sort-by-diag(Q^TLQ) -> qr(L Q) found
  fuse-factor-update: unchanged: no Gram lerp/addmm of a Kronecker factor found
  fuse-inverse-root: unchanged: no eigh or coupled-Newton inverse root found
  fuse-two-sided: unchanged: no A X B chain of two products found
  batch-by-shape: changed: 2 ops in 1 batched op(s)
  choose-algorithm: unchanged: no Newton-Schulz op to plan
  choose-precision: unchanged: no Newton-Schulz op to plan
graph step(
  p0_0: fp32[4, 6]  # param_groups[0]['params'][0]
  g0_0: fp32[4, 6]  # param_groups[0]['params'][0].grad
  s0_0_momentum_buffer: fp32[4, 6]  # state[param_groups[0]['params'][0]]['momentum_buffer']
  p0_1: fp32[6, 4]  # param_groups[0]['params'][1]
  g0_1: fp32[6, 4]  # param_groups[0]['params'][1].grad
  s0_1_momentum_buffer: fp32[6, 4]  # state[param_groups[0]['params'][1]]['momentum_buffer']
  h0: fp64 (host) = (-g0.weight_decay) * g0.lr
  h1: fp64 (host) = 1 - g0.momentum
  h2: fp64 (host) = -g0.lr
):
  t0: fp32[4, 6] = aten.add.Tensor(p0_0, p0_0, alpha=h0)  # capture
  t1: fp32[4, 6] = aten.lerp.Scalar(s0_0_momentum_buffer, g0_0, h1)  # capture
  t2: fp32[6, 4] = aten.permute(t1, [1, 0])  # batch-by-shape
  t3: fp32[6, 4] = aten.lerp.Scalar(s0_1_momentum_buffer, g0_1, h1)  # capture
  t4: fp32[2, 6, 4] = aten.stack([t2, t3])  # batch-by-shape
  t5: fp32[2, 6, 4] = hocompile.polar(t4, svd, scale=nuclear)  # batch-by-shape
  t6: (fp32[6, 4], fp32[6, 4]) = aten.unbind.int(t5)  # batch-by-shape
  t7: fp32[6, 4] = getitem(t6, 0)  # batch-by-shape
  t8: fp32[4, 6] = aten.permute(t7, [1, 0])  # batch-by-shape
  t9: fp32[4, 6] = aten.mul.Tensor(t8, 1.0)  # capture
  t10: fp32[4, 6] = aten.add.Tensor(t0, t9, alpha=h2)  # capture
  t11: fp32[6, 4] = aten.add.Tensor(p0_1, p0_1, alpha=h0)  # capture
  t12: fp32[6, 4] = getitem(t6, 1)  # batch-by-shape
  t13: fp32[6, 4] = aten.mul.Tensor(t12, 1.0)  # capture
  t14: fp32[6, 4] = aten.add.Tensor(t11, t13, alpha=h2)  # capture
  return (t10, t1, t14, t3)
""")

    def test_polargrad_steady(self) -> None:
        self.assertExpectedInline(_full(_polargrad, AVX2_LIKE), """\
passes:
  canonicalize: unchanged: nothing to remove
  fuse-newton-schulz: changed: fused 2 Newton-Schulz chain(s)
  fuse-polar: unchanged: no svd -> U @ Vh found
  fuse-eigenbasis: unchanged: no sort-by-diag(Q^TLQ) -> qr(L Q) found
  fuse-factor-update: unchanged: no Gram lerp/addmm of a Kronecker factor found
  fuse-inverse-root: unchanged: no eigh or coupled-Newton inverse root found
  fuse-two-sided: unchanged: no A X B chain of two products found
  batch-by-shape: unchanged: test-cpu does not gain from stacking (a loop of mm is as fast there); batching would only add copies and memory
  choose-algorithm: changed: standard/fp32 x2 on test-cpu (GEMM GFLOP/s: bf16 1.0, fp16 1.0, fp32 100.0; stacks run as loop of mm)
  choose-precision: unchanged: no op planned
graph step(
  p0_0: fp32[4, 6]  # param_groups[0]['params'][0]
  g0_0: fp32[4, 6]  # param_groups[0]['params'][0].grad
  s0_0_momentum_buffer: fp32[4, 6]  # state[param_groups[0]['params'][0]]['momentum_buffer']
  p0_1: fp32[6, 4]  # param_groups[0]['params'][1]
  g0_1: fp32[6, 4]  # param_groups[0]['params'][1].grad
  s0_1_momentum_buffer: fp32[6, 4]  # state[param_groups[0]['params'][1]]['momentum_buffer']
  h0: fp64 (host) = (-g0.weight_decay) * g0.lr
  h1: fp64 (host) = 1 - g0.momentum
  h2: fp64 (host) = -g0.lr
):
  t0: fp32[4, 6] = aten.add.Tensor(p0_0, p0_0, alpha=h0)  # capture
  t1: fp32[4, 6] = aten.lerp.Scalar(s0_0_momentum_buffer, g0_0, h1)  # capture
  t2: fp32[4, 6] = hocompile.newton_schulz(t1, [(4.0848, -6.8946, 2.927) + (3.9505, -6.3029, 2.6377) + (3.7418, -5.5913, 2.3037) + (2.8769, -3.1427, 1.2046) + (2.8366, -3.0525, 1.2012)], eps=1e-07 clamp, wide, fp32->fp32, standard, native)  # fuse-newton-schulz; choose-algorithm: standard fp32, 25.6 ns predicted (vs gram 25.6 ns), eager's precision; choose-precision: uniform precision kept, short side 4 < 64, outside the calibrated shapes
  t3: fp32[4, 6] = aten.mul.Tensor(t2, t1)  # capture
  t4: fp32[] = aten.sum(t3)  # capture
  t5: fp32[4, 6] = aten.mul.Tensor(t2, t4)  # capture
  t6: fp32[4, 6] = aten.mul.Tensor(t5, 1.0)  # capture
  t7: fp32[4, 6] = aten.add.Tensor(t0, t6, alpha=h2)  # capture
  t8: fp32[6, 4] = aten.add.Tensor(p0_1, p0_1, alpha=h0)  # capture
  t9: fp32[6, 4] = aten.lerp.Scalar(s0_1_momentum_buffer, g0_1, h1)  # capture
  t10: fp32[6, 4] = hocompile.newton_schulz(t9, [(4.0848, -6.8946, 2.927) + (3.9505, -6.3029, 2.6377) + (3.7418, -5.5913, 2.3037) + (2.8769, -3.1427, 1.2046) + (2.8366, -3.0525, 1.2012)], eps=1e-07 clamp, transpose, fp32->fp32, standard, native)  # fuse-newton-schulz; choose-algorithm: standard fp32, 25.6 ns predicted (vs gram 25.6 ns), eager's precision; choose-precision: uniform precision kept, short side 4 < 64, outside the calibrated shapes
  t11: fp32[6, 4] = aten.mul.Tensor(t10, t9)  # capture
  t12: fp32[] = aten.sum(t11)  # capture
  t13: fp32[6, 4] = aten.mul.Tensor(t10, t12)  # capture
  t14: fp32[6, 4] = aten.mul.Tensor(t13, 1.0)  # capture
  t15: fp32[6, 4] = aten.add.Tensor(t8, t14, alpha=h2)  # capture
  return (t7, t1, t15, t9)
""")

    def test_polargrad_steady_batched(self) -> None:
        self.assertExpectedInline(_full(_polargrad, BATCHING), """\
passes:
  canonicalize: unchanged: nothing to remove
  fuse-newton-schulz: changed: fused 2 Newton-Schulz chain(s)
  fuse-polar: unchanged: no svd -> U @ Vh found
  fuse-eigenbasis: unchanged: no sort-by-diag(Q^TLQ) -> qr(L Q) found
  fuse-factor-update: unchanged: no Gram lerp/addmm of a Kronecker factor found
  fuse-inverse-root: unchanged: no eigh or coupled-Newton inverse root found
  fuse-two-sided: unchanged: no A X B chain of two products found
  batch-by-shape: changed: 2 ops in 1 batched op(s)
  choose-algorithm: changed: standard/fp32 x1 on test-gpu (GEMM GFLOP/s: bf16 400.0, fp16 400.0, fp32 100.0; stacks run as bmm)
  choose-precision: unchanged: no op planned
graph step(
  p0_0: fp32[4, 6]  # param_groups[0]['params'][0]
  g0_0: fp32[4, 6]  # param_groups[0]['params'][0].grad
  s0_0_momentum_buffer: fp32[4, 6]  # state[param_groups[0]['params'][0]]['momentum_buffer']
  p0_1: fp32[6, 4]  # param_groups[0]['params'][1]
  g0_1: fp32[6, 4]  # param_groups[0]['params'][1].grad
  s0_1_momentum_buffer: fp32[6, 4]  # state[param_groups[0]['params'][1]]['momentum_buffer']
  h0: fp64 (host) = (-g0.weight_decay) * g0.lr
  h1: fp64 (host) = 1 - g0.momentum
  h2: fp64 (host) = -g0.lr
):
  t0: fp32[4, 6] = aten.add.Tensor(p0_0, p0_0, alpha=h0)  # capture
  t1: fp32[4, 6] = aten.lerp.Scalar(s0_0_momentum_buffer, g0_0, h1)  # capture
  t2: fp32[6, 4] = aten.lerp.Scalar(s0_1_momentum_buffer, g0_1, h1)  # capture
  t3: fp32[4, 6] = aten.permute(t2, [1, 0])  # batch-by-shape
  t4: fp32[2, 4, 6] = aten.stack([t1, t3])  # batch-by-shape
  t5: fp32[2, 4, 6] = hocompile.newton_schulz(t4, [(4.0848, -6.8946, 2.927) + (3.9505, -6.3029, 2.6377) + (3.7418, -5.5913, 2.3037) + (2.8769, -3.1427, 1.2046) + (2.8366, -3.0525, 1.2012)], eps=1e-07 clamp, wide, fp32->fp32, standard, native)  # batch-by-shape; choose-algorithm: standard fp32, 51.2 ns predicted (vs gram 51.2 ns), eager's precision; choose-precision: uniform precision kept, short side 4 < 64, outside the calibrated shapes
  t6: (fp32[4, 6], fp32[4, 6]) = aten.unbind.int(t5)  # batch-by-shape
  t7: fp32[4, 6] = getitem(t6, 0)  # batch-by-shape
  t8: fp32[4, 6] = aten.mul.Tensor(t7, t1)  # capture
  t9: fp32[] = aten.sum(t8)  # capture
  t10: fp32[4, 6] = aten.mul.Tensor(t7, t9)  # capture
  t11: fp32[4, 6] = aten.mul.Tensor(t10, 1.0)  # capture
  t12: fp32[4, 6] = aten.add.Tensor(t0, t11, alpha=h2)  # capture
  t13: fp32[6, 4] = aten.add.Tensor(p0_1, p0_1, alpha=h0)  # capture
  t14: fp32[4, 6] = getitem(t6, 1)  # batch-by-shape
  t15: fp32[6, 4] = aten.permute(t14, [1, 0])  # batch-by-shape
  t16: fp32[6, 4] = aten.mul.Tensor(t15, t2)  # capture
  t17: fp32[] = aten.sum(t16)  # capture
  t18: fp32[6, 4] = aten.mul.Tensor(t15, t17)  # capture
  t19: fp32[6, 4] = aten.mul.Tensor(t18, 1.0)  # capture
  t20: fp32[6, 4] = aten.add.Tensor(t13, t19, alpha=h2)  # capture
  return (t12, t1, t20, t2)
""")

    def test_shampoo_step_between_refreshes(self) -> None:
        self.assertExpectedInline(_summary(_shampoo, AVX2_LIKE, eager_steps=1), """\
passes:
  canonicalize: changed: removed 14 identity/copy ops and 0 dead nodes
  fuse-newton-schulz: unchanged: no Newton-Schulz chain found; declined 2: div_3: the norm is taken of mm_1, not of the matrix linalg_vector_norm it divides ...
  fuse-polar: unchanged: no svd -> U @ Vh found
  fuse-eigenbasis: unchanged: no sort-by-diag(Q^TLQ) -> qr(L Q) found
  fuse-factor-update: changed: fused 4 factor update(s)
  fuse-inverse-root: unchanged: no eigh or coupled-Newton inverse root found
  fuse-two-sided: changed: fused 2 two-sided product(s)
  batch-by-shape: unchanged: test-cpu does not gain from stacking (a loop of mm is as fast there); batching would only add copies and memory
  choose-algorithm: unchanged: no Newton-Schulz op to plan
  choose-precision: unchanged: no Newton-Schulz op to plan
made by passes (6 of 34 ops):
  t8: fp32[4, 4] = hocompile.factor_update(s0_0_left_factor_0, g0_0 @ g0_0^T, addmm, weight=h3, beta=h2)  # fuse-factor-update
  t9: fp32[6, 6] = hocompile.factor_update(s0_0_right_factor_0, g0_0^T @ g0_0, addmm, weight=h3, beta=h2)  # fuse-factor-update
  t10: fp32[4, 6] = hocompile.two_sided(s0_0_left_root_0 @ t1 @ s0_0_right_root_0, left_first)  # fuse-two-sided
  t25: fp32[6, 6] = hocompile.factor_update(s0_1_left_factor_0, g0_1 @ g0_1^T, addmm, weight=h3, beta=h2)  # fuse-factor-update
  t26: fp32[4, 4] = hocompile.factor_update(s0_1_right_factor_0, g0_1^T @ g0_1, addmm, weight=h3, beta=h2)  # fuse-factor-update
  t27: fp32[6, 4] = hocompile.two_sided(s0_1_left_root_0 @ t18 @ s0_1_right_root_0, left_first)  # fuse-two-sided
op counts:
  aten.add.Tensor x6
  aten.addcmul x2
  aten.div.Tensor x8
  aten.lerp.Scalar x2
  aten.linalg_vector_norm x4
  aten.mul.Tensor x4
  aten.sqrt x2
  hocompile.factor_update x4
  hocompile.two_sided x2
""")

    def test_shampoo_refresh_step(self) -> None:
        self.assertExpectedInline(_summary(_shampoo, AVX2_LIKE, eager_steps=2), """\
passes:
  canonicalize: changed: removed 14 identity/copy ops and 0 dead nodes
  fuse-newton-schulz: unchanged: no Newton-Schulz chain found; declined 2: div_5: the norm is taken of mm_3, not of the matrix linalg_vector_norm it divides ...
  fuse-polar: unchanged: no svd -> U @ Vh found
  fuse-eigenbasis: unchanged: no sort-by-diag(Q^TLQ) -> qr(L Q) found
  fuse-factor-update: changed: fused 4 factor update(s)
  fuse-inverse-root: changed: fused 4 inverse root(s)
  fuse-two-sided: changed: fused 2 two-sided product(s)
  batch-by-shape: unchanged: test-cpu does not gain from stacking (a loop of mm is as fast there); batching would only add copies and memory
  choose-algorithm: unchanged: no Newton-Schulz op to plan
  choose-precision: unchanged: no Newton-Schulz op to plan
made by passes (10 of 66 ops):
  t8: fp32[4, 4] = hocompile.factor_update(s0_0_left_factor_0, g0_0 @ g0_0^T, addmm, weight=h3, beta=h2)  # fuse-factor-update
  t10: fp32[4, 4] = hocompile.inverse_root(t9, -1/4, eps=h6, eigh)  # fuse-inverse-root
  t17: fp32[6, 6] = hocompile.factor_update(s0_0_right_factor_0, g0_0^T @ g0_0, addmm, weight=h3, beta=h2)  # fuse-factor-update
  t19: fp32[6, 6] = hocompile.inverse_root(t18, -1/4, eps=h6, eigh)  # fuse-inverse-root
  t26: fp32[4, 6] = hocompile.two_sided(t16 @ t1 @ t25, left_first)  # fuse-two-sided
  t41: fp32[6, 6] = hocompile.factor_update(s0_1_left_factor_0, g0_1 @ g0_1^T, addmm, weight=h3, beta=h2)  # fuse-factor-update
  t43: fp32[6, 6] = hocompile.inverse_root(t42, -1/4, eps=h6, eigh)  # fuse-inverse-root
  t50: fp32[4, 4] = hocompile.factor_update(s0_1_right_factor_0, g0_1^T @ g0_1, addmm, weight=h3, beta=h2)  # fuse-factor-update
  t52: fp32[4, 4] = hocompile.inverse_root(t51, -1/4, eps=h6, eigh)  # fuse-inverse-root
  t59: fp32[6, 4] = hocompile.two_sided(t49 @ t34 @ t58, left_first)  # fuse-two-sided
op counts:
  aten.abs x4
  aten.add.Tensor x6
  aten.addcmul x2
  aten.all x4
  aten.div.Tensor x12
  aten.eq.Tensor x4
  aten.lerp.Scalar x2
  aten.linalg_vector_norm x4
  aten.mul.Tensor x8
  aten.ne.Scalar x4
  aten.sqrt x2
  aten.where.self x4
  hocompile.factor_update x4
  hocompile.inverse_root x4
  hocompile.two_sided x2
""")

    def test_shampoo_newton_refresh_step(self) -> None:
        self.assertExpectedInline(_summary(_shampoo_newton, AVX2_LIKE, eager_steps=2), """\
passes:
  canonicalize: changed: removed 14 identity/copy ops and 0 dead nodes
  fuse-newton-schulz: unchanged: no Newton-Schulz chain found; declined 2: div_5: the norm is taken of mm_25, not of the matrix linalg_vector_norm_2 it divides ...
  fuse-polar: unchanged: no svd -> U @ Vh found
  fuse-eigenbasis: unchanged: no sort-by-diag(Q^TLQ) -> qr(L Q) found
  fuse-factor-update: changed: fused 4 factor update(s)
  fuse-inverse-root: changed: fused 4 inverse root(s)
  fuse-two-sided: changed: fused 2 two-sided product(s)
  batch-by-shape: unchanged: test-cpu does not gain from stacking (a loop of mm is as fast there); batching would only add copies and memory
  choose-algorithm: unchanged: no Newton-Schulz op to plan
  choose-precision: unchanged: no Newton-Schulz op to plan
made by passes (10 of 66 ops):
  t8: fp32[4, 4] = hocompile.factor_update(s0_0_left_factor_0, g0_0 @ g0_0^T, addmm, weight=h3, beta=h2)  # fuse-factor-update
  t10: fp32[4, 4] = hocompile.inverse_root(t9, -1/4, eps=h6, newton x3)  # fuse-inverse-root
  t17: fp32[6, 6] = hocompile.factor_update(s0_0_right_factor_0, g0_0^T @ g0_0, addmm, weight=h3, beta=h2)  # fuse-factor-update
  t19: fp32[6, 6] = hocompile.inverse_root(t18, -1/4, eps=h6, newton x3)  # fuse-inverse-root
  t26: fp32[4, 6] = hocompile.two_sided(t16 @ t1 @ t25, left_first)  # fuse-two-sided
  t41: fp32[6, 6] = hocompile.factor_update(s0_1_left_factor_0, g0_1 @ g0_1^T, addmm, weight=h3, beta=h2)  # fuse-factor-update
  t43: fp32[6, 6] = hocompile.inverse_root(t42, -1/4, eps=h6, newton x3)  # fuse-inverse-root
  t50: fp32[4, 4] = hocompile.factor_update(s0_1_right_factor_0, g0_1^T @ g0_1, addmm, weight=h3, beta=h2)  # fuse-factor-update
  t52: fp32[4, 4] = hocompile.inverse_root(t51, -1/4, eps=h6, newton x3)  # fuse-inverse-root
  t59: fp32[6, 4] = hocompile.two_sided(t49 @ t34 @ t58, left_first)  # fuse-two-sided
op counts:
  aten.abs x4
  aten.add.Tensor x6
  aten.addcmul x2
  aten.all x4
  aten.div.Tensor x12
  aten.eq.Tensor x4
  aten.lerp.Scalar x2
  aten.linalg_vector_norm x4
  aten.mul.Tensor x8
  aten.ne.Scalar x4
  aten.sqrt x2
  aten.where.self x4
  hocompile.factor_update x4
  hocompile.inverse_root x4
  hocompile.two_sided x2
""")
