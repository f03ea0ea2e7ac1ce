"""Compile cost and step time at frontier parameter counts: Muon + AdamW on real model structures.

    .venv/bin/python benchmarks/scale.py --structure small-muon --n 48 384
    .venv/bin/python benchmarks/scale.py --structure qwen3 --scale 64 --steps 3
    .venv/bin/python benchmarks/scale.py --structure qwen3 --scale 64 --layers 1 2 4   # N grows with layers
    .venv/bin/python benchmarks/scale.py --structure kimi-k2 --scale 64 --experts stacked --no-torch-compile
    .venv/bin/python benchmarks/scale.py --plan kimi-k2 --target sm90                  # true shapes, meta

One row per configuration (benchmarks/structures.py builds the params: the
real counts, every dimension divided by ``--scale``). torch.optim.Muon steps
the Muon params (BatchedMuon from benchmarks/batched_muon.py for stacked
``[E, m, n]`` experts, which torch.optim.Muon refuses) and torch.optim.AdamW
the rest; both are compiled with ``hocompile.compile_optimizer`` and stepped
together, as a training step would. Each configuration runs in its own
subprocess (its peak memory and caches are its own):

- first compile: wall seconds of the first compiled step (it compiles the
  first-step graph, which creates the state); steady compile: the second
  (the steady-state graph). Each in a fresh ``HOCOMPILE_CACHE_DIR`` seeded
  only with this machine's target calibration (measured once per run of this
  script), so the NS candidate timings and generated modules are cold.
- warm start: a NEW process on the same cache directory, seconds of its first
  compiled step (and, in the JSON, of the process from spawn).
- eager / compiled step: medians of ``--steps`` interleaved steps in one
  process (a busy neighbour slows both alike), on separate copies of the
  params with the same grads (set once, seeded; both optimizers read the
  same grad tensors, which none of them writes). Where two copies would not
  fit, eager and compiled alternate on one set of params (the table says so).
- peak RSS: VmHWM over the two compiling steps (reset before them through
  /proc/self/clear_refs), and its increase over the RSS before.
- growth: log(t2 / t1) / log(N2 / N1) of each compile time against the
  previous row with a different N.
- torch.compile(opt.step) of the same optimizers, in a subprocess killed
  after ``--torch-compile-timeout`` seconds (its first call compiles).

A configuration whose params + grads + state would not fit in 75% of RAM is
refused before anything is built. Results: benchmarks/results/scale_<structure>.json
and .md (``--json PATH`` moves both), with the machine and the command line.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import shutil
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.scale_child import CHILD_ROLES, child_main, run_child  # noqa: E402
from benchmarks.structures import DEFAULT_SCALE, MODELS, STRUCTURES, footprint_bytes, format_summary, specs_for  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
GIB = 2**30
GROWTH_KEYS = ("first_compile_s", "steady_compile_s", "warm_start_s", "torch_compile_first_s")


def mem_total() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no MemTotal in /proc/meminfo")


def gemm_gflops(dtype_name: str, size: int = 512, budget_s: float = 1.0) -> float:
    """Best-of rate of one ``size``-cubed matmul: at least 3 runs, more while within ``budget_s``."""
    import torch

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    a @ b
    best, runs, begin = float("inf"), 0, time.perf_counter()
    while runs < 3 or (time.perf_counter() - begin < budget_s and runs < 50):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
        runs += 1
    return 2 * size**3 / best / 1e9


def machine() -> dict[str, Any]:
    import torch

    model = next(
        (ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines() if "model name" in ln),
        platform.processor() or "unknown CPU",
    )
    info = {
        "cpu": model,
        "cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)),
        "torch_threads": torch.get_num_threads(),
        "ram_gib": round(mem_total() / GIB, 1),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "gemm512_gflops": {name: round(gemm_gflops(name), 2) for name in ("fp32", "bf16")},
        # small GEMMs are what an optimizer step of many small matrices runs (eager Muon: in bf16)
        "gemm64_gflops": {name: round(gemm_gflops(name, 64, 0.2), 2) for name in ("fp32", "bf16")},
        "loadavg": [round(x, 2) for x in os.getloadavg()],
    }
    return info


def describe_machine(m: dict[str, Any]) -> str:
    g, small = m["gemm512_gflops"], m.get("gemm64_gflops", {})
    return (
        f"{m['cpu']}, {m['usable_cores']} of {m['cores']} cores ({m['torch_threads']} torch threads), "
        f"{m['ram_gib']} GiB RAM, torch {m['torch']}, 512^3 GEMM fp32 {g['fp32']} GFLOP/s, bf16 {g['bf16']} GFLOP/s "
        f"(64^3: fp32 {small.get('fp32')}, bf16 {small.get('bf16')}), load average {'/'.join(map(str, m['loadavg']))}"
    )


def choose_layout(fp: dict[str, int], limit: int) -> str | None:
    """Two copies (eager, compiled) sharing one set of grads, else one set of params; None if neither fits."""
    if 2 * fp["params"] + fp["grads"] + 2 * fp["state"] <= limit:
        return "two copies"
    if fp["params"] + fp["grads"] + 2 * fp["state"] <= limit:
        return "shared params"
    return None


def configurations(args: argparse.Namespace) -> list[dict[str, Any]]:
    base = {"structure": args.structure, "experts": args.experts, "dtype": args.dtype, "seed": args.seed}
    if args.structure in MODELS:
        return [{**base, "scale": s, "layers": lay, "n": None} for s in args.scale or [DEFAULT_SCALE] for lay in
                args.layers or [None]]
    return [{**base, "scale": None, "layers": None, "n": n} for n in args.n]


def growth(prev: dict[str, Any] | None, row: dict[str, Any], key: str) -> float | None:
    if prev is None or prev["n_params"] == row["n_params"]:
        return None
    t1, t2 = prev.get(key), row.get(key)
    if not t1 or not t2:
        return None
    return math.log(t2 / t1) / math.log(row["n_params"] / prev["n_params"])


def fmt(x: Any, spec: str = ".2f", none: str = "—") -> str:
    return none if x is None else format(x, spec)


def torch_compile_cell(tc: dict[str, Any] | None) -> tuple[str, str]:
    if tc is None:
        return "not run", "—"
    if "error" in tc:
        return tc["error"], "—"
    return f"{tc['first_s']:.2f} s (+{tc['second_s']:.2f} s)", f"{tc['step_s'] * 1e3:.1f}"


def markdown(result: dict[str, Any]) -> str:
    rows = result["rows"]
    lines = [
        f"# Scale benchmark: {result['structure']}",
        "",
        f"Machine: {describe_machine(result['machine'])}.",
        "",
        f"Command: `{result['command']}` ({result['date']}).",
        "",
        "Times in seconds unless marked; first / steady compile are the wall times of the first and second "
        "compiled steps (cold cache), warm start the first compiled step of a new process on the same cache "
        "(loading and the step; its check against eager on copies, one eager step and fp64 references, "
        "counted apart); "
        "steps are medians of interleaved steps; growth is log(t2/t1)/log(N2/N1) against the row above "
        "(first, steady, warm, torch.compile first call); peak RSS is VmHWM over the two compiling steps "
        "(+ its increase). Layout: 'two copies' = eager and compiled on separate params (same grads), "
        "'shared params' = they alternate on one set. Eager torch.optim.Muon runs Newton–Schulz in bf16; "
        "hocompile plans its precision for the machine (fp32 on CPUs without a fast small bf16 GEMM), so "
        "eager/compiled also measures that choice.",
        "",
        "| config | N params (Muon+AdamW) | p+g+state GiB | layout | first compile | steady compile | warm start "
        "| eager step ms | compiled step ms | eager/compiled | peak RSS MiB | growth | torch.compile first (+second) "
        "| torch.compile step ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        config = row["config_name"]
        if "refused" in row or "error" in row:
            lines.append(f"| {config} | {row['n_params']} | {row['footprint_gib']:.2f} | "
                         f"{row.get('refused') or row.get('error')} |" + " |" * 10)
            continue
        g = [fmt(row["growth"][k]) for k in GROWTH_KEYS]
        tc_first, tc_step = torch_compile_cell(row.get("torch_compile"))
        ratio = row["eager_step_s"] / row["compiled_step_s"] if row.get("compiled_step_s") else None
        lines.append(
            f"| {config} | {row['n_params']} ({row['n_muon']}+{row['n_adamw']}) | {row['footprint_gib']:.2f} "
            f"| {row['layout']} | {fmt(row['first_compile_s'])} | {fmt(row['steady_compile_s'])} "
            f"| {fmt(row.get('warm_start_s'))} (+ {fmt(row.get('warm_check_s'))} checking against eager; "
            f"{fmt(row['warm'].get('spawn_to_first_step_s'), '.1f')} from spawn) "
            f"| {fmt(row['eager_step_s'] * 1e3, '.1f')} "
            f"| {fmt(row['compiled_step_s'] * 1e3, '.1f')} | {fmt(ratio)}x "
            f"| {row['peak_rss_mib']:.0f} (+{row['rss_increase_mib']:.0f}) | {' / '.join(g)} | {tc_first} | {tc_step} |"
        )
    lines += ["", "Where the compile time goes (hocompile's own account, summed over the optimizers): capture / "
              "passes / lowering seconds of the first and the steady-state compile, cold and warm.", "",
              "| config | first, cold | steady, cold | first, warm | steady, warm |", "|---|---|---|---|---|"]
    for row in rows:
        if "compiles" in row:
            cells = [phases(row["compiles"], i) for i in (0, 1)]
            cells += [phases(row.get("warm", {}).get("compiles", []), i) for i in (0, 1)]
            lines.append(f"| {row['config_name']} | " + " | ".join(cells) + " |")
    lines += ["", "Parameter classes of each configuration:", ""]
    for row in rows:
        lines += [f"{row['config_name']}:", "", "```", row["summary"], "```", ""]
    return "\n".join(lines)


def phases(compiles: list[dict[str, Any]], number: int) -> str:
    """capture / passes / lowering seconds of each optimizer's ``number``-th compile, summed."""
    per_opt: dict[str, list[dict[str, Any]]] = {}
    for c in compiles:
        per_opt.setdefault(c["optimizer"], []).append(c)
    mine = [cs[number] for cs in per_opt.values() if len(cs) > number]
    if not mine:
        return "—"
    return " / ".join(f"{sum(c[k] or 0.0 for c in mine):.2f}" for k in ("capture_s", "passes_s", "lower_s"))


