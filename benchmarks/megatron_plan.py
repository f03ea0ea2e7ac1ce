"""Megatron-shaped tensor-parallel and layer-wise Muon plans for Kimi-K2 and Qwen3-30B-A3B, at true shapes.

    .venv/bin/python benchmarks/megatron_plan.py     # writes benchmarks/results/megatron_plan.md

No tensors and no ranks: the per-rank Newton–Schulz time and the bytes each rank moves per step come
from hocompile's own cost model (``distributed.tp_plan.choose_tp_mode``: the target's GEMM rate and
link, the formulas in its docstring) and its owner plans (``distributed.plan``), for a configuration
at TP 8 / EP 8 / DP 64 on sm90 (H100: dense bf16 989 TFLOP/s, NVLink4 450 GB/s per direction).

How Megatron lays the matrices out (as this script models it; Megatron Core 0.19):

- attention and dense/shared-expert MLPs are TP-split: column-parallel (q/k/v, MLA's q_b/kv_b,
  gate/up: rows split, ``partition_dim`` 0) or row-parallel (o_proj, down_proj: columns split,
  ``partition_dim`` 1). MLA's down projections (q_a, kv_a) are left whole on every TP rank here (each
  TP rank orthogonalises its own copy: no communication);
- routed experts go to EP ranks whole (E/8 each), expert TP 1: orthogonalised locally;
- ``muon_tp_mode``: ``duplicated`` all-gathers each TP-split matrix and runs the full NS on every TP
  rank; ``distributed`` keeps the shard and all-reduces the fp32 Gram (X·Xᵀ) each iteration (only
  where the split is along the long side of X; elsewhere Megatron's call would orthogonalise the short
  side: its warning, modelled here as duplicated); ``blockwise`` orthogonalises each shard alone (no
  communication; another update, not the same math).
- layer-wise (``use_layer_wise_distributed_optimizer``): the 64 DP ranks of one TP/EP rank split its
  local matrices whole; per-rank NS time is the slowest rank's, for Megatron's rule (by element
  count) and hocompile's LPT plan (by NS cost, max·min²).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.structures import ParamSpec, specs_for  # noqa: E402
from hocompile.distributed.plan import Item, assign_by_numel, assign_owners  # noqa: E402
from hocompile.distributed.tp_plan import LINKS, choose_tp_mode, ns_flops_as_given  # noqa: E402
from hocompile.ir.decisions import format_seconds  # noqa: E402
from hocompile.targets import gpu_target  # noqa: E402

TP, EP, DP, STEPS = 8, 8, 64, 5
COLUMN = ("q_proj", "k_proj", "v_proj", "q_b_proj", "kv_b_proj", "gate_proj", "up_proj")
ROW = ("o_proj", "down_proj")


def split_of(spec: ParamSpec) -> int | None:
    """Megatron's ``partition_dim`` for this matrix under TP (None: whole on every TP rank)."""
    if spec.kind == "expert":
        return None
    leaf = spec.name.split(".")[-2]
    return 0 if leaf in COLUMN else 1 if leaf in ROW else None


def local_matrices(specs: Sequence[ParamSpec]) -> list[tuple[ParamSpec, int | None]]:
    """One TP/EP rank's Muon matrices: the TP-split ones (full shape, split dim), the routed experts of
    its EP slice, and the rest whole."""
    out: list[tuple[ParamSpec, int | None]] = []
    for spec in specs:
        if spec.optimizer != "muon":
            continue
        if spec.kind == "expert":
            index = int(spec.name.split(".experts.")[1].split(".")[0])
            if index % EP:  # EP rank 0's slice: every EP-th expert (the same count as a contiguous slice)
                continue
        out.append((spec, split_of(spec)))
    return out


def plan_rows(model: str) -> list[str]:
    target = gpu_target("sm90")
    link = LINKS["sm90"]
    rate = target.planning_throughput(torch.bfloat16) * 1e9
    mats = local_matrices(specs_for(model, scale=1))
    rows = []
    for mode in ("duplicated", "distributed", "blockwise"):
        seconds = moved = 0.0
        for spec, dim in mats:
            m, n = spec.shape
            transpose = m > n  # NS works on the short side
            if dim is None:
                seconds += ns_flops_as_given(spec.shape, STEPS, transpose) / rate
                continue
            if mode == "blockwise":
                shard = (m // TP, n) if dim == 0 else (m, n // TP)
                seconds += ns_flops_as_given(shard, STEPS, shard[0] > shard[1]) / rate
                continue
            choice = choose_tp_mode(spec.shape, dim, TP, STEPS, target, transpose=transpose, link=link,
                                    requested=mode)
            seconds += choice.predicted_s[choice.mode]
            frac = (TP - 1) / TP
            short = min(m, n)
            moved += frac * m * n * 4 if choice.mode == "duplicated" else STEPS * 2 * frac * short * short * 4
        rows.append(f"| {model} | {mode} | {len(mats)} | {format_seconds(seconds)} | {moved / 1e9:.2f} GB |")
    return rows


def layer_wise_rows(model: str) -> list[str]:
    """DP 64 over one TP/EP rank's local matrices (TP-split ones at their shard's shape)."""
    rate = gpu_target("sm90").planning_throughput(torch.bfloat16) * 1e9
    items = []
    for k, (spec, dim) in enumerate(local_matrices(specs_for(model, scale=1))):
        m, n = spec.shape
        shape = (m, n) if dim is None else (m // TP, n) if dim == 0 else (m, n // TP)
        items.append(Item(f"{k}", shape, "bf16", float(ns_flops_as_given(shape, STEPS, shape[0] > shape[1]))))
    ours, megatron = assign_owners(items, DP), assign_by_numel(items, DP)
    ideal = sum(i.cost for i in items) / DP / rate
    return [
        f"| {model} | {len(items)} | {format_seconds(ideal)} | {format_seconds(max(megatron.loads) / rate)} "
        f"({megatron.imbalance():.2f}x) | {format_seconds(max(ours.loads) / rate)} ({ours.imbalance():.2f}x) |"
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="megatron_plan.md", help="file name under benchmarks/results/")
    args = parser.parse_args()
    lines = [
        "# Megatron-shaped Muon plans at TP 8 / EP 8 / DP 64 on sm90 (cost model, true shapes)",
        "",
        f"Command: `.venv/bin/python benchmarks/megatron_plan.py`. {STEPS} NS iterations, bf16 at sm90's declared "
        f"rate, {LINKS['sm90'].source}; the layout rules are in the script's docstring. Per TP/EP rank, per step.",
        "",
        "| model | muon_tp_mode | local matrices | NS time per rank (incl. collectives) | bytes moved per rank |",
        "|---|---|---|---|---|",
    ]
    for model in ("qwen3", "kimi-k2"):
        lines += plan_rows(model)
    lines += [
        "",
        "Layer-wise (`use_layer_wise_distributed_optimizer`): the 64 DP ranks of one TP/EP rank split its local "
        "matrices whole; the slowest rank's NS time (and its load over the ideal):",
        "",
        "| model | matrices | ideal (total / 64) | Megatron 0.19 (by element count) | hocompile (LPT by NS cost) |",
        "|---|---|---|---|---|",
    ]
    for model in ("qwen3", "kimi-k2"):
        lines += layer_wise_rows(model)
    out = Path(__file__).resolve().parent / "results" / args.out
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
