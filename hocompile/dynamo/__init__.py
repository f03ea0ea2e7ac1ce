"""hocompile inside torch.compile: a Dynamo backend (``backend="hocompile"``) and Inductor
custom passes (``hocompile.inductor_passes()``), both running hocompile's passes on the aten
graphs torch.compile makes; ``hocompile.explain_last()`` shows what they did."""

from __future__ import annotations

from ..errors import BackendFallbackWarning
from .backend import hocompile_backend
from .inductor import InductorPasses, inductor_passes
from .last import explain_last, last_records

__all__ = [
    "BackendFallbackWarning", "InductorPasses", "explain_last", "hocompile_backend", "inductor_passes",
    "last_records", "register",
]


def register() -> None:
    """Register the backend as ``"hocompile"`` with Dynamo, for a source tree that is not installed.
    Installed, the package's ``torch_dynamo_backends`` entry point registers it when Dynamo first
    looks the name up, and ``import hocompile`` registers nothing."""
    from importlib.metadata import entry_points

    from torch._dynamo.backends.registry import _COMPILER_FNS, register_backend

    # Installed, the entry point registers it when Dynamo first looks the name up; registering it
    # here too would make that lookup fail ("duplicate name"). From a source tree: here.
    if "hocompile" not in _COMPILER_FNS and "hocompile" not in entry_points(group="torch_dynamo_backends").names:
        register_backend(hocompile_backend, name="hocompile")
