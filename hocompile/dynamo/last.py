"""What hocompile did to the graphs torch.compile handed it: ``hocompile.explain_last()``."""

from __future__ import annotations

import threading

from .graphs import GraphRecord

_LOCK = threading.Lock()
_RECORDS: list[GraphRecord] = []
_KEEP = 32  # the most recent graphs (a long run compiles many: the oldest go)
_TOTAL = [0]


def remember(record: GraphRecord) -> None:
    with _LOCK:
        _RECORDS.append(record)
        del _RECORDS[:-_KEEP]
        _TOTAL[0] += 1


def compiled_graphs() -> int:
    """How many graphs have come through the backend and the Inductor pass in this process (a
    recompile is one more: tests and benchmarks count them)."""
    return _TOTAL[0]


def last_records(n: int = 1) -> list[GraphRecord]:
    """The ``n`` most recent graphs' records, oldest first."""
    with _LOCK:
        return list(_RECORDS[-n:]) if n > 0 else []


def explain_last(n: int = 1, graph: bool = True) -> str:
    """What hocompile's passes did on the last ``n`` graphs compiled through
    ``torch.compile(backend="hocompile")`` or hocompile's Inductor passes (``graph``: with the
    final graph printed)."""
    records = last_records(n)
    if not records:
        return "hocompile: no graph has come through torch.compile(backend='hocompile') or hocompile's Inductor passes"
    return "\n\n".join(_describe(r, graph) for r in records)


def _describe(r: GraphRecord, graph: bool) -> str:
    lines = [f"hocompile ({r.route}): {r.title}"]
    if r.declined:
        lines.append(f"  left alone: {r.declined}")
    if r.before:
        lines.append(
            f"  handed over: {r.before['tensor inputs']} tensor inputs, {r.before['ops']} ops "
            f"({r.before['matmuls']} matmuls)"
        )
    if r.after:
        lines.append(
            f"  after passes: {r.after['ops']} ops ({r.after['matmuls']} matmuls, "
            f"{r.after['newton-schulz']} newton_schulz) in {r.pass_seconds * 1e3:.1f} ms"
        )
    if r.passes:
        lines.append("  passes:")
        width = max(len(p.name) for p in r.passes)
        lines += [f"    {p.name:<{width}}  {p.status:<9}  {p.seconds * 1e3:6.1f} ms  {p.summary}" for p in r.passes]
    if r.decisions:
        lines.append("  plans:")
        lines += [f"    {d}" for d in r.decisions]
    if r.lowering:
        lines.append(f"  lowering: {r.lowering}" + (f" ({r.lower_seconds * 1e3:.1f} ms)" if r.lower_seconds else ""))
    if r.key:
        lines.append(f"  key: {r.key[:16]}")
    if graph and r.final_graph:
        lines.append("")
        lines.append(r.final_graph)
    return "\n".join(lines)
