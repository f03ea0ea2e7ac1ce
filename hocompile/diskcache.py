"""On-disk cache: generated step modules, and small JSON files (calibrations, autotune winners).

A leaf module (it imports nothing from hocompile but errors.py) so that both the lowerings,
which write and load generated modules, and the runtime, which owns the
cache directory, can use it without the lowering importing the runtime.

Entries are Python files named by a content key. Each starts with a header
holding the sha256 of its body; an entry whose body does not match (random
bytes, a truncated file, another build's code) is reported with a warning
and rebuilt, never trusted. Writes go to a temporary file in the same
directory and are renamed into place, so a crash or a concurrent writer
never leaves half a file behind. A directory that cannot be written is
bypassed: the generated module runs from memory. Every cache problem is
warned about once per process (a read-only directory is met at every
compile), and none is an error.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import linecache
import os
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

from .errors import CacheWarning  # noqa: F401  (defined there, re-exported here)

_HEADER = "# hocompile cache entry sha256="
_T = TypeVar("_T")
# Problems already warned about, by (path, what is wrong with it).
_warned: set[tuple[str, str]] = set()


def default_cache_dir() -> Path:
    env = os.environ.get("HOCOMPILE_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "hocompile"


class DiskCache:
    def __init__(self, root: Path) -> None:
        self.root = root

    def path(self, key: str) -> Path:
        return self.root / f"step_{key[:24]}.py"

    def read(self, key: str) -> str | None:
        """The cached body for ``key``, or None if absent or corrupt (warned once)."""
        path = self.path(key)
        try:
            raw = path.read_bytes()
        except (FileNotFoundError, NotADirectoryError):
            return None  # an unusable directory is reported by the write that follows
        except OSError as exc:
            warn_once(path, "unreadable", f"hocompile cache entry {path} unreadable ({exc}); rebuilding it")
            return None
        try:
            header, _, body = raw.decode("utf-8").partition("\n")
        except UnicodeDecodeError:
            header, body = "", ""
        if not header.startswith(_HEADER) or header.removeprefix(_HEADER) != _digest(body):
            digest = hashlib.sha256(raw).hexdigest()
            warn_once(path, f"corrupt {digest}", f"hocompile cache entry {path} is corrupt; rebuilding it")
            return None
        return body

    def write(self, key: str, body: str) -> Path:
        path = self.path(key)
        atomic_write_text(path, entry_text(body))
        return path


def entry_text(body: str) -> str:
    """An entry's file: the digest header, then the body."""
    return f"{_HEADER}{_digest(body)}\n{body}"


def _digest(body: str) -> str:
    return hashlib.sha256(body.encode()).hexdigest()


def load_generated(cache: DiskCache, key: str, body: str, injected: dict[str, Any]) -> tuple[ModuleType, Path, bool]:
    """Run generated ``body`` as a module cached under ``key``: (module, its file, found on disk).

    An absent, corrupt or stale entry is (re)written first; if that fails the
    module runs from memory under a ``<...>`` name, after one warning.
    """
    path = name = cache.path(key)
    cached = cache.read(key)
    from_disk = cached == body
    if cached is not None and not from_disk:
        # A valid entry with other text under the same key: another hocompile build wrote it.
        message = f"hocompile cache entry {path} is stale; rebuilding it"
        warn_once(path, f"stale {_digest(cached)}", message)
    if not from_disk:
        try:
            cache.write(key, body)
        except OSError as exc:
            warn_unwritable(path.parent, exc)
            path = Path(f"<hocompile in-memory {path.name}>")
    return run_source(entry_text(body), path, f"hocompile_generated.{name.stem}", injected), path, from_disk


def run_source(text: str, path: Path, name: str, injected: dict[str, Any]) -> ModuleType:
    """Execute ``text`` as module ``name`` whose file is ``path``.

    Compiled from the text in hand, not imported from disk: what runs is what
    was checked (no file replaced meanwhile, no stale ``.pyc``), and a module
    that could not be written runs all the same. The text is registered in
    linecache, so tracebacks and ``inspect`` (Triton reads kernel source with
    it) see these lines whether or not ``path`` exists.
    """
    filename = str(path)
    # mtime None: linecache.checkcache leaves the entry alone instead of re-reading the file.
    linecache.cache[filename] = (len(text), None, text.splitlines(keepends=True), filename)
    module = ModuleType(name)
    module.__file__ = filename
    module.__dict__.update(injected)
    exec(compile(text, filename, "exec"), module.__dict__)
    return module


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically (see :func:`atomic_write_bytes`)."""
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so readers see the old file or the whole new one, never a part.

    The temporary file is in the same directory (``os.replace`` is atomic
    only within one filesystem) and is removed if anything fails, even an
    interrupt; readers never look at ``.tmp-*`` names.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=path.suffix, dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def read_json(path: Path, parse: Callable[[Any], _T]) -> _T | None:
    """``parse`` of the JSON file at ``path``; None when absent, or (warned once) unreadable or malformed.

    ``parse`` raises ValueError, TypeError or KeyError for data of the wrong
    shape; such a file is treated as absent, so the caller rebuilds it.
    """
    try:
        raw = path.read_bytes()
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        warn_once(path, "unreadable", f"hocompile cache file {path} unreadable ({exc}); ignoring it")
        return None
    try:
        return parse(json.loads(raw))
    except (ValueError, TypeError, KeyError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        digest = hashlib.sha256(raw).hexdigest()
        warn_once(path, f"corrupt {digest}", f"hocompile cache file {path} is corrupt ({exc}); ignoring it")
        return None


def write_json(path: Path, data: Any) -> bool:
    """Write ``data`` atomically as JSON; False (warned once) when the directory cannot be written."""
    try:
        atomic_write_text(path, json.dumps(data, indent=1))
    except OSError as exc:
        warn_unwritable(path.parent, exc)
        return False
    return True


def warn_unwritable(directory: Path, exc: OSError) -> None:
    message = f"hocompile cache directory {directory} is unusable ({type(exc).__name__}: {exc}); not caching there"
    warn_once(directory, "unwritable", message)


def warn_once(path: Path, problem: str, message: str) -> None:
    """Warn about ``problem`` at ``path`` the first time this process meets it."""
    if (str(path), problem) in _warned:
        return
    _warned.add((str(path), problem))
    warnings.warn(message, CacheWarning, stacklevel=3)
