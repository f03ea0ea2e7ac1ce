"""The parameter lists of frontier MoE models, every dimension divided by a scale factor, every count real.

    from benchmarks.structures import build, specs_for, format_summary
    muon, adamw = build("qwen3", scale=16)                        # CPU tensors, fp32
    muon, adamw = build("kimi-k2", scale=1, device="meta")        # true shapes, no memory
    print(format_summary(specs_for("kimi-k2", scale=16, experts="stacked")))

What shrinks and what stays: a *dimension* (hidden size, head dim, LoRA rank,
intermediate size, vocabulary) becomes ``ceil(d / scale)``, at least 1; a
*count* (layers, experts, attention heads, dense layers) is kept. The router's
output is the expert count, so it stays too (Qwen3's router is [128, 2048/s]).
Head counts are kept and the per-head dims divided, so q_proj's output is
``heads * ceil(head_dim / s)``: the same as ``ceil(heads * head_dim / s)``
whenever s divides the head dims (s <= 64 for both models), and still
``heads`` times the q/k-norm length above that. The point: the number of
params, and how many share a shape, is the real model's; only the shapes
shrink.

Muon or AdamW, as these models are trained with Muon (Moonlight / Kimi K2
style): every 2-D hidden matrix and every expert matrix goes to Muon (with
stacked experts, the 3-D ``[E, m, n]`` weights); embeddings, lm_head, norms
and the router go to AdamW. Neither model has biases (Qwen3 ``attention_bias:
false``; DeepSeek-V3-style layers have none). Kimi K2's router score bias
(``e_score_correction_bias``, 384 per MoE layer) is left out: it is updated by
the load-balancing rule, not by the optimizer (Megatron keeps it as a buffer).

Experts come in both of Megatron's layouts: ``separate`` (one 2-D weight per
expert and projection, as in the HF checkpoints) or ``stacked`` (one
``[E, m, n]`` weight per layer and projection, grouped-GEMM style). Both hold
the same elements. The shared expert of Kimi K2 stays a 2-D weight in both.

Exact counts (any scale; tests/test_structures.py asserts them):

- qwen3, separate: Muon 48 * (4 attention + 128 * 3 experts) = 18,624 matrices;
  AdamW 48 routers + embed + lm_head = 50 matrices and 48 * 4 + 1 = 193 vectors
  (18,674 matrices, 18,867 params).
- qwen3, stacked: Muon 48 * 4 = 192 matrices + 48 * 3 = 144 3-D stacks (336);
  AdamW as above (243): 579 params.
- kimi-k2, separate: Muon 61 * 5 attention + 3 dense MLP + 60 * (384 * 3 + 3 shared)
  = 69,608 matrices; AdamW 60 routers + embed + lm_head = 62 matrices and
  61 * 4 + 1 = 245 vectors (69,670 matrices, 69,915 params).
- kimi-k2, stacked: Muon 305 + 3 + 60 * 3 shared = 488 matrices + 60 * 3 = 180
  3-D stacks (668); AdamW 307: 975 params.

This module imports nothing heavy: specs are plain Python, and ``build``
imports torch only when it makes tensors.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import torch

Layout = Literal["separate", "stacked"]
STRUCTURES = ("small-muon", "small-adamw", "qwen3", "kimi-k2")
MODELS = ("qwen3", "kimi-k2")
DEFAULT_SCALE = 16


@dataclass(frozen=True)
class ParamSpec:
    """One parameter: its HF-style name, shape, what it is, and which optimizer steps it."""

    name: str
    shape: tuple[int, ...]
    kind: str  # attention, mlp, expert, shared_expert, router, norm, embedding, lm_head, synthetic
    optimizer: Literal["muon", "adamw"]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def scaled(dim: int, scale: int) -> int:
    """A dimension divided by ``scale``, rounded up, at least 1."""
    if scale < 1:
        raise ValueError(f"scale must be a positive int, got {scale}")
    return max(1, -(-dim // scale))


# Qwen/Qwen3-30B-A3B, HF config.json (Qwen3MoeForCausalLM), as converted to Megatron flags in
# slime's scripts/models/qwen3-30B-A3B.sh: --num-layers 48 --hidden-size 2048 --num-attention-heads 32
# --num-query-groups 4 --kv-channels 128 --moe-ffn-hidden-size 768 --num-experts 128 --moe-router-topk 8
# --vocab-size 151936 --untie-embeddings-and-output-weights --qk-layernorm --disable-bias-linear
# (config.json: hidden_size 2048, num_hidden_layers 48, num_attention_heads 32, num_key_value_heads 4,
# head_dim 128, moe_intermediate_size 768, num_experts 128, num_experts_per_tok 8, vocab_size 151936,
# tie_word_embeddings false, decoder_sparse_step 1 with mlp_only_layers []: every layer is MoE).
QWEN3 = {
    "layers": 48,
    "hidden": 2048,
    "heads": 32,
    "kv_heads": 4,
    "head_dim": 128,
    "experts": 128,
    "moe_intermediate": 768,
    "vocab": 151936,
}

# moonshotai/Kimi-K2-Instruct, HF config.json (model_type kimi_k2, DeepseekV3ForCausalLM): num_hidden_layers 61,
# first_k_dense_replace 1, hidden_size 7168, intermediate_size 18432 (the dense layer), moe_intermediate_size 2048,
# n_routed_experts 384, n_shared_experts 1, num_experts_per_tok 8, vocab_size 163840 (field table of
# blog.csdn.net/hbkybkzw/article/details/149370789); the MLA dims from slime's scripts/models/kimi-k2.sh
# (Megatron flags converted from the same config): --num-attention-heads 64 --q-lora-rank 1536
# --kv-lora-rank 512 --qk-head-dim 128 (qk_nope_head_dim) --qk-pos-emb-head-dim 64 (qk_rope_head_dim)
# --v-head-dim 128 --moe-shared-expert-intermediate-size 2048 --qk-layernorm --disable-bias-linear
# --untie-embeddings-and-output-weights, FIRST_K_DENSE_REPLACE=1.
KIMI_K2 = {
    "layers": 61,
    "dense_layers": 1,
    "hidden": 7168,
    "dense_intermediate": 18432,
    "heads": 64,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "experts": 384,
    "shared_experts": 1,
    "moe_intermediate": 2048,
    "vocab": 163840,
}


def _experts(prefix: str, count: int, inter: int, hidden: int, experts: Layout) -> list[ParamSpec]:
    """SwiGLU experts: gate/up [inter, hidden] and down [hidden, inter], per expert or stacked [E, m, n]."""
    if experts == "stacked":
        return [
            ParamSpec(f"{prefix}.gate_proj", (count, inter, hidden), "expert", "muon"),
            ParamSpec(f"{prefix}.up_proj", (count, inter, hidden), "expert", "muon"),
            ParamSpec(f"{prefix}.down_proj", (count, hidden, inter), "expert", "muon"),
        ]
    specs = []
    for e in range(count):
        specs += [
            ParamSpec(f"{prefix}.{e}.gate_proj.weight", (inter, hidden), "expert", "muon"),
            ParamSpec(f"{prefix}.{e}.up_proj.weight", (inter, hidden), "expert", "muon"),
            ParamSpec(f"{prefix}.{e}.down_proj.weight", (hidden, inter), "expert", "muon"),
        ]
    return specs


def _check_layers(layers: int | None, total: int) -> int:
    if layers is None:
        return total
    if not 1 <= layers <= total:
        raise ValueError(f"layers must be in 1..{total}, got {layers}")
    return layers


def qwen3_30b_a3b(
    scale: int = DEFAULT_SCALE, experts: Layout = "separate", layers: int | None = None
) -> list[ParamSpec]:
    """Qwen3-30B-A3B's params (HF names), dims divided by ``scale``; ``layers`` keeps only the first ones."""
    c = QWEN3
    d, hd = scaled(c["hidden"], scale), scaled(c["head_dim"], scale)
    q_out, kv_out = c["heads"] * hd, c["kv_heads"] * hd
    inter, vocab = scaled(c["moe_intermediate"], scale), scaled(c["vocab"], scale)
    specs = [ParamSpec("model.embed_tokens.weight", (vocab, d), "embedding", "adamw")]
    for i in range(_check_layers(layers, c["layers"])):
        p = f"model.layers.{i}"
        specs += [
            ParamSpec(f"{p}.input_layernorm.weight", (d,), "norm", "adamw"),
            ParamSpec(f"{p}.self_attn.q_proj.weight", (q_out, d), "attention", "muon"),
            ParamSpec(f"{p}.self_attn.k_proj.weight", (kv_out, d), "attention", "muon"),
            ParamSpec(f"{p}.self_attn.v_proj.weight", (kv_out, d), "attention", "muon"),
            ParamSpec(f"{p}.self_attn.o_proj.weight", (d, q_out), "attention", "muon"),
            ParamSpec(f"{p}.self_attn.q_norm.weight", (hd,), "norm", "adamw"),
            ParamSpec(f"{p}.self_attn.k_norm.weight", (hd,), "norm", "adamw"),
            ParamSpec(f"{p}.post_attention_layernorm.weight", (d,), "norm", "adamw"),
            ParamSpec(f"{p}.mlp.gate.weight", (c["experts"], d), "router", "adamw"),
        ]
        specs += _experts(f"{p}.mlp.experts", c["experts"], inter, d, experts)
    specs += [
        ParamSpec("model.norm.weight", (d,), "norm", "adamw"),
        ParamSpec("lm_head.weight", (vocab, d), "lm_head", "adamw"),
    ]
    return specs


