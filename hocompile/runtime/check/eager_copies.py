"""Eager's step on copies of the optimizer's tensors, and everything put back after.

verify=N (verify.py), the self-check's view (view.py) and the judgement (judgement.py) each run
the optimizer's own step eagerly without touching what the compiled step will read:
:func:`eager_step` runs it on copies of the params (grads attached) and state and returns the
result as a :class:`Mirror`, which can be installed in place of the compiled step's result when
a check fails; :func:`put_back` restores the optimizer's own objects; :func:`tensor_versions` and
:func:`require_untouched` prove a run wrote nothing of the real tensors.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch

from ...capture.host_state import HostSlot
from ...capture.stand_ins import tensor_attributes
from ...capture.trace import unwrapped_step
from ...errors import VerificationError


@dataclass
class Mirror:
    """The eager step's result on copies: each group's params (grads attached) and their state."""

    params: list[list[torch.Tensor]]
    state: defaultdict[torch.Tensor, dict[Any, Any]]
    host: dict[HostSlot, Any]  # the Python numbers the compiled step updates on the host, as eager left them
    # Tensors held directly in param groups and optimizer attributes (a step counter group["step"]),
    # as eager left them: eager ran on clones of them, so the real ones are the compiled step's alone.
    group_tensors: list[dict[str, torch.Tensor]] = field(default_factory=list)
    attr_tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    def install(self, opt: torch.optim.Optimizer) -> None:
        """Give ``opt`` this result, in place where the layout allows (state may alias batched banks)."""
        with torch.no_grad():
            for group, copies in zip(opt.param_groups, self.params):
                for p, c in zip(group["params"], copies):
                    hung = [(v, getattr(c, k)) for k, v in tensor_attributes(p) if v is not p and v is not p.grad]
                    p.copy_(c)
                    for value, eager_value in hung:  # main_grad: written in place, as eager's step did
                        value.copy_(eager_value)
                    if c.grad is None:
                        p.grad = None
                    elif p.grad is not None and _same_layout(p.grad, c.grad):
                        p.grad.copy_(c.grad)
                    else:
                        p.grad = c.grad
                    if c not in self.state:
                        opt.state.pop(p, None)
                        continue
                    real, new = opt.state[p], self.state[c]
                    for key in [k for k in real if k not in new]:
                        del real[key]
                    for key, value in new.items():
                        old = real.get(key)
                        tensors = isinstance(value, torch.Tensor) and isinstance(old, torch.Tensor)
                        if tensors and _same_layout(old, value):
                            old.copy_(value)
                        else:
                            real[key] = value
            for group, held in zip(opt.param_groups, self.group_tensors):
                for key, value in held.items():
                    _put(group, key, value)
            for key, value in self.attr_tensors.items():
                old = vars(opt).get(key)
                if isinstance(old, torch.Tensor) and _same_layout(old, value):
                    old.copy_(value)
                else:
                    setattr(opt, key, value)
            for slot, value in self.host.items():
                slot.write(opt, value)


def _put(group: dict[str, Any], key: str, value: torch.Tensor) -> None:
    old = group.get(key)
    if isinstance(old, torch.Tensor) and _same_layout(old, value):
        old.copy_(value)
    else:
        group[key] = value


def eager_step(opt: torch.optim.Optimizer, host: list[HostSlot]) -> Mirror:
    """Run ``opt``'s own step on copies; every Python-level change it makes to ``opt`` is undone
    (``host``: Python values whose new value is read before that, to compare with the compiled step's)."""
    groups = opt.param_groups
    copies = [[copy_param(p) for p in group["params"]] for group in groups]
    state: defaultdict[torch.Tensor, dict[Any, Any]] = defaultdict(dict)
    for group, group_copies in zip(groups, copies):
        for p, c in zip(group["params"], group_copies):
            if p in opt.state:
                state[c] = {k: v.detach().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)
                            for k, v in opt.state[p].items()}
    versions = tensor_versions(opt)
    saved_groups = [dict(group) for group in groups]
    saved_state = opt.state
    saved_attrs = dict(vars(opt))
    # A tensor in a group or an attribute (group["step"] = torch.tensor(0.)) is updated in place
    # by the step: eager runs on a clone, or the compiled step would apply it a second time.
    group_keys = [[k for k, v in g.items() if k != "params" and isinstance(v, torch.Tensor)] for g in groups]
    attr_keys = [k for k, v in saved_attrs.items() if isinstance(v, torch.Tensor)]
    try:
        for group, group_copies, keys in zip(groups, copies, group_keys):
            group["params"] = group_copies
            for key in keys:
                group[key] = group[key].detach().clone()
        for key in attr_keys:
            setattr(opt, key, saved_attrs[key].detach().clone())
        opt.state = state
        with torch.no_grad():
            unwrapped_step(opt)(opt)
        after = {slot: copy.deepcopy(slot.read(opt)) for slot in host}
        group_after = [
            {k: g[k] for k in keys if isinstance(g.get(k), torch.Tensor)} for g, keys in zip(groups, group_keys)
        ]
        attrs_after = {k: vars(opt)[k] for k in attr_keys if isinstance(vars(opt).get(k), torch.Tensor)}
    finally:
        put_back(opt, saved_state, saved_groups, saved_attrs)
    require_untouched(opt, versions, VerificationError, "verify: ", "; it cannot be verified against eager")
    return Mirror(copies, state, after, group_after, attrs_after)


