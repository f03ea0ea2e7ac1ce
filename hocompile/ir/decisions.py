"""Structured decisions: what a pass chose for an op, what else it weighed, and why.

A pass that plans an op (choose-algorithm, choose-precision) records a
:class:`Decision` in ``node.meta[DECISION]`` with :func:`record`; a node
carries at most one per pass, in the order the passes ran. Everything that
reads them goes through this module:

- print_graph, ``graph.decisions()``, ``explain()`` and ``plan()`` show
  :meth:`Decision.render`;
- the cache key hashes :meth:`Decision.choices_key`: the choices only, never
  the predicted timings, so recalibrating a target's rates keeps the key
  when the plan is the same;
- tests assert on the fields (``decision.chose["algorithm"] == "gram"``).

A Newton–Schulz op after choose-algorithm, as ``graph.decisions()`` shows it::

    hocompile.newton_schulz fp32[768, 3072]: choose-algorithm: gram fp32, 20.1 ms predicted
        (vs standard 36.2 ms), no fast bf16 GEMM here

(one line), and the same decision's fields: ``chose == {"algorithm": "gram",
"compute": "fp32", "restarts": (), "matmul": "native", "blocks": 0}``,
``predicted_s == 0.0201``, ``alternatives == (Alternative("standard", 0.0362),)``,
``why == "no fast bf16 GEMM here"``.

The meta keys passes share are declared here, with their type and who
writes them; no pass reads a key another pass wrote that is not declared.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Union

import torch
import torch.fx as fx

DECISION = "hocompile.decision"
"""``tuple[Decision, ...]``: one per pass that planned the node, in pass order (written by
:func:`record`). batch-by-shape copies keys starting with this prefix onto the batched node."""

EAGER_DTYPE = "hocompile.eager_dtype"
"""``torch.dtype``: the compute dtype the captured (eager) code used for a Newton–Schulz op,
recorded by choose-algorithm before it replaces the op's compute dtype; choose-precision's
default error budget and the verify reference read it (:func:`eager_dtype`)."""

# A chosen value: a name ("gram", "fp32"), a count, or a tuple of them (restart iterations).
Choice = Union[str, int, float, bool, tuple[Union[str, int], ...]]


def format_seconds(seconds: float) -> str:
    """``0.0201`` → ``"20.1 ms"``, ``2.56e-7`` → ``"256 ns"``: how decisions and reports show predicted times."""
    for scale, unit in ((1.0, "s"), (1e-3, "ms"), (1e-6, "us")):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds * 1e9:.3g} ns"


@dataclass(frozen=True)
class Alternative:
    """An option the pass weighed and did not take, with what the model predicted for it."""

    name: str  # "standard", "bf16*5": in the same words the chosen option's label uses
    predicted_s: float | None = None
    predicted_error: float | None = None  # worst relative-to-fp64 error over the calibration cases
    why_not: str = ""  # "" when it simply predicted slower

    def render(self) -> str:
        facts = [self.name]
        if self.predicted_s is not None:
            facts[0] += f" {format_seconds(self.predicted_s)}"
        if self.predicted_error is not None:
            facts.append(f"error {self.predicted_error:.3g}")
        if self.why_not:
            facts.append(self.why_not)
        return ", ".join(facts)


@dataclass(frozen=True)
class Decision:
    """One pass's answer for one op.

    ``chose`` holds the choices the pass applied to the op (field -> value,
    e.g. ``algorithm``, ``compute``, ``restarts``, ``blocks``, ``schedule``);
    it is what the cache key hashes. An empty ``chose`` means the pass
    looked and left the op as it was (``why`` says why). ``label`` is the
    choice in words for humans ("gram fp32 restart [2]"); the predictions
    and alternatives are for humans too and never enter the key.
    ``not_applied``: the plan was recorded but the op left unchanged (the
    backend lacks kernels for it), and why.
    """

    pass_name: str
    chose: Mapping[str, Choice]
    label: str = ""
    predicted_s: float | None = None
    predicted_error: float | None = None
    alternatives: tuple[Alternative, ...] = ()
    why: str = ""
    not_applied: str = ""

    def __post_init__(self) -> None:
        # Read-only, so a decision shared between nodes (batch-by-shape copies it) cannot drift.
        object.__setattr__(self, "chose", MappingProxyType(dict(self.chose)))

    def __reduce__(self) -> tuple[type[Decision], tuple[object, ...]]:
        # A mappingproxy does not pickle; the warm start (runtime/warm.py) keeps decisions on disk.
        fields = (self.label, self.predicted_s, self.predicted_error, self.alternatives, self.why, self.not_applied)
        return (Decision, (self.pass_name, dict(self.chose), *fields))

    @property
    def applied(self) -> bool:
        return bool(self.chose) and not self.not_applied

    def render(self) -> str:
        """One line: ``pass: label, predictions (vs alternatives), why``; no ``;`` inside, so a
        node's decisions join with ``; ``."""
        text = f"{self.pass_name}: {self.label or self._chose_text() or 'unchanged'}"
        if self.predicted_s is not None:
            text += f", {format_seconds(self.predicted_s)} predicted"
        if self.predicted_error is not None:
            text += f", error {self.predicted_error:.3g}"
        if self.alternatives:
            text += " (vs " + " | ".join(a.render() for a in self.alternatives) + ")"
        if self.why:
            text += f", {self.why}"
        if self.not_applied:
            text += f", recorded, not applied: {self.not_applied}"
        return text

    def choices_key(self) -> str:
        """Stable text of what was chosen (sorted fields), without any prediction: the cache key's part."""
        fields = ",".join(f"{k}={self.chose[k]!r}" for k in sorted(self.chose))
        applied = "" if not self.not_applied else ",not-applied"
        return f"{self.pass_name}({fields}{applied})"

    def _chose_text(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.chose.items())