def config_name(cfg: dict[str, Any]) -> str:
    if cfg["n"] is not None:
        return f"{cfg['structure']} N={cfg['n']}"
    layers = "" if cfg["layers"] is None else f" layers={cfg['layers']}"
    return f"{cfg['structure']} s={cfg['scale']} {cfg['experts']}{layers}"


def bench_one(cfg: dict[str, Any], args: argparse.Namespace, limit: int, seed_dir: Path) -> dict[str, Any]:
    import tempfile

    specs = specs_for(cfg["structure"], scale=cfg["scale"] or DEFAULT_SCALE, experts=cfg["experts"], n=cfg["n"],
                      layers=cfg["layers"])
    fp = footprint_bytes(specs, 2 if cfg["dtype"] == "bf16" else 4)
    row: dict[str, Any] = {
        "config": cfg, "config_name": config_name(cfg), "n_params": len(specs),
        "n_muon": sum(s.optimizer == "muon" for s in specs), "n_adamw": sum(s.optimizer == "adamw" for s in specs),
        "elements": sum(s.numel for s in specs), "footprint_bytes": fp, "footprint_gib": sum(fp.values()) / GIB,
        "summary": format_summary(specs),
    }
    print(f"\n== {row['config_name']}: {row['n_params']} params, params+grads+state {row['footprint_gib']:.2f} GiB")
    print(row["summary"], flush=True)
    layout = choose_layout(fp, limit)
    if layout is None:
        row["refused"] = (f"refused: needs {(fp['params'] + fp['grads'] + 2 * fp['state']) / GIB:.1f} GiB, over 75% "
                          f"of RAM ({limit / GIB:.1f} GiB)")
        print(row["refused"])
        return row
    row["layout"] = layout
    cache = Path(tempfile.mkdtemp(prefix="hocompile-scale-"))
    for seed_file in seed_dir.glob("target-*.json"):
        shutil.copy(seed_file, cache / seed_file.name)
    try:
        return measure(row, {**cfg, "layout": layout, "steps": args.steps}, cache, args, limit)
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def measure(row: dict[str, Any], cfg: dict[str, Any], cache: Path, args: argparse.Namespace, limit: int) -> dict:
    """The three subprocesses of one configuration: run (cold), warm start, torch.compile."""
    env = {**os.environ, "HOCOMPILE_CACHE_DIR": str(cache)}
    run = run_child("run", cfg, env, args.timeout, limit)
    if "error" in run:
        row["error"] = run["error"]
        return row
    row.update(run)
    warm = run_child("warm", cfg, env, args.timeout, limit)
    row["warm"] = warm
    # The loaded steps' first step is also checked against eager on copies (an eager step and the
    # references): counted apart, the warm start is loading plus the compiled step itself.
    if warm.get("first_step_s") is not None:
        row["warm_start_s"] = warm["first_step_s"] - warm.get("first_step_check_s", 0.0)
        row["warm_check_s"] = warm.get("first_step_check_s", 0.0)
    if not args.no_torch_compile:
        tenv = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor")}
        row["torch_compile"] = run_child("torch-compile", cfg, tenv, args.torch_compile_timeout, limit)
        row["torch_compile_first_s"] = row["torch_compile"].get("first_s")
    return row