def put_back(
    opt: torch.optim.Optimizer, state: Any, groups: list[dict[str, Any]], attrs: dict[str, Any]
) -> None:
    """Give ``opt`` back the state dict, group contents and attributes an eager run on copies replaced."""
    opt.state = state
    for group, saved in zip(opt.param_groups, groups):
        group.clear()
        group.update(saved)
    for key in set(vars(opt)) - set(attrs):
        delattr(opt, key)
    for key, value in attrs.items():
        if vars(opt).get(key) is not value:
            setattr(opt, key, value)


def copy_param(p: torch.Tensor, rows: slice | None = None) -> torch.Tensor:
    """A copy of ``p`` with its grad and Python attributes; of its leading ``rows`` only if given."""
    c = (p.detach() if rows is None else p.detach()[rows]).clone()
    if isinstance(p, torch.nn.Parameter):
        c = torch.nn.Parameter(c, requires_grad=p.requires_grad)
    elif p.requires_grad:
        c.requires_grad_(True)
    if p.grad is not None:
        c.grad = (p.grad.detach() if rows is None else p.grad.detach()[rows]).clone()
    # What the step reads of the param besides its data (Megatron's is_qkv, partition_dim): the
    # copy must take the same branches, or eager on copies is another step (stand_ins.py).
    c.__dict__.update(p.__dict__)
    # Tensors hung on it (main_grad) are inputs the step may write in place: copies of their own
    # (the grad or the param itself where the attribute is that very tensor). A sliced copy has
    # none to slice: check_slices does not slice such a param.
    for key, value in tensor_attributes(p):
        setattr(c, key, c if value is p else c.grad if value is p.grad else value.detach().clone())
    return c


def require_untouched(
    opt: torch.optim.Optimizer, versions: list[int], error: type[Exception], prefix: str = "", suffix: str = ""
) -> None:
    """Raise ``error`` if an eager run on copies changed the optimizer's own tensors (``tensor_versions``)."""
    if tensor_versions(opt) != versions:
        raise error(
            f"{prefix}{type(opt).__name__}.step changed the optimizer's own tensors while running on copies "
            f"(it holds references outside param_groups and state){suffix}"
        )


def tensor_versions(opt: torch.optim.Optimizer) -> list[int]:
    out: list[int] = []
    for group in opt.param_groups:
        for p in group["params"]:
            out += [p._version, -1 if p.grad is None else p.grad._version]
            out += [v._version for v in opt.state.get(p, {}).values() if isinstance(v, torch.Tensor)]
            out += [v._version for _, v in tensor_attributes(p)]
    return out


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.device == b.device


# ------------------------------------------------------------ comparing
