"""Runtime behaviour: dumps, disk cache, disabled passes, hooks, API surface, explain()."""

from __future__ import annotations

import re
import warnings

import pytest
import torch

import hocompile
from hocompile import CacheWarning

from .helpers import EXACT, Pair, make_params


def _muon(ps):
    return torch.optim.Muon(ps, lr=0.02, weight_decay=0.1)


def test_dump_dir_has_graph_before_and_after_each_pass(tmp_path, monkeypatch, cache_dir) -> None:
    monkeypatch.setenv("HOCOMPILE_DUMP_DIR", str(tmp_path / "dump"))
    pair = Pair(_muon, [(8, 4), (4, 4)], cache_dir)
    pair.step()
    first = tmp_path / "dump" / "compile-001"
    names = sorted(p.name for p in first.iterdir())
    assert names == [
        "00-captured.txt",
        "01-canonicalize.after.txt", "01-canonicalize.before.txt",
        "02-fuse-newton-schulz.after.txt", "02-fuse-newton-schulz.before.txt",
        "03-fuse-polar.after.txt", "03-fuse-polar.before.txt",
        "04-fuse-eigenbasis.after.txt", "04-fuse-eigenbasis.before.txt",
        "05-fuse-factor-update.after.txt", "05-fuse-factor-update.before.txt",
        "06-fuse-inverse-root.after.txt", "06-fuse-inverse-root.before.txt",
        "07-fuse-two-sided.after.txt", "07-fuse-two-sided.before.txt",
        "08-batch-by-shape.after.txt", "08-batch-by-shape.before.txt",
        "09-choose-algorithm.after.txt", "09-choose-algorithm.before.txt",
        "10-choose-precision.after.txt", "10-choose-precision.before.txt",
        "11-stack-calls.after.txt", "11-stack-calls.before.txt",  # a step traced whole (passes/pipeline.step_pipeline)
        "lowered.py",
    ]
    before = (first / "01-canonicalize.before.txt").read_text()
    after = (first / "01-canonicalize.after.txt").read_text()
    assert before.startswith("graph before canonicalize(") and "aten.mm(" in before
    assert after.startswith("graph after canonicalize(")
    assert after.count("aten.permute") < before.count("aten.permute")
    fused = (first / "02-fuse-newton-schulz.after.txt").read_text()
    assert "aten.mm(" not in fused and fused.count("hocompile.newton_schulz(") == 2
    assert "def forward(self, p0_0, g0_0" in (first / "lowered.py").read_text()


def test_disabled_pass_is_skipped_and_reported(cache_dir, monkeypatch) -> None:
    monkeypatch.setenv("HOCOMPILE_DISABLE_PASSES", "canonicalize,fuse-newton-schulz")
    pair = Pair(_muon, [(8, 4)], cache_dir)
    pair.step()
    pair.step()
    assert pair.max_rel_diff() == 0.0
    report = hocompile.explain(pair.compiled)
    assert re.search(r"canonicalize +disabled", report)
    assert re.search(r"fuse-newton-schulz +disabled", report)


def test_disk_cache_reused_and_corrupt_entry_rebuilt(cache_dir) -> None:
    a = Pair(_muon, [(8, 4)], cache_dir, **EXACT)
    a.step()
    assert a.compiled.counters.disk_hits == 0
    b = Pair(_muon, [(8, 4)], cache_dir, **EXACT)
    b.step()
    assert b.compiled.counters.disk_hits == 1  # same graph, generated module read back from disk
    path = b.compiled.history[0].lowered.path
    assert path.parent == cache_dir and path.read_text().startswith("# hocompile cache entry sha256=")
    text = path.read_text()
    assert ".mm(" in text  # eager's X @ Xᵀ, called as a tensor method
    path.write_text(text.replace(".mm(", ".bmm(", 1))  # tamper
    c = Pair(_muon, [(8, 4)], cache_dir, **EXACT)
    with pytest.warns(CacheWarning, match="is corrupt; rebuilding it"):
        c.step()
    assert c.compiled.counters.disk_hits == 0
    for _ in range(3):
        c.step()
    assert c.max_rel_diff() == 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("error", CacheWarning)
        d = Pair(_muon, [(8, 4)], cache_dir, **EXACT)
        d.step()  # the rebuilt entry is good again
    assert d.compiled.counters.disk_hits == 1


