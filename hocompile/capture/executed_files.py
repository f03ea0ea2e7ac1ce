"""Which source files a capture ran: what the warm start's records are keyed on (runtime/warm.py)."""

from __future__ import annotations

import os
import sys
import sysconfig
import types
import warnings
from typing import Any

from ..errors import CompiledHelperWarning  # noqa: F401  (defined there, re-exported here)
from .scalars import HOCOMPILE_DIR, TORCH_DIR


def dynamo_wrapper_codes() -> frozenset[types.CodeType]:
    """The code of Dynamo's wrapper around a torch.compile'd function (defined in
    ``_TorchDynamoContext.__call__``: ``compile_wrapper``, ``_fn`` in older releases; not
    DisableContext's): inside a trace it runs the original function as plain Python."""
    try:
        from torch._dynamo.eval_frame import _TorchDynamoContext
    except ImportError:
        return frozenset()
    consts = _TorchDynamoContext.__call__.__code__.co_consts
    return frozenset(c for c in consts if isinstance(c, types.CodeType) and c.co_name in ("compile_wrapper", "_fn"))


class ExecutedFiles:
    """The files of every Python function called while it is entered (``sys.setprofile``),
    except torch's and hocompile's own (their versions key the cache already); and the
    torch.compile'd functions among those calls (``compiled``: "name (file:line)")."""

    _INTERNAL = (
        TORCH_DIR,
        HOCOMPILE_DIR,  # hocompile itself
        sysconfig.get_paths()["stdlib"],  # Python's own: its version keys the cache too
    )

    def __init__(self) -> None:
        self._codes: set[Any] = set()
        self.compiled: dict[str, None] = {}
        self._wrappers = dynamo_wrapper_codes()
        # False while the user's own C-level profiler runs (cProfile, pyinstrument): it cannot be
        # chained, nor put back with sys.setprofile, so this records nothing and no record is kept.
        self.seeing = True
        self._chained: Any = None

    def _profile(self, frame: Any, event: str, arg: Any) -> None:
        if self._chained is not None:  # the user's Python-level profile function still sees every event
            self._chained(frame, event, arg)
        if event != "call":
            return
        code = frame.f_code
        self._codes.add(code)
        if code in self._wrappers:
            context = frame.f_locals.get("self")
            if _backend_name(context) == "eager":  # Dynamo runs the plain Python's aten ops: same arithmetic
                return
            fn = frame.f_locals.get("fn")
            inner = getattr(fn, "__code__", None)
            if inner is not None:
                where = f"{os.path.basename(inner.co_filename)}:{inner.co_firstlineno}"
                self.compiled[f"{getattr(fn, '__qualname__', inner.co_name)} ({where})"] = None

    def __enter__(self) -> ExecutedFiles:
        self._saved = sys.getprofile()
        # sys.getprofile() hands back cProfile's Profiler object, which sys.setprofile would install
        # as a Python function: the user's next call then raised "'Profile' object is not callable"
        self.seeing = self._saved is None or callable(self._saved)
        if self.seeing:
            self._chained = self._saved
            sys.setprofile(self._profile)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.seeing:
            sys.setprofile(self._saved)

    def files(self) -> tuple[str, ...]:
        names = {code.co_filename for code in self._codes}
        return tuple(sorted(n for n in names if not n.startswith(("<", *self._INTERNAL)) and os.path.isfile(n)))


def _backend_name(context: Any) -> str | None:
    """The torch.compile backend's name (walked through Dynamo's wrappers; None where unknown)."""
    x = getattr(context, "callback", None)
    for _ in range(6):
        name = getattr(x, "compiler_name", None)
        if isinstance(name, str):
            return name
        x = getattr(x, "_torchdynamo_orig_backend", None) or getattr(x, "compiler_fn", None)
    return None


def compiled_helpers_note(optimizer: str, names: list[str]) -> str:
    """The note (and a warning, once per message) for torch.compile'd functions the step calls: eager
    runs Inductor's kernels for them, the trace their plain Python, and the two round differently.
    (Others run as opaque ops: compiled_helpers.py.)"""
    note = (
        f"{optimizer}.step calls {', '.join(names)}, wrapped in torch.compile: eager runs Inductor's "
        "kernels there and hocompile traces the plain Python (why, per helper, in parentheses: matrix "
        "products to fuse and plan), so the compiled step rounds differently in them (not bitwise with "
        "eager; judged against eager's spread). Helpers without matrix products run as the user compiled "
        "them, and those with them too when fuse-newton-schulz is disabled"
    )
    warnings.warn(f"hocompile: {note}", CompiledHelperWarning, stacklevel=4)
    return note
