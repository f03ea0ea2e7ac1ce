"""Tracing-time helpers that keep host-visible scalars symbolic.

Two things an optimizer step reads on the host, which a fake-tensor trace
cannot evaluate and must not bake in:

- its hyperparameters (``group["lr"]``, ``group["betas"]``...): replaced by
  :class:`~hocompile.scalars.HyperParam` for the duration of the trace;
- step counters kept as 0-d tensors and read with ``.item()`` (Adam's
  ``state["step"]``): :class:`HostScalarMode` mirrors each such tensor as a
  host expression, follows ``+=``/``add_`` by a number, and answers ``.item()``
  with that expression. Any other data-dependent read raises a clear error.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from .scalars import HyperParam, ScalarTracker, const, input_expr, sentinel


class CaptureError(RuntimeError):
    """The optimizer step cannot be compiled as it is; the message says why."""


# Group keys that select the program rather than feed it numbers: they go into
# the cache key even when they hold floats.
STRUCTURAL_KEYS = frozenset(
    {"ns_coefficients", "coefficients", "coefficient_type", "ns_steps", "num_ns_steps"}
)


def is_hyperparameter(key: str, value: Any, structural: frozenset[str]) -> bool:
    """Floats (and tuples of floats, like betas) that schedules may change."""
    if key == "params" or key in structural:
        return False
    if isinstance(value, float):
        return True
    if isinstance(value, (tuple, list)) and value and all(isinstance(v, float) for v in value):
        return True
    return False


def hyper_names(group_index: int, key: str, value: Any) -> list[str]:
    """Host input names for one group entry: ``g0.lr`` or ``g0.betas[1]``."""
    if isinstance(value, (tuple, list)):
        return [f"g{group_index}.{key}[{i}]" for i in range(len(value))]
    return [f"g{group_index}.{key}"]


def counter_name(group: int, index: int, key: str) -> str:
    return f"g{group}.p{index}.state.{key}"


class HostScalarMode(TorchFunctionMode):
    """Answers ``.item()`` on step counters with host expressions."""

    def __init__(self, tracker: ScalarTracker, salt: int) -> None:
        super().__init__()
        self.tracker = tracker
        self.salt = salt
        # id(tensor) -> (tensor kept alive so the id stays unique, its value)
        self.mirrors: dict[int, tuple[torch.Tensor, HyperParam | None]] = {}
        # float32 matmul precisions in force at the step's matmuls
        # (emerging-optimizers switches it around its Newton-Schulz).
        self.matmul_precisions: set[str] = set()

    def track(self, tensor: torch.Tensor, name: str, real: float, index: int) -> None:
        self.tracker.real[name] = real
        value = self.tracker.make(sentinel(real, index, self.salt), input_expr(name))
        self.mirrors[id(tensor)] = (tensor, value)

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.item:
            return self._item(args[0])
        if getattr(func, "__name__", "") in _MATMULS:
            self.matmul_precisions.add(torch.get_float32_matmul_precision())
        first = args[0] if args else None
        if isinstance(first, torch.Tensor) and id(first) in self.mirrors:
            if func in (torch.Tensor.add_, torch.Tensor.__iadd__):
                self._follow_add(first, args[1] if len(args) > 1 else None, kwargs)
            elif _mutates_first_arg(func):
                # An update we cannot mirror: a later .item() on it must fail.
                self.mirrors[id(first)] = (first, None)
        out = func(*args, **kwargs)
        if func is torch.tensor and isinstance(first, (int, float)) and not isinstance(first, bool):
            self.mirrors[id(out)] = (out, self.tracker.make(float(first), const(float(first))))
        return out

    def _item(self, tensor: torch.Tensor) -> HyperParam:
        entry = self.mirrors.get(id(tensor))
        if entry is None or entry[1] is None:
            raise CaptureError(
                "the step reads a tensor's value on the host (`.item()` / float(tensor)) "
                f"on a {tuple(tensor.shape)} {tensor.dtype} tensor that is not a step counter; "
                "a data-dependent host read cannot be compiled"
            )
        return entry[1]

    def _follow_add(self, tensor: torch.Tensor, other: Any, kwargs: dict[str, Any]) -> None:
        _, value = self.mirrors[id(tensor)]
        if value is None or isinstance(other, torch.Tensor) or "alpha" in kwargs:
            self.mirrors[id(tensor)] = (tensor, None)
            return
        self.mirrors[id(tensor)] = (tensor, value + other)


_MATMULS = frozenset({"mm", "matmul", "__matmul__", "__rmatmul__", "addmm", "bmm", "baddbmm", "addmm_", "baddbmm_"})


def _mutates_first_arg(func: Callable[..., Any]) -> bool:
    name = getattr(func, "__name__", "")
    return name.endswith("_") and not name.endswith("__") or name.startswith("__i")


def swap_in_hyperparams(
    groups: list[dict[str, Any]], structural: frozenset[str], tracker: ScalarTracker, salt: int
) -> list[dict[str, Any]]:
    """Replace each group's hyperparameters by HyperParams; returns the originals."""
    # Refuse before changing anything, so no group is left half swapped.
    for g, group in enumerate(groups):
        for key, value in group.items():
            if isinstance(value, torch.Tensor) and key != "params":
                raise CaptureError(
                    f"param_groups[{g}][{key!r}] is a Tensor; hocompile already makes float "
                    "hyperparameters runtime inputs (no recompiles when they change): pass a float"
                )
    saved: list[dict[str, Any]] = []
    index = 0
    for g, group in enumerate(groups):
        saved.append(dict(group))
        for key, value in list(group.items()):
            if not is_hyperparameter(key, value, structural):
                continue
            names = hyper_names(g, key, value)
            reals = list(value) if isinstance(value, (tuple, list)) else [value]
            made: list[HyperParam] = []
            for name, real in zip(names, reals):
                tracker.real[name] = float(real)
                made.append(tracker.make(sentinel(float(real), index, salt), input_expr(name)))
                index += 1
            group[key] = type(value)(made) if isinstance(value, (tuple, list)) else made[0]
    return saved


def restore_groups(
    groups: list[dict[str, Any]], saved: list[dict[str, Any]], installed: list[dict[str, Any]]
) -> list[str]:
    """Put the original entries back; returns the entries the step itself changed.

    ``installed`` is what the capture put in each group before the trace; any
    key whose object the step replaced, added or removed is a Python-level side
    effect that the compiled step would not repeat.
    """
    changed: list[str] = []
    for g, (group, before, ours) in enumerate(zip(groups, saved, installed)):
        for key in (set(group) | set(ours)) - {"params"}:
            if key not in group or key not in ours or group[key] is not ours[key]:
                changed.append(f"param_groups[{g}][{key!r}]")
        group.clear()
        group.update(before)
    return sorted(changed)
