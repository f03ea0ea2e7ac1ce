"""The copies a self-check runs on (self_check.py): some of an optimizer's params, swapped in for one run.

A view holds, per group, copies of the members it keeps (grads and Python attributes with them) and
private copies of what a run may change in place: group entries, optimizer attributes and the kept
members' state (tensors cloned; containers and objects holding tensors, and plain lists and dicts,
deep-copied). The optimizer gets its own objects back after the run (eager_copies.put_back), and the run's
results come back by name: ``g0.p3`` (a param), ``g0.p3.grad``, ``g0.p3.exp_avg`` (state),
``g0.p3.@main_grad`` (a tensor attribute),
``g0.step`` (a group entry), ``attr.calls`` (an attribute), a container's leaves by their path.
"""

from __future__ import annotations

import builtins
import copy
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from ...capture.containers import flatten, holds_tensors
from ...capture.snapshot import random_state_kept
from ...capture.stand_ins import real_id, tensor_attributes
from .eager_copies import copy_param, put_back, require_untouched, tensor_versions
from .slices import sliced


@dataclass
class ViewResult:
    tensors: dict[str, torch.Tensor]
    host: dict[str, Any]  # Python values a step may change: state entries, group entries, attributes
    before: dict[str, torch.Tensor]
    keep: list[list[int]] = field(default_factory=list)  # per group, the members the view held
    base: dict[str, str] = field(default_factory=dict)  # a container leaf's name -> its entry's name

    def entry(self, name: str) -> str:
        return self.base.get(name, name)

    def where(self, name: str) -> str:
        entry = self.entry(name)
        return describe_name(entry) + name[len(entry):]


