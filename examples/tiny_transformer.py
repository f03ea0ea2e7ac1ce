"""Train a tiny transformer with eager vs. hocompile-compiled optimizers, side by side.

This is the ``make demo`` example. It shows that ``hocompile.compile_optimizer`` is a
drop-in replacement for a stock PyTorch optimizer:

* a tiny decoder-only transformer (vocab 64, d_model 64, 2 layers, 4 heads, seq 32,
  batch 16; plain ``torch.nn``, nothing downloaded) learns synthetic arithmetic
  sequences (random start, random stride) generated deterministically from a fixed
  ``torch.Generator`` seed;
* the 2-D hidden matrices (attention / MLP weights) use ``torch.optim.Muon`` and
  everything else (embeddings, output head, norms, biases) uses ``torch.optim.AdamW``;
* both Muon optimizers carry a ``LambdaLR`` schedule (linear warmup, then cosine), so
  the compiled optimizer must honour learning-rate changes made from outside;
* two identical copies of the model (``copy.deepcopy``) see the same batches; one is
  stepped by the eager optimizers, the other by ``hocompile.compile_optimizer(...)``
  applied to each of the two optimizers.

Every 10 steps it prints both losses, the largest parameter difference between the
two copies and the median optimizer-step time so far. The summary reports whether the
losses match, the speed-up, the first (capture + compile) step time, the compiled
optimizers' counters and ``hocompile.explain()`` of the compiled Muon optimizer.

What "match" means: by default hocompile fuses Muon's Newton–Schulz into one
op and plans it for this machine; on a CPU without a bf16 GEMM it computes in
fp32 (faster there, and more accurate than eager's bf16), so the two runs
round differently and the losses agree to about bf16 precision: the exit code
is 1 if they differ by more than 2e-2 relative. With ``--exact`` the NS passes
are off, the compiled step runs eager's own kernels, and the losses must be
bit-identical (tolerance 1e-5 relative, expected 0).

Run: ``.venv/bin/python examples/tiny_transformer.py [--steps 60] [--exact]``
"""

from __future__ import annotations

import argparse
import copy
import math
import statistics
import sys
import time
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as nnf
from torch import nn

import hocompile

if TYPE_CHECKING:
    from collections.abc import Callable

VOCAB, D_MODEL, N_LAYERS, N_HEADS, SEQ, BATCH = 64, 64, 2, 4, 32, 16
REL_TOL = {"exact": 1e-5, "default": 2e-2}


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention + GELU MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(D_MODEL)
        self.qkv = nn.Linear(D_MODEL, 3 * D_MODEL)
        self.proj = nn.Linear(D_MODEL, D_MODEL)
        self.ln2 = nn.LayerNorm(D_MODEL)
        self.fc = nn.Linear(D_MODEL, 4 * D_MODEL)
        self.out = nn.Linear(4 * D_MODEL, D_MODEL)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(D_MODEL, dim=-1)
        q, k, v = (z.view(b, t, N_HEADS, -1).transpose(1, 2) for z in (q, k, v))
        y = nnf.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, D_MODEL))
        return x + self.out(nnf.gelu(self.fc(self.ln2(x))))


