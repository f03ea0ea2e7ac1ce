"""Planning the compiled step across ranks (DESIGN.md §7).

hocompile does not run its own communication: it plans which rank
orthogonalises which matrix (``plan.py``) and puts torch.distributed's own
collectives into the step around that work.
"""

from .plan import DistPlan, Item, assign_buckets, assign_owners, ns_cost

__all__ = ["DistPlan", "Item", "assign_buckets", "assign_owners", "ns_cost"]
