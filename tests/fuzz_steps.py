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
update through a view; decoupled weight decay. And what training code does between steps: a step
counter kept as a Python int in state; noise from the random stream (``randn_like``); Megatron's
fp32 ``main_grad`` attribute, filled in place or bound anew each step; an update through ``p.data``;
a param frozen, an attribute changed and group options changed mid-run; a grad that is a transposed
view; a bf16 param among fp32 ones; a param group added mid-run. ``tests/test_fuzz_steps.py`` runs
a fixed seed set; ``benchmarks/fuzz_steps.py`` runs many.

A step the self-check caught (a :class:`hocompile.SelfCheckWarning`, then eager's result) is
reported as ``caught``: not silently wrong, but a class the compiler got wrong.
"""

from __future__ import annotations

import importlib.util
import random
import sys
import warnings
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
    "param_class", "id_lookup", "int_state_step", "noise", "main_grad", "main_grad_new", "data_update",
    "freeze_mid", "attr_mid", "group_mid", "grad_strided", "bf16_param", "add_group", "main_grad_zero",
)  # fmt: skip  (new patterns go last: a seed draws the earlier ones as before)
SHAPES = [(6, 4), (6, 4), (3, 6), (6, 4), (9, 2)]
STEPS = 8
MID = STEPS // 2 + 2  # mid-run changes come before this step (the lr changes at 4, the round trip at 5)


@dataclass(frozen=True)
class Outcome:
    seed: int
    features: tuple[str, ...]
    verdict: str  # "bitwise", "refused", "caught" (by the self-check) or "WRONG"
    detail: str = ""


# Drawn less while they were refused whenever drawn (not to hide the rest); main_grad is traced now,
# and the rates stay so that the fixed seeds keep the patterns they were chosen for.
RARE = {"main_grad": 0.1, "main_grad_new": 0.1}


def features_of(seed: int) -> tuple[str, ...]:
    rng = random.Random(seed)
    return tuple(f for f in FEATURES if rng.random() < RARE.get(f, 0.4))


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
        per_group += [
            "            if 'step' not in group:",
            "                group['step'] = torch.tensor(0.0)",
            "            group['step'] += 1",
            "            lr = lr / (1 - group['beta'] ** group['step'].item())",
        ]
    if has("id_lookup"):
        init += ["        self.no_decay_ids = {id(self.param_groups[0]['params'][2])}"]
    if has("attr_step"):
        init += ["        self.count = torch.tensor(0.0)"]
        pre += ["        self.count += 1", "        warm = min(1.0, self.count.item() / 4)"]
    if has("global_norm"):
        pre += [
            "        norms = [p.grad.float().norm()",
            "                 for g in self.param_groups for p in g['params'] if p.grad is not None]",
            "        total = torch.stack(norms).norm().item()",
            "        clip = min(1.0, 3.0 / (total + 1e-6))",
        ]
    if has("skip_frozen"):
        body += ["                if not p.requires_grad or not p.is_leaf:", "                    continue"]
    if has("freeze_mid"):
        body += ["                if not p.requires_grad:", "                    continue"]
    body += ["                g = p.grad", "                st = self.state[p]", "                plr = lr"]
    if has("main_grad") or has("main_grad_new"):
        body += ["                g = getattr(p, 'main_grad', g)"]
    if has("int_state_step"):
        body += ["                st['n'] = st.get('n', 0) + 1", "                plr = plr * (1.0 - 0.5 ** st['n'])"]
    if has("noise"):
        body += ["                g = g + 1e-3 * torch.randn_like(g)"]
    if has("attr_step"):
        body += ["                plr = plr * warm"]
    if has("global_norm"):
        body += ["                g = g * clip"]
    if has("attr_scale"):
        body += ["                plr = plr * getattr(p, 'lr_scale', 1.0)"]
    if has("id_lookup"):
        body += ["                if id(p) in self.no_decay_ids:", "                    plr = plr * 0.25"]
    if has("param_class"):
        body += [
            "                if not isinstance(p, torch.nn.Parameter) or type(p) is not torch.nn.Parameter:",
            "                    plr = plr * 3.0",
        ]
    if has("attr_branch"):
        body += [
            "                if getattr(p, 'is_qkv', False):",
            "                    g = torch.cat([x / (x.norm() + 1e-8) for x in g.chunk(3, dim=0)])",
        ]
    if has("state_step"):
        body += [
            "                if 'step' not in st:",
            "                    st['step'] = torch.tensor(0.0)",
            "                st['step'] += 1",
            "                plr = plr / st['step'].item() ** 0.5",
        ]
    if has("item_arith"):
        body += [
            "                rms = g.pow(2).mean().sqrt().item()",
            "                plr = plr / max(1.0, rms) * min(1.0, abs(rms - 0.5) + 0.75)",
        ]
    if has("item_branch"):
        body += ["                if g.abs().max().item() > 2.5:", "                    g = g * 0.5"]
    if has("momentum"):
        body += [
            "                if 'm' not in st:",
            "                    st['m'] = torch.zeros_like(p)",
            "                st['m'].mul_(group['beta']).add_(g)",
            "                g = st['m']",
        ]
    if has("container"):
        body += [
            "                if 'bufs' not in st:",
            "                    st['bufs'] = [torch.zeros_like(p), torch.zeros_like(p)]",
            "                st['bufs'][0].lerp_(g, 0.1)",
            "                st['bufs'][1].lerp_(g * g, 0.05)",
            "                g = st['bufs'][0] / (st['bufs'][1].sqrt() + 1e-3)",
        ]
    if has("decay"):
        body += ["                p.mul_(1 - plr * group['wd'])"]
    if has("data_update"):
        body += ["                p.data.add_(g, alpha=-plr * 0.1)"]
    if has("view_update"):
        body += [
            "                half = p.numel() // 2",
            "                p.view(-1)[:half].add_(g.reshape(-1)[:half], alpha=-plr * 0.5)",
        ]
    body += ["                p.add_(g, alpha=-plr)"]
    if has("main_grad_zero"):  # Megatron zeroes its grad buffer: here the step does, in place
        body += ["                if hasattr(p, 'main_grad'):", "                    p.main_grad.zero_()"]
    if has("foreach_decay"):
        post += [
            "            live = [p for p in group['params'] if p.grad is not None]",
            "            torch._foreach_mul_(live, 1 - lr * group['wd'])",
        ]
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
    if "bf16_param" in features:
        params[4] = torch.nn.Parameter(params[4].detach().bfloat16())
    if "skip_frozen" in features:
        params[3].requires_grad_(False)
    params[0].lr_scale = 0.5  # type: ignore[attr-defined]  (read only where attr_scale is drawn)
    params[1].is_qkv = True  # type: ignore[attr-defined]
    if "main_grad" in features or "main_grad_new" in features:
        params[2].main_grad = torch.zeros(SHAPES[2])  # type: ignore[attr-defined]  (Megatron's grad buffer)
    return params


def _grads(k: int, params: list[torch.nn.Parameter], features: tuple[str, ...]) -> list[torch.Tensor | None]:
    gen = torch.Generator().manual_seed(100 + k)
    grads: list[torch.Tensor | None] = [
        torch.randn(p.shape, generator=gen, dtype=p.dtype) * (1 + k % 3) for p in params
    ]
    if "grad_strided" in features:
        grads[2] = torch.randn(tuple(reversed(params[2].shape)), generator=gen).t()
    if k % 3 == 2:
        grads[4] = None  # a grad that goes None now and then
    return grads


def _between_steps(k: int, opt: Any, params: list[torch.nn.Parameter], features: tuple[str, ...]) -> None:
    """What training code does to the params, their grads and the groups before step ``k``."""
    for p, g in zip(params, _grads(k, params, features)):
        p.grad = g
    if hasattr(params[2], "main_grad") and params[2].grad is not None:
        if "main_grad_new" in features:
            params[2].main_grad = params[2].grad.clone()  # type: ignore[attr-defined]  (a new tensor)
        else:
            params[2].main_grad.copy_(params[2].grad)  # type: ignore[attr-defined]
    if k == STEPS // 2:
        for group in opt.param_groups:
            group["lr"] *= 0.5
    if k != MID:
        return
    if "freeze_mid" in features:
        params[0].requires_grad_(False)
    if "attr_mid" in features:
        params[0].lr_scale = 0.25  # type: ignore[attr-defined]
        params[1].is_qkv = False  # type: ignore[attr-defined]
    if "group_mid" in features:
        for group in opt.param_groups:
            group["wd"], group["beta"] = 0.05, 0.8


def _run(cls: Any, features: tuple[str, ...], cache: Path | None) -> tuple[list[torch.nn.Parameter], Any]:
    torch.manual_seed(1234)  # the same random stream for eager and compiled ("noise")
    params = _params(features)
    opt: Any = cls(params)
    if cache is not None:
        opt = hocompile.compile_optimizer(opt, cache_dir=cache, **EVERY_PASS_OFF)
    for k in range(STEPS):
        if k == MID and "add_group" in features:
            extra = torch.nn.Parameter(torch.randn(5, 3, generator=torch.Generator().manual_seed(7)))
            opt.add_param_group({"params": [extra], "lr": 0.02})
            params.append(extra)
        _between_steps(k, opt, params, features)
        if k == STEPS // 2 + 1 and "round_trip" in features:
            fresh = cls(params)
            fresh.load_state_dict(opt.state_dict())
            opt = fresh if cache is None else hocompile.compile_optimizer(fresh, cache_dir=cache, **EVERY_PASS_OFF)
        opt.step()
    return params, opt


def _state(opt: Any, params: list[torch.nn.Parameter]) -> list[Any]:
    """The state the step leaves: tensors (containers opened), Python numbers, group values besides params.
    By key: a compiled step writes a new entry's tensors before its Python numbers, so a param's state
    may list its keys in another order than eager's (no value depends on it)."""
    out: list[Any] = []
    for p in params:
        for _, value in sorted(opt.state.get(p, {}).items()):
            out += value if isinstance(value, list) else [value]
    for group in opt.param_groups:
        out += [v for k, v in sorted(group.items()) if k != "params"]
    return out


def _hung(params: list[torch.nn.Parameter]) -> list[torch.Tensor]:
    """The tensors hung on the params (main_grad): a step may write them in place."""
    return [v for p in params for _, v in sorted(vars(p).items()) if isinstance(v, torch.Tensor)]


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
    return type(a) is type(b) and a == b


def check(seed: int, root: Path) -> Outcome:
    """One seed: eager and compiled in this process, compared bitwise (params, state and groups)."""
    features = features_of(seed)
    path = root / f"fuzzed_{seed}.py"
    path.write_text(source(features))
    cls = _load(path, seed)
    want_params, want_opt = _run(cls, features, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", hocompile.SelfCheckWarning)
        try:
            got_params, got_opt = _run(cls, features, root / f"cache_{seed}")
        except CaptureError as exc:
            return Outcome(seed, features, "refused", str(exc).splitlines()[0][:200])
    checks = [w for w in caught if issubclass(w.category, hocompile.SelfCheckWarning)]
    want = [p.detach() for p in want_params] + _hung(want_params) + _state(want_opt, want_params)
    got = [p.detach() for p in got_params] + _hung(got_params) + _state(got_opt, got_params)
    if len(want) != len(got):
        return Outcome(seed, features, "WRONG", f"{len(got)} values, eager has {len(want)}")
    for k, (a, b) in enumerate(zip(want, got)):
        if not _same(a, b):
            diff = (a - b).abs().max().item() if isinstance(a, torch.Tensor) and a.shape == b.shape else a
            return Outcome(seed, features, "WRONG", f"value {k} differs ({diff!r} vs eager's)")
    if checks:
        return Outcome(seed, features, "caught", str(checks[0].message).splitlines()[0][:200])
    return Outcome(seed, features, "bitwise")
