"""Megatron's LayerWiseDistributedOptimizer at data parallelism 2, compiled: one process per gloo rank,
run by tests/test_megatron_wrapped.py.

``get_megatron_optimizer(OptimizerConfig(optimizer="muon", use_layer_wise_distributed_optimizer=True))``
on the tiny GPTModel gives each data-parallel rank whole matrices to orthogonalise (Megatron's
ping-pong assignment) inside a ``LayerWiseDistributedOptimizer``; ``compile_optimizer`` compiles the
torch optimizers inside it, in place. Two copies from one seed, one eager, one compiled (NS passes
off, ``fallback="error"``), 10 steps with an lr change at step 5; the same grads on both ranks, as
after DDP's all-reduce. Prints one JSON line: which params this rank's optimizers own, and whether
each is bitwise eager's.

What cannot run on this CPU, eagerly too, so it is not run: Megatron's ``step()`` around the inner
steps (without ``bf16`` the layer-wise path leaves the torch optimizers unwrapped and its grad
preparation calls ``prepare_grads`` on them: AttributeError; with ``bf16`` the fp16 wrapper
requires CUDA tensors), and its all-gather of the updated params (``all_gather`` of uneven sizes,
which gloo refuses). The inner steps are called as Megatron's ``step_with_ready_grads`` calls them.

    python tests/megatron_layer_wise.py --rank R --port N     # one per rank, world 2
"""

from __future__ import annotations

import argparse
import json
import os
import typing
import warnings

import typing_extensions

typing.override = typing_extensions.override  # emerging-optimizers 0.3.0 targets Python 3.12
warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--port", type=int, default=29561)
    args = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(args.port)
    dist.init_process_group("gloo", rank=args.rank, world_size=2)
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(1, 1)  # TP 1, PP 1: data parallelism 2
    from megatron_wrapped import build, megatron_on_cpu  # this script runs from tests/

    megatron_on_cpu()
    import hocompile

    eager_model, eager = build("muon", use_layer_wise_distributed_optimizer=True)
    model, wrapper = build("muon", use_layer_wise_distributed_optimizer=True)
    compiled = hocompile.compile_optimizer(wrapper, disable_passes=["fuse-newton-schulz"], fallback="error")
    names = {id(p): n for n, p in model.named_parameters()}
    pairs = list(zip(eager_model.parameters(), model.parameters()))
    owned = [p for o in compiled.chained_optimizers for g in o.param_groups for p in g["params"]]
    gen = torch.Generator().manual_seed(1)  # the same grads on both ranks (DDP's all-reduced grads)
    for step in range(10):
        if step == 5:
            for opt in (eager, compiled):
                for group in opt.param_groups:
                    group["lr"] *= 0.5
        for a, b in pairs:
            g = torch.randn(a.shape, generator=gen)
            a.grad, b.grad = g.clone(), g.clone()
        for wrapped in (eager, compiled):
            for inner in wrapped.chained_optimizers:
                inner.step()
    inside = hocompile.runtime.wrappers.compiled_inside(compiled)
    report = {
        "wrapper": type(compiled).__name__,
        "owned": sorted(names[id(p)] for p in owned),
        "params": len(names),
        "bitwise": {names[id(b)]: bool(torch.equal(a, b)) for a, b in pairs if any(b is p for p in owned)},
        "inner": [type(o.optimizer).__name__ for o in inside],
        "eager_fallbacks": sum(o.counters.eager_fallbacks for o in inside),
        "compiles": sum(o.counters.compiles for o in inside),
    }
    print(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
