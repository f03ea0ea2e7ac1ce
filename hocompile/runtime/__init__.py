"""Runtime: the drop-in CompiledOptimizer, its guards and caches, explain()."""

from .compiled_optimizer import CompiledOptimizer, Counters
from .validate import UnsupportedParameterError

__all__ = ["CompiledOptimizer", "Counters", "UnsupportedParameterError"]
