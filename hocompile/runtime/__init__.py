"""Runtime: the drop-in CompiledOptimizer, its guards, the compile driver it shares with plan(),
verify=N (``check/``), and explain() (``report/``). The on-disk cache is hocompile/diskcache.py,
shared with the lowerings."""

from ..errors import UnsupportedParameterError
from .compiled_optimizer import CompiledOptimizer, Counters

__all__ = ["CompiledOptimizer", "Counters", "UnsupportedParameterError"]
