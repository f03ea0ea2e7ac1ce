"""Compiled steps against eager, over 20 steps on random data.

Tolerances. Capture and runtime are exact: without the Newton–Schulz passes
the CPU lowering runs the very aten ops eager runs, in the same order, with
host scalars computed by the same double-precision arithmetic in the same
order (see hocompile/capture/scalars.py), so those tests assert bitwise equality. The
pointwise optimizers are held to the 1e-6 relative bound. With the default
pipeline Muon's NS is one fused op planned for the target (on a CPU without a
bf16 GEMM it computes in fp32), so it no longer rounds where eager does; the
bound there is on accuracy: the compiled trajectory must stay at least as close
to the exact (fp64 NS) trajectory as eager's bf16 trajectory is (≤ 1.25×),
see test_newton_schulz.py.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from .helpers import Pair, UserMuon, emerging_muon

SHAPES = [(16, 8), (8, 8), (12, 8), (8, 20)]


@pytest.mark.parametrize(
    "name, factory",
    [
        ("muon", lambda ps: torch.optim.Muon(ps, lr=0.02, weight_decay=0.1)),
        ("muon-match-rms", lambda ps: torch.optim.Muon(ps, lr=0.02, adjust_lr_fn="match_rms_adamw", nesterov=False)),
        ("user-muon", lambda ps: UserMuon(ps, lr=0.02, weight_decay=0.01)),
        ("emerging-muon", lambda ps: emerging_muon(ps, lr=0.02, weight_decay=0.1)),
    ],
)
def test_muon_family_capture_is_exact(name: str, factory, cache_dir) -> None:
    """With the NS passes off, the compiled step is bit-identical to eager."""
    pair = Pair(factory, SHAPES, cache_dir, disable_passes=("fuse-newton-schulz", "choose-algorithm"))
    for _ in range(20):
        pair.step()
    assert pair.max_rel_diff() == 0.0, name
    pair.assert_state_equal()
    assert pair.compiled.counters.recompiles == []


@pytest.mark.parametrize(
    "name, factory",
    [
        ("adamw", lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)),
        ("adam", lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.01)),
        ("adam-amsgrad", lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True)),
        ("sgd-nesterov", lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3)),
        ("sgd-momentum", lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, dampening=0.1)),
        ("sgd-plain", lambda ps: torch.optim.SGD(ps, lr=0.05)),
    ],
)
def test_pointwise_optimizers_match_eager(name: str, factory, cache_dir) -> None:
    pair = Pair(factory, SHAPES + [(8,), (3, 4, 5)], cache_dir)
    for _ in range(20):
        pair.step()
    assert pair.max_rel_diff() <= 1e-6, name
    assert pair.compiled.counters.recompiles == []


def test_param_groups_with_different_hyperparameters(cache_dir) -> None:
    def groups(ps):
        return [
            {"params": ps[:2], "lr": 0.02, "weight_decay": 0.0},
            {"params": ps[2:], "lr": 0.005, "weight_decay": 0.2, "momentum": 0.8},
        ]

    pair = Pair(lambda g: torch.optim.Muon(g), SHAPES, cache_dir, groups=groups, disable_passes=("fuse-newton-schulz",))
    for _ in range(20):
        pair.step()
    assert pair.max_rel_diff() == 0.0


def test_none_grads_are_skipped_like_eager(cache_dir) -> None:
    pair = Pair(lambda ps: torch.optim.AdamW(ps, lr=1e-2), SHAPES, cache_dir)
    for step in range(6):
        pair.step(none_grads=(1,) if step < 3 else ())
    assert pair.max_rel_diff() <= 1e-6
    pair.assert_state_equal()
    # grads of param 1 appearing later is a guard change with a clear reason.
    assert pair.compiled.counters.recompiles == ["param_groups[0]['params'][1].grad is no longer None"]


@settings(max_examples=12, deadline=None)
@given(
    shapes=st.lists(st.tuples(st.integers(1, 9), st.integers(1, 9)), min_size=1, max_size=3),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]),
    opt=st.sampled_from(["adamw", "sgd", "muon"]),
)
def test_shapes_and_dtypes(shapes, dtype, opt, new_cache_dir) -> None:
    factories = {
        "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2),
        "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True),
        "muon": lambda ps: torch.optim.Muon(ps, lr=0.02),
    }
    pair = Pair(factories[opt], shapes, new_cache_dir())
    for group_params in (pair.eager_params, pair.compiled_params):
        for i, p in enumerate(group_params):
            group_params[i] = p.to(dtype)
    # rebuild on the converted tensors (Pair made fp32 ones)
    pair.eager = factories[opt](pair.eager_params)
    inner = factories[opt](pair.compiled_params)
    from hocompile import compile_optimizer

    pair.compiled = compile_optimizer(
        inner, cache_dir=new_cache_dir(), disable_passes=["fuse-newton-schulz"]
    )
    for _ in range(3):
        pair.step()
    assert pair.max_rel_diff() == 0.0
