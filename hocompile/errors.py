"""Every exception and warning hocompile raises or issues to its users, in one place.

Each is re-exported by ``hocompile`` and by the module that raises it. This module
imports nothing of hocompile's, so any layer may use it (tests/test_layers.py: "leaf").

Errors (the step cannot run as asked; nothing was written):

- :class:`CaptureError` — the optimizer's step cannot be compiled as it is.
- :class:`UnsupportedParameterError` — a parameter or its gradient cannot be stepped compiled.
- :class:`VerificationError` — ``verify=`` found a compiled step beyond its error model.
- :class:`DistributedMismatchError` — ranks that must agree (``distributed="replicated"``) do not.

Warnings (the step ran, eagerly or without some of hocompile's work; the message says why):

- :class:`SelfCheckWarning` — a self-checked step differed from eager; that program runs eagerly.
- :class:`RecompileLimitWarning` — ``recompile_limit`` reached; new configurations run eagerly.
- :class:`LinAlgFallbackWarning` — an eigh/SVD did not converge; that step ran eagerly.
- :class:`CompiledHelperWarning` — the step calls a ``torch.compile``'d helper whose products are planned.
- :class:`BackendFallbackWarning` — a graph handed to ``backend="hocompile"`` runs without its passes.
- :class:`CacheWarning` — a cache entry was unreadable or corrupt and has been rebuilt.
- :class:`BlockwiseWarning` — ``tp_mode="blockwise"`` (asked for) orthogonalises each shard on its own.
"""

from __future__ import annotations


class CaptureError(RuntimeError):
    """The optimizer step cannot be compiled as it is; the message says why."""


class UnsupportedParameterError(ValueError):
    """A parameter (or its gradient) cannot be stepped by the compiled optimizer."""


class VerificationError(RuntimeError):
    """A compiled step differed from eager beyond the error model of this module (runtime/check/verify.py)."""


class DistributedMismatchError(RuntimeError):
    """Ranks that must agree (distributed="replicated") do not; nothing was written."""


class SelfCheckWarning(UserWarning):
    """A compiled program differed from eager on a self-checked step; it runs eagerly from then on."""


class RecompileLimitWarning(UserWarning):
    """An optimizer recompiled ``recompile_limit`` times; new configurations run eagerly."""


class LinAlgFallbackWarning(UserWarning):
    """An eigh/SVD in a compiled step did not converge; that step ran eagerly (with its retries)."""


class CompiledHelperWarning(UserWarning):
    """The step calls a torch.compile'd function: the compiled step is not eager's arithmetic there."""


class BackendFallbackWarning(UserWarning):
    """A graph torch.compile handed to hocompile runs without hocompile's passes (the reason says why)."""


class CacheWarning(UserWarning):
    """A cache entry was unreadable or corrupt and has been rebuilt."""


class BlockwiseWarning(UserWarning):
    """Blockwise NS orthogonalises each shard on its own: not the matrix's update."""


__all__ = [
    "BackendFallbackWarning", "BlockwiseWarning", "CacheWarning", "CaptureError", "CompiledHelperWarning",
    "DistributedMismatchError", "LinAlgFallbackWarning", "RecompileLimitWarning", "SelfCheckWarning",
    "UnsupportedParameterError", "VerificationError",
]
