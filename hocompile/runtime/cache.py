"""On-disk cache of generated step modules.

Entries are Python files named by a content key. Each starts with a header
holding the sha256 of its body; an entry whose body does not match, or that
fails to import, is reported with a warning and rebuilt, never trusted.
Writes go to a temporary file in the same directory and are renamed into
place, so a crash or a concurrent writer never leaves half a file behind.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import tempfile
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any

_HEADER = "# hocompile cache entry sha256="


class CacheWarning(UserWarning):
    """A cache entry was unreadable or corrupt and has been rebuilt."""


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
        """The cached body for ``key``, or None if absent or corrupt."""
        path = self.path(key)
        try:
            text = path.read_text()
        except FileNotFoundError:
            return None
        except OSError as exc:
            warnings.warn(f"hocompile cache entry {path} unreadable ({exc}); rebuilding", CacheWarning, stacklevel=2)
            return None
        header, _, body = text.partition("\n")
        expected = header.removeprefix(_HEADER)
        if not header.startswith(_HEADER) or expected != _digest(body):
            warnings.warn(f"hocompile cache entry {path} is corrupt; rebuilding it", CacheWarning, stacklevel=2)
            return None
        return body

    def write(self, key: str, body: str) -> Path:
        path = self.path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".py", dir=path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(f"{_HEADER}{_digest(body)}\n{body}")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return path


def _digest(body: str) -> str:
    return hashlib.sha256(body.encode()).hexdigest()


def import_from_path(path: Path, injected: dict[str, Any]) -> ModuleType:
    """Import a generated module from its file so tracebacks point into it."""
    spec = importlib.util.spec_from_file_location(f"hocompile_generated.{path.stem}", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    module.__dict__.update(injected)
    spec.loader.exec_module(module)
    return module
