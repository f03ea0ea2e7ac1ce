"""The capture's side of tensors in containers (containers.py has the structures themselves).

Before the trace, each container the step could read or change (a state entry
or an optimizer attribute holding tensors, or an empty list/dict/deque the
step may fill: a lazily built cache) is replaced by a copy holding fakes. After
it, :meth:`ContainerTrace.finish` compares each copy with what went in:

- same structure, same tensors: nothing (in-place updates are graph outputs already);
- same structure, some leaves replaced: those leaves are outputs, written into
  the real container in place (``replace_leaves``);
- a new structure (created by the step, grown, reshaped): a :class:`TreeWrite`
  rebuilds the container after the step from the step's outputs and the
  tensors that went in.

The structure is in the step's signature (guards.py), so a compiled step only
runs on the structure it was traced on; a container that grows every step
recompiles every step until the recompile limit, then runs eagerly, saying so.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import CaptureError
from ..ir.graph import InputSlot
from .containers import Spec, flatten, holds_tensors, is_mutable_container, rebuild, replace_leaves, unflatten
from .host_state import MISSING, is_constant
from .hyper_params import HyperParam

# Attributes every torch Optimizer has (hooks, profiling names): never the step's data.
_OPTIMIZER_INTERNALS = frozenset({"state", "param_groups", "defaults"})


def _torch_internal(key: str) -> bool:
    return key in _OPTIMIZER_INTERNALS or key.startswith(("_optimizer_", "_zero_grad", "_opt_called", "_patched"))


def container_attributes(opt: torch.optim.Optimizer) -> list[str]:
    """Optimizer attributes a trace substitutes a copy for: those holding tensors in containers,
    and empty lists, dicts and deques (a cache the step may fill)."""
    keys = []
    for key, value in vars(opt).items():
        if _torch_internal(key) or isinstance(value, torch.Tensor):
            continue
        if holds_tensors(value) or (is_mutable_container(value) and not _has_items(value)):
            keys.append(key)
    return sorted(keys)


def _has_items(value: Any) -> bool:
    try:
        return len(value) > 0
    except TypeError:
        return True


def leaf_slots(base: InputSlot, value: Any, owned: set[int]) -> list[InputSlot]:
    """The input slots of ``value``'s tensor leaves (``owned``: ids of params and grads, which
    are inputs already and stand in the container as themselves)."""
    leaves, _, paths = flatten(value)
    slots = []
    for j, (t, path) in enumerate(zip(leaves, paths)):
        if id(t) not in owned:  # the first place a tensor is found is its input; the rest alias it
            owned.add(id(t))
            slots.append(base.leaf_at(j, path))
    return slots


@dataclass(frozen=True)
class TreeWrite:
    """After the step: ``base`` = a new container of ``spec``, its tensor leaves taken, in order,
    from ``sources``: ("out", slot) a graph output, ("in", slot) a tensor that went in."""

    base: InputSlot
    spec: Spec
    sources: tuple[tuple[str, InputSlot], ...]
    new: bool = True  # the step created it (False: it reshaped one that held tensors: a growing list)


@dataclass
class ContainerTrace:
    """The containers one trace substituted, and what the step left in them."""

    by_slot: dict[InputSlot, torch.Tensor]
    fake_of: dict[int, torch.Tensor]  # id(real param or grad) -> its fake
    inputs: dict[InputSlot, tuple[Spec, list[torch.Tensor]]] = field(default_factory=dict)
    trees: list[TreeWrite] = field(default_factory=list)
    copies: dict[InputSlot, Any] = field(default_factory=dict)
    produced: dict[int, InputSlot] = field(default_factory=dict)  # id(tensor the step made) -> its output

    def install(self, base: InputSlot, real: Any) -> Any:
        """A copy of ``real`` holding the trace's fakes."""
        leaves, spec, paths = flatten(real)
        fakes = []
        for j, (t, path) in enumerate(zip(leaves, paths)):
            slot = base.leaf_at(j, path)
            fake = self.by_slot.get(slot, self.fake_of.get(id(t)))
            if fake is None:
                raise CaptureError(f"{slot.describe()} is a tensor hocompile does not substitute")
            fakes.append(fake)
        self.inputs[base] = (spec, fakes)
        self.copies[base] = rebuild(real, fakes)
        return self.copies[base]

    def assign_tensor(self, base: InputSlot, after: Any, assigns: list[InputSlot], values: list[torch.Tensor]) -> bool:
        """A group entry or attribute the step set to a tensor (dion's lazily made lr tensor): written
        after the step, the very tensor that went in where it is one; False when ``after`` is no tensor."""
        if not isinstance(after, torch.Tensor):
            return False
        self._sources(base, [after], [""], Spec("tensor"), assigns, values, new=True)
        return True

    def _sources(
        self, base: InputSlot, leaves: list[torch.Tensor], paths: list[str], spec: Spec,
        assigns: list[InputSlot], values: list[torch.Tensor], new: bool,
    ) -> None:
        went_in = {id(t): s for s, t in self.by_slot.items()}
        sources: list[tuple[str, InputSlot]] = []
        for j, (t, path) in enumerate(zip(leaves, paths)):
            if id(t) in went_in:
                sources.append(("in", went_in[id(t)]))
            elif id(t) in self.produced:  # one tensor the step made, kept in two places: one output
                sources.append(("out", self.produced[id(t)]))
            else:
                slot = base.leaf_at(j, path)
                assigns.append(slot)
                values.append(t)
                self.produced[id(t)] = slot
                sources.append(("out", slot))
        self.trees.append(TreeWrite(base, spec, tuple(sources), new))

    def finish(self, base: InputSlot, after: Any, assigns: list[InputSlot], values: list[torch.Tensor]) -> bool:
        """Record what the step did to ``base``'s container; False when it is not one (the caller's case)."""
        if base.kind == "attr" and _torch_internal(base.key):
            return False  # param_groups, state, defaults: the capture's own business
        if not holds_tensors(after) and (base not in self.inputs or after is not self.copies[base]):
            return False  # not a container of tensors, or one the step replaced by another value: Python state
        if after is MISSING:
            raise CaptureError(f"the step deletes {base.describe()}, a container of tensors; hocompile cannot")
        leaves, spec, paths = flatten(after)
        before = {id(v) for v in _values(self.inputs[base][0])} if base in self.inputs else set()
        _check_values(base, spec, before)
        if base in self.inputs and self.inputs[base][0].signature() == spec.signature():
            for j, (now, was) in enumerate(zip(leaves, self.inputs[base][1])):
                if now is not was:
                    assigns.append(base.leaf_at(j, paths[j]))
                    values.append(now)
            return True
        if not leaves and base in self.inputs and not self.inputs[base][1]:
            # a Python-only container (an empty cache that stayed without tensors): its
            # changes are the host's, and a compiled step cannot repeat them
            raise CaptureError(
                f"the step changes {base.describe()} (a container without tensors) on the host; a compiled "
                "step cannot repeat that. Keep such values in tensors, or pass fallback='eager'"
            )
        new = base not in self.inputs or not self.inputs[base][1]
        self._sources(base, leaves, paths, spec, assigns, values, new)
        return True


