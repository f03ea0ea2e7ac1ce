"""Everything a traced step could change besides what the capture substitutes.

The capture hands the step fake tensors through the optimizer's own
``param_groups``, grads and ``state`` (and puts those back). A step can reach
further: a sub-optimizer's ``state`` dict (a wrapper that steps an owned Muon
and AdamW), a list the optimizer caches tensors in, a dict of buffers. A
write there during the trace would leave fake tensors behind, and worse, the
graph would not carry that state from one step to the next: a compiled step
that silently restarts its momentum every step.

So before tracing, :class:`Snapshot` records the contents of every container
reachable from the optimizer (dicts, lists, plain objects' attributes; not
tensors' contents); afterwards it lists what the step changed, puts it back,
and the capture refuses naming the place.
"""

from __future__ import annotations

import logging
import types
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

log = logging.getLogger("hocompile.capture")

_MAX_OBJECTS = 20_000  # a bound on the walk: optimizers that reference a whole model stay cheap
_MAX_DEPTH = 6


@contextmanager
def random_state_kept() -> Iterator[None]:
    """The CPU (and initialised CUDA) random states as they were before the block.

    A user's step that draws noise (``torch.randn_like``) must draw what eager would: whatever
    hocompile runs besides the step (compiling, with its calibration GEMMs and stack timings on
    random inputs; the self-check's copies) must not move the stream.
    """
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


def _is_container(value: Any) -> bool:
    return isinstance(value, (dict, list)) or _has_plain_dict(value)


def _has_plain_dict(value: Any) -> bool:
    """Plain Python objects and optimizers; not tensors, modules, classes or callables (nn.Module)."""
    if isinstance(value, (torch.Tensor, type, types.ModuleType)):
        return False
    return hasattr(value, "__dict__") and not callable(value)


def _contents(value: Any) -> Any:
    if isinstance(value, dict):
        return dict(value)
    if isinstance(value, list):
        return list(value)
    return dict(vars(value))


def _children(value: Any) -> Iterator[tuple[str, Any]]:
    if isinstance(value, dict):
        for key, item in value.items():
            yield f"[{key!r}]" if isinstance(key, (str, int)) else "[<key>]", item
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield f"[{index}]", item
    else:
        for key, item in vars(value).items():
            yield f".{key}", item


class Snapshot:
    """Contents of the containers reachable from ``root``, except those in ``skip``."""

    def __init__(self, root: Any, skip: set[int]) -> None:
        self.saved: dict[int, tuple[str, Any, Any]] = {}  # id -> (path, container, contents)
        frontier: list[tuple[str, Any, int]] = [("opt", root, 0)]
        while frontier and len(self.saved) < _MAX_OBJECTS:
            path, value, depth = frontier.pop()
            if id(value) in self.saved or id(value) in skip:
                continue
            self.saved[id(value)] = (path, value, _contents(value))
            if depth >= _MAX_DEPTH:
                continue
            for suffix, child in _children(value):
                if _is_container(child):
                    frontier.append((path + suffix, child, depth + 1))
        # A bound, so say when it was hit: what lies beyond is not checked.
        self.truncated = bool(frontier)
        if self.truncated:
            log.info("capture: checked the first %d containers reachable from the optimizer only", _MAX_OBJECTS)

    def changed(self) -> list[str]:
        """Paths whose contents differ (by identity of their entries) from the snapshot."""
        return sorted(path for path, value, before in self.saved.values() if not _same(before, _contents(value)))

    def restore(self) -> None:
        for _, value, before in self.saved.values():
            if _same(before, _contents(value)):
                continue
            if isinstance(value, dict):
                value.clear()
                value.update(before)
            elif isinstance(value, list):
                value[:] = before
            else:
                for key in set(vars(value)) - set(before):
                    delattr(value, key)
                for key, item in before.items():
                    setattr(value, key, item)


def _same(before: Any, now: Any) -> bool:
    if isinstance(before, dict):
        return before.keys() == now.keys() and all(before[k] is now[k] for k in before)
    return len(before) == len(now) and all(a is b for a, b in zip(before, now))
