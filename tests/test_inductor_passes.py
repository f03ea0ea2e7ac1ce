"""hocompile's passes inside Inductor (hocompile/dynamo/inductor.py): a whole train step (forward,
backward, Muon + AdamW steps) under plain ``torch.compile`` with ``hocompile.inductor_passes()``
installed gets its Newton–Schulz chains fused into ``hocompile::newton_schulz`` inside Inductor's
graph, trains as eager does (within the demo's NS tolerance), and Inductor's FX-graph cache key
changes when hocompile's plan does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters

import hocompile
from hocompile.dynamo import last_records
from hocompile.dynamo.last import compiled_graphs

V, D, S, B = 32, 16, 8, 4
REL_TOL = 2e-2  # examples/tiny_transformer.py's tolerance for NS-fused losses


class Tiny(nn.Module):
    """One pre-norm attention + MLP block over a small vocabulary."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.ln = nn.Embedding(V, D), nn.LayerNorm(D)
        self.qkv, self.out = nn.Linear(D, 3 * D, bias=False), nn.Linear(D, D, bias=False)
        self.up, self.down = nn.Linear(D, 2 * D, bias=False), nn.Linear(2 * D, D, bias=False)
        self.head = nn.Linear(D, V, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        q, k, v = self.qkv(self.ln(h)).view(B, S, 3, 2, D // 2).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        h = h + self.out(a.transpose(1, 2).reshape(B, S, D))
        return self.head(h + self.down(F.gelu(self.up(h))))


def _trainer() -> tuple[Any, Tiny]:
    torch.manual_seed(0)
    model = Tiny()
    hidden = [model.qkv.weight, model.out.weight, model.up.weight, model.down.weight]
    rest = [p for p in model.parameters() if all(p is not q for q in hidden)]
    # tensor lrs: Dynamo guards on Python floats (a schedule would recompile)
    muon = torch.optim.Muon(hidden, lr=torch.tensor(0.02))
    adamw = torch.optim.AdamW(rest, lr=torch.tensor(1e-2))

    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(model(x).view(-1, V), y.view(-1))
        loss.backward()
        muon.step()
        adamw.step()
        muon.zero_grad()
        adamw.zero_grad()
        return loss.detach()

    return train_step, model


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        start = torch.randint(0, V, (B, 1), generator=gen)
        stride = torch.randint(1, 4, (B, 1), generator=gen)
        x = (start + stride * torch.arange(S)) % V
        out.append((x, (x + stride) % V))
    return out


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Any:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_whole_train_step_gets_ns_fused_inside_inductor(cache_dir: Path) -> None:
    batches = _batches(100)
    eager_step, _ = _trainer()
    eager = [float(eager_step(x, y)) for x, y in batches]
    step, _ = _trainer()
    pre, post = hocompile.inductor_passes(cache_dir=cache_dir)
    patch = {"post_grad_custom_pre_pass": pre, "post_grad_custom_post_pass": post, "fx_graph_cache": False}
    before = compiled_graphs()
    with torch._inductor.config.patch(patch), torch._functorch.config.patch(enable_autograd_cache=False):
        compiled = torch.compile(step)  # (no cache: a hit would skip the passes)
        losses = [float(compiled(x, y)) for x, y in batches]
    records = last_records(compiled_graphs() - before)
    fused = [r for r in records if r.route == "inductor pass" and r.after.get("newton-schulz")]
    assert len(fused) == 1, hocompile.explain_last(8, graph=False)
    assert fused[0].after["newton-schulz"] == 4 and fused[0].after["matmuls"] == 0, hocompile.explain_last()
    assert "4 hocompile ops" in fused[0].lowering, fused[0].lowering  # still there after Inductor's passes
    assert losses[-1] < 0.5 * losses[0], losses[::10]  # it trains
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, eager))
    assert worst <= REL_TOL, f"losses differ from eager by {worst:.2e} relative"


def _muon_step() -> Any:
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in [(16, 8), (8, 16)]]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    return torch.optim.Muon(params, lr=torch.tensor(0.02)).step


def test_inductor_cache_key_follows_the_plan(cache_dir: Path, tmp_path: Path, monkeypatch: Any) -> None:
    """Same plan: Inductor's FX-graph cache hits; another plan (NS fusion off): a miss, compiled afresh."""
    same = hocompile.inductor_passes(cache_dir=cache_dir)
    assert same.pre.uuid() == hocompile.inductor_passes(cache_dir=cache_dir).pre.uuid()
    off = hocompile.inductor_passes(cache_dir=cache_dir, disable_passes=["fuse-newton-schulz"])
    fp32 = hocompile.inductor_passes(cache_dir=cache_dir, precision="fp32")
    assert len({same.pre.uuid(), off.pre.uuid(), fp32.pre.uuid()}) == 3
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    misses = []
    for passes in (same, same, off):
        torch._dynamo.reset()
        before = counters["inductor"]["fxgraph_cache_miss"]
        patch = {"post_grad_custom_pre_pass": passes.pre, "fx_graph_cache": True}
        with torch._inductor.config.patch(patch):
            torch.compile(_muon_step())()
        misses.append(counters["inductor"]["fxgraph_cache_miss"] - before)
    assert misses == [1, 0, 1], misses