def _values(spec: Spec) -> list[Any]:
    if spec.kind == "value":
        return [spec.value]
    return [v for child in spec.children for v in _values(child)]


def _plain(value: Any) -> bool:
    return is_constant(value) or isinstance(value, (bytes, torch.dtype, torch.device))


def _check_values(base: InputSlot, spec: Spec, before: set[int]) -> None:
    """What a rebuilt container may hold besides tensors: plain values, and objects that were there."""
    if spec.kind == "value" and isinstance(spec.value, HyperParam):
        raise CaptureError(
            f"the step stores a hyperparameter-derived number in {base.describe()}, a container of tensors; "
            "hocompile cannot carry it there. Keep it in a tensor or in the param group"
        )
    if spec.kind == "value" and not _plain(spec.value) and id(spec.value) not in before:
        raise CaptureError(
            f"the step stores a new {type(spec.value).__name__} in {base.describe()}, a container of tensors; "
            "a compiled step cannot create Python objects (only tensors, numbers and strings there)"
        )
    if spec.kind == "dict" and any(isinstance(k, torch.Tensor) for k in spec.keys):
        raise CaptureError(
            f"the step keys {base.describe()} by tensors (a dict from params to their state): hocompile "
            "cannot carry such a dict; keep per-param state in `state`, or pass fallback='eager'"
        )
    for child in spec.children:
        _check_values(base, child, before)


def _base(slot: InputSlot) -> InputSlot:
    return slot.whole()


def container_value(opt: torch.optim.Optimizer, base: InputSlot) -> Any:
    """The value a container slot names: an attribute's, a group entry's or a state entry's."""
    if base.kind == "attr":
        return vars(opt)[base.key]
    if base.kind == "group":
        return opt.param_groups[base.group][base.key]
    return opt.state[opt.param_groups[base.group]["params"][base.index]][base.key]


def _set(opt: torch.optim.Optimizer, base: InputSlot, value: Any) -> None:
    if base.kind == "attr":
        setattr(opt, base.key, value)
    elif base.kind == "group":
        opt.param_groups[base.group][base.key] = value
    else:
        opt.state[opt.param_groups[base.group]["params"][base.index]][base.key] = value


