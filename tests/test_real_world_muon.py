"""The Muon optimizers people actually run (tests/real_world/) against hocompile's contract.

Each class is rewritten from a public implementation (Keller Jordan's Muon,
Moonlight, nanochat, pytorch_optimizer, modded-nanogpt, NorMuon, Dion, Polar
Express, a HeavyBall-matched Muon, MuonClip, and the glue objects training code
builds around a Muon and an AdamW); tests/real_world/corpus.py lists them with
the pattern each exercises. The contract, per class, over 10 steps with the
learning rate changed before every step:

- EITHER it compiles, and
  - with every pass off it matches eager bit for bit after every step (params,
    grads, optimizer state), through a state_dict round trip at step 5, and
    leaves no tracing-time fake tensor anywhere in the optimizer;
  - with the default pipeline (a fixed CPU target: fp32 GEMMs fast, bf16 slow)
    each matrix's trajectory stays at least as close to the exact-NS (float64)
    trajectory as eager's is (≤ 1.25×, as in test_newton_schulz.py), 1-D params
    within 1e-6 of eager;
  - the steady-state graph has one ``hocompile::newton_schulz`` op per matrix
    eager orthogonalises (per stack, where eager stacks them);
  - neither pipeline recompiles because the lr changed;
- OR its first step raises ``hocompile.CaptureError`` that names a reason the
  step really cannot be compiled for (the case's ``refusal``: a tensor value
  read on the host, with the line; a collective; not an Optimizer), having
  changed nothing (params, grads, state; no fake tensor left behind), and
  ``fallback="eager"`` then matches eager bit for bit.

The whole module runs in about a minute (tiny shapes; tests/real_world/harness.py
explains why ``@torch.compile`` helpers run as plain Python in the eager copies).
``benchmarks/real_world_muon.py`` prints the same measurements as a table.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from .real_world.corpus import CASES, CORPUS_MODULES, Case
from .real_world.harness import ensure_process_group, run, violation


@pytest.fixture(scope="module")
def shared_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("real-world-cache")


@pytest.fixture(scope="module", autouse=True)
def one_rank_process_group() -> Iterator[None]:
    """The distributed classes call torch.distributed themselves: give them a world of one."""
    created = dist.is_available() and not dist.is_initialized()
    ensure_process_group()
    yield
    if created:
        dist.destroy_process_group()


def test_every_corpus_class_is_a_case() -> None:
    defined = {
        f"{module.__name__.rpartition('.')[2]}.{name}"
        for module in CORPUS_MODULES
        for name, obj in vars(module).items()
        if inspect.isclass(obj) and obj.__module__ == module.__name__ and callable(getattr(obj, "step", None))
        and name != "BaseOptimizer"
    }
    assert defined == {case.name for case in CASES}


def test_cases_are_the_mixed_tiny_shapes() -> None:
    for case in CASES:
        assert {s for s in case.shapes if len(s) == 2} == {(16, 32), (32, 16), (24, 24)}, case.name
    assert sum((8,) in case.shapes for case in CASES) >= 10  # 1-D params beside matrices


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_compiles_and_matches_eager_or_refuses_cleanly(case: Case, shared_cache: Path) -> None:
    torch.manual_seed(0)
    outcome = run(case, shared_cache)
    broken = violation(case, outcome)
    assert broken is None, f"{case.name} (mirrors {case.mirrors}; {case.pattern}): {broken}"