def seed_calibration(limit: int) -> Path:
    """A cache directory holding only this machine's target calibration (one tiny compile measures it)."""
    import tempfile

    seed_dir = Path(tempfile.mkdtemp(prefix="hocompile-scale-seed-"))
    print("calibrating this machine's target once (one tiny compile); every cold cache starts from it", flush=True)
    env = {**os.environ, "HOCOMPILE_CACHE_DIR": str(seed_dir)}
    cfg = {"structure": "small-muon", "n": 1, "scale": None, "layers": None, "experts": "separate", "dtype": "fp32",
           "seed": 0, "layout": "two copies", "steps": 1}
    result = run_child("warm", cfg, env, 600, limit)
    if "error" in result:
        print(f"calibration seed failed ({result['error']}); every cold compile calibrates the target itself")
    return seed_dir


def main_bench(args: argparse.Namespace) -> None:
    limit = int(0.75 * mem_total())
    info = machine()
    print(f"machine: {describe_machine(info)}", flush=True)
    seed_dir = seed_calibration(limit)
    rows: list[dict[str, Any]] = []
    prev = None
    for cfg in configurations(args):
        row = bench_one(cfg, args, limit, seed_dir)
        ok = "refused" not in row and "error" not in row
        row["growth"] = {k: growth(prev, row, k) if ok else None for k in GROWTH_KEYS}
        if ok:
            prev = row
            tc_first, tc_step = torch_compile_cell(row.get("torch_compile"))
            print(f"-> first compile {row['first_compile_s']:.2f} s, steady {row['steady_compile_s']:.2f} s, warm "
                  f"{fmt(row['warm_start_s'])} s; eager step {row['eager_step_s'] * 1e3:.1f} ms, compiled "
                  f"{row['compiled_step_s'] * 1e3:.1f} ms ({row['layout']}); peak RSS {row['peak_rss_mib']:.0f} MiB "
                  f"(+{row['rss_increase_mib']:.0f}); growth {row['growth']}; torch.compile {tc_first}, "
                  f"step {tc_step} ms", flush=True)
        rows.append(row)
    result = {
        "structure": args.structure, "machine": info, **provenance(), "rows": rows,
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
    }
    shutil.rmtree(seed_dir, ignore_errors=True)
    write_results(result, Path(args.json) if args.json else RESULTS / f"scale_{args.structure}.json", markdown)


