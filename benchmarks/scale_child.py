"""The subprocesses of benchmarks/scale.py, and the runner that starts, watches and kills them.

Roles (each writes one JSON object to ``--out``):

- ``run``: eager and hocompile-compiled Muon + AdamW on the same structure:
  the two compiling steps, then interleaved steps; peak RSS of the compiles.
- ``warm``: a new process on the cache directory ``run`` filled: its first
  compiled steps.
- ``torch-compile``: ``torch.compile(opt.step)`` of the same optimizers.
- ``plan``: ``hocompile.plan`` of the Muon optimizer on meta tensors.

The runner kills a child (its whole process group: inductor's compile
workers too) past its time limit or when its RSS passes the memory limit,
and reports which as the row's error.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

CHILD_ROLES = ("run", "warm", "torch-compile", "plan")
SCRIPT = Path(__file__).with_name("scale.py")
MIB = 2**20
MUON_KW: dict[str, Any] = {"lr": 0.02, "momentum": 0.95, "weight_decay": 0.1}
ADAMW_KW: dict[str, Any] = {"lr": 3e-4, "betas": (0.9, 0.95), "weight_decay": 0.1}


def _status_kib(field: str, pid: int | str = "self") -> int:
    match = re.search(rf"^{field}:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text(), re.M)
    return int(match.group(1)) if match else 0


def run_child(role: str, cfg: dict[str, Any], env: dict[str, str], timeout_s: float, rss_limit: int) -> dict[str, Any]:
    """Run ``scale.py --child role``; its JSON, or {"error": why} (timeout, over memory, exit status)."""
    with tempfile.TemporaryDirectory(prefix="hocompile-scale-child-") as tmp:
        out, err = Path(tmp) / "out.json", Path(tmp) / "stderr"
        cmd = [sys.executable, str(SCRIPT), "--child", role, "--config", json.dumps(cfg), "--out", str(out)]
        start, spawned_at = time.perf_counter(), time.time()
        with err.open("w") as err_file:
            proc = subprocess.Popen(cmd, env=env, stderr=err_file, start_new_session=True)
            why, rss = "", 0
            while proc.poll() is None:
                time.sleep(0.2)
                if time.perf_counter() - start > timeout_s:
                    why = f"did not finish in {timeout_s:.0f} s"
                else:
                    try:
                        rss = _status_kib("VmRSS", proc.pid) * 1024
                    except OSError:
                        continue
                    if rss > rss_limit:
                        why = f"killed at {rss / 2**30:.1f} GiB RSS (limit {rss_limit / 2**30:.1f} GiB)"
                if why:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                    print(f"  {role}: {why}", flush=True)
                    return {"error": why, "seconds": time.perf_counter() - start, "last_rss_gib": rss / 2**30}
        wall = time.perf_counter() - start
        if proc.returncode != 0 or not out.exists():
            tail = err.read_text()[-3000:]
            print(f"  {role} failed (exit {proc.returncode}):\n{tail}", flush=True)
            return {"error": f"exit {proc.returncode}: {tail.strip().splitlines()[-1] if tail.strip() else ''}",
                    "stderr_tail": tail, "seconds": wall}
        result: dict[str, Any] = json.loads(out.read_text())
        result["process_s"] = wall
        if "first_step_done_at" in result:  # spawn, imports and building included
            result["spawn_to_first_step_s"] = result["first_step_done_at"] - spawned_at
        return result


# ---- inside the child ----


def _specs(cfg: dict[str, Any]) -> Any:
    from benchmarks.structures import DEFAULT_SCALE, specs_for, split

    specs = specs_for(cfg["structure"], scale=cfg["scale"] or DEFAULT_SCALE, experts=cfg["experts"], n=cfg["n"],
                      layers=cfg["layers"])
    return split(specs)


def _tensors(cfg: dict[str, Any], device: str = "cpu") -> tuple[list[Any], list[Any], list[Any]]:
    """(muon params, adamw params, grads of both in that order), seeded: every child makes the same ones."""
    import torch

    from benchmarks.structures import materialize

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[cfg["dtype"]]
    muon_specs, adamw_specs = _specs(cfg)
    muon = materialize(muon_specs, device=device, dtype=dtype, seed=cfg["seed"])
    adamw = materialize(adamw_specs, device=device, dtype=dtype, seed=cfg["seed"] + 1)
    if device == "meta":
        return muon, adamw, [torch.empty_like(p) for p in muon + adamw]
    gen = torch.Generator().manual_seed(cfg["seed"] + 2)
    grads = [torch.randn(p.shape, generator=gen).mul_(1e-3).to(dtype) for p in muon + adamw]
    return muon, adamw, grads


def _optimizers(muon: list[Any], adamw: list[Any]) -> list[Any]:
    """torch.optim.Muon (BatchedMuon where a param is not 2-D) on ``muon``, torch.optim.AdamW on ``adamw``."""
    import torch

    from benchmarks.batched_muon import BatchedMuon

    opts: list[Any] = []
    if muon:
        cls = torch.optim.Muon if all(p.ndim == 2 for p in muon) else BatchedMuon
        opts.append(cls(muon, **MUON_KW))
    if adamw:
        opts.append(torch.optim.AdamW(adamw, **ADAMW_KW))
    return opts


def _attach(params: list[Any], grads: list[Any]) -> None:
    for p, g in zip(params, grads):
        p.grad = g


def _timed(steps: list[Callable[[], Any]]) -> float:
    start = time.perf_counter()
    for step in steps:
        step()
    return time.perf_counter() - start


def _compile_entries(compiled: list[Any]) -> list[dict[str, Any]]:
    """What each compile cost, by the library's own account (fields read defensively: internals move),
    with its module's cache key and whether it came from disk (a warm start that misses shows why here:
    the plans differ)."""
    rows = []
    for opt in compiled:
        for entry in getattr(opt, "history", []):
            captured, lowered = getattr(entry, "captured", None), getattr(entry, "lowered", None)
            rows.append({
                "optimizer": type(opt.optimizer).__name__, "reason": getattr(entry, "reason", ""),
                "compile_s": getattr(entry, "compile_seconds", None),
                "capture_s": getattr(captured, "trace_seconds", None), "passes_s": getattr(entry, "pass_seconds", None),
                "lower_s": getattr(entry, "lower_seconds", None), "fallback": getattr(entry, "fallback", ""),
                "warm": bool(getattr(entry, "warm", "")),
                # checking against eager: verify='s (fp64 references) and the self-check's (on copies)
                "verify_s": getattr(getattr(entry, "verification", None), "seconds", 0.0)
                + getattr(getattr(entry, "self_check", None), "seconds", 0.0),
                "key": str(getattr(lowered, "key", ""))[:24], "from_disk": getattr(lowered, "from_disk", None),
                "plans": _plans(getattr(entry, "decisions", [])),
            })
    return rows


def _plans(decisions: list[str]) -> list[str]:
    """Each decision line cut to its op and chosen algorithm (predictions and timings dropped)."""
    plans = []
    for line in decisions[:50]:
        chosen = re.search(r"choose-algorithm: ([^,(]+)", line)
        cached = " (timing cached)" if "(cached)" in line else ""
        plans.append(f"{line.split(': ')[0]}: {chosen.group(1).strip() if chosen else '?'}{cached}")
    return plans


def _reset_peak() -> None:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    except OSError:
        pass


def child_run(cfg: dict[str, Any]) -> dict[str, Any]:
    import torch

    import hocompile

    muon, adamw, grads = _tensors(cfg)
    shared = cfg["layout"] == "shared params"
    c_muon = muon if shared else [torch.nn.Parameter(p.detach().clone()) for p in muon]
    c_adamw = adamw if shared else [torch.nn.Parameter(p.detach().clone()) for p in adamw]
    _attach(muon + adamw, grads)
    _attach(c_muon + c_adamw, grads)
    grad_sums = torch.stack([g.float().sum() for g in grads])
    eager = _optimizers(muon, adamw)
    compiled = [hocompile.compile_optimizer(o, warm_start=True) for o in _optimizers(c_muon, c_adamw)]
    eager_steps, compiled_steps = [o.step for o in eager], [o.step for o in compiled]

    rss_before = _status_kib("VmRSS")
    _reset_peak()
    first = _timed(compiled_steps)
    print(f"  compiled step 1 (first compile): {first:.2f} s", flush=True)
    steady_compile = _timed(compiled_steps)
    print(f"  compiled step 2 (steady compile): {steady_compile:.2f} s", flush=True)
    peak = max(_status_kib("VmHWM"), rss_before)
    eager_first = _timed(eager_steps)
    eager_second = _timed(eager_steps)
    print(f"  eager steps 1, 2: {eager_first:.2f} s, {eager_second:.2f} s", flush=True)
    eager_times, compiled_times = [], []
    for i in range(cfg["steps"]):
        eager_times.append(_timed(eager_steps))
        compiled_times.append(_timed(compiled_steps))
        print(f"  round {i + 1}: eager {eager_times[-1]:.3f} s, compiled {compiled_times[-1]:.3f} s", flush=True)
    result: dict[str, Any] = {
        "first_compile_s": first, "steady_compile_s": steady_compile, "eager_first_step_s": eager_first,
        "eager_step_s": statistics.median(eager_times) if eager_times else eager_second,
        "compiled_step_s": statistics.median(compiled_times) if compiled_times else None,
        "eager_times_s": eager_times, "compiled_times_s": compiled_times,
        "eager_best_s": min(eager_times, default=None), "compiled_best_s": min(compiled_times, default=None),
        "rss_before_mib": rss_before / 1024, "peak_rss_mib": peak / 1024,
        "rss_increase_mib": (peak - rss_before) / 1024,
        "compiles": _compile_entries(compiled), "counters": [dict(o.counters) for o in compiled],
        "grads_unchanged": bool(torch.equal(grad_sums, torch.stack([g.float().sum() for g in grads]))),
        "explain_head": [hocompile.explain(o).splitlines()[:6] for o in compiled],
    }
    if not shared:  # both sides took 2 + steps steps from the same params
        result.update(_compare(cfg, muon + adamw, c_muon + c_adamw))
    return result


def _compare(cfg: dict[str, Any], eager: list[Any], compiled: list[Any]) -> dict[str, float]:
    """Eager vs compiled after the same steps: the largest elementwise difference, and the largest
    ||eager - compiled|| / ||eager - initial|| of one tensor (the difference relative to the update)."""
    from benchmarks.structures import initial_values

    muon_specs, adamw_specs = _specs(cfg)
    initial = itertools.chain(initial_values(muon_specs, cfg["seed"]), initial_values(adamw_specs, cfg["seed"] + 1))
    max_abs, worst = 0.0, 0.0
    for e, c, p0 in zip(eager, compiled, initial):
        e, c = e.detach().float(), c.detach().float()
        max_abs = max(max_abs, float((e - c).abs().max()))
        update = float((e - p0).norm())
        worst = max(worst, float((e - c).norm()) / update if update else 0.0)
    return {"max_abs_diff_eager_vs_compiled": max_abs, "max_diff_over_update": worst}


def child_warm(cfg: dict[str, Any]) -> dict[str, Any]:
    import hocompile

    muon, adamw, grads = _tensors(cfg)
    _attach(muon + adamw, grads)
    compiled = [hocompile.compile_optimizer(o, warm_start=True) for o in _optimizers(muon, adamw)]
    steps = [o.step for o in compiled]
    rss_before = _status_kib("VmRSS")
    _reset_peak()
    first = _timed(steps)
    done_at = time.time()
    second = _timed(steps)
    peak = max(_status_kib("VmHWM"), rss_before)
    entries = _compile_entries(compiled)
    checked = sum(e["verify_s"] or 0.0 for e in entries if e["reason"] == "first step")
    print(f"  warm start: compiled steps 1, 2: {first:.2f} s, {second:.2f} s "
          f"(checking the loaded steps against eager: {checked:.2f} s of step 1)", flush=True)
    return {
        "first_step_s": first, "second_step_s": second, "first_step_check_s": checked,
        "first_step_done_at": done_at, "peak_rss_mib": peak / 1024,
        "rss_increase_mib": (peak - rss_before) / 1024, "compiles": entries,
        "counters": [dict(o.counters) for o in compiled],
    }


def child_torch_compile(cfg: dict[str, Any]) -> dict[str, Any]:
    import torch

    muon, adamw, grads = _tensors(cfg)
    _attach(muon + adamw, grads)
    steps = [torch.compile(o.step) for o in _optimizers(muon, adamw)]
    first = _timed(steps)
    print(f"  torch.compile: first call {first:.2f} s", flush=True)
    second = _timed(steps)
    times = [_timed(steps) for _ in range(max(1, cfg["steps"]))]
    from torch._dynamo.utils import counters

    return {"first_s": first, "second_s": second, "step_s": statistics.median(times), "times_s": times,
            "unique_graphs": counters["stats"]["unique_graphs"]}


def child_plan(cfg: dict[str, Any]) -> dict[str, Any]:
    import hocompile

    muon, _, grads = _tensors(cfg, device="meta")
    _attach(muon, grads)
    (opt,) = _optimizers(muon, [])
    settings: dict[str, Any] = {"target": cfg["target"]}
    if cfg.get("world"):
        settings["world"] = cfg["world"]  # the replicated owner plan across that many ranks
    rss_before = _status_kib("VmRSS")
    _reset_peak()
    start = time.perf_counter()
    try:
        report = hocompile.plan(opt, **settings)
    except Exception:  # the point is to report what today's library does at this size
        return {"error": traceback.format_exc()[-4000:], "seconds": time.perf_counter() - start,
                "optimizer": type(opt).__name__}
    seconds = time.perf_counter() - start
    peak = max(_status_kib("VmHWM"), rss_before)
    lines = report.splitlines()
    print(f"  plan: {seconds:.2f} s, {len(lines)} lines", flush=True)
    return {"seconds": seconds, "optimizer": type(opt).__name__, "report_lines": len(lines),
            "report_head": "\n".join(lines[:60]), "peak_rss_mib": peak / 1024,
            "rss_increase_mib": (peak - rss_before) / 1024}


def child_main(role: str, cfg: dict[str, Any], out: Path) -> None:
    roles = {"run": child_run, "warm": child_warm, "torch-compile": child_torch_compile, "plan": child_plan}
    result = roles[role](cfg)
    out.write_text(json.dumps(result, default=str))
