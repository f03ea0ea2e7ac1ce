"""Home of hocompile's custom ops (the ``hocompile::`` torch.library namespace).

Passes rewrite recognised subgraphs into these ops. Each op registered here
comes with a fake (meta) implementation so graphs stay traceable, an exact
reference implementation that runs in fp64 for tests, and lowerings.

Conventions:

- schemas are functional (no aliasing, no mutation), like the graphs;
- structural choices (coefficients, steps, flags) are op arguments, so they
  show in printed graphs and enter the cache key through the graph text;
- hyperparameters never are: they stay host scalars.

The Newton–Schulz op arrives with the fuse-newton-schulz pass.
"""

from __future__ import annotations

import torch

NAMESPACE = "hocompile"

# One fragment for the namespace; ops are defined on it as passes need them.
LIBRARY = torch.library.Library(NAMESPACE, "FRAGMENT")


def defined_ops() -> list[str]:
    """Names of the ops currently registered under ``hocompile::``."""
    ns = getattr(torch.ops, NAMESPACE)
    return sorted(name for name in dir(ns) if not name.startswith("_") and name not in {"name"})