def provenance() -> dict[str, str]:
    return {"command": shlex.join([sys.executable, *sys.argv]),
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}


def write_results(result: dict[str, Any], json_path: Path, render: Any) -> None:
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(result, indent=1, default=str))
    md = render(result)
    json_path.with_suffix(".md").write_text(md)
    print(f"\nwrote {json_path} and {json_path.with_suffix('.md')}\n\n{md}")


def plan_markdown(result: dict[str, Any]) -> str:
    p = result["plan"]
    lines = [
        f"# hocompile.plan at true shapes: {result['structure']}",
        "",
        f"Machine: {describe_machine(result['machine'])}.",
        "",
        f"Command: `{result['command']}` ({result['date']}).",
        "",
        f"{result['n_muon']} Muon params on the meta device (scale {result['config']['scale']}, "
        f"{result['config']['experts']} experts), target {result['config']['target']}.",
        "",
    ]
    if "error" in p:
        rss = f", RSS {p['last_rss_gib']:.1f} GiB when stopped" if p.get("last_rss_gib") else ""
        return "\n".join(lines + [f"plan did not complete ({fmt(p.get('seconds'))} s{rss}):", "", "```", p["error"],
                                   "```", ""])
    lines += [f"plan took {p['seconds']:.2f} s, peak RSS {p['peak_rss_mib']:.0f} MiB (+{p['rss_increase_mib']:.0f}), "
              f"a {p['report_lines']}-line report; its first lines:", "", "```", p["report_head"], "```", ""]
    return "\n".join(lines)


