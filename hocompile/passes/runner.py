"""Runs a pipeline: times each pass, verifies after it, stamps provenance, dumps."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch.fx as fx

from ..ir.decisions import decisions_of
from ..ir.graph import ORIGIN, print_graph, verify
from .base import Pass

log = logging.getLogger("hocompile.passes")


@dataclass(frozen=True)
class PassRecord:
    """One line of explain(): what a pass did and how long it took."""

    name: str
    status: str  # "changed" | "unchanged" | "disabled"
    summary: str
    seconds: float


# Passes added to the default pipeline by the runtime (stamped steps' member stacking, a whole
# trace's same-shaped calls): disabling them is valid.
_OUTSIDE_PIPELINE = frozenset({"stack-members", "stack-calls"})


def run_pipeline(
    gm: fx.GraphModule,
    pipeline: tuple[Pass, ...],
    disabled: frozenset[str] = frozenset(),
    dump_dir: Path | None = None,
) -> tuple[fx.GraphModule, list[PassRecord]]:
    """Apply ``pipeline`` in order; skip passes named in ``disabled``.

    With ``dump_dir`` set, writes ``00-captured.txt`` and, per pass,
    ``NN-<name>.before.txt`` / ``NN-<name>.after.txt`` in the printed-graph
    format, so a reader can diff what each pass did.
    """
    unknown = disabled - {p.name for p in pipeline} - _OUTSIDE_PIPELINE
    if unknown:
        log.warning("disable_passes / HOCOMPILE_DISABLE_PASSES name unknown passes: %s", ", ".join(sorted(unknown)))
    verify(gm)
    if dump_dir is not None:
        dump_dir.mkdir(parents=True, exist_ok=True)
        (dump_dir / "00-captured.txt").write_text(print_graph(gm, "captured"))
    records: list[PassRecord] = []
    for index, pass_ in enumerate(pipeline, start=1):
        if pass_.name in disabled:
            records.append(PassRecord(pass_.name, "disabled", "skipped (HOCOMPILE_DISABLE_PASSES)", 0.0))
            continue
        stem = f"{index:02d}-{pass_.name}"
        if dump_dir is not None:
            (dump_dir / f"{stem}.before.txt").write_text(print_graph(gm, f"before {pass_.name}"))
        before_nodes = set(gm.graph.nodes)
        start = time.perf_counter()
        result = pass_(gm)
        seconds = time.perf_counter() - start
        gm = result.gm
        for node in gm.graph.nodes:
            if node not in before_nodes and node.op == "call_function":
                node.meta.setdefault(ORIGIN, pass_.name)
        verify(gm)
        for node in gm.graph.nodes:
            # Fail at the pass that broke it: decisions are records others read by field, not prose.
            decisions_of(node)
        if dump_dir is not None:
            (dump_dir / f"{stem}.after.txt").write_text(print_graph(gm, f"after {pass_.name}"))
        status = "changed" if result.changed else "unchanged"
        records.append(PassRecord(pass_.name, status, result.summary, seconds))
        log.debug("%s: %s in %.1f ms", pass_.name, result.summary, seconds * 1e3)
    return gm, records
