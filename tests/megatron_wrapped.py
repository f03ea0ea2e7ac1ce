"""What Megatron Core builds, compiled whole: run as a subprocess by tests/test_megatron_wrapped.py.

``get_megatron_optimizer(OptimizerConfig(optimizer=NAME, ...), [model])`` on a tiny GPTModel (2
layers, hidden 32, CPU init, gloo world 1) returns Megatron's own wrappers (a ``ChainedOptimizer`` of
``FP32Optimizer``\\ s around its inner torch optimizers). The wrapper goes to ``compile_optimizer``
as it is; its ``step()`` stays Megatron's (grads from ``main_grad``, the grad norm and its
all-reduce; clipping itself asserts CUDA grads, so ``clip_grad=0`` here). Two copies from one seed,
one eager, one compiled (NS passes off unless ``--passes on``, ``fallback="error"``), 10 steps with
an lr change at step 5 and a checkpoint round trip there (each side loads the other's
``state_dict()``: the formats are one). Prints one JSON line.

Megatron's optimizer modules write ``device='cuda'`` into a few factories (``FP32Optimizer``'s loss
scale, the grad-norm accumulators of ``clip_grads`` and ``utils``): on this CPU-only machine those
modules get a ``torch`` whose factories make such tensors on the CPU (the example's shims). Nothing else is
replaced, and hocompile never sees it.

    python tests/megatron_wrapped.py --optimizer muon [--passes on] [--port N] [--explain] [--no-compile] [--plant]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import typing
import warnings
from pathlib import Path

import typing_extensions

typing.override = typing_extensions.override  # emerging-optimizers 0.3.0 targets Python 3.12
warnings.filterwarnings("ignore")
warnings.filterwarnings("always", module="hocompile")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def megatron_on_cpu() -> None:
    """The example's shims (examples/megatron_muon.py): Megatron's ``device='cuda'`` factories and its
    other CUDA-only corners pointed at the CPU; one copy for the example and these tests."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
    from megatron_muon import megatron_on_cpu as shims

    shims()


def build(name: str, **options: typing.Any) -> tuple[torch.nn.Module, typing.Any]:
    """Megatron's tiny GPTModel and ``get_megatron_optimizer``'s wrappers for it (``options``: more
    ``OptimizerConfig`` fields)."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(0)
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                               ffn_hidden_size=64, use_cpu_initialization=True)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=64,
                     max_sequence_length=16)
    # What Megatron's DDP wrapper would carry; its optimizer="adam" path reads it.
    model.ddp_config = DistributedDataParallelConfig()  # type: ignore[assignment]
    # clip_grad=0: Megatron's clipping asserts CUDA grads (clip_grads.py: param.grad.type() ==
    # 'torch.cuda.FloatTensor'); the grad norm it computes and all-reduces every step still runs.
    built = get_megatron_optimizer(OptimizerConfig(optimizer=name, lr=0.01, clip_grad=0.0, **options), [model])
    return model, built


def plant_a_wrong_plan() -> None:
    """Every compiled program gets one more pass: the last in-place or out-of-place add of the graph
    scaled by 1 + 2^-20, a wrong elementwise op where the plan keeps eager's arithmetic (the
    self-check must find it and fall back, through the wrapper)."""
    from helpers import PerturbLastAdd  # tests/helpers.py: this script runs from tests/

    import hocompile.passes.pipeline as pipeline

    default = pipeline.default_pipeline

    def planted(*args: typing.Any, **kwargs: typing.Any) -> typing.Any:
        return (*default(*args, **kwargs), PerturbLastAdd())

    pipeline.default_pipeline = planted  # type: ignore[assignment]


def inner_names(wrapper: typing.Any) -> list[str]:
    from hocompile.runtime.wrappers import compiled_inside, wrapped_slots

    found = compiled_inside(wrapper) or [slot[0][slot[1]] if isinstance(slot[1], int) else getattr(*slot)
                                         for slot in wrapped_slots(wrapper) or []]
    return [type(getattr(o, "optimizer", o)).__name__ for o in found]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--optimizer", default="muon")
    parser.add_argument("--port", type=int, default=29551)
    parser.add_argument("--passes", choices=["off", "on"], default="off")
    parser.add_argument("--explain", action="store_true", help="explain() on stderr")
    # The control: the second copy eager too (how alike two eager copies stay)
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--plant", action="store_true", help="a wrong elementwise op in every program")
    args = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(args.port)
    dist.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(1, 1)
    megatron_on_cpu()
    import hocompile

    if args.plant:
        plant_a_wrong_plan()
    eager_model, eager = build(args.optimizer)
    model, wrapper = build(args.optimizer)
    disabled = ["fuse-newton-schulz"] if args.passes == "off" else []
    compiled = wrapper if args.no_compile else hocompile.compile_optimizer(
        wrapper, disable_passes=disabled, fallback="error"
    )
    kinds = {"wrapper": type(compiled).__name__, "same_object": compiled is wrapper, "inner": inner_names(compiled)}
    names = [n for n, _ in model.named_parameters()]
    pairs = list(zip(eager_model.parameters(), model.parameters()))
    gen = torch.Generator().manual_seed(1)
    results = []
    caught = warnings.catch_warnings(record=True)
    seen = caught.__enter__()
    warnings.simplefilter("always")
    for step in range(10):
        if step == 5:
            for opt in (eager, compiled):
                for group in opt.param_groups:
                    group["lr"] *= 0.5
            mine, theirs = copy.deepcopy(compiled.state_dict()), copy.deepcopy(eager.state_dict())
            eager.load_state_dict(mine)
            compiled.load_state_dict(theirs)
        for a, b in zip(*zip(*pairs)):
            g = torch.randn(a.shape, generator=gen)
            a.grad, b.grad = g.clone(), g.clone()
        results.append((eager.step(), compiled.step()))
        if os.environ.get("MW_TRACE"):
            bad = [n for n, (a, b) in zip(names, pairs) if not torch.equal(a, b)]
            print(step, bad[:4], file=sys.stderr)
    caught.__exit__(None, None, None)
    norms_equal = all(str(e) == str(c) for e, c in results)
    inside = hocompile.runtime.wrappers.compiled_inside(compiled)
    report = {
        **kinds,
        "params": {n: bool(torch.equal(a, b)) for n, (a, b) in zip(names, pairs)},
        "max_abs": max(float((a - b).abs().max()) for a, b in pairs),
        "step_results_equal": norms_equal,
        "warnings": sorted({w.category.__name__ for w in seen if w.category.__module__.startswith("hocompile")}),
        "compiles": sum(o.counters.compiles for o in inside),
        "eager_fallbacks": sum(o.counters.eager_fallbacks for o in inside),
        "explain_head": hocompile.explain(compiled).splitlines()[0] if inside else "",
    }
    if args.explain and inside:
        print(hocompile.explain(compiled), file=sys.stderr)
    print(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