def main_plan(args: argparse.Namespace) -> None:
    limit = int(0.75 * mem_total())
    info = machine()
    scale = args.scale[0] if args.scale else 1
    cfg = {"structure": args.plan, "scale": scale, "experts": args.experts, "n": args.n[0] if args.n else None,
           "layers": args.layers[0] if args.layers else None, "dtype": args.dtype, "seed": args.seed,
           "target": args.target, "world": args.world}
    specs = specs_for(args.plan, scale=scale, experts=args.experts, n=cfg["n"], layers=cfg["layers"])
    n_muon = sum(s.optimizer == "muon" for s in specs)
    print(f"machine: {describe_machine(info)}\nplanning {n_muon} Muon params of {args.plan} (scale {scale}) on meta "
          f"for {args.target}", flush=True)
    plan = run_child("plan", cfg, dict(os.environ), args.plan_timeout, limit)
    result = {
        "structure": args.plan, "config": cfg, "n_muon": n_muon, "machine": info, "plan": plan,
        **provenance(),
    }
    default = RESULTS / f"scale_plan_{args.plan}.json"
    write_results(result, Path(args.json) if args.json else default, plan_markdown)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--structure", choices=STRUCTURES, default="small-muon")
    ap.add_argument("--n", type=int, nargs="+", default=[48, 384], help="param count of the small structures")
    ap.add_argument("--scale", type=int, nargs="+", help=f"dimension divisor of the models (default {DEFAULT_SCALE}; "
                    "--plan: 1, the true shapes)")
    ap.add_argument("--layers", type=int, nargs="+", help="keep only the first L layers of a model (default all)")
    ap.add_argument("--experts", choices=("separate", "stacked"), default="separate")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--steps", type=int, default=5, help="interleaved eager/compiled steps timed after the compiles")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-torch-compile", action="store_true")
    ap.add_argument("--torch-compile-timeout", type=float, default=600.0)
    ap.add_argument("--timeout", type=float, default=7200.0, help="limit of each hocompile subprocess, seconds")
    ap.add_argument("--json", help="where the JSON goes (the .md goes beside it)")
    ap.add_argument("--plan", choices=STRUCTURES, help="time hocompile.plan of a structure's Muon on meta tensors")
    ap.add_argument("--target", default="sm90", help="--plan: the target planned for")
    ap.add_argument("--world", type=int, help="--plan: also plan distributed='replicated' owners across WORLD ranks")
    ap.add_argument("--plan-timeout", type=float, default=600.0)
    ap.add_argument("--render", help="only rewrite the .md beside this results JSON from it")
    ap.add_argument("--child", choices=CHILD_ROLES, help=argparse.SUPPRESS)
    ap.add_argument("--config", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main() -> None:
    args = parse_args()
    if args.child:
        child_main(args.child, json.loads(args.config), Path(args.out))
    elif args.render:
        path = Path(args.render)
        result = json.loads(path.read_text())
        path.with_suffix(".md").write_text((plan_markdown if "plan" in result else markdown)(result))
    elif args.plan:
        main_plan(args)
    else:
        main_bench(args)


if __name__ == "__main__":
    main()
