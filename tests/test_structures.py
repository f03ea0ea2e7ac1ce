"""benchmarks/structures.py: the frontier parameter lists have the documented counts (meta tensors, fast)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from benchmarks.structures import Layout, build, footprint_bytes, scaled, specs_for, split, summary

# (muon params, adamw params, 2-D matrices in all, 3-D stacks) per structure and layout; structures.py derives them.
COUNTS = {
    ("qwen3", "separate"): (48 * (4 + 128 * 3), 48 + 2 + 48 * 4 + 1, 48 * (4 + 128 * 3) + 48 + 2, 0),
    ("qwen3", "stacked"): (48 * (4 + 3), 48 + 2 + 48 * 4 + 1, 48 * 4 + 48 + 2, 48 * 3),
    ("kimi-k2", "separate"): (61 * 5 + 3 + 60 * (384 * 3 + 3), 60 + 2 + 61 * 4 + 1, 69608 + 62, 0),
    ("kimi-k2", "stacked"): (61 * 5 + 3 + 60 * 6, 60 + 2 + 61 * 4 + 1, 61 * 5 + 3 + 60 * 3 + 62, 60 * 3),
}


@pytest.mark.parametrize("structure,experts", sorted(COUNTS))
def test_counts_at_scale_64_on_meta(structure: str, experts: Layout) -> None:
    muon, adamw = build(structure, scale=64, experts=experts, device="meta")
    n_muon, n_adamw, matrices, stacks = COUNTS[structure, experts]
    assert (len(muon), len(adamw)) == (n_muon, n_adamw)
    ranks = Counter(p.ndim for p in muon + adamw)
    assert (ranks[2], ranks[3]) == (matrices, stacks)
    assert all(p.device.type == "meta" for p in muon + adamw)
    assert all(p.ndim >= 2 for p in muon) and all(p.ndim <= 2 for p in adamw)


def test_documented_totals() -> None:
    assert len(specs_for("qwen3")) == 18867 and sum(len(s.shape) == 2 for s in specs_for("qwen3")) == 18674
    assert len(specs_for("kimi-k2")) == 69915 and sum(len(s.shape) == 2 for s in specs_for("kimi-k2")) == 69670


@pytest.mark.parametrize("structure", ["qwen3", "kimi-k2"])
@pytest.mark.parametrize("scale", [1, 64])
def test_layouts_hold_the_same_elements(structure: str, scale: int) -> None:
    separate, stacked = (specs_for(structure, scale=scale, experts=e) for e in ("separate", "stacked"))
    assert sum(s.numel for s in separate) == sum(s.numel for s in stacked)
    assert footprint_bytes(separate, 4) == footprint_bytes(stacked, 4)


def test_true_shapes() -> None:
    qwen = {s.name: s.shape for s in specs_for("qwen3", scale=1)}
    assert qwen["model.layers.0.self_attn.q_proj.weight"] == (4096, 2048)
    assert qwen["model.layers.0.self_attn.k_proj.weight"] == (512, 2048)
    assert qwen["model.layers.0.mlp.gate.weight"] == (128, 2048)
    assert qwen["model.layers.47.mlp.experts.127.down_proj.weight"] == (2048, 768)
    assert qwen["lm_head.weight"] == (151936, 2048)
    kimi = {s.name: s.shape for s in specs_for("kimi-k2", scale=1)}
    assert kimi["model.layers.0.mlp.gate_proj.weight"] == (18432, 7168)
    assert kimi["model.layers.1.self_attn.q_b_proj.weight"] == (12288, 1536)
    assert kimi["model.layers.1.self_attn.kv_a_proj_with_mqa.weight"] == (576, 7168)
    assert kimi["model.layers.1.self_attn.kv_b_proj.weight"] == (16384, 512)
    assert kimi["model.layers.1.self_attn.o_proj.weight"] == (7168, 8192)
    assert kimi["model.layers.60.mlp.gate.weight"] == (384, 7168)
    assert kimi["model.layers.60.mlp.experts.383.up_proj.weight"] == (2048, 7168)
    assert kimi["model.embed_tokens.weight"] == (163840, 7168)
    # true scale: ~30.5B and ~1.03T elements (Kimi's MTP layer is not part of the trained step's params here)
    assert sum(s.numel for s in specs_for("qwen3", scale=1)) == 30_532_122_624
    assert sum(s.numel for s in specs_for("kimi-k2", scale=1)) == 1_026_408_209_408


def test_scale_16_classes() -> None:
    muon, _ = split(specs_for("qwen3", scale=16))
    assert [(shape, n) for _, shape, n, _ in summary(muon)] == [
        ((48, 128), 12288), ((128, 48), 6144), ((32, 128), 96), ((128, 256), 48), ((256, 128), 48)
    ]
    assert scaled(64, 128) == 1 and scaled(2048, 16) == 128 and scaled(151936, 64) == 2374


def test_small_structures() -> None:
    muon, adamw = build("small-muon", n=6, device="meta")
    assert [tuple(p.shape) for p in muon] == [(32, 64), (64, 32), (64, 64)] * 2 and adamw == []
    muon, adamw = build("small-adamw", n=8)
    assert muon == [] and len(adamw) == 8 + 2 and adamw[-1].shape == (64,)
    assert adamw[0].dtype == torch.float32 and float(adamw[0].detach().abs().max()) > 0