class View:
    """Copies of some of an optimizer's params (grads, attributes and state with them), swapped in
    for one run: groups hold only ``keep[g]``'s copies, group and attribute tensors are clones."""

    def __init__(self, keep: list[list[int]], rows: dict[tuple[int, int], slice] | None = None) -> None:
        self.keep = keep
        self.rows = rows or {}  # members (group, index) held as copies of their leading rows (check_slices.py)

    def only(self, members: set[tuple[int, int]], opt: torch.optim.Optimizer) -> View:
        """This view's members in ``members`` (and every param without a grad, as the stamp's proof ran)."""
        groups = opt.param_groups
        return View([
            [i for i in keep if (g, i) in members or groups[g]["params"][i].grad is None]
            for g, keep in enumerate(self.keep)
        ], self.rows)

    def run(self, opt: torch.optim.Optimizer, body: Callable[[Any], Any], modes: list[Any] | None = None) -> ViewResult:
        groups = opt.param_groups
        saved_groups, saved_state, saved_attrs = [dict(g) for g in groups], opt.state, dict(vars(opt))
        groups_params = [[g["params"][i] for i in keep] for g, keep in zip(groups, self.keep)]
        versions = tensor_versions(opt)
        rows = self.rows
        copies = [
            [copy_param(group["params"][i], rows.get((g, i))) for i in keep]
            for g, (group, keep) in enumerate(zip(groups, self.keep))
        ]
        # The kept members' tensors, by identity, to their copies: an attribute that *is* a param
        # (QK-Clip's w_q) must be that param's copy in the view, as it is the param itself outside.
        memo: dict[int, Any] = {}
        state: defaultdict[torch.Tensor, dict[Any, Any]] = defaultdict(dict)
        for g, (group, keep, group_copies) in enumerate(zip(groups, self.keep, copies)):
            for i, c in zip(keep, group_copies):
                p = group["params"][i]
                memo[id(p)] = c
                if p.grad is not None and c.grad is not None:
                    memo[id(p.grad)] = c.grad
                real = saved_state.get(p)
                if real is not None:
                    part = rows.get((g, i))
                    state[c] = {k: _private(v if part is None else sliced(v, p, part), memo) for k, v in real.items()}
                    memo.update((id(v), state[c][k]) for k, v in real.items() if isinstance(v, torch.Tensor))
        held = _member_storages(opt, saved_state) if _holds_other_tensors(groups, saved_attrs) else set()
        before: dict[str, torch.Tensor] = {}  # the real tensors: unchanged while the view runs
        for g, (group, keep) in enumerate(zip(groups, self.keep)):
            for i in keep:
                p = group["params"][i]
                part = rows.get((g, i))
                before[f"g{g}.p{i}"] = p if part is None else p[part]
                for key, value in saved_state.get(p, {}).items():
                    if isinstance(value, torch.Tensor):
                        before[f"g{g}.p{i}.{key}"] = value if part is None else sliced(value, p, part)
                for key, value in tensor_attributes(p):  # (a param holding any is never sliced)
                    before[f"g{g}.p{i}.@{key}"] = value
        try:
            with random_state_kept(), torch.no_grad(), ExitStack() as stack:
                for group, group_copies in zip(groups, copies):
                    for key, value in list(group.items()):
                        if key != "params":
                            group[key] = _private(value, memo, held, f"param group entry {key!r}")
                    group["params"] = group_copies
                for key, value in saved_attrs.items():
                    if key not in ("param_groups", "state", "defaults"):
                        private = _private(value, memo, held, f"optimizer attribute {key!r}")
                        if private is not value:
                            setattr(opt, key, private)
                opt.state = state
                for mode in modes or []:
                    stack.enter_context(mode)
                stack.enter_context(_ids_of_the_real(copies, groups_params))
                body(opt)
            result = self._collect(opt, copies, before)
        finally:
            put_back(opt, saved_state, saved_groups, saved_attrs)
        require_untouched(opt, versions, RuntimeError)
        return result

    def _collect(self, opt: torch.optim.Optimizer, copies: list[list[torch.Tensor]], before: dict) -> ViewResult:
        result = ViewResult({}, {}, before, self.keep)
        members: set[int] = set()  # a group entry or attribute that *is* a member's tensor is compared as that
        for g, (keep, group_copies) in enumerate(zip(self.keep, copies)):
            for i, c in zip(keep, group_copies):
                name = f"g{g}.p{i}"
                result.tensors[name] = c.detach()
                members.add(id(c))
                result.host[name + ".grad?"] = c.grad is not None
                if c.grad is not None:
                    result.tensors[name + ".grad"] = c.grad.detach()
                    members.add(id(c.grad))
                for key, value in tensor_attributes(c):  # main_grad: its own copy, written in place
                    if value is not c and value is not c.grad:
                        result.tensors[f"{name}.@{key}"] = value.detach()
                        members.add(id(value))
                entries = opt.state.get(c, {})
                result.host[name + ".keys"] = sorted(map(str, entries))
                for key, value in entries.items():
                    _put(result, f"{name}.{key}", value)
                    members |= {id(value)} if isinstance(value, torch.Tensor) else set()
        for g, group in enumerate(opt.param_groups):
            for key, value in group.items():
                if key != "params" and id(value) not in members:
                    _put(result, f"g{g}.{key}", value)
        for key, value in vars(opt).items():
            if key not in ("param_groups", "state", "defaults") and id(value) not in members:
                _put(result, f"attr.{key}", value)
        return result


def _put(result: ViewResult, name: str, value: Any) -> None:
    if isinstance(value, torch.Tensor):
        result.tensors[name] = value.detach()
    elif holds_tensors(value):  # a container or an object holding tensors: its leaves, and its structure
        try:
            leaves, spec, paths = flatten(value)
        except ValueError as exc:
            result.host[name] = f"<{exc}>"
            return
        result.host[name + " (structure)"] = spec.signature()
        for leaf, path in zip(leaves, paths):
            result.tensors[name + path] = leaf.detach()
            result.base[name + path] = name
    elif _plain(value):
        result.host[name] = value


