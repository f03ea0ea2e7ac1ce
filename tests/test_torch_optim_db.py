"""torch.optim's own test database through compile_optimizer: every OptimizerInput that
``torch.testing._internal.common_optimizers.optim_db`` ships for the CPU, × for-loop / foreach /
fused where the optimizer has them.

The contract is the sweep's (torch_optim_configs.violation): over 10 steps with the lr changing
every step and a state_dict round trip, params and every state entry bitwise eager's, or a refusal
at the first step that changed nothing and names why. The pipeline is the one users get: the
default (EXACT, the Newton–Schulz passes off, for Muon); every pass off is the sweep's (the same
optimizers, each flag flipped), which keeps this file within CI's time.
Only LBFGS is refused (its step re-evaluates a closure); torch's own fused steps and
SparseAdam run as torch runs them (fused_kernels.runs_as_is), the rest compile.

test_torch_optim_sweep.py covers what the database does not vary: each boolean flag flipped
(capturable, differentiable), a resume from a checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from .torch_optim_configs import Config, check, db_configs, violation

CONFIGS = db_configs()


@pytest.fixture(scope="module")
def shared_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("db-cache")


def test_the_database_is_all_here() -> None:
    names = {cfg.optimizer for cfg in CONFIGS}
    assert {"Adam", "AdamW", "SGD", "Adagrad", "Adafactor", "Muon", "LBFGS", "SparseAdam"} <= names
    assert sum(cfg.variant.endswith("+fused") for cfg in CONFIGS) >= 20  # Adam, AdamW, SGD, Adagrad


@pytest.mark.parametrize("cfg", CONFIGS, ids=[cfg.id for cfg in CONFIGS])
def test_database_input_matches_eager_or_refuses(cfg: Config, shared_cache: Path) -> None:
    torch.manual_seed(0)
    outcome = check(cfg, shared_cache, only="last")
    assert violation(cfg, outcome) is None, violation(cfg, outcome)
    if cfg.optimizer != "LBFGS":
        assert outcome.kind == "bitwise", outcome.detail  # only LBFGS may refuse
