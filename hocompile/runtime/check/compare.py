"""How the self-check compares a compiled step's results with eager's (self_check.py): Python state
equal; tensors bitwise where the plan keeps eager's arithmetic (``units`` ulps on lowerings whose
pointwise kernels contract to FMAs); planned tensors within eager's own spread (judgement.py), or
only finite where eager's are when the user opted out of eager's precision. A difference is
confirmed against a second eager run before it counts (:func:`confirmed`)."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import torch

from ..records import SelfCheck
from .judgement import judge_tensor, nonfinite_difference
from .view import ViewResult, describe_name, same_bits

log = logging.getLogger("hocompile")


def compare(
    got: ViewResult, want: ViewResult, probes: list[ViewResult], planned: Callable[[str], bool], units: float,
    opted_out: bool,
) -> tuple[list[str], str]:
    """Problems (one line each) and a line on the planned tensor closest to its bound."""
    problems: list[str] = []
    worst, worst_share = "", -1.0
    for name in sorted(set(got.host) | set(want.host)):
        a, b = got.host.get(name, "<absent>"), want.host.get(name, "<absent>")
        if not _equal(a, b):
            problems.append(f"{describe_name(name)} is {a!r}, eager's {b!r}")
    for name in sorted(set(got.tensors) | set(want.tensors)):
        a, b = got.tensors.get(name), want.tensors.get(name)
        if a is None or b is None:
            if not name.endswith(".grad"):  # a grad's presence is in host
                problems.append(f"{want.where(name)} is {'absent' if a is None else 'present'}, eager's "
                                f"{'absent' if b is None else 'present'}")
            continue
        if a.shape != b.shape or a.dtype != b.dtype:
            problems.append(f"{want.where(name)} is {a.dtype} {tuple(a.shape)}, eager's {b.dtype} {tuple(b.shape)}")
            continue
        if not planned(want.entry(name)) or not b.is_floating_point():
            problem = _pointwise(a, b, units)
            if problem:
                problems.append(f"{want.where(name)} {problem}")
            continue
        if opted_out or not probes:
            if not torch.equal(a.isfinite(), b.isfinite()):
                problems.append(f"{want.where(name)} is {nonfinite_difference(a, b)}")
            continue
        spread = [p.tensors[name] for p in probes if name in p.tensors]
        verdict = judge_tensor(name, a, b, spread, want.before.get(want.entry(name)))
        if verdict.problem:
            problems.append(f"{want.where(name)} is {verdict.problem}")
        share = verdict.error / verdict.bound if verdict.bound > 0 else math.inf * (verdict.error > 0)
        if share > worst_share:
            worst_share = share
            worst = (f"worst {want.where(name)}: {verdict.error:.2g} of its update from eager's, "
                     f"bound {verdict.bound:.2g} (eager's own spread {verdict.spread:.2g})")
    return problems, worst


def _pointwise(a: torch.Tensor, b: torch.Tensor, units: float) -> str:
    if torch.equal(a, b):
        return ""
    same = (a == b) | (a.isnan() & b.isnan()) if a.is_floating_point() else a == b
    if bool(same.all()):
        return ""
    if not a.is_floating_point():
        return "differs from eager's (integer values, bound: equal)"
    diff = float(torch.where(same, 0.0, (a.double() - b.double()).abs()).max())
    scale = max(float(b.double().abs().max()), torch.finfo(b.dtype).tiny)
    if units and diff / scale <= units * float(torch.finfo(b.dtype).eps) / 2:
        return ""
    bound = "bitwise equal" if not units else f"{units:g} ulps"
    return f"differs where the plan keeps eager's arithmetic: max |Δ| {diff / scale:.3g} of max |eager| ({bound})"


def _equal(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, float) and math.isnan(a) and math.isnan(b):
        return True
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - values that do not compare are not Python state
        return True


def confirmed(
    outcome: tuple[list[str], str],
    got: ViewResult,
    reference: ViewResult,
    rerun: Callable[[], ViewResult],
    judge: Callable[[ViewResult], tuple[list[str], str]],
    record: SelfCheck,
) -> tuple[list[str], str]:
    """A difference is confirmed against a second eager run on fresh copies before it fails the program.

    Only eager's side is run again: the compiled result stays the one the check got, so a compiled step
    that differs once is never passed by a luckier second run. Where eager's two runs differ from each
    other, eager's own step was not reproducible on this machine at that moment (seen once per few CI
    runs on one CPU kind: a SOAP first step whose eager reference came out all non-finite while the real
    compiled and eager steps were finite), and the compiled result is judged against the second run."""
    again = rerun()
    if same_results(again, reference):
        return outcome  # eager reproduces itself: the difference is the compiled step's
    second = judge(again)
    record.irreproducible += 1
    log.warning(
        "hocompile: self-check: eager's step on copies did not reproduce itself (first run: %s); "
        "the compiled step was judged against a second eager run%s",
        "; ".join(outcome[0][:2]), ", and agrees with it" if not second[0] else "",
    )
    return second


def same_results(a: ViewResult, b: ViewResult) -> bool:
    """Whether two eager runs on copies gave the same bits (nan where nan) and the same host values."""
    if set(a.host) != set(b.host) or set(a.tensors) != set(b.tensors):
        return False
    if not all(_equal(value, b.host[name]) for name, value in a.host.items()):  # (a dict's != may raise)
        return False
    return all(same_bits(x, b.tensors[name]) for name, x in a.tensors.items())
