"""Which param-group entries are hyperparameters, their host names, and swapping them in for a trace.

A float (or a tuple of floats: betas) in a param group is a hyperparameter a schedule may change:
while tracing it is a :class:`~.hyper_params.HyperParam` named ``g0.lr`` / ``g0.betas[1]``, and the
compiled step takes its live value as a host scalar. Keys in :data:`STRUCTURAL_KEYS` select the
program instead (Newton–Schulz coefficients, step counts): they key the cache even as floats.
"""

from __future__ import annotations

import numbers
from typing import Any

from .host_state import MISSING
from .hyper_params import HyperParam, ScalarTracker, sentinel
from .scalars import input_expr

# Group keys that select the program rather than feed it numbers: they go into
# the cache key even when they hold floats.
STRUCTURAL_KEYS = frozenset(
    {"ns_coefficients", "coefficients", "coefficient_type", "ns_steps", "num_ns_steps"}
)


def is_float(value: Any) -> bool:
    """A float-like number: Python floats and numpy floating scalars, not ints or bools."""
    return isinstance(value, numbers.Real) and not isinstance(value, numbers.Integral)


def is_hyperparameter(key: str, value: Any, structural: frozenset[str]) -> bool:
    """Floats (and tuples of floats, like betas) that schedules may change."""
    if key == "params" or key in structural:
        return False
    if is_float(value):
        return True
    if isinstance(value, (tuple, list)) and value and all(is_float(v) for v in value):
        return True
    return False


def hyper_names(group_index: int, key: str, value: Any) -> list[str]:
    """Host input names for one group entry: ``g0.lr`` or ``g0.betas[1]``."""
    if isinstance(value, (tuple, list)):
        return [f"g{group_index}.{key}[{i}]" for i in range(len(value))]
    return [f"g{group_index}.{key}"]


def counter_name(group: int, index: int, key: str) -> str:
    return f"g{group}.p{index}.state.{key}"


def swap_in_hyperparams(
    groups: list[dict[str, Any]], structural: frozenset[str], tracker: ScalarTracker, salt: int
) -> list[dict[str, Any]]:
    """Replace each group's hyperparameters by HyperParams; returns the originals.

    Tensor hyperparameters (``lr=torch.tensor(0.01)``) are not touched here:
    they are tensor inputs of the graph (capture.input_slots), and a 0-d one
    is also a host counter, so ``lr.item()`` reads its live value.
    """
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
) -> list[tuple[int, str, Any]]:
    """Put the original entries back; returns ``(group, key, value it was left with)``
    for each entry the step itself changed (the value is ``MISSING`` where it was deleted).

    ``installed`` is what the capture put in each group before the trace; any
    key whose object the step replaced, added or removed is a Python-level
    update that the compiled step must repeat (see host_state.py).
    """
    changed: list[tuple[int, str, Any]] = []
    for g, (group, before, ours) in enumerate(zip(groups, saved, installed)):
        for key in sorted((set(group) | set(ours)) - {"params"}):
            if key not in group or key not in ours or group[key] is not ours[key]:
                changed.append((g, key, group.get(key, MISSING)))
        group.clear()
        group.update(before)
    return changed
