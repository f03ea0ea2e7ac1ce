"""Megatron Core's own Muon, compiled: run as a subprocess by tests/test_megatron.py (it initialises
torch.distributed and Megatron's parallel state, which must not leak into other tests' processes).

A tiny GPTModel (2 layers, hidden 32, 4 heads in 2 query groups, CPU init) is built twice from one seed,
and each copy gets Megatron's inner ``TensorParallelMuon`` from ``get_megatron_optimizer``'s own code
(param groups, the ``is_qkv`` / ``qkv_split_shapes`` / ``partition_dim`` tags, its kwargs). Megatron's
fp32 wrapper allocates a CUDA tensor in its constructor, so the wrappers are replaced by the inner
optimizers here (compiling the wrappers is issue 32). One copy is stepped eagerly, the other compiled
with ``fuse-newton-schulz`` off and ``fallback="error"``, over 10 steps with an lr change; the script
prints one JSON line: per param, whether it is bitwise eager's, and the compiled steps' counters.

    python tests/megatron_muon.py [--split-qkv 0|1] [--port N] [--lose-attributes]
    python tests/megatron_muon.py --world 2 --rank R --tp-mode duplicated   # one per rank
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


def build(split_qkv: bool, tp_mode: str = "duplicated") -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    import megatron.core.optimizer as mopt
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.transformer_config import TransformerConfig

    class Inner:  # stands for FP32Optimizer, whose constructor needs CUDA
        def __init__(self, optimizer: torch.optim.Optimizer, config: object, init_state_fn: object) -> None:
            self.optimizer = optimizer

    mopt.FP32Optimizer = Inner  # type: ignore[assignment,misc]
    mopt.ChainedOptimizer = lambda optimizers: optimizers  # type: ignore[assignment,misc]
    torch.manual_seed(0)
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                               ffn_hidden_size=64, use_cpu_initialization=True)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=64,
                     max_sequence_length=16)
    built = get_megatron_optimizer(OptimizerConfig(optimizer="muon", lr=0.01, muon_split_qkv=split_qkv,
                                                    muon_tp_mode=tp_mode), [model])
    muon = next(o.optimizer for o in built if type(o.optimizer).__name__ == "TensorParallelMuon")
    return model, muon


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--split-qkv", type=int, default=1)
    parser.add_argument("--port", type=int, default=29541)
    # The negative control: stand-ins that lose the params' Python attributes (is_qkv), self-check off.
    parser.add_argument("--lose-attributes", action="store_true")
    # Tensor parallelism: this process is rank --rank of --world (TP over all of them), Muon in --tp-mode.
    parser.add_argument("--world", type=int, default=1)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--tp-mode", default="duplicated", choices=["blockwise", "duplicated", "distributed"])
    args = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(args.port)
    dist.init_process_group("gloo", rank=args.rank, world_size=args.world)
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(args.world, 1)
    import hocompile

    eager_model, eager = build(bool(args.split_qkv), args.tp_mode)
    model, inner = build(bool(args.split_qkv), args.tp_mode)
    names = {id(p): n for n, p in model.named_parameters()}
    if args.lose_attributes:
        from hocompile.capture import stand_ins

        stand_ins.install = lambda stand_in, real, where, traced: {}
    compiled = hocompile.compile_optimizer(inner, disable_passes=["fuse-newton-schulz"], fallback="error",
                                           self_check=not args.lose_attributes)
    eager_params = [p for g in eager.param_groups for p in g["params"]]
    params = [p for g in compiled.param_groups for p in g["params"]]
    gen = torch.Generator().manual_seed(1 + args.rank)
    refused = ""
    for step in range(10):
        if step == 5:
            for opt in (eager, compiled):
                for group in opt.param_groups:
                    group["lr"] *= 0.5
        for a, b in zip(eager_params, params):
            g = torch.randn(a.shape, generator=gen)
            a.grad, b.grad = g.clone(), g.clone()
        before = [b.detach().clone() for b in params]
        eager.step()
        try:
            compiled.step()
        except hocompile.CaptureError as exc:  # refused: it must say which call, and have touched nothing
            refused = str(exc)
            untouched = all(torch.equal(b, c) for b, c in zip(params, before))
            print(json.dumps({"refused": refused, "untouched": untouched, "step": step}))
            dist.destroy_process_group()
            return
    report = {
        "params": {names[id(b)]: bool(torch.equal(a, b)) for a, b in zip(eager_params, params)},
        "qkv": [names[id(p)] for p in params if getattr(p, "is_qkv", False)],
        "split_qkv": bool(inner.split_qkv),
        "counters": compiled.counters.as_dict(),
        "self_checks": sum(e.self_check.checks for e in compiled.history),
        # the collectives the compiled programs issue (functional: all_gather_into_tensor, all_reduce)
        "collectives": sorted({line.split("_c10d_functional.")[1].split("(")[0].split(".")[0]
                               for e in compiled.history for line in e.final_graph.splitlines()
                               if "_c10d_functional." in line and "wait_tensor" not in line}),
    }
    print(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
