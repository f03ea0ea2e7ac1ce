"""``Declined(reason)``: what a matcher, a stamp or a split returns where it gives no result.

A pass's recogniser, ``classes/stamp.py``, ``lowering/class_programs.py`` and the compile driver
each either produce a value or say why not. They return ``X | Declined``; the caller tests
``isinstance(x, Declined)`` and passes ``x.reason`` on (a pass logs it as its decline, a compile
reports it in explain()). A plain string would read the same and could be mistaken for a result.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Declined:
    """Why there is no result; ``str()`` is the reason."""

    reason: str

    def __str__(self) -> str:
        return self.reason
