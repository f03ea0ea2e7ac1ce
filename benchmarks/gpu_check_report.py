"""gpu_check's short Markdown report (``gpu-<arch>.md``), written beside its JSON from the same data."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _ms(x: Any) -> str:
    return "-" if x is None else f"{x * 1e3:.3f} ms"


def _x(x: Any) -> str:
    return "-" if x is None else f"{x:.2f}x"


def _status(section: dict[str, Any], failures: list[str], name: str) -> str:
    if "error" in section:
        return "ERROR"
    if isinstance(section.get("skipped"), str):
        return "skipped"
    return "FAIL" if any(f.startswith(f"{name}:") or f.startswith(f"{name} ") for f in failures) else "ok"


def write_markdown(data: dict[str, Any], path: Path) -> Path:
    sections: dict[str, Any] = data.get("sections", {})
    failures: list[str] = data.get("failures", [])
    env = sections.get("env", {})
    smoke = " (smoke: CPU, interpreter)" if data.get("smoke") else ""
    lines = [
        f"# gpu_check on {env.get('gpu', data.get('arch', '?'))} ({data.get('arch', '?')})",
        "",
        f"{data.get('date', '')}; `{data.get('command', '')}`; torch {env.get('torch', '?')}, triton "
        f"{env.get('triton', '?')}, git {env.get('git', '?')}{smoke}",
        "",
        f"**{'PASS' if not failures else f'{len(failures)} FAILURE(S)'}** in {data.get('elapsed_s', 0):.0f} s "
        f"(estimate for one H200: {data.get('estimate_h200_total_s', 0):.0f} s, "
        f"budget {data.get('budget_s', 0):.0f} s)",
        "",
        "| section | status | seconds | H200 estimate |",
        "|---|---|---:|---:|",
    ]
    for name, section in sections.items():
        lines.append(
            f"| {name} | {_status(section, failures, name)} | {section.get('seconds', '-')} | "
            f"{section.get('estimate_s', '-')} |"
        )
    if failures:
        lines += ["", "Failures:", *(f"- {f}" for f in failures)]
    for set_name in ("gpt2", "large"):
        variants = sections.get(set_name, {}).get("variants", {})
        if not variants:
            continue
        lines += ["", f"Timing, {set_name} ({sections[set_name].get('n_matrices')} matrices):", ""]
        lines += ["| variant | first call | steady | vs eager | launches | peak extra MB |"]
        lines += ["|---|---:|---:|---:|---:|---:|"]
        for variant, res in variants.items():
            if "median_s" not in res:
                lines.append(f"| {variant} | {res.get('skipped') or res.get('error', '?')} | | | | |")
                continue
            lines.append(
                f"| {variant} | {res['first_call_s']:.2f} s | {_ms(res['median_s'])} | {_x(res.get('vs_eager'))} | "
                f"{res.get('launches', '-')} | {res.get('step_peak_extra_mb', '-')} |"
            )
    family = {k: v for k, v in sections.get("shampoo_family", {}).items() if isinstance(v, dict) and "eager" in v}
    if family:
        lines += ["", "Shampoo family (one GPT-2 layer):", ""]
        lines += [
            "| optimizer | eager | hocompile | vs eager | update vs eager | eager's own spread |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for name, res in family.items():
            lines.append(
                f"| {name} | {_ms(res['eager'].get('median_s'))} | {_ms(res.get('hocompile', {}).get('median_s'))} | "
                f"{_x(res.get('vs_eager'))} | {res.get('max_update_diff_vs_eager', float('nan')):.2e} | "
                f"{res.get('max_eager_spread', float('nan')):.2e} |"
            )
    fence = sections.get("fence", {})
    cases = {k: v for k, v in fence.items() if isinstance(v, dict)}
    if cases:
        verdicts = ", ".join(f"{k} {'ok' if v.get('passed') else 'FAIL'}" for k, v in cases.items())
        lines += ["", f"Write fence: {verdicts}"]
    dist = sections.get("distributed", {})
    if dist:
        lines += ["", f"Distributed: {dist.get('skipped') or ('ok' if dist.get('passed') else 'FAIL')}"]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path
