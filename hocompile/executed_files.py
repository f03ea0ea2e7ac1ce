"""Which source files a capture ran: what the warm start's records are keyed on (runtime/warm.py)."""

from __future__ import annotations

import os
import sys
import sysconfig
from typing import Any

import torch


class ExecutedFiles:
    """The files of every Python function called while it is entered (``sys.setprofile``),
    except torch's and hocompile's own (their versions key the cache already)."""

    _INTERNAL = (
        os.path.dirname(torch.__file__),
        os.path.dirname(os.path.abspath(__file__)),  # hocompile itself
        sysconfig.get_paths()["stdlib"],  # Python's own: its version keys the cache too
    )

    def __init__(self) -> None:
        self._codes: set[Any] = set()

    def _profile(self, frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            self._codes.add(frame.f_code)

    def __enter__(self) -> ExecutedFiles:
        self._saved = sys.getprofile()
        sys.setprofile(self._profile)
        return self

    def __exit__(self, *exc: Any) -> None:
        sys.setprofile(self._saved)

    def files(self) -> tuple[str, ...]:
        names = {code.co_filename for code in self._codes}
        return tuple(sorted(n for n in names if not n.startswith(("<", *self._INTERNAL)) and os.path.isfile(n)))