def write_containers(
    opt: torch.optim.Optimizer,
    trees: tuple[TreeWrite, ...],
    outputs: dict[InputSlot, torch.Tensor],
    inputs: dict[InputSlot, torch.Tensor],
) -> None:
    """After a compiled step: leaves the step replaced go into their containers in place; the
    containers it created or reshaped are rebuilt (``inputs``: the tensors that went in)."""
    rebuilt = {t.base for t in trees}
    in_place: dict[InputSlot, dict[int, torch.Tensor]] = {}
    for slot, value in outputs.items():
        if _base(slot) not in rebuilt:
            in_place.setdefault(_base(slot), {})[slot.leaf] = value
    for base, new in in_place.items():
        container = container_value(opt, base)
        replaced = replace_leaves(container, new)
        if replaced is not container:  # a tuple: rebuilt, not changed in place
            _set(opt, base, replaced)
    for tree in trees:
        tensors = [outputs[s] if how == "out" else inputs[s] for how, s in tree.sources]
        _set(opt, tree.base, unflatten(tree.spec, tensors))


def containers_held(opt: torch.optim.Optimizer) -> str:
    """Where the optimizer keeps tensors in containers (or a cache it may fill), for messages; '' if nowhere."""
    where = [f"optimizer attribute {k!r}" for k in container_attributes(opt)]
    for state in opt.state.values():
        where += [f"state[p][{k!r}]" for k, v in state.items() if not isinstance(v, torch.Tensor) and holds_tensors(v)]
        if len(where) > 2:
            break
    return ", ".join(dict.fromkeys(where[:3]))


def leaf_aliases(
    opt: torch.optim.Optimizer, slots: list[InputSlot], tensor_of: Any
) -> tuple[tuple[InputSlot, InputSlot], ...]:
    """The container leaves that are another input's very tensor (a cached lr that is also the
    group's), as (leaf, that input); refuses a leaf that shares storage with another input
    without being it (a view), whose writes a functional graph would not see through."""
    by_id = {id(tensor_of(s)): s for s in slots}
    storages: dict[int, InputSlot] = {}
    for s in slots:
        t = tensor_of(s)
        ptr = _storage(t)
        if not ptr:
            continue
        other = storages.setdefault(ptr, s)
        if other is not s and (s.leaf >= 0 or other.leaf >= 0) and tensor_of(other) is not t:
            raise CaptureError(
                f"{s.describe()} shares memory with {other.describe()} (a view of it, or it of the "
                "other): a compiled step would update them independently. Keep one of them only, "
                "or pass fallback='eager'"
            )
    inputs = set(slots)
    pairs = []
    for key, value in vars(opt).items():  # a tensor attribute that is another input (a param)
        attr = InputSlot.attribute(key)
        if key != "state" and isinstance(value, torch.Tensor) and attr not in inputs and id(value) in by_id:
            pairs.append((attr, by_id[id(value)]))
    for base, value in _containers(opt):
        leaves, _, paths = flatten(value)
        for j, (t, path) in enumerate(zip(leaves, paths)):
            leaf = base.leaf_at(j, path)
            if leaf not in inputs and id(t) in by_id:
                pairs.append((leaf, by_id[id(t)]))
    return tuple(pairs)


def _containers(opt: torch.optim.Optimizer) -> list[tuple[InputSlot, Any]]:
    found = [(InputSlot.attribute(k), vars(opt)[k]) for k in container_attributes(opt)]
    for g, group in enumerate(opt.param_groups):
        found += [(InputSlot.group_entry(g, k), v) for k, v in sorted(group.items())
                  if k != "params" and not isinstance(v, torch.Tensor) and holds_tensors(v)]
    for g, group in enumerate(opt.param_groups):
        for i, p in enumerate(group["params"]):
            for k, v in sorted(opt.state.get(p, {}).items()):
                if not isinstance(v, torch.Tensor) and holds_tensors(v):
                    found.append((InputSlot.state(g, i, k), v))
    return found


def aliases_hold(opt: torch.optim.Optimizer, inputs: tuple[InputSlot, ...], aliases: Any, tensor_of: Any) -> bool:
    """Whether the container leaves alias the inputs as they did when the step was captured."""
    if any(tensor_of(leaf) is not tensor_of(target) for leaf, target in aliases):
        return False
    ids = [id(tensor_of(s)) for s in inputs]
    return len(set(ids)) == len(ids)


def _storage(t: torch.Tensor) -> int:
    """Where ``t``'s memory starts (0: none to compare: empty, meta, a wrapper without storage)."""
    if t.device.type == "meta" or not t.numel():
        return 0
    try:
        return int(t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):
        return 0
