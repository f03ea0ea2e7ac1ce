"""The step signature checked without recomputing it: O(groups) in Python, the tensors in C.

:func:`~hocompile.runtime.guards.signature` builds a tuple per param every
step: ~4 µs per param, more than eager spends on a small param. A
:class:`FastGuard` is built once for a signature and then answers "is the
optimizer still at that signature?" by:

- recomputing what is O(groups): the optimizer's attributes and each group's options;
- comparing each group's params by identity (``map(id, params)``, in C);
- reading each param's grad and state dict, checking which grads are None and
  each dict's keys (by count and lookup), and any Python values held in state;
- checking every param, grad and state tensor's shape, strides, dtype, device
  and layout in one C call (``torch._C._dynamo.guards.TensorGuards``, what
  torch.compile's own guards are made of; a Python loop where it is missing).

It is stricter than the signature (strides and ``requires_grad`` too), never
looser: when it fails, the runtime computes the real signature and looks the
step up as before. The state dicts of ``opt.state`` are cached while the dict
itself is unchanged (its version tag, which every insertion, deletion and
assignment bumps); the keys inside them are read every step.
"""

from __future__ import annotations

from collections.abc import Callable
from operator import attrgetter
from typing import Any

import torch

from ..capture.host_state import HostSlot
from ..capture.stand_ins import frozen_attributes
from .guards import Signature, attributes, group_options, state_value

TensorGuards: Any
dict_version: Any
try:  # torch's C guards: present in torch 2.x; a Python check stands in where they are not
    from torch._C._dynamo.guards import TensorGuards, dict_version
except ImportError:  # pragma: no cover - depends on the torch build
    TensorGuards, dict_version = None, None

_grad = attrgetter("grad")


def _tensor_check(tensors: list[torch.Tensor]) -> Callable[[list[torch.Tensor]], bool]:
    if TensorGuards is not None:
        guard = TensorGuards(
            *tensors,
            dynamic_dims_sizes=[list(t.shape) for t in tensors],
            dynamic_dims_strides=[list(t.stride()) for t in tensors],
        )
        return lambda now: bool(guard.check(*now))
    want = [(t.shape, t.stride(), t.dtype, t.device, t.layout, t.requires_grad, type(t)) for t in tensors]

    def check(now: list[torch.Tensor]) -> bool:
        have = [(t.shape, t.stride(), t.dtype, t.device, t.layout, t.requires_grad, type(t)) for t in now]
        return have == want

    return check


def _is_tensor_sig(value: Any) -> bool:
    return isinstance(value, tuple) and value[:1] == ("tensor",)


class FastGuard:
    """Whether ``opt`` is still at ``sig`` (built while it is); see the module docstring."""

    def __init__(
        self,
        opt: torch.optim.Optimizer,
        sig: Signature,
        structural: frozenset[str],
        lifted: frozenset[HostSlot],
        candidates: list[Any],
    ) -> None:
        # ``candidates``: the compiled steps held for ``sig`` (the runtime's own list: hashing a
        # signature is O(params), so a step that passes this guard does not look it up again)
        self.sig, self.structural, self.lifted, self.candidates = sig, structural, lifted, candidates
        self.ids = [tuple(p.ident for p in g.params) for g in sig.groups]
        # Per group, per param: whether it has a grad, its state keys, and the Python values in
        # state the signature holds by value (key, index, frozen value).
        self.has_grad = [tuple(p.grad is not None for p in g.params) for g in sig.groups]
        self.keys = [tuple(tuple(k for k, _ in p.state) for p in g.params) for g in sig.groups]
        # Params' Python attributes (stand_ins.py; requires_grad is in the tensor check): per param, a
        # shallow copy of its __dict__ (None where empty: one truthiness test per step), compared as a
        # dict in C (the same objects short-circuit); params holding a list, dict or set, which can
        # change in place, are compared frozen as the signature does (``self.deep``).
        self.attrs: list[list[dict[str, Any] | None]] = []
        self.deep: list[set[int]] = []
        for group, gsig in zip(opt.param_groups, sig.groups):
            dicts: list[dict[str, Any] | None] = []
            deep: set[int] = set()
            for i, (p, psig) in enumerate(zip(group["params"], gsig.params)):
                if not psig.attributes:
                    dicts.append(None)
                    continue
                dicts.append(dict(p.__dict__))
                if any(isinstance(v, (list, dict, set)) for v in p.__dict__.values()):
                    deep.add(i)
            self.attrs.append(dicts)
            self.deep.append(deep)
        self.values = [
            [(k, i, v) for i, p in enumerate(g.params) for k, v in p.state if not _is_tensor_sig(v)]
            for g in sig.groups
        ]
        self._state_obj: Any = None
        self._state_version = -1
        self._dicts: list[list[dict[Any, Any]]] = []
        gathered = self.gather(opt)
        self.check = _tensor_check(gathered) if gathered is not None else (lambda now: False)

    def _state_dicts(self, opt: torch.optim.Optimizer) -> list[list[dict[Any, Any]]]:
        state = opt.state
        version = dict_version(state) if dict_version is not None and isinstance(state, dict) else -2
        if state is self._state_obj and version == self._state_version and version != -2:
            return self._dicts
        empty: dict[Any, Any] = {}
        self._dicts = [[state.get(p, empty) for p in group["params"]] for group in opt.param_groups]
        self._state_obj, self._state_version = state, version
        return self._dicts

    def gather(self, opt: torch.optim.Optimizer) -> list[torch.Tensor] | None:
        """Every param, grad and state tensor in signature order; None when the structure differs."""
        groups = opt.param_groups
        if len(groups) != len(self.ids):
            return None
        out: list[torch.Tensor] = []
        for group, ids in zip(groups, self.ids):
            params = group["params"]
            if tuple(map(id, params)) != ids:
                return None
        dicts = self._state_dicts(opt)
        for g, (group, has_grad, keys, attrs) in enumerate(zip(groups, self.has_grad, self.keys, self.attrs)):
            params = group["params"]
            grads = list(map(_grad, params))
            if [grad is not None for grad in grads] != list(has_grad):
                return None
            for i, (p, grad, d, k, a) in enumerate(zip(params, grads, dicts[g], keys, attrs)):
                if len(d) != len(k):
                    return None
                if (a is not None or p.__dict__) and not self._same_attributes(g, i, p, a):
                    return None
                out.append(p)
                if grad is not None:
                    out.append(grad)
                try:
                    out += [v for v in (d[key] for key in k) if isinstance(v, torch.Tensor)]
                except KeyError:
                    return None
        return out

    def _same_attributes(self, g: int, i: int, p: torch.Tensor, saved: dict[str, Any] | None) -> bool:
        if saved is None:
            return False  # it had none when the step was compiled
        if i in self.deep[g]:
            return frozen_attributes(p) == self.sig.groups[g].params[i].attributes
        try:
            return bool(p.__dict__ == saved)
        except Exception:  # noqa: BLE001 - a value that cannot compare (a new tensor): the signature decides
            return False

    def holds(self, opt: torch.optim.Optimizer) -> bool:
        sig = self.sig
        if attributes(opt, self.lifted) != sig.attributes:
            return False
        for g, group in enumerate(opt.param_groups[: len(sig.groups)]):
            if group_options(g, group, self.structural, self.lifted) != sig.groups[g].options:
                return False
        tensors = self.gather(opt)
        if tensors is None or not self.check(tensors):
            return False
        dicts = self._dicts
        for g, values in enumerate(self.values):
            for key, i, frozen in values:
                if state_value(key, g, i, dicts[g][i][key], self.lifted) != frozen:
                    return False
        return True
