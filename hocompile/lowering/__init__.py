"""Lowerings: graph -> runnable step. ``aten`` (any device) here; Triton (CUDA) in ``lowering.triton``,
which returns a plain runnable that the runtime wraps (CUDA-graph replay in ``runtime.step_graph``)."""

from .aten import LoweredStep, cache_key, lower_to_aten

__all__ = ["LoweredStep", "cache_key", "lower_to_aten"]
