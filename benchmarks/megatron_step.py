"""Megatron Core's Muon step on Megatron-shaped layers: eager vs hocompile, on this CPU.

    .venv/bin/python benchmarks/megatron_step.py                 # writes benchmarks/results/megatron_step.md
    .venv/bin/python benchmarks/megatron_step.py --steps 2 --rows dense   # smoke run

``get_megatron_optimizer(OptimizerConfig(optimizer="muon", muon_fp32_matmul_prec=...))`` builds the
optimizer (Megatron's ``ChainedOptimizer`` of ``FP32Optimizer``\\ s: ``TensorParallelMuon`` for the
matrices, AdamW for the rest) for one transformer layer of Megatron's ``GPTModel`` (gloo, world 1):

- dense: hidden 1024, ffn 4096, 16 heads / 8 query groups (QKV split per head, Megatron's default);
- moe: hidden 1024, 8 experts of ffn 1024 (``SequentialMLP``), a router.

Two copies from one seed get the same random grads; one steps eagerly, the other compiled
(``hocompile.compile_optimizer(optimizer)``, default settings: Newton–Schulz fused and planned). Steady
steps are interleaved (order alternating) after five warm steps (the self-check's early runs); the
table gives the first step of each (hocompile's includes its compile and first self-check), the
median step, the ratio, and the largest param difference after the run. Vocabulary 64 keeps the
embedding out of the picture.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import megatron_muon as example  # noqa: E402  (Megatron's CPU shims and typing.override)
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

WARM = 5  # untimed: both programs compiled, the self-check's runs 1, 2 and 4 done (the next is run 8)
OUT = Path(__file__).resolve().parent / "results" / "megatron_step.md"
ROWS = {
    "dense": {"num_attention_heads": 16, "num_query_groups": 8, "ffn_hidden_size": 4096},
    "moe": {"num_attention_heads": 16, "num_query_groups": 8, "ffn_hidden_size": 4096, "num_moe_experts": 8,
            "moe_ffn_hidden_size": 1024, "moe_router_topk": 2},
}


def build(row: str, precision: str) -> tuple[torch.nn.Module, object]:
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(0)
    shape = ROWS[row]
    config = TransformerConfig(num_layers=1, hidden_size=1024, use_cpu_initialization=True, **shape)
    spec = get_gpt_layer_local_spec(num_experts=shape.get("num_moe_experts"), moe_grouped_gemm=False)
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=64, max_sequence_length=16)
    model.ddp_config = DistributedDataParallelConfig()  # type: ignore[assignment]
    settings = OptimizerConfig(optimizer="muon", lr=0.01, clip_grad=0.0, muon_fp32_matmul_prec=precision)
    return model, get_megatron_optimizer(settings, [model])


def measure(row: str, precision: str, steps: int) -> str:
    import hocompile

    eager_model, eager = build(row, precision)
    model, optimizer = build(row, precision)
    compiled = hocompile.compile_optimizer(optimizer)
    pairs = list(zip(eager_model.parameters(), model.parameters()))
    gen = torch.Generator().manual_seed(1)
    times: dict[str, list[float]] = {"eager": [], "hocompile": []}
    first: dict[str, float] = {}
    for k in range(steps + WARM):
        for a, b in pairs:
            g = torch.randn(a.shape, generator=gen)
            a.grad, b.grad = g.clone(), g.clone()
        order = [("eager", eager), ("hocompile", compiled)]
        for name, opt in order if k % 2 == 0 else order[::-1]:
            started = time.perf_counter()
            opt.step()  # type: ignore[attr-defined]
            took = time.perf_counter() - started
            if k == 0:
                first[name] = took
            elif k >= WARM:
                times[name].append(took)
    med = {name: statistics.median(v) for name, v in times.items()}
    worst = max(float((a - b).detach().abs().max()) for a, b in pairs)
    matrices = sum(1 for a, _ in pairs if a.dim() == 2 and min(a.shape) > 1)
    # The FLOP floor: Megatron's Newton–Schulz FLOPs for these matrices (QKV split as it splits them) at
    # this CPU's 1024³ GEMM rate in the dtype eager's matmul precision computes in ('medium' lets oneDNN
    # use bf16 here, as eager's 3x faster steps show; 'highest' is fp32).
    flops = _ns_flops(eager)
    floor = flops / _rate(torch.bfloat16 if precision == "medium" else torch.float32)
    return (f"| {row} | {precision} | {matrices} | {first['eager']:.2f} s | {first['hocompile']:.2f} s "
            f"| {med['eager'] * 1e3:.0f} ms | {med['hocompile'] * 1e3:.0f} ms "
            f"| {med['eager'] / med['hocompile']:.2f}x | {flops / 1e9:.0f} GFLOP, {floor * 1e3:.0f} ms "
            f"| {med['hocompile'] / floor:.2f}x | {worst:.1e} |")


def _ns_flops(wrapper: object) -> float:
    """Newton–Schulz FLOPs of one step of Megatron's TensorParallelMuon inside ``wrapper`` (5 quintic
    iterations of X·Xᵀ, A·A and B·X on the short side: 5 (4 s² l + 2 s³) per s×l matrix)."""
    total = 0.0
    for opt in getattr(wrapper, "chained_optimizers", [wrapper]):
        inner = getattr(opt, "optimizer", opt)
        if type(inner).__name__ != "TensorParallelMuon":
            continue
        for group in inner.param_groups:
            for p in group["params"]:
                shapes = [tuple(p.shape)]
                if inner.split_qkv and inner.is_qkv_fn(p):
                    split = getattr(p, "qkv_split_shapes", None) or inner.qkv_split_shapes
                    groups = p.shape[0] // sum(split)
                    shapes = [(groups * part, p.shape[-1]) for part in split]
                for m, n in shapes:
                    short, long = min(m, n), max(m, n)
                    total += 5 * (4 * short * short * long + 2 * short**3)
    return total


def _rate(dtype: torch.dtype, n: int = 1024) -> float:
    """FLOP/s of an n³ GEMM in ``dtype`` on this CPU (best of 5)."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    best = float("inf")
    for _ in range(6):
        started = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - started)
    return 2 * n**3 / best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rows", default="dense,moe")
    parser.add_argument("--precisions", default="medium,highest", help="muon_fp32_matmul_prec values")
    parser.add_argument("--port", type=int, default=29581)
    parser.add_argument("--out", default=OUT.name, help="file name under benchmarks/results/")
    args = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(args.port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(1, 1)
    example.megatron_on_cpu()
    from hocompile.targets import declared_ratios

    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if "model name" in line), "?")
    lines = [
        "# Megatron Core's Muon step: eager vs hocompile",
        "",
        f"Machine: {cpu}, {os.cpu_count()} cores, GEMM 1024³: bf16 {_rate(torch.bfloat16) / 1e9:.0f}, fp32 "
        f"{_rate(torch.float32) / 1e9:.0f} GFLOP/s, "
        f"declared {declared_ratios()}; torch {torch.__version__}, Python {platform.python_version()}, "
        f"load {os.getloadavg()[0]:.1f}.",
        f"Command: `{' '.join(['benchmarks/megatron_step.py', *sys.argv[1:]])}`; {args.steps} timed steps each.",
        "",
        "| layer | muon_fp32_matmul_prec | matrices | eager 1st | hocompile 1st | eager step | hocompile step "
        "| ratio | NS work, its floor at the 1024³ GEMM rate | hocompile / floor | max abs diff |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in args.rows.split(","):
        for precision in args.precisions.split(","):
            line = measure(row, precision, args.steps)
            print(line, flush=True)
            lines.append(line)
    out = OUT.with_name(args.out)
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
