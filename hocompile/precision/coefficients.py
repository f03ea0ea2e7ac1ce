"""Newton–Schulz coefficient tables the precision planner is calibrated for (data only).

Sources:

- ``keller_jordan``: Keller Jordan's muon.py, (3.4445, -4.7750, 2.0315) × 5,
  also torch.optim.Muon's default;
- ``simple``, ``quintic``, ``polar_express``, ``cans``, ``aol``,
  ``deepseekv4``: copied from emerging-optimizers 0.3.0,
  ``emerging_optimizers/orthogonalized_optimizers/muon_utils.py``
  (``_COEFFICIENT_SETS``), including how a table is stretched to ``steps``
  iterations (``get_coefficient_iterator``: "repeat_last" for polar_express,
  cans and deepseekv4, "cycle" otherwise, as tests/helpers.py passes it);
  tests/test_precision_emulation.py checks they are still equal;
- ``cubic``: (1.5, -0.5, 0) × 5, the classic cubic NS (c = 0).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

Table = tuple[tuple[float, float, float], ...]

_KJ = (3.4445, -4.775, 2.0315)

TABLES: dict[str, Table] = {
    "keller_jordan": (_KJ,) * 5,
    "simple": (_KJ,),
    "quintic": (
        (4.0848, -6.8946, 2.927),
        (3.9505, -6.3029, 2.6377),
        (3.7418, -5.5913, 2.3037),
        (2.8769, -3.1427, 1.2046),
        (2.8366, -3.0525, 1.2012),
    ),
    "polar_express": (
        (8.2051, -22.9019, 16.4607),
        (4.0664, -2.8612, 0.5184),
        (3.9096, -2.8234, 0.525),
        (3.2856, -2.4153, 0.4853),
        (2.2779, -1.6198, 0.3985),
        (1.8726, -1.2307, 0.3585),
        (1.8564, -1.2132, 0.3568),
        (1.875, -1.25, 0.375),
    ),
    "cans": (
        (8.4703, -25.1081, 18.6293),
        (4.1828, -3.1087, 0.5806),
        (3.9619, -2.9541, 0.563),
        (3.2866, -2.4647, 0.5074),
        (2.2737, -1.6447, 0.4162),
    ),
    "aol": (
        (4.0098, -7.0585, 2.4635),
        (3.4585, -5.5479, 2.5959),
        (2.7573, -3.2939, 1.4254),
        (2.7215, -3.0494, 1.3169),
    ),
    "deepseekv4": (_KJ,) * 8 + ((2.0, -1.5, 0.5),) * 2,
    "cubic": ((1.5, -0.5, 0.0),) * 5,
}

# Tables stretched by repeating their last tuple (the others cycle), as emerging-optimizers does.
REPEAT_LAST = ("polar_express", "cans", "deepseekv4")

# The iteration count each set is used with by default (the table's length; "simple" is Keller Jordan's 5).
DEFAULT_STEPS: dict[str, int] = {name: 5 if name == "simple" else len(t) for name, t in TABLES.items()}


def coefficients(name: str, steps: int | None = None) -> Table:
    """The ``steps`` (default: :data:`DEFAULT_STEPS`) coefficient tuples of a named set."""
    if name not in TABLES:
        raise KeyError(f"unknown coefficient set {name!r}; known: {sorted(TABLES)}")
    table = TABLES[name]
    steps = DEFAULT_STEPS[name] if steps is None else steps
    stream: Iterator[tuple[float, float, float]]
    if name in REPEAT_LAST:
        stream = itertools.chain(table, itertools.repeat(table[-1]))
    else:
        stream = itertools.cycle(table)
    return tuple(itertools.islice(stream, steps))
