"""Every torch.optim optimizer × variant against eager (configs: torch_optim_configs.py).

Each config either matches eager bitwise over 10 steps with the learning rate
changing every step and a state_dict round trip at step 5 (params and every
state entry, max abs diff 0, with every pass off, and also under the NS-passes-off
pipeline for Muon and the default one where there is no Newton–Schulz op)
with no recompile after the steady state, or refuses at the first step with a
CaptureError / UnsupportedParameterError that changed nothing and names what
is unsupported: torch's own reason when eager rejects the config too, the
documented limitation otherwise (LIMITATIONS). The support matrix in
benchmarks/results/torch_optim_support.md is generated from the same configs.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from .torch_optim_configs import Config, check, configs, discover_optimizers, violation

CONFIGS = configs()


@pytest.fixture(scope="module")
def shared_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # One cache for the module: the CPU target is measured once, not per config.
    return tmp_path_factory.mktemp("sweep-cache")


def test_every_torch_optimizer_is_swept() -> None:
    swept = {cfg.optimizer for cfg in CONFIGS}
    assert swept == {cls.__name__ for cls in discover_optimizers()}
    assert {"Adam", "AdamW", "SGD", "Muon", "LBFGS", "SparseAdam", "Adafactor"} <= swept


@pytest.mark.parametrize("cfg", CONFIGS, ids=[cfg.id for cfg in CONFIGS])
def test_matches_eager_or_refuses_cleanly(cfg: Config, shared_cache: Path) -> None:
    torch.manual_seed(0)
    outcome = check(cfg, shared_cache)
    broken = violation(cfg, outcome)
    assert broken is None, broken
