"""Plans that do not depend on the machine's mood (issue 31): the same bits in every process.

What a plan computes is a rule over the program, shapes, settings and the CPU's declared
capabilities (targets.declared_ratios); timing only picks among bitwise-identical alternatives.
So fresh processes, one of them compiling while two busy loops saturate the cores, compute
the same bits, and so do compile_optimizer, torch.compile's backend and 2 gloo ranks under
``distributed="replicated"``. Before the rule, the loaded process chose other precisions and
symmetric products by its timings (two quiet processes differed too, while tests ran beside them).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import torch

import hocompile
from hocompile.targets import Target, declared_ratios

ROOT = Path(__file__).resolve().parent.parent


def _digest(mode: str, cache_dir: Path, loaded: bool = False) -> str:
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2 if loaded else 0)]
    try:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        done = subprocess.run(
            [sys.executable, "-m", "tests.same_bits_child", mode, str(cache_dir)],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
        )
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


def test_two_fresh_processes_one_of_them_loaded_compute_the_same_bits(tmp_path: Path) -> None:
    quiet = _digest("compile_optimizer", tmp_path / "quiet")
    loaded = _digest("compile_optimizer", tmp_path / "loaded", loaded=True)
    assert quiet == loaded


def test_compile_optimizer_the_backend_and_two_replicated_ranks_compute_the_same_bits(tmp_path: Path) -> None:
    found = {mode: _digest(mode, tmp_path / mode) for mode in ("compile_optimizer", "backend", "replicated")}
    assert len(set(found.values())) == 1, found


def _muon_steps(target: Target | None, shape: tuple[int, int] = (8, 256), steps: int = 3) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(torch.randn(shape, generator=gen) * 0.02)
    inner = torch.optim.Muon([p], lr=0.02)
    opt = inner if target is None else hocompile.compile_optimizer(inner, target=target)
    out = []
    for k in range(steps):
        p.grad = torch.randn(shape, generator=torch.Generator().manual_seed(10 + k))
        opt.step()
        out.append(p.detach().clone())
    return out


def test_an_8x256_router_keeps_eagers_bf16_where_bf16_is_kept() -> None:
    """Below the calibrated shapes (short side 8 < 64) the rule is the same as above them: on a CPU
    declaring bf16 units, eager's bf16 NS, bitwise eager's step (it was fp32 by a timing)."""
    gflops = {"fp32": 100.0, "bf16": 250.0, "fp16": 1.0}
    with_units = Target("cpu", gflops, measured=True, ratios=declared_ratios(frozenset({"amx_bf16"}), ""))
    eager = _muon_steps(None)
    compiled = _muon_steps(with_units)
    assert all(torch.equal(a, b) for a, b in zip(eager, compiled))


def test_small_shapes_follow_the_same_rule_as_large_ones() -> None:
    """On this machine, whichever kind: the 8×256 matrix computes in the dtype a 768² one does."""
    params = [torch.nn.Parameter(torch.zeros(s)) for s in ((8, 256), (768, 768))]
    for p in params:
        p.grad = torch.randn(p.shape) * 1e-3
    text = hocompile.plan(torch.optim.Muon(params, lr=0.02))
    lines = [line for line in text.splitlines() if "hocompile.newton_schulz" in line and "choose-algorithm" in line]
    dtypes = {re.search(r"choose-algorithm: (?:standard|gram) (\w+)", line).group(1) for line in lines}  # type: ignore[union-attr]
    assert len(lines) == 2 and len(dtypes) == 1, lines


def test_replicated_ranks_that_would_plan_other_numbers_are_refused() -> None:
    """Two ranks, one declaring bf16 units and one not (CPUs of two kinds), or with another
    precision=: each would plan other numbers, so both raise before anything is written; on the
    same basis both step."""
    from hocompile.distributed.check import DistributedMismatchError

    from .dist_helpers import threaded

    gflops = {"fp32": 100.0, "bf16": 250.0, "fp16": 1.0}
    kinds = {
        flag: Target("cpu", gflops, measured=True, ratios=declared_ratios(frozenset({flag}), ""))
        for flag in ("amx_bf16", "avx2")
    }

    def body(rank: int, targets: tuple[str, str], precisions: tuple[str, str]) -> str:
        gen = torch.Generator().manual_seed(0)
        ps = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in ((32, 64), (64, 32), (48, 48), (16, 80))]
        for p in ps:
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(1))
        before = [p.detach().clone() for p in ps]
        opt = hocompile.compile_optimizer(
            torch.optim.Muon(ps, lr=0.02), distributed="replicated", target=kinds[targets[rank]],
            precision=precisions[rank],
        )
        try:
            opt.step()
            return "stepped"
        except DistributedMismatchError as e:
            assert all(torch.equal(a, p) for a, p in zip(before, ps)), "nothing written"
            return str(e)

    same = threaded(2, lambda r: body(r, ("amx_bf16", "amx_bf16"), ("auto", "auto")))
    assert same == {0: "stepped", 1: "stepped"}
    for targets, precisions in ((("amx_bf16", "avx2"), ("auto", "auto")), (("amx_bf16",) * 2, ("auto", "fp32"))):
        found = threaded(2, lambda r, t=targets, p=precisions: body(r, t, p))  # type: ignore[misc]
        assert all("plan on different bases" in found[r] for r in (0, 1)), found
