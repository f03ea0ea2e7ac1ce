"""Warm start: a new process loads a compiled step from the cache directory instead of tracing it.

After a compile, the step as the passes left it (graphs encoded by
graph_codec.py, the host-scalar programs, guards, counters, Python-state
updates, the class stamp) is written to ``warm-<key>-<n>.pkl``. The key is
everything the traced program depends on besides the code: the optimizer's
class, the step signature with params by position instead of identity (shapes,
dtypes, devices, group options, state layout), the settings and the pass
pipeline's identity (passes' sources), and the versions of hocompile (its own
source files), torch and Python.

The code is checked when the record is read: it lists every source file
whose functions the capture ran (the optimizer's, its helpers', a
monkeypatch's; capture.ExecutedFiles) with the digest of its contents, and a
record whose files changed or vanished is refused and rewritten. What no key
can see (a monkeypatch the new process does not make, a global the code
reads) is caught by running the loaded step's first step against eager on
copies (runtime/check/verify.py): a mismatch gives the optimizer eager's result,
deletes the record and compiles afresh. Loading lowers the graphs again
(their modules come from the same cache directory), so it costs the
lowering, not the trace.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import pickle
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..capture.compiled_helpers import holds_compiled_calls
from ..capture.host_state import HostSlot
from ..capture.scalars import build_scalar_program
from ..capture.trace import CapturedStep
from ..diskcache import atomic_write_bytes, warn_once, warn_unwritable
from ..errors import CacheWarning
from ..ir import codec as graph_codec
from ..ir.codec import CodecError
from ..lowering.class_programs import Program
from ..passes import Pass
from ..settings import Settings
from .guards import Signature, signature

log = logging.getLogger("hocompile")

WARM_VERSION = "warm-1"
_MAX_VARIANTS = 8  # records kept per key (outcomes of host-number branches)
_SOURCE_DIGEST: str | None = None


def _hocompile_digest() -> str:
    """hocompile's own source files: a changed hocompile never replays an older one's records."""
    global _SOURCE_DIGEST
    if _SOURCE_DIGEST is None:
        root = Path(__file__).resolve().parent.parent
        h = hashlib.sha256()
        for path in sorted(root.rglob("*.py")):
            h.update(str(path.relative_to(root)).encode())
            h.update(path.read_bytes())
        _SOURCE_DIGEST = h.hexdigest()
    return _SOURCE_DIGEST


def _file_digest(path: str) -> str | None:
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return None


def _stable(value: Any) -> str:
    """``repr`` that does not depend on the process (sets in sorted order, dataclasses by field)."""
    if isinstance(value, (set, frozenset)):
        return "{" + ", ".join(sorted(_stable(v) for v in value)) + "}"
    if isinstance(value, (list, tuple)):
        return "(" + ", ".join(_stable(v) for v in value) + ")"
    if isinstance(value, dict):
        return "{" + ", ".join(sorted(f"{_stable(k)}: {_stable(v)}" for k, v in value.items())) + "}"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = ", ".join(f"{f.name}={_stable(getattr(value, f.name))}" for f in dataclasses.fields(value))
        return f"{type(value).__name__}({fields})"
    return repr(value)


def _positional(sig: Signature) -> Signature:
    """The signature with params by position: ids differ between processes, nothing else may
    (ident 0: a param's position in its group's tuple says which it is)."""
    groups = tuple(
        dataclasses.replace(g, params=tuple(dataclasses.replace(p, ident=0) for p in g.params))
        for g in sig.groups
    )
    return Signature(sig.attributes, groups)


_SETTINGS_KEPT = (
    "disabled_passes", "structural_keys", "precision", "target", "backend", "cuda_graphs", "autotune",
    "error_budget", "schedule", "max_batch", "max_stack_bytes", "fused_updates", "distributed", "tp_mode", "stamp",
)  # fmt: skip


def warm_key(
    opt: torch.optim.Optimizer, settings: Settings, pipeline: tuple[Pass, ...], lifted: frozenset[HostSlot]
) -> str:
    sig = _positional(signature(opt, settings.structural_keys, lifted))
    options = {name: getattr(settings, name) for name in _SETTINGS_KEPT}
    parts = [
        WARM_VERSION,
        _hocompile_digest(),
        torch.__version__,
        sys.version,
        f"{type(opt).__module__}.{type(opt).__qualname__}",
        _stable(options),
        ";".join(p.identity() for p in pipeline if p.name not in settings.disabled_passes),
        _stable(lifted),
        # repr, not _stable: a signature holds tuples, numbers, strings, dtypes and devices only
        # (guards._freeze orders sets and dicts), so its repr is the same in every process, and at
        # 18k params it costs ~0.1 s where _stable's walk cost ~1.3 s.
        repr(sig),
    ]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


@dataclass
class WarmRecord:
    """What a compiled step is without its trace (see the module docstring)."""

    key: str
    files: dict[str, str]  # source file -> sha256 of its contents when the step was traced
    captured: dict[str, Any]  # CapturedStep's fields, its graph encoded
    step: dict[str, Any]  # CompiledStep's fields the runtime and explain() read
    programs: tuple[dict[str, Any], list[dict[str, Any]]] | None  # a stamped step's, encoded


def _paths(root: Path, key: str) -> list[Path]:
    return [root / f"warm-{key[:32]}-{n}.pkl" for n in range(_MAX_VARIANTS)]


def _encode_program(program: Program) -> dict[str, Any]:
    fields = {f.name: getattr(program, f.name) for f in dataclasses.fields(program)}
    fields.update(gm=graph_codec.encode(program.gm), lowered=None, list_mode=False, list_mode_note="")
    return fields


def _decode_program(data: dict[str, Any]) -> Program:
    return Program(**{**data, "gm": graph_codec.decode(data["gm"])})


def encode_step(step: Any, key: str) -> bytes | None:
    """``step`` (a lower_step.CompiledStep, before lowering: it rewrites the graphs) as a record;
    None where it cannot be kept (said at INFO)."""
    captured: CapturedStep = step.captured
    if holds_compiled_calls(step.gm):
        log.info("hocompile: not kept for a warm start: it calls torch.compile'd helpers (by process-local keys)")
        return None
    if not captured.files_seen:  # keyed on no file, a record could outlive an edit of the optimizer
        log.info("hocompile: not kept for a warm start: a profiler hid which source files the step ran")
        return None
    files = {path: digest for path in captured.code_files if (digest := _file_digest(path)) is not None}
    try:
        cap = {f.name: getattr(captured, f.name) for f in dataclasses.fields(captured)}
        cap.update(gm=graph_codec.encode(step.gm), scalars=captured.scalars.exprs)
        kept = ("records", "final_graph", "decisions", "final_stats", "pass_seconds", "stamp", "stamp_note")
        fields = {name: getattr(step, name) for name in kept}
        programs = None
        if step.programs is not None:
            shared, per_class = step.programs
            programs = (_encode_program(shared), [_encode_program(p) for p in per_class])
        return pickle.dumps(WarmRecord(key, files, cap, fields, programs))
    except (CodecError, pickle.PicklingError, TypeError, AttributeError, RuntimeError) as exc:
        log.info("hocompile: not kept for a warm start: %s", exc)
        return None


def write(settings: Settings, key: str, blob: bytes) -> None:
    """Keep a record for later processes (best effort: an unwritable directory is warned about once)."""
    root = Path(settings.cache_dir)
    for path in _paths(root, key):
        if not path.exists():
            try:
                atomic_write_bytes(path, blob)
            except OSError as exc:
                warn_unwritable(root, exc)
            return


def load(opt: torch.optim.Optimizer, settings: Settings, key: str) -> list[tuple[Path, WarmRecord]]:
    """The records for ``key`` whose source files are unchanged (stale ones are deleted)."""
    found = []
    for path in _paths(Path(settings.cache_dir), key):
        if not path.exists():
            break
        try:
            record = pickle.loads(path.read_bytes())
            assert isinstance(record, WarmRecord) and record.key == key
        except Exception as exc:  # a corrupt or foreign file: never trusted
            warn_once(path, "corrupt", f"hocompile warm-start record {path} is unreadable ({exc}); ignoring it")
            continue
        changed = [f for f, digest in record.files.items() if _file_digest(f) != digest]
        if changed:
            log.info("hocompile: warm-start record %s is stale (%s changed); compiling afresh", path.name, changed[0])
            discard(path)
            continue
        found.append((path, record))
    return found


def discard(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass


def rebuild(record: WarmRecord, step_type: Any) -> Any:
    """The lower_step.CompiledStep a record holds, not yet lowered (``step_type``: that class)."""
    cap = dict(record.captured)
    gm = graph_codec.decode(cap.pop("gm"))
    exprs = cap.pop("scalars")
    cap["trace_seconds"] = 0.0  # nothing was traced: the step was loaded (its compile_seconds)
    captured = CapturedStep(gm=gm, scalars=build_scalar_program(exprs), **cap)
    fields = dict(record.step)
    fields["pass_seconds"] = 0.0
    step = step_type(
        captured, gm, fields.pop("records"), None, fields.pop("final_graph"), fields.pop("decisions"),
        fields.pop("final_stats"), fields.pop("pass_seconds"), **fields,
    )
    if record.programs is not None:
        shared, per_class = record.programs
        step.programs = (_decode_program(shared), [_decode_program(p) for p in per_class])
    return step


def discard_stale(forget: Callable[[Any], None], entry: Any, why: str) -> None:
    """A warm-start record that does not match eager: never used again (``forget``: the optimizer's
    StepRunner.forget); the next step compiles afresh."""
    message = f"hocompile: the compiled step loaded from {entry.warm} {why}; discarding it and compiling afresh"
    log.warning(message)
    warnings.warn(message, CacheWarning, stacklevel=4)
    Path(entry.warm).unlink(missing_ok=True)
    forget(entry)
    entry.fallback = f"stale warm-start record: {why}"
