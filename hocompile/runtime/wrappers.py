"""Optimizer wrappers of training stacks (Megatron Core's MegatronOptimizer family), compiled in place.

Megatron Core wraps each torch optimizer it builds: ``FP32Optimizer`` and
``Float16OptimizerWithFloat16Params`` hold it as ``.optimizer`` and run
Megatron's own work around its ``step()`` (grads copied from ``main_grad``,
clipping with its collectives, zero counting, fp16 master copies);
``ChainedOptimizer`` and ``LayerWiseDistributedOptimizer`` hold a list of
those as ``.chained_optimizers`` (the latter all-gathers the params each rank
updated after the step). None of them is a ``torch.optim.Optimizer``: their
``state`` and ``param_groups`` are properties forwarding to the inner one.

``compile_optimizer`` on such a wrapper compiles the torch optimizers inside
it, replacing each ``.optimizer`` / list entry by its CompiledOptimizer (which
shares the inner optimizer's param groups and state), and returns the wrapper
itself: Megatron's step, checkpoints (``state_dict``, ``sharded_state_dict``)
and everything else it does stay Megatron's. Found by shape, never by
importing Megatron: an object that is not an optimizer, with a
``chained_optimizers`` list, or with an ``optimizer`` instance attribute that is
one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

Slot = tuple[Any, str | int]  # (holder, attribute name or list index)


def wrapped_slots(obj: Any) -> list[Slot] | None:
    """Where the wrapper ``obj`` keeps its torch optimizers, in step order; None if ``obj`` is not
    a wrapper (an optimizer itself, or an object holding none the way the wrappers do)."""
    if isinstance(obj, torch.optim.Optimizer) or not hasattr(obj, "__dict__"):
        return None
    attrs = vars(obj)  # instance attributes only: ChainedOptimizer.optimizer is a property that asserts
    chained = attrs.get("chained_optimizers")
    if isinstance(chained, list):
        slots: list[Slot] = []
        for k, child in enumerate(chained):
            inner = wrapped_slots(child)
            if inner is not None:
                slots += inner
            elif isinstance(child, torch.optim.Optimizer):
                slots.append((chained, k))
            else:
                raise TypeError(
                    f"compile_optimizer: {type(obj).__name__}.chained_optimizers[{k}] is a {type(child).__name__}, "
                    "neither a torch.optim.Optimizer nor a wrapper holding one"
                )
        return slots
    if isinstance(attrs.get("optimizer"), torch.optim.Optimizer):
        return [(obj, "optimizer")]
    return None


def _get(slot: Slot) -> Any:
    holder, key = slot
    return holder[key] if isinstance(key, int) else getattr(holder, key)


def _put(slot: Slot, value: Any) -> None:
    holder, key = slot
    if isinstance(key, int):
        holder[key] = value
    else:
        setattr(holder, key, value)


def compile_wrapped(wrapper: Any, slots: list[Slot], compile_one: Callable[[torch.optim.Optimizer], Any]) -> Any:
    """Compile every optimizer in ``slots`` with ``compile_one`` and put it in its place.

    All are compiled before any is put back: an optimizer that cannot be wrapped (already
    compiled, not compilable) raises with the wrapper exactly as it was.
    """
    if not slots:
        raise TypeError(f"compile_optimizer: {type(wrapper).__name__} holds no torch optimizer to compile")
    compiled = []
    for slot in slots:
        inner = _get(slot)
        where = f"{type(slot[0]).__name__}.{slot[1]}" if isinstance(slot[1], str) else f"chained_optimizers[{slot[1]}]"
        try:
            compiled.append(compile_one(inner))
        except TypeError as exc:
            raise TypeError(f"compile_optimizer: {type(wrapper).__name__}'s {where}: {exc}") from exc
    for slot, one in zip(slots, compiled):
        _put(slot, one)
    return wrapper


def compiled_inside(wrapper: Any) -> list[Any]:
    """The CompiledOptimizers inside a wrapper compile_optimizer returned (explain() reports each)."""
    from .compiled_optimizer import CompiledOptimizer

    return [o for o in (_get(s) for s in wrapped_slots(wrapper) or []) if isinstance(o, CompiledOptimizer)]


__all__ = ["compile_wrapped", "compiled_inside", "wrapped_slots"]