def _plain(value: Any, depth: int = 0) -> bool:
    """Numbers, strings and containers of them: what a step's Python state is made of."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if depth < 4 and isinstance(value, (list, tuple)):
        return all(_plain(v, depth + 1) for v in value)
    if depth < 4 and isinstance(value, dict):
        return all(_plain(k, depth + 1) and _plain(v, depth + 1) for k, v in value.items())
    return False


def _plain_container(value: Any) -> bool:
    return isinstance(value, (list, dict)) and _plain(value)


class UnfaithfulView(RuntimeError):
    """A view cannot hold what the optimizer holds (an attribute that is a slice of a param)."""


def _private(value: Any, memo: dict[int, Any], held: set[int] | None = None, where: str = "") -> Any:
    """A copy of a group entry, attribute or state entry that a run on the view may change in place
    (a counter list, a projector object in state, a dict of scratch buffers); the value itself where
    nothing in it can change (numbers, strings, functions, process groups). ``memo``: real tensors that
    have a copy in the view already (the kept params, grads, state); ``held``: the storages of every
    member's tensors, which a tensor other than those must not share."""
    if isinstance(value, torch.Tensor):
        if id(value) in memo:
            return memo[id(value)]
        if held and value.untyped_storage().data_ptr() in held:
            raise UnfaithfulView(f"{where} shares memory with a param, its grad or its state without being one")
        return value.detach().clone()
    if holds_tensors(value) or _plain_container(value):
        try:
            return copy.deepcopy(value, dict(memo))
        except Exception:  # noqa: BLE001 - a value deepcopy refuses is shared with the view
            return value
    return value


def _holds_other_tensors(groups: list[dict[str, Any]], attrs: dict[str, Any]) -> bool:
    values = [v for g in groups for k, v in g.items() if k != "params"] + list(attrs.values())
    return any(isinstance(v, torch.Tensor) for v in values)


def _member_storages(opt: torch.optim.Optimizer, state: Any) -> set[int]:
    out: set[int] = set()
    for group in opt.param_groups:
        for p in group["params"]:
            out.add(p.untyped_storage().data_ptr())
            if p.grad is not None:
                out.add(p.grad.untyped_storage().data_ptr())
            out |= {v.untyped_storage().data_ptr() for v in state.get(p, {}).values() if isinstance(v, torch.Tensor)}
    return out


@contextmanager
def _ids_of_the_real(copies: list[list[torch.Tensor]], reals: list[list[torch.Tensor]]) -> Iterator[None]:
    """``id(copy)`` is the real param's in the user's code (``id(p) in self.no_decay_ids``), as the
    capture answers it for its stand-ins (stand_ins.real_id); torch's and hocompile's own ids stay."""
    saved = builtins.id
    builtins.id = real_id({saved(c): p for cs, ps in zip(copies, reals) for c, p in zip(cs, ps)}, saved)
    try:
        yield
    finally:
        builtins.id = saved


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if torch.equal(a, b):
        return True
    return a.is_floating_point() and bool(((a == b) | (a.isnan() & b.isnan())).all())


def describe_name(name: str) -> str:
    """``g0.p3.momentum_buffer`` -> ``param_groups[0]['params'][3] state 'momentum_buffer'``."""
    head, _, rest = name.partition(".")
    if head == "attr":
        return f"optimizer attribute {rest!r}"
    g = head[1:]
    if not rest.startswith("p") or not rest[1:].split(".", 1)[0].isdigit():
        return f"param_groups[{g}][{rest!r}]"
    index, _, key = rest[1:].partition(".")
    where = f"param_groups[{g}]['params'][{index}]"
    if not key:
        return where
    if key in ("grad", "grad?"):
        return f"{where}.grad"
    if key == "keys":
        return f"{where}'s state keys"
    if key.startswith("@"):
        return f"{where}.{key[1:]}"
    return f"{where} state {key!r}"
