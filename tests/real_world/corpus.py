"""The corpus: one :class:`Case` per real-world Muon pattern, with what hocompile owes it.

Shared by tests/test_real_world_muon.py (asserts the contract) and
benchmarks/real_world_muon.py (tabulates the measurements). Every case runs on
the same tiny parameters: a 16×32 (wide), a 32×16 (tall) and a 24×24 matrix,
plus an (8,) bias for the optimizers that also take 1-D params.

``refusal`` says whether a ``CaptureError`` is an acceptable outcome: ``None``
means nothing in the step justifies refusing it (it must compile); otherwise
a regex the refusal message must match, naming the legitimate reason (a value
read on the host, a collective, an object that is not an Optimizer).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from . import (
    combined,
    dion,
    heavyball_matched,
    keller_jordan,
    kozistr,
    modded_nanogpt,
    moonlight,
    muon_clip,
    nanochat,
    normuon,
    polar_express,
)

CORPUS_MODULES = (
    combined, dion, heavyball_matched, keller_jordan, kozistr, modded_nanogpt, moonlight, muon_clip, nanochat,
    normuon, polar_express,
)

MATRICES = ((16, 32), (32, 16), (24, 24))
BIAS = (8,)


@dataclass(frozen=True)
class Case:
    name: str  # "module.Class"
    mirrors: str  # the public implementation
    pattern: str  # what it exercises
    build: Callable[[list[torch.nn.Parameter]], Any]
    ns_module: ModuleType  # holds NS_DTYPE (float64 there gives the exact-NS trajectory)
    shapes: tuple[tuple[int, ...], ...] = MATRICES
    ns_ops: int = 3  # Newton–Schulz calls per step in eager (one per matrix, or per stack)
    refusal: str | None = None
    distributed: bool = False  # needs a (one-rank) process group
    before_step: Callable[[Any, int], None] | None = None  # what the training loop does between steps
    scratch: frozenset[str] = frozenset()  # group keys holding scratch buffers, not compared
    # Recompiles the case's own code explains (each pipeline may have one of each), by reason text
    expected_recompiles: tuple[str, ...] = ()

    @property
    def id(self) -> str:
        return self.name

    def refusal_ok(self, message: str) -> bool:
        return self.refusal is not None and re.search(self.refusal, message) is not None


def _muon_aux_groups(ps: list[torch.nn.Parameter], **adam: Any) -> list[dict[str, Any]]:
    matrices, vectors = [p for p in ps if p.ndim >= 2], [p for p in ps if p.ndim < 2]
    return [
        dict(params=matrices, use_muon=True, lr=0.02, weight_decay=0.01),
        dict(params=vectors, use_muon=False, lr=3e-3, weight_decay=0.01, **adam),
    ]


def _nanochat_groups(ps: list[torch.nn.Parameter]) -> list[dict[str, Any]]:
    muon = dict(kind="muon", lr=0.02, momentum=0.95, ns_steps=5, beta2=0.95, weight_decay=0.01)
    by_shape: dict[torch.Size, list[torch.nn.Parameter]] = {}
    for p in ps:
        if p.ndim >= 2:
            by_shape.setdefault(p.shape, []).append(p)
    groups = [dict(params=same, **muon) for same in by_shape.values()]
    groups.append(dict(kind="adamw", params=[p for p in ps if p.ndim < 2], lr=3e-3, betas=(0.8, 0.95), eps=1e-10,
                       weight_decay=0.01))
    return groups


def _modded_normuon(ps: list[torch.nn.Parameter]) -> modded_nanogpt.NorMuonAndAdam:
    labels = ["attn_qkv", "mlp_proj", "attn_out", "scalars"]
    for p, label in zip(ps, labels):
        p.label = label  # type: ignore[attr-defined]
    table = {label: {"optim": "normuon"} for label in labels[:3]}
    table["scalars"] = {"optim": "adam", "adam_betas": [0.9, 0.99], "lr_mul": 5.0, "wd_mul": 0.0}
    return modded_nanogpt.NorMuonAndAdam(
        [(label, p) for label, p in zip(labels, ps)], table,
        adam_defaults=dict(lr=0.008, weight_decay=0.005, eps=1e-10),
        normuon_defaults=dict(lr=0.02, weight_decay=0.01, momentum=0.95, beta2=0.95),
    )


def _muon_clip(ps: list[torch.nn.Parameter]) -> muon_clip.MuonClip:
    # w_q: the 24×24 matrix, w_k: the 32×16 one; two heads.
    return muon_clip.MuonClip(ps, w_q=ps[2], w_k=ps[1], max_logits=torch.zeros(2), lr=0.02, weight_decay=0.01)


def _attention_logits(opt: Any, step: int) -> None:
    # What the forward pass records: head 0 crosses the threshold from step 3 on, head 1 never.
    opt.max_logits.copy_(torch.tensor([70.0 + 10.0 * step, 40.0]))


def _kj_single(ps: list[torch.nn.Parameter]) -> keller_jordan.SingleDeviceMuon:
    return keller_jordan.SingleDeviceMuon(ps, lr=0.02, weight_decay=0.01)


_COLLECTIVE = r"all_gather|reduce_scatter|collective|distributed|c10d"
_NOT_AN_OPTIMIZER = r"torch\.optim\.Optimizer"
_HOST_READ = r"(\.item\(\)|on the host|data-dependent|bool\(\)|value of a tensor)"
# Known limitation, documented: tensors the step reads from containers hocompile does
# not substitute (views of a buffer kept in a list in a group; tensors cached lazily in a
# dict attribute). Faking them one by one would break their aliasing, so capture refuses.

CASES: list[Case] = [
    Case("keller_jordan.SingleDeviceMuon", "KellerJordan/Muon muon.py", "plain KJ Muon: muon_update helper, "
         "grad.lerp_ in place, None grads zero-filled", _kj_single, keller_jordan),
    Case("keller_jordan.SingleDeviceMuonWithAuxAdam", "KellerJordan/Muon muon.py", "mixed use_muon groups "
         "(1-D Adam beside Muon), int state['step'], host bias corrections",
         lambda ps: keller_jordan.SingleDeviceMuonWithAuxAdam(_muon_aux_groups(ps)), keller_jordan,
         shapes=MATRICES + (BIAS,)),
    Case("keller_jordan.Muon", "KellerJordan/Muon muon.py", "dist.all_gather of every param after each round "
         "(one rank), padded param list",
         lambda ps: keller_jordan.Muon(ps, lr=0.02, weight_decay=0.01), keller_jordan,
         refusal=_COLLECTIVE, distributed=True),
    Case("keller_jordan.MuonWithAuxAdam", "KellerJordan/Muon muon.py", "distributed Muon + Adam groups, "
         "params sorted by size", lambda ps: keller_jordan.MuonWithAuxAdam(_muon_aux_groups(ps)), keller_jordan,
         shapes=MATRICES + (BIAS,), refusal=_COLLECTIVE, distributed=True),
    Case("moonlight.Muon", "MoonshotAI/Moonlight examples/toy_train.py", "@torch.compile NS (2-D, X.T, "
         "whole-matrix norm); use_muon bool in state; one group mixing 1-D and 2-D; math.sqrt of shapes; "
         "-lr / (bc1 / bc2**0.5)",
         lambda ps: moonlight.Muon(lr=2e-3, wd=0.1, muon_params=ps[:3], adamw_params=ps[3:]), moonlight,
         shapes=MATRICES + (BIAS,)),
    Case("nanochat.MuonAdamW", "karpathy/nanochat nanochat/optim.py", "0-D CPU tensor attributes fill_-ed "
         "from groups; @torch.compile(fullgraph) fused kernels; stacked same-shape params; Polar Express "
         "[:ns_steps], safety factor 1.01, tall XᵀX branch; NorMuon; cautious WD",
         lambda ps: nanochat.MuonAdamW(_nanochat_groups(ps)), nanochat,
         shapes=((16, 32), (16, 32), (32, 16), (24, 24), BIAS)),
    Case("nanochat.DistMuon", "karpathy/nanochat nanochat/muon.py", "async reduce_scatter(AVG) + all_gather "
         "futures; zero_buffer tensor in each group; @torch.compile NS",
         lambda ps: nanochat.DistMuon(ps, lr=0.02), nanochat, refusal=_COLLECTIVE, distributed=True),
    Case("kozistr.Muon", "kozistr/pytorch_optimizer optimizer/muon.py", "addmm/baddbmm(out=) NS with "
         "beta=0.0, in-place safety-factor norm; group['step'] += 1; math.sqrt(debias); use_muon groups",
         lambda ps: kozistr.Muon(_muon_aux_groups(ps)), kozistr, shapes=MATRICES + (BIAS,)),
    Case("kozistr.AdaMuon", "kozistr/pytorch_optimizer optimizer/muon.py", "second moment on the flattened "
         "NS output; update.norm() rescale; 0.2*math.sqrt(numel)",
         lambda ps: kozistr.AdaMuon(_muon_aux_groups(ps)), kozistr, shapes=MATRICES + (BIAS,)),
    Case("kozistr.AdaGO", "kozistr/pytorch_optimizer optimizer/muon.py", "min(grad.norm()**2, gamma**2) in "
         "Python; step size max(eps, ...).item(); 0-D state tensor 'v'",
         lambda ps: kozistr.AdaGO(_muon_aux_groups(ps), eps=1e-8), kozistr, shapes=MATRICES + (BIAS,),
         refusal=_HOST_READ + r"[\s\S]*kozistr\.py"),
    Case("modded_nanogpt.Muon", "KellerJordan/modded-nanogpt train_gpt.py (early 2025)", "update_buffer "
         "tensors in param groups; async all_gather_into_tensor; closure applies the previous round; "
         "groups by numel", lambda ps: modded_nanogpt.Muon(ps, lr=0.02), modded_nanogpt,
         refusal=r"update_buffer_views'\]\[0\] shares memory with", distributed=True,
         scratch=frozenset({"update_buffer", "update_buffer_views"})),
    Case("modded_nanogpt.NorMuonAndAdam", "KellerJordan/modded-nanogpt train_gpt.py (current)", "not an "
         "Optimizer: per-param configs by label; Polar Express with out= buffers, (1+2e-2) safety, tall "
         "addmm(X, X, B); grads cleared in step", _modded_normuon, modded_nanogpt,
         shapes=MATRICES + (BIAS,), refusal=_NOT_AN_OPTIMIZER),
    Case("normuon.SingleDeviceNorMuonWithAuxAdam", "zichongli5/NorMuon normuon.py", "row-wise second moment "
         "p[..., 0:1]; norm-preserving rescale; `if group['weight_decay'] and had_grad`",
         lambda ps: normuon.SingleDeviceNorMuonWithAuxAdam(_muon_aux_groups(ps, betas=(0.9, 0.95), eps=1e-10)),
         normuon, shapes=MATRICES + (BIAS,)),
    Case("dion.Muon", "microsoft/dion dion/muon.py", "Tensor lr kept in the group; torch.tensor(group['mu']) "
         "per step; @torch.compile foreach helpers; stacked NS with 5 distinct coefficient triples",
         lambda ps: dion.Muon([dict(params=ps[:3]), dict(params=ps[3:], algorithm="adamw", lr=3e-3)], lr=0.02,
                              weight_decay=0.01), dion, shapes=MATRICES + (BIAS,),
         # load_state_dict gives each group a new lr tensor, no longer the one dion caches in
         # _hyperparam_tensors: its step takes the copy_ branch from then on (a new program, once)
         expected_recompiles=("other inputs' tensors than when compiled",)),
    Case("polar_express.PolarExpressMuon", "NoahAmsel/PolarExpress (arXiv:2505.16932)", "coefficients "
         "divided by safety powers, norm * 1.01 + 1e-7, repeat-last schedule, @torch.compile, cast back",
         lambda ps: polar_express.PolarExpressMuon(ps, lr=0.02, weight_decay=0.01), polar_express),
    Case("heavyball_matched.Muon", "HeavyBall-matched simple Muon (heavyball utils NS)", "fp32 NS; Horner "
         "form with diagonal().add_ (regrouped products); clamp(norm) without keepdim; 1-D params in the group",
         lambda ps: heavyball_matched.Muon(ps, lr=0.02, weight_decay=0.01), heavyball_matched,
         # fp32 Horner form (a·I + B)·X is declined by fuse-newton-schulz: the op's a·X + B·X is
         # 1.5-2x less accurate in fp32, outside the 1.25x budget. It compiles unfused, bitwise.
         shapes=MATRICES + (BIAS,), ns_ops=0),
    Case("muon_clip.MuonClip", "Kimi K2 QK-Clip (Megatron-LM qk_clip.py)", "per-head max logit .item() in "
         "a Python if after the Muon update; tensor attribute written by the forward pass", _muon_clip, muon_clip,
         before_step=_attention_logits),
    Case("combined.CombinedOptimizer", "nanochat-style training code; modded-nanogpt [adam, muon]", "not an "
         "Optimizer: owns a Muon and an AdamW, steps both",
         lambda ps: combined.CombinedOptimizer(_kj_single(ps[:3]), torch.optim.AdamW(ps[3:], lr=3e-3)),
         keller_jordan, shapes=MATRICES + (BIAS,), refusal=_NOT_AN_OPTIMIZER),
    Case("combined.TrainerCombinedOptimizer", "HF Trainer wrappers around Muon + AdamW", "an Optimizer "
         "whose step delegates to two owned optimizers sharing its group dicts",
         lambda ps: combined.TrainerCombinedOptimizer(muon=_kj_single(ps[:3]),
                                                      aux=torch.optim.AdamW(ps[3:], lr=3e-3)),
         keller_jordan, shapes=MATRICES + (BIAS,), refusal=r"\bmuon\b|\baux\b|SingleDeviceMuon|AdamW|owned|nested"),
]
