"""Megatron Core's own Muon, compiled by hocompile, trained beside eager on a tiny GPTModel (CPU, gloo).

What a Megatron user adds is three lines around what Megatron builds::

    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="muon", ...), model_chunks)
    import hocompile
    optimizer = hocompile.compile_optimizer(optimizer)   # Megatron's wrappers, compiled inside

``compile_optimizer`` compiles the torch optimizers inside Megatron's ``ChainedOptimizer`` /
``FP32Optimizer`` wrappers in place and returns the wrapper: its ``step()`` stays Megatron's (grad
preparation, the grad norm and its all-reduce, zero counting), only the inner steps are hocompile's.

Here two copies of Megatron's tiny ``GPTModel`` (2 layers, hidden 64, 4 heads / 2 query groups,
vocab 64, CPU init) see the same batches of a synthetic next-token task; one is stepped by Megatron's
optimizer as built, the other by the same optimizer compiled. ``--world 2`` runs two gloo ranks with
tensor parallelism 2 (``--tp-mode``, Megatron's ``muon_tp_mode``: its default ``duplicated`` all-gathers the
shards, ``distributed`` all-reduces X·Xᵀ; the compiled step issues the same collectives). Each rank
prints both losses every 10 steps; rank 0
writes the loss curves to ``--out`` (a PNG where matplotlib is installed, ``pip install -e .[bench]``;
a CSV beside it always). ``--exact`` turns the Newton–Schulz passes off: every param must then be
bitwise Megatron's eager (exit code 1 if not). By default NS is fused and planned for this machine: the
compiled step is then within Megatron's own bf16 NS rounding, which is large at these sizes (eager's NS
re-run under another summation order differs from itself by ~20 % of an update; the self-check's line
in ``explain()`` shows both figures), so the two runs' losses drift apart over the steps as two eager
runs on two machines would, and only their level is alike.

Megatron expects CUDA in a few places a CPU run reaches (its attention's scratch buffer, the
model-parallel RNG tracker, a loss scale and grad-norm accumulators): ``megatron_on_cpu()`` points
those at the CPU and is the only change to Megatron's code; on a GPU leave it out.

    .venv/bin/python examples/megatron_muon.py [--steps 40] [--world 1|2] [--exact] [--out megatron_muon.png]

Needs megatron-core 0.19.2 (``make`` installs it: ``pip install --no-deps --ignore-requires-python
megatron-core==0.19.2`` plus ``packaging`` and ``triton``).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import os
import sys
import types
import typing
from pathlib import Path

import typing_extensions

typing.override = typing_extensions.override  # Megatron's emerging-optimizers 0.3.0 targets Python 3.12

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

VOCAB, HIDDEN, SEQ, BATCH = 64, 64, 16, 8


class _CpuCuda(types.ModuleType):
    """``torch.cuda`` whose current device is the CPU (Megatron's attention buffer asks for it)."""

    def __getattr__(self, name: str) -> typing.Any:
        return (lambda: "cpu") if name == "current_device" else getattr(torch.cuda, name)


class _CpuTorch(types.ModuleType):
    """``torch`` for Megatron modules on a machine without CUDA: ``device='cuda'`` factories make CPU tensors."""

    def __getattr__(self, name: str) -> typing.Any:
        if name == "cuda":
            return _CpuCuda("torch.cuda")
        found = getattr(torch, name)
        if name not in ("tensor", "zeros", "ones", "empty", "full"):
            return found

        def factory(*args: typing.Any, **kwargs: typing.Any) -> torch.Tensor:
            if str(kwargs.get("device", "")).startswith("cuda"):
                kwargs["device"] = "cpu"
            return found(*args, **kwargs)

        return factory


class _NoRngTracker:
    """Megatron's model-parallel RNG tracker keeps CUDA generator states; dropout is 0 here."""

    def fork(self, name: str = "model-parallel-rng") -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def is_initialized(self) -> bool:
        return True


def megatron_on_cpu() -> None:
    import megatron.core.optimizer.clip_grads as clip_grads
    import megatron.core.optimizer.optimizer as optimizer
    import megatron.core.tensor_parallel.random as tp_random
    import megatron.core.transformer.dot_product_attention as attention
    import megatron.core.utils as utils

    for module in (clip_grads, optimizer, utils):
        module.torch = _CpuTorch("torch")  # type: ignore[attr-defined]
    tracker = _NoRngTracker()
    tp_random.get_cuda_rng_tracker = lambda *a, **k: tracker  # type: ignore[assignment]
    attention.tensor_parallel.get_cuda_rng_tracker = tp_random.get_cuda_rng_tracker  # type: ignore[attr-defined]


def build(tp_mode: str) -> tuple[torch.nn.Module, typing.Any]:
    """Megatron's tiny GPTModel and the optimizer ``get_megatron_optimizer`` makes for it (Muon for the
    matrices, AdamW for embeddings, norms and biases, all in Megatron's wrappers)."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(0)
    config = TransformerConfig(num_layers=2, hidden_size=HIDDEN, num_attention_heads=4, num_query_groups=2,
                               ffn_hidden_size=4 * HIDDEN, use_cpu_initialization=True,
                               hidden_dropout=0.0, attention_dropout=0.0,
                               tensor_model_parallel_size=dist.get_world_size())
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=VOCAB,
                     max_sequence_length=SEQ)
    model.ddp_config = DistributedDataParallelConfig()  # type: ignore[assignment]
    # clip_grad=0: Megatron's clipping asserts CUDA grads; the grad norm is still computed and all-reduced.
    settings = OptimizerConfig(optimizer="muon", lr=0.02, clip_grad=0.0, muon_tp_mode=tp_mode)
    return model, get_megatron_optimizer(settings, [model])


def batch(gen: torch.Generator) -> torch.Tensor:
    """Arithmetic sequences mod VOCAB (random start and stride): learnable next-token structure."""
    start = torch.randint(0, VOCAB, (BATCH, 1), generator=gen)
    stride = torch.randint(1, 5, (BATCH, 1), generator=gen)
    return (start + stride * torch.arange(SEQ + 1)) % VOCAB


def loss_of(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    positions = torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ)
    causal = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1).view(1, 1, SEQ, SEQ)  # True: masked out
    return model(inputs, positions, causal, labels=labels).float().mean()  # per-token cross entropy


def train(rank: int, args: argparse.Namespace) -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(args.port))
    dist.init_process_group("gloo", rank=rank, world_size=args.world)
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(args.world, 1)
    megatron_on_cpu()
    import hocompile

    eager_model, eager = build(args.tp_mode)
    model, optimizer = build(args.tp_mode)
    optimizer = hocompile.compile_optimizer(
        optimizer, disable_passes=["fuse-newton-schulz"] if args.exact else None
    )
    gen = torch.Generator().manual_seed(1)
    rows: list[tuple[int, float, float]] = []
    for step in range(args.steps):
        tokens = batch(gen)
        losses = []
        for m, opt in ((eager_model, eager), (model, optimizer)):
            m.zero_grad(set_to_none=True)
            loss = loss_of(m, tokens)
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
        rows.append((step, losses[0], losses[1]))
        if step % 10 == 0 or step == args.steps - 1:
            worst = max(float((a - b).abs().max()) for a, b in zip(eager_model.parameters(), model.parameters()))
            print(f"rank {rank} step {step:3d}  loss eager {losses[0]:.4f}  compiled {losses[1]:.4f}  "
                  f"max |param diff| {worst:.2e}", flush=True)
    bitwise = all(torch.equal(a, b) for a, b in zip(eager_model.parameters(), model.parameters()))
    if rank == 0:
        last = rows[-10:]
        print(f"mean loss over the last {len(last)} steps: eager {sum(r[1] for r in last) / len(last):.4f}, "
              f"compiled {sum(r[2] for r in last) / len(last):.4f}")
        text = hocompile.explain(optimizer)
        print(text.splitlines()[0])
        print("\n".join(line for line in text.splitlines() if "self-check:" in line))
        _write(rows, Path(args.out))
    print(f"rank {rank}: params bitwise Megatron's eager: {bitwise}", flush=True)
    dist.destroy_process_group()
    if args.exact and not bitwise:
        sys.exit(1)


def _write(rows: list[tuple[int, float, float]], out: Path) -> None:
    with out.with_suffix(".csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["step", "eager_loss", "compiled_loss"])
        writer.writerows(rows)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"wrote {out.with_suffix('.csv')} (matplotlib not installed: no PNG)")
        return
    steps, eager, compiled = zip(*rows)
    plt.figure(figsize=(6, 4))
    plt.plot(steps, eager, label="Megatron Muon, eager")
    plt.plot(steps, compiled, "--", label="Megatron Muon, hocompile")
    plt.xlabel("step")
    plt.ylabel("loss")
    plt.legend()
    plt.tight_layout()
    plt.savefig(out)
    print(f"wrote {out} and {out.with_suffix('.csv')}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--world", type=int, choices=[1, 2], default=1, help="gloo ranks (tensor parallel)")
    parser.add_argument("--tp-mode", default="duplicated", choices=["blockwise", "duplicated", "distributed"],
                        help="Megatron's muon_tp_mode with --world 2 (its default: duplicated)")
    parser.add_argument("--exact", action="store_true", help="NS passes off: bitwise Megatron's eager")
    parser.add_argument("--out", default="megatron_muon.png")
    parser.add_argument("--port", type=int, default=29571)
    args = parser.parse_args()
    if args.world == 1:
        train(0, args)
    else:
        mp.spawn(train, args=(args,), nprocs=args.world)


if __name__ == "__main__":
    main()