def kimi_k2(scale: int = DEFAULT_SCALE, experts: Layout = "separate", layers: int | None = None) -> list[ParamSpec]:
    """Kimi K2's params (HF DeepseekV3 names), dims divided by ``scale``; ``layers`` keeps only the first ones."""
    c = KIMI_K2
    d, q_rank, kv_rank = scaled(c["hidden"], scale), scaled(c["q_lora_rank"], scale), scaled(c["kv_lora_rank"], scale)
    nope, rope, v = (scaled(c[k], scale) for k in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))
    heads, vocab = c["heads"], scaled(c["vocab"], scale)
    specs = [ParamSpec("model.embed_tokens.weight", (vocab, d), "embedding", "adamw")]
    for i in range(_check_layers(layers, c["layers"])):
        p = f"model.layers.{i}"
        specs += [
            ParamSpec(f"{p}.input_layernorm.weight", (d,), "norm", "adamw"),
            ParamSpec(f"{p}.self_attn.q_a_proj.weight", (q_rank, d), "attention", "muon"),
            ParamSpec(f"{p}.self_attn.q_a_layernorm.weight", (q_rank,), "norm", "adamw"),
            ParamSpec(f"{p}.self_attn.q_b_proj.weight", (heads * (nope + rope), q_rank), "attention", "muon"),
            ParamSpec(f"{p}.self_attn.kv_a_proj_with_mqa.weight", (kv_rank + rope, d), "attention", "muon"),
            ParamSpec(f"{p}.self_attn.kv_a_layernorm.weight", (kv_rank,), "norm", "adamw"),
            ParamSpec(f"{p}.self_attn.kv_b_proj.weight", (heads * (nope + v), kv_rank), "attention", "muon"),
            ParamSpec(f"{p}.self_attn.o_proj.weight", (d, heads * v), "attention", "muon"),
            ParamSpec(f"{p}.post_attention_layernorm.weight", (d,), "norm", "adamw"),
        ]
        if i < c["dense_layers"]:
            dense = scaled(c["dense_intermediate"], scale)
            specs += [
                ParamSpec(f"{p}.mlp.gate_proj.weight", (dense, d), "mlp", "muon"),
                ParamSpec(f"{p}.mlp.up_proj.weight", (dense, d), "mlp", "muon"),
                ParamSpec(f"{p}.mlp.down_proj.weight", (d, dense), "mlp", "muon"),
            ]
            continue
        inter = scaled(c["moe_intermediate"], scale)
        specs.append(ParamSpec(f"{p}.mlp.gate.weight", (c["experts"], d), "router", "adamw"))
        specs += _experts(f"{p}.mlp.experts", c["experts"], inter, d, experts)
        # n_shared_experts=1: one MLP of n_shared_experts * moe_intermediate_size, a 2-D weight in both layouts
        shared = c["shared_experts"] * inter
        specs += [
            ParamSpec(f"{p}.mlp.shared_experts.gate_proj.weight", (shared, d), "shared_expert", "muon"),
            ParamSpec(f"{p}.mlp.shared_experts.up_proj.weight", (shared, d), "shared_expert", "muon"),
            ParamSpec(f"{p}.mlp.shared_experts.down_proj.weight", (d, shared), "shared_expert", "muon"),
        ]
    specs += [
        ParamSpec("model.norm.weight", (d,), "norm", "adamw"),
        ParamSpec("lm_head.weight", (vocab, d), "lm_head", "adamw"),
    ]
    return specs


