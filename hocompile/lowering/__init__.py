"""Lowerings: graph -> runnable step. CPU uses aten; CUDA will use Triton."""

from .aten import LoweredStep, cache_key, lower_to_aten

__all__ = ["LoweredStep", "cache_key", "lower_to_aten"]
