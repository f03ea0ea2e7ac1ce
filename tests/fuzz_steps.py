"""A differential fuzzer of optimizer steps: compiled (every pass off) against eager, bitwise.

Each seed composes an optimizer class from the patterns real optimizer code uses, writes it to a
module file (a user's own code, with lines to name), and runs it eager and compiled over a few steps
with an lr change, grads that go None, and a state_dict round trip into a fresh compiled wrapper. A
step must match eager bit for bit, or be refused (CaptureError) at its first step with nothing
touched. Anything else is a silently wrong step: the worst bug this product can have.

Patterns (each seed draws a subset): a skip by ``requires_grad``; a branch on the param's class
(``isinstance(p, nn.Parameter)``, ``type(p)``); a lookup by ``id(p)``; a param attribute scaling the
step and one selecting a branch (Megatron's ``is_qkv`` split); step counters as tensors in the
group, in state and on the optimizer, read with ``.item()``; a value read with ``.item()`` through
Python arithmetic (``max``, ``min``, ``abs``, ratios) and through a branch; a global grad norm
read once per step; momentum; a container of tensors in state; foreach ops over the group; an
update through a view; decoupled weight decay. ``tests/test_fuzz_steps.py`` runs a fixed seed set;
``benchmarks/fuzz_steps.py`` runs many.
"""

from __future__ import annotations

import importlib.util
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import hocompile
from hocompile import CaptureError

from .helpers import EVERY_PASS_OFF

FEATURES = (
    "skip_frozen", "attr_scale", "attr_branch", "group_step", "state_step", "attr_step", "item_arith",
    "item_branch", "global_norm", "momentum", "container", "foreach_decay", "view_update", "decay", "round_trip",
    "param_class", "id_lookup",
)  # fmt: skip
SHAPES = [(6, 4), (6, 4), (3, 6), (6, 4), (9, 2)]
STEPS = 8


@dataclass(frozen=True)
class Outcome:
    seed: int
    features: tuple[str, ...]
    verdict: str  # "bitwise", "refused" or "WRONG"
    detail: str = ""


def features_of(seed: int) -> tuple[str, ...]:
    rng = random.Random(seed)
    return tuple(f for f in FEATURES if rng.random() < 0.4)


def source(features: tuple[str, ...]) -> str:
    """The optimizer module's text for these features."""
    has = set(features).__contains__
    init = ["        super().__init__(params, {'lr': lr, 'beta': 0.9, 'wd': 0.01})"]
    pre: list[str] = []
    per_group: list[str] = ["            lr = group['lr']"]
    body: list[str] = ["                if p.grad is None:", "                    continue"]
    post: list[str] = []
    if has("group_step"):
        init += ["        for group in self.param_groups:", "            group['step'] = torch.tensor(0.0)"]
        per_group += ["            group['step'] += 1",
                      "            lr = lr / (1 - group['beta'] ** group['step'].item())"]
    if has("id_lookup"):
        init += ["        self.no_decay_ids = {id(self.param_groups[0]['params'][2])}"]
    if has("attr_step"):
        init += ["        self.count = torch.tensor(0.0)"]
        pre += ["        self.count += 1", "        warm = min(1.0, self.count.item() / 4)"]
    if has("global_norm"):
        pre += ["        norms = [p.grad.norm() for g in self.param_groups for p in g['params'] if p.grad is not None]",
                "        total = torch.stack(norms).norm().item()",
                "        clip = min(1.0, 3.0 / (total + 1e-6))"]
    if has("skip_frozen"):
        body += ["                if not p.requires_grad or not p.is_leaf:", "                    continue"]
    body += ["                g = p.grad", "                st = self.state[p]", "                plr = lr"]
    if has("attr_step"):
        body += ["                plr = plr * warm"]
    if has("global_norm"):
        body += ["                g = g * clip"]
    if has("attr_scale"):
        body += ["                plr = plr * getattr(p, 'lr_scale', 1.0)"]
    if has("id_lookup"):
        body += ["                if id(p) in self.no_decay_ids:", "                    plr = plr * 0.25"]
    if has("param_class"):
        body += ["                if not isinstance(p, torch.nn.Parameter) or type(p) is not torch.nn.Parameter:",
                 "                    plr = plr * 3.0"]
    if has("attr_branch"):
        body += ["                if getattr(p, 'is_qkv', False):",
                 "                    g = torch.cat([x / (x.norm() + 1e-8) for x in g.chunk(3, dim=0)])"]
    if has("state_step"):
        body += ["                if 'step' not in st:", "                    st['step'] = torch.tensor(0.0)",
                 "                st['step'] += 1", "                plr = plr / st['step'].item() ** 0.5"]
    if has("item_arith"):
        body += ["                rms = g.pow(2).mean().sqrt().item()",
                 "                plr = plr / max(1.0, rms) * min(1.0, abs(rms - 0.5) + 0.75)"]
    if has("item_branch"):
        body += ["                if g.abs().max().item() > 2.5:", "                    g = g * 0.5"]
    if has("momentum"):
        body += ["                if 'm' not in st:", "                    st['m'] = torch.zeros_like(p)",
                 "                st['m'].mul_(group['beta']).add_(g)", "                g = st['m']"]
    if has("container"):
        body += ["                if 'bufs' not in st:",
                 "                    st['bufs'] = [torch.zeros_like(p), torch.zeros_like(p)]",
                 "                st['bufs'][0].lerp_(g, 0.1)", "                st['bufs'][1].lerp_(g * g, 0.05)",
                 "                g = st['bufs'][0] / (st['bufs'][1].sqrt() + 1e-3)"]
    if has("decay"):
        body += ["                p.mul_(1 - plr * group['wd'])"]
    if has("view_update"):
        body += ["                half = p.numel() // 2",
                 "                p.view(-1)[:half].add_(g.reshape(-1)[:half], alpha=-plr * 0.5)"]
    body += ["                p.add_(g, alpha=-plr)"]
    if has("foreach_decay"):
        post += ["            live = [p for p in group['params'] if p.grad is not None]",
                 "            torch._foreach_mul_(live, 1 - lr * group['wd'])"]
    lines = [
        "import torch", "", "", "class Fuzzed(torch.optim.Optimizer):",
        "    def __init__(self, params, lr=0.05):", *init, "",
        "    @torch.no_grad()", "    def step(self):", *pre,
        "        for group in self.param_groups:", *per_group,
        "            for i, p in enumerate(group['params']):", *body, *post, "",
    ]  # fmt: skip
    return "\n".join(lines)