class TinyTransformer(nn.Module):
    """Decoder-only transformer with learned positional embeddings."""

    def __init__(self) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(VOCAB, D_MODEL)
        self.pos_emb = nn.Embedding(SEQ, D_MODEL)
        self.blocks = nn.ModuleList(Block() for _ in range(N_LAYERS))
        self.ln_f = nn.LayerNorm(D_MODEL)
        self.head = nn.Linear(D_MODEL, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def make_batches(steps: int, seed: int = 1234) -> list[torch.Tensor]:
    """Arithmetic sequences ``x[t+1] = (x[t] + stride) % VOCAB``, random start/stride.

    The stride (1..4) is fixed per sequence, so after the first two tokens every next
    token is predictable by attending to the previous ones.
    """
    gen = torch.Generator().manual_seed(seed)
    positions = torch.arange(SEQ + 1)
    batches: list[torch.Tensor] = []
    for _ in range(steps):
        start = torch.randint(0, VOCAB, (BATCH, 1), generator=gen)
        stride = torch.randint(1, 5, (BATCH, 1), generator=gen)
        batches.append((start + stride * positions) % VOCAB)
    return batches


def make_optimizers(
    model: nn.Module,
) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
    """Muon for the hidden 2-D matrices, AdamW for everything else."""
    hidden: list[nn.Parameter] = []
    rest: list[nn.Parameter] = []
    for name, p in model.named_parameters():
        is_hidden = p.ndim == 2 and not name.startswith(("tok_emb", "pos_emb", "head"))
        (hidden if is_hidden else rest).append(p)
    muon = torch.optim.Muon(hidden, lr=0.02, momentum=0.95, weight_decay=0.01)
    adamw = torch.optim.AdamW(rest, lr=3e-3)
    return muon, adamw


def lr_lambda(total: int, warmup: int = 10) -> Callable[[int], float]:
    """Linear warmup to 1.0 over ``warmup`` steps, then cosine decay to 0.1."""

    def fn(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return 0.1 + 0.45 * (1.0 + math.cos(math.pi * min(progress, 1.0)))

    return fn


def train_step(model: nn.Module, opts: tuple[torch.optim.Optimizer, ...], batch: torch.Tensor) -> tuple[float, float]:
    """One forward/backward/step; returns (loss, seconds spent in optimizer steps)."""
    logits = model(batch[:, :-1])
    loss = nnf.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
    for opt in opts:
        opt.zero_grad(set_to_none=True)
    loss.backward()
    t0 = time.perf_counter()
    for opt in opts:
        opt.step()
    return loss.item(), time.perf_counter() - t0


def max_param_diff(a: nn.Module, b: nn.Module) -> float:
    """Largest absolute element-wise difference between two models' parameters."""
    with torch.no_grad():
        return max((pa - pb).abs().max().item() for pa, pb in zip(a.parameters(), b.parameters(), strict=True))


def rel_diff(x: float, y: float) -> float:
    """Relative difference of two losses (a NaN counts as infinitely different)."""
    d = abs(x - y) / max(abs(x), abs(y), 1e-12)
    return math.inf if math.isnan(d) else d


def main() -> int:
    """Train both copies, print progress and summary; return the exit code."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60, help="training steps (default 60)")
    parser.add_argument("--seed", type=int, default=0, help="model init seed")
    parser.add_argument("--exact", action="store_true", help="compile without the Newton-Schulz passes")
    args = parser.parse_args()
    options = {"disable_passes": ["fuse-newton-schulz", "choose-algorithm"]} if args.exact else {}
    tolerance = REL_TOL["exact" if args.exact else "default"]
    steps: int = max(1, args.steps)

    torch.manual_seed(args.seed)
    eager_model = TinyTransformer()
    comp_model = copy.deepcopy(eager_model)
    batches = make_batches(steps)

    eager_muon, eager_adamw = make_optimizers(eager_model)
    raw_muon, raw_adamw = make_optimizers(comp_model)
    comp_muon = hocompile.compile_optimizer(raw_muon, **options)
    comp_adamw = hocompile.compile_optimizer(raw_adamw, **options)
    eager_sched = torch.optim.lr_scheduler.LambdaLR(eager_muon, lr_lambda(steps))
    comp_sched = torch.optim.lr_scheduler.LambdaLR(comp_muon, lr_lambda(steps))

    n_muon = sum(p.numel() for g in eager_muon.param_groups for p in g["params"])
    n_adamw = sum(p.numel() for g in eager_adamw.param_groups for p in g["params"])
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; "
        f"Muon: {n_muon:,} params, AdamW: {n_adamw:,} params; {steps} steps"
    )
    print(f"{'step':>5} {'eager loss':>12} {'compiled loss':>14} {'max|dp|':>10} {'eager ms':>9} {'compiled ms':>12}")

    eager_losses: list[float] = []
    comp_losses: list[float] = []
    eager_times: list[float] = []
    comp_times: list[float] = []
    for step, batch in enumerate(batches, start=1):
        loss_e, t_e = train_step(eager_model, (eager_muon, eager_adamw), batch)
        loss_c, t_c = train_step(comp_model, (comp_muon, comp_adamw), batch)
        eager_sched.step()
        comp_sched.step()
        eager_losses.append(loss_e)
        comp_losses.append(loss_c)
        eager_times.append(t_e)
        comp_times.append(t_c)
        if step % 10 == 0 or step == steps:
            # Medians exclude steps 1-2: the compiled ones include capture + compile
            # (step 1 creates the optimizer state, step 2 compiles the steady graph).
            med_e = statistics.median(eager_times[2:] or eager_times)
            med_c = statistics.median(comp_times[2:] or comp_times)
            print(
                f"{step:>5} {loss_e:>12.6f} {loss_c:>14.6f} "
                f"{max_param_diff(eager_model, comp_model):>10.2e} "
                f"{med_e * 1e3:>9.2f} {med_c * 1e3:>12.2f}"
            )

    worst = max(rel_diff(a, b) for a, b in zip(eager_losses, comp_losses, strict=True))
    exact = eager_losses == comp_losses
    med_e = statistics.median(eager_times[2:] or eager_times)
    med_c = statistics.median(comp_times[2:] or comp_times)
    ok = worst <= tolerance

    print("\n=== summary ===")
    print(f"loss: first {eager_losses[0]:.4f} -> last eager {eager_losses[-1]:.4f}, compiled {comp_losses[-1]:.4f}")
    print(
        f"losses match: {'exactly (bitwise)' if exact else 'no, not bitwise'}; "
        f"max relative difference {worst:.3e} (tolerance {tolerance:g}) -> "
        f"{'OK' if ok else 'DIVERGED'}"
    )
    print(f"final max |param difference|: {max_param_diff(eager_model, comp_model):.3e}")
    print(
        f"median optimizer step (steps 3..{steps}): eager {med_e * 1e3:.2f} ms, "
        f"compiled {med_c * 1e3:.2f} ms, speed-up x{med_e / med_c:.2f}"
    )
    print(
        f"first step, Muon + AdamW (capture + compile): {comp_times[0]:.2f} s "
        f"(eager first step {eager_times[0] * 1e3:.2f} ms)"
    )
    if steps > 1:
        print(
            f"second step (optimizer state now exists): compiled "
            f"{comp_times[1]:.2f} s, eager {eager_times[1] * 1e3:.2f} ms"
        )
    print(f"Muon counters:  {dict(comp_muon.counters)}")
    print(f"AdamW counters: {dict(comp_adamw.counters)}")
    print("\n=== hocompile.explain(muon) ===")
    print(hocompile.explain(comp_muon))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