SMALL_SHAPES = ((32, 64), (64, 32), (64, 64))


def small_muon(n: int) -> list[ParamSpec]:
    """N small matrices cycling 32x64 / 64x32 / 64x64, all for Muon."""
    return [ParamSpec(f"w{i}", SMALL_SHAPES[i % 3], "synthetic", "muon") for i in range(n)]


def small_adamw(n: int) -> list[ParamSpec]:
    """AdamW over N matrices cycling 32x64 / 64x32 / 64x64 plus N // 4 vectors of 64."""
    mats = [ParamSpec(f"w{i}", SMALL_SHAPES[i % 3], "synthetic", "adamw") for i in range(n)]
    return mats + [ParamSpec(f"b{i}", (64,), "synthetic", "adamw") for i in range(n // 4)]


def specs_for(
    structure: str,
    *,
    scale: int = DEFAULT_SCALE,
    experts: Layout = "separate",
    n: int | None = None,
    layers: int | None = None,
) -> list[ParamSpec]:
    """The specs of one structure: ``n`` for the small ones; ``scale``, ``experts``, ``layers`` for the models."""
    if structure in ("small-muon", "small-adamw"):
        if n is None or n < 1:
            raise ValueError(f"{structure} needs n >= 1, got {n}")
        return small_muon(n) if structure == "small-muon" else small_adamw(n)
    if experts not in ("separate", "stacked"):
        raise ValueError(f"experts must be 'separate' or 'stacked', got {experts!r}")
    if structure == "qwen3":
        return qwen3_30b_a3b(scale, experts, layers)
    if structure == "kimi-k2":
        return kimi_k2(scale, experts, layers)
    raise ValueError(f"structure must be one of {STRUCTURES}, got {structure!r}")


def split(specs: Sequence[ParamSpec]) -> tuple[list[ParamSpec], list[ParamSpec]]:
    """(Muon specs, AdamW specs)."""
    return [s for s in specs if s.optimizer == "muon"], [s for s in specs if s.optimizer == "adamw"]


def summary(specs: Sequence[ParamSpec]) -> list[tuple[str, tuple[int, ...], int, dict[str, int]]]:
    """(optimizer, shape, count, count per kind) per shape class, Muon first, largest count first.

    A shape class is what class stamping groups: same optimizer, shape (and, here, dtype and state
    layout, which every param of one optimizer shares), whatever the param is called.
    """
    classes: dict[tuple[str, tuple[int, ...]], Counter[str]] = {}
    for s in specs:
        classes.setdefault((s.optimizer, s.shape), Counter())[s.kind] += 1
    rows = [(opt, shape, sum(kinds.values()), dict(kinds)) for (opt, shape), kinds in classes.items()]
    return sorted(rows, key=lambda r: (r[0] != "muon", -r[2], r[1]))


def format_summary(specs: Sequence[ParamSpec]) -> str:
    """A printable table of :func:`summary`, with totals per optimizer."""
    lines = []
    for opt in ("muon", "adamw"):
        mine = [s for s in specs if s.optimizer == opt]
        if not mine:
            continue
        rank = Counter(len(s.shape) for s in mine)
        lines.append(
            f"{opt}: {len(mine)} params ({rank[2]} matrices, {rank[3]} 3-D stacks, {rank[1]} vectors) in "
            f"{len(summary(mine))} shape classes, {sum(s.numel for s in mine):,} elements"
        )
        for _, shape, n, kinds in summary(mine):
            named = ", ".join(f"{kind} {k}" for kind, k in sorted(kinds.items())) if len(kinds) > 1 else [*kinds][0]
            lines.append(f"  {n:6d} x {'x'.join(map(str, shape)):<14} {named}")
    return "\n".join(lines)


def footprint_bytes(specs: Sequence[ParamSpec], element_size: int) -> dict[str, int]:
    """Bytes of params, grads and optimizer state: Muon keeps one momentum buffer, AdamW two moments
    (its step counters are a few bytes per param and not counted)."""
    muon, adamw = split(specs)
    params = sum(s.numel for s in specs) * element_size
    state = (sum(s.numel for s in muon) + 2 * sum(s.numel for s in adamw)) * element_size
    return {"params": params, "grads": params, "state": state}


def initial_values(specs: Sequence[ParamSpec], seed: int = 0) -> Iterator[torch.Tensor]:
    """The fp32 CPU values :func:`materialize` starts from (randn * 0.02, one seeded stream), one at a time."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    for s in specs:
        yield torch.randn(s.shape, generator=gen, dtype=torch.float32).mul_(0.02)


def materialize(
    specs: Sequence[ParamSpec],
    *,
    device: str = "cpu",
    dtype: torch.dtype | None = None,
    seed: int = 0,
) -> list[torch.Tensor]:
    """Parameters for ``specs`` as ``torch.nn.Parameter``: :func:`initial_values`, or empty ones on ``meta``."""
    import torch

    dtype = dtype or torch.float32
    if device == "meta":
        return [torch.nn.Parameter(torch.empty(s.shape, device="meta", dtype=dtype)) for s in specs]
    return [torch.nn.Parameter(v.to(device=device, dtype=dtype)) for v in initial_values(specs, seed)]


def build(
    structure: str,
    *,
    scale: int = DEFAULT_SCALE,
    experts: Layout = "separate",
    n: int | None = None,
    layers: int | None = None,
    device: str = "cpu",
    dtype: torch.dtype | None = None,
    seed: int = 0,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(muon_params, adamw_params) of a structure; see :func:`specs_for` and :func:`materialize`."""
    muon, adamw = split(specs_for(structure, scale=scale, experts=experts, n=n, layers=layers))
    return (
        materialize(muon, device=device, dtype=dtype, seed=seed),
        materialize(adamw, device=device, dtype=dtype, seed=seed + 1),
    )
