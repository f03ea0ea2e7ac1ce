"""Where the step's tensor inputs live in the optimizer (InputSlot <-> tensor), and the host
values a compiled step runs with: what capture.py traces and the runtime feeds, read the same way."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..ir.graph import InputSlot
from .container_trace import container_attributes, container_value, leaf_slots
from .containers import holds_tensors, leaf, tensor_leaves
from .group_hypers import is_float
from .stand_ins import tensor_attributes

# Which params a trace hands the step, per group: their indices into the group's own
# list, in order (None: all of them). A reduced trace (classes/stamp.py) runs the step
# on a few representatives of each parameter class; inputs keep their real indices.
TraceView = dict[int, list[int]]


def input_slots(opt: torch.optim.Optimizer, view: TraceView | None = None) -> list[InputSlot]:
    """Tensor inputs of the step, in graph order: per param, param, grad, state, tensor attributes."""
    slots: list[InputSlot] = []
    owned = _owned(opt)
    for g, group in enumerate(opt.param_groups):
        params = group["params"]
        for i in range(len(params)) if view is None else view.get(g, []):
            p = params[i]
            if p.grad is None:
                continue
            slots += [InputSlot.param(g, i), InputSlot.grad(g, i)]
            state = opt.state.get(p, {})
            for k in sorted(state):
                if isinstance(state[k], torch.Tensor):
                    slots.append(InputSlot.state(g, i, k))
                elif holds_tensors(state[k]):  # a list, dict, deque or object of tensors: one input per leaf
                    slots += leaf_slots(InputSlot.state(g, i, k), state[k], owned)
            # Tensors hung on the param (Megatron's main_grad): inputs like its state; one that *is*
            # the param, its grad or a state tensor is that input (stand_ins.py points it there)
            mine = {id(p), id(p.grad), *(id(v) for v in state.values() if isinstance(v, torch.Tensor))}
            slots += [InputSlot.param_attribute(g, i, k) for k, v in tensor_attributes(p) if id(v) not in mine]
    # Tensors held as optimizer attributes (GradScaler's grad_scale and
    # found_inf on a fused optimizer, a user's scale tensor, a cache of
    # buffers) and tensor hyperparameters (lr=torch.tensor(0.01)): inputs
    # too, never constants.
    # (one that is a param, grad or state tensor, like QK-Clip's w_q, is that input: not another)
    per_param = {id(slot_tensor(opt, s)) for s in slots}
    slots += [
        InputSlot.attribute(k) for k in sorted(vars(opt))
        if _tensor_attribute(opt, k) and id(vars(opt)[k]) not in per_param
    ]
    for k in container_attributes(opt):
        slots += leaf_slots(InputSlot.attribute(k), vars(opt)[k], owned)
    for g, group in enumerate(opt.param_groups):
        slots += [InputSlot.group_entry(g, k) for k in sorted(group) if k != "params" and _tensor(group[k])]
    for g, group in enumerate(opt.param_groups):  # containers of tensors in a group (buffers kept there)
        for k in group_containers(group):
            slots += leaf_slots(InputSlot.group_entry(g, k), group[k], owned)
    return slots


def _owned(opt: torch.optim.Optimizer) -> set[int]:
    """Ids of the tensors that are inputs by where they live (params, grads, state, tensor
    attributes and group values): a container holding one holds that input, not another."""
    owned: set[int] = set()
    for group in opt.param_groups:
        owned.update(id(v) for v in group.values() if isinstance(v, torch.Tensor))
        for p in group["params"]:
            owned.add(id(p))
            if p.grad is not None:
                owned.add(id(p.grad))
            owned.update(id(v) for v in opt.state.get(p, {}).values() if isinstance(v, torch.Tensor))
            owned.update(id(v) for _, v in tensor_attributes(p))
    return owned | {id(v) for k, v in vars(opt).items() if k != "state" and isinstance(v, torch.Tensor)}


def group_containers(group: dict[str, Any]) -> list[str]:
    """The keys of a param group holding tensors in containers (not its params)."""
    return sorted(k for k, v in group.items() if k != "params" and not _tensor(v) and holds_tensors(v))


def _tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor)


def _tensor_attribute(opt: torch.optim.Optimizer, key: str) -> bool:
    return key != "state" and isinstance(vars(opt)[key], torch.Tensor)


def slot_tensor(opt: torch.optim.Optimizer, slot: InputSlot) -> torch.Tensor:
    if slot.leaf >= 0:
        return leaf(container_value(opt, slot), slot.leaf)
    if slot.kind == "attr":
        return vars(opt)[slot.key]  # type: ignore[no-any-return]
    if slot.kind == "group":
        return opt.param_groups[slot.group][slot.key]  # type: ignore[no-any-return]
    return member_tensor(opt, slot, opt.param_groups[slot.group]["params"][slot.index])


def member_tensor(opt: torch.optim.Optimizer, slot: InputSlot, p: torch.Tensor) -> torch.Tensor:
    """The tensor of a per-param slot (graph.PER_PARAM) for param ``p``: itself, its grad, a state
    entry or a tensor attribute (a stamped program runs one slot for every member of its class)."""
    if slot.kind == "param":
        return p
    if slot.kind == "grad":
        return p.grad  # type: ignore[return-value]
    if slot.kind == "pattr":
        return getattr(p, slot.key)  # type: ignore[no-any-return]
    return opt.state[p][slot.key]  # type: ignore[no-any-return]


def tensor_lookup(opt: torch.optim.Optimizer) -> Callable[[InputSlot], torch.Tensor]:
    """``slot_tensor`` for many slots at once: each container is flattened once, not once per
    leaf (a step with a list per param reads thousands of leaves before every step)."""
    flat: dict[int, list[torch.Tensor]] = {}

    def tensor_of(slot: InputSlot) -> torch.Tensor:
        if slot.leaf < 0:
            return slot_tensor(opt, slot)
        value = container_value(opt, slot)
        leaves = flat.get(id(value))
        if leaves is None:
            leaves = flat[id(value)] = tensor_leaves(value)
        return leaves[slot.leaf]

    return tensor_of


def step_tensors(opt: torch.optim.Optimizer, slots: Any, env: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors for a step's inputs: the optimizer's, and the values its host reads' programs
    computed and hand on (kind "carry", in ``env`` once host_env has run them)."""
    tensor_of = tensor_lookup(opt)
    return [env[s.key] if s.kind == "carry" else tensor_of(s) for s in slots]


def host_env(opt: torch.optim.Optimizer, captured: Any) -> dict[str, Any]:
    """The host inputs' live values, each of the type the user set (int, float, numpy scalar)."""
    env: dict[str, Any] = {}
    for g, group in enumerate(opt.param_groups):
        for key, value in group.items():
            if is_float(value):
                env[f"g{g}.{key}"] = value
            elif isinstance(value, (tuple, list)) and value and is_float(value[0]):
                for i, v in enumerate(value):
                    env[f"g{g}.{key}[{i}]"] = v
    for counter in captured.counters:
        env[counter.name] = slot_tensor(opt, counter.slot).item()
    for slot in captured.lifted:
        env[slot.name()] = slot.read(opt)
    for read in captured.reads:  # in the step's order: a read may use an earlier one's value
        env[read.name] = read.value(lambda s: slot_tensor(opt, s), env)
    return env
