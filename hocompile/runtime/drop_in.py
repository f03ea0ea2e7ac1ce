"""The drop-in part of a CompiledOptimizer: it is the wrapped optimizer to everything that reads it.

``param_groups``, ``state`` and ``defaults`` are the wrapped optimizer's own objects (never
copies), ``state_dict()``/``load_state_dict()`` its format, and any other attribute (hook dicts,
what ``torch.optim.Optimizer``'s methods expect) is read from it; GradScaler's ``grad_scale`` and
``found_inf`` are set on it. CompiledOptimizer adds the compiling and running on top.
"""

from __future__ import annotations

from typing import Any

import torch

from .entries import FORWARDED


class DropIn(torch.optim.Optimizer):
    """Forwards to ``self._inner`` (set by the subclass's ``__init__``; Optimizer.__init__ is not called)."""

    _inner: torch.optim.Optimizer

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self._inner

    @property  # type: ignore[override]
    def param_groups(self) -> list[dict[str, Any]]:
        return self._inner.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self._inner.param_groups = value

    @property  # type: ignore[override]
    def state(self) -> Any:
        return self._inner.state

    @state.setter
    def state(self, value: Any) -> None:
        self._inner.state = value

    @property  # type: ignore[override]
    def defaults(self) -> dict[str, Any]:
        return self._inner.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self._inner.defaults = value

    def __getattr__(self, name: str) -> Any:
        # Hook dicts and anything else Optimizer methods expect live on the
        # wrapped optimizer. `_inner` itself must not recurse (unpickling).
        if name == "_inner":
            raise AttributeError(name)
        return getattr(self._inner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        # GradScaler hands a fused optimizer its scale and inf flag as
        # attributes; the wrapped step is what reads them (as graph inputs).
        if name in FORWARDED:
            setattr(self._inner, name, value)
        else:
            object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        if name in FORWARDED:
            delattr(self._inner, name)
        else:
            object.__delattr__(self, name)

    def state_dict(self) -> dict[str, Any]:
        return self._inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._inner.load_state_dict(state_dict)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._inner.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        # The next step's signature differs, so it recompiles with that reason.
        self._inner.add_param_group(param_group)