def _load(path: Path, seed: int) -> Any:
    name = f"hocompile_fuzz_{seed}_{abs(hash(str(path))) % 10**8}"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module.Fuzzed


def _params(features: tuple[str, ...]) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(*s, generator=gen)) for s in SHAPES]
    if "skip_frozen" in features:
        params[3].requires_grad_(False)
    params[0].lr_scale = 0.5  # type: ignore[attr-defined]  (read only where attr_scale is drawn)
    params[1].is_qkv = True  # type: ignore[attr-defined]
    return params


def _grads(k: int, params: list[torch.nn.Parameter]) -> list[torch.Tensor | None]:
    gen = torch.Generator().manual_seed(100 + k)
    grads: list[torch.Tensor | None] = [torch.randn(p.shape, generator=gen) * (1 + k % 3) for p in params]
    if k % 3 == 2:
        grads[4] = None  # a grad that goes None now and then
    return grads


def _run(cls: Any, features: tuple[str, ...], cache: Path | None) -> tuple[list[torch.nn.Parameter], Any]:
    params = _params(features)
    opt: Any = cls(params)
    if cache is not None:
        opt = hocompile.compile_optimizer(opt, cache_dir=cache, **EVERY_PASS_OFF)
    for k in range(STEPS):
        for p, g in zip(params, _grads(k, params)):
            p.grad = g
        if k == STEPS // 2:
            for group in opt.param_groups:
                group["lr"] *= 0.5
        if k == STEPS // 2 + 1 and "round_trip" in features:
            fresh = cls(params)
            fresh.load_state_dict(opt.state_dict())
            opt = fresh if cache is None else hocompile.compile_optimizer(fresh, cache_dir=cache, **EVERY_PASS_OFF)
        opt.step()
    return params, opt


def _state_tensors(opt: Any, params: list[torch.nn.Parameter]) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for p in params:
        for value in opt.state.get(p, {}).values():
            leaves = value if isinstance(value, list) else [value]
            out += [v for v in leaves if isinstance(v, torch.Tensor)]
    return out


def check(seed: int, root: Path) -> Outcome:
    """One seed: eager and compiled in this process, compared bitwise (params and state)."""
    features = features_of(seed)
    path = root / f"fuzzed_{seed}.py"
    path.write_text(source(features))
    cls = _load(path, seed)
    want_params, want_opt = _run(cls, features, None)
    try:
        got_params, got_opt = _run(cls, features, root / f"cache_{seed}")
    except CaptureError as exc:
        return Outcome(seed, features, "refused", str(exc).splitlines()[0][:200])
    want = [p.detach() for p in want_params] + _state_tensors(want_opt, want_params)
    got = [p.detach() for p in got_params] + _state_tensors(got_opt, got_params)
    if len(want) != len(got):
        return Outcome(seed, features, "WRONG", f"{len(got)} tensors, eager has {len(want)}")
    for k, (a, b) in enumerate(zip(want, got)):
        if a.shape != b.shape or not torch.equal(a, b):
            diff = (a - b).abs().max().item() if a.shape == b.shape else float("nan")
            return Outcome(seed, features, "WRONG", f"tensor {k} differs by {diff:.3g}")
    return Outcome(seed, features, "bitwise")