def record(node: fx.Node, decision: Decision) -> None:
    """Attach ``decision`` to ``node``, replacing an earlier one of the same pass (a pass run twice)."""
    kept = tuple(d for d in decisions_of(node) if d.pass_name != decision.pass_name)
    node.meta[DECISION] = kept + (decision,)


def decisions_of(node: fx.Node) -> tuple[Decision, ...]:
    """The decisions recorded on ``node``, in pass order (empty if none)."""
    value = node.meta.get(DECISION, ())
    if not isinstance(value, tuple) or not all(isinstance(d, Decision) for d in value):
        raise TypeError(f"{node.name}.meta[{DECISION!r}] is {value!r}, not a tuple of Decision (use record())")
    return value


def decision_of(node: fx.Node, pass_name: str) -> Decision | None:
    """``pass_name``'s decision on ``node``, or None."""
    return next((d for d in decisions_of(node) if d.pass_name == pass_name), None)


def decided(graph: fx.Graph) -> list[tuple[fx.Node, tuple[Decision, ...]]]:
    """Every node with a recorded decision, with its decisions, in graph order."""
    return [(node, decisions_of(node)) for node in graph.nodes if DECISION in node.meta]


def render_choices(node: fx.Node, predictions: bool = True) -> str:
    """The node's decisions as one text: rendered for humans, or (``predictions=False``) their
    choices only, as the cache key hashes them."""
    return "; ".join(d.render() if predictions else d.choices_key() for d in decisions_of(node))


def set_eager_dtype(node: fx.Node, dtype: torch.dtype) -> None:
    """Record eager's compute dtype once: a later pass (or a second run) must not overwrite it."""
    node.meta.setdefault(EAGER_DTYPE, dtype)


def eager_dtype(node: fx.Node, default: torch.dtype) -> torch.dtype:
    """:data:`EAGER_DTYPE` of ``node``; ``default`` (the op's compute dtype) when choose-algorithm did not run."""
    value = node.meta.get(EAGER_DTYPE, default)
    if not isinstance(value, torch.dtype):
        raise TypeError(f"{node.name}.meta[{EAGER_DTYPE!r}] is {value!r}, not a torch.dtype")
    return value


__all__ = [
    "DECISION",
    "EAGER_DTYPE",
    "Alternative",
    "Choice",
    "Decision",
    "decided",
    "decision_of",
    "decisions_of",
    "eager_dtype",
    "format_seconds",
    "record",
    "render_choices",
    "set_eager_dtype",
]