def test_generated_code_tracebacks_point_into_the_cache_file(cache_dir) -> None:
    pair = Pair(lambda ps: torch.optim.SGD(ps, lr=0.1), [(4, 4)], cache_dir)
    pair.step()
    entry = pair.compiled.history[-1]
    with pytest.raises(Exception) as info:
        entry.lowered.run([torch.zeros(3, 3), torch.zeros(4, 4), 0.1])  # wrong shapes
    files = [str(frame.path) for frame in info.traceback]
    assert str(entry.lowered.path) in files


def test_is_a_drop_in_optimizer(cache_dir) -> None:
    params = make_params([(6, 4), (4,)])
    inner = torch.optim.AdamW(params, lr=1e-2)
    opt = hocompile.compile_optimizer(inner, cache_dir=cache_dir)
    assert isinstance(opt, torch.optim.Optimizer)
    assert opt.param_groups is inner.param_groups and opt.state is inner.state
    assert repr(opt).startswith("CompiledOptimizer(AdamW (")
    calls = []
    opt.register_step_pre_hook(lambda o, a, k: calls.append("pre"))
    opt.register_step_post_hook(lambda o, a, k: calls.append("post"))

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = sum((p**2).sum() for p in params)
        loss.backward()
        return loss

    for p in params:
        p.requires_grad_(True)
    loss = opt.step(closure)
    assert isinstance(loss, torch.Tensor) and calls == ["pre", "post"]
    opt.zero_grad(set_to_none=True)
    assert all(p.grad is None for p in params)
    opt.zero_grad(set_to_none=False)


def test_add_param_group_recompiles_with_reason(cache_dir) -> None:
    pair = Pair(_muon, [(8, 4)], cache_dir, **EXACT)
    pair.step()
    pair.step()
    extra_e, extra_c = make_params([(4, 4)], seed=7), make_params([(4, 4)], seed=7)
    pair.eager.add_param_group({"params": extra_e, "lr": 0.01})
    pair.compiled.add_param_group({"params": extra_c, "lr": 0.01})
    pair.eager_params += extra_e
    pair.compiled_params += extra_c
    for _ in range(3):
        pair.step()
    assert pair.compiled.counters.recompiles == ["number of param groups changed 1 -> 2"]
    assert pair.max_rel_diff() == 0.0


def test_explain_report(cache_dir) -> None:
    pair = Pair(lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1), [(8, 4)], cache_dir)
    assert "nothing compiled yet" in hocompile.explain(pair.compiled)
    for _ in range(3):
        pair.step()
    report = hocompile.explain(pair.compiled)
    for expected in [
        "hocompile: torch.optim.adamw.AdamW, 1 param group(s), 1 params, 3 steps",
        "counters: compiles 2, recompiles 0, cache hits 1",
        "compiled step #1 (first step)",
        "compiled step #2 (steady state: the previous step created the optimizer state)",
        "h0 = 1 - (g0.lr * g0.weight_decay)",
        "(g0.weight_decay != 0) is True",
        "canonicalize",
        "cache key:",
    ]:
        assert expected in report, expected
    with pytest.raises(TypeError, match="takes the result of compile_optimizer"):
        hocompile.explain(pair.eager)


def test_bad_arguments() -> None:
    w = torch.randn(2, 2)
    with pytest.raises(ValueError, match="fallback must be one of"):
        hocompile.compile_optimizer(torch.optim.SGD([w], lr=0.1), fallback="maybe")
    with pytest.raises(TypeError, match="expects a torch.optim.Optimizer or an object like one"):
        hocompile.compile_optimizer(object())  # type: ignore[arg-type]
    opt = hocompile.compile_optimizer(torch.optim.SGD([w], lr=0.1))
    with pytest.raises(TypeError, match="already compiled"):
        hocompile.compile_optimizer(opt)


def test_grad_cleared_by_the_step_is_cleared_by_the_compiled_step(cache_dir) -> None:
    """heavyball sets p.grad = None after its step; the runtime repeats that."""

    class ClearingSGD(torch.optim.SGD):
        @torch.no_grad()
        def step(self, closure=None):  # type: ignore[override]
            super().step(closure)
            for group in self.param_groups:
                for p in group["params"]:
                    p.grad = None

    pair = Pair(lambda ps: ClearingSGD(ps, lr=0.1, momentum=0.9), [(4, 4)], cache_dir)
    for _ in range(3):
        pair.step()
        assert pair.compiled_params[0].grad is None
    assert pair.max_rel_diff() == 0.0
