"""The differential fuzzer's fixed seed set (tests/fuzz_steps.py): compiled with every pass off is
bitwise eager, or refused at its first step with nothing touched. Seed 5 (a value read with
``.item()`` through ``max``/``min`` feeding both a decay factor and the update) found two params'
host scalars sharing one sentinel payload, so one was lifted as the other's; it stays in the set.
Seeds 7 and 18 draw a bf16 param under ``_foreach_mul_``, whose in-place kernel rounds otherwise than
its functional form (test_fuzz_found.py).
A longer run: ``.venv/bin/python benchmarks/fuzz_steps.py --seeds 500``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from .fuzz_steps import FEATURES, check, features_of

SEEDS = range(24)  # ~1.3 s each on the 2-core machine
@pytest.mark.parametrize("seed", SEEDS)
def test_compiled_is_bitwise_eager_or_refused(seed: int, tmp_path: Path) -> None:
    outcome = check(seed, tmp_path)
    assert outcome.verdict in ("bitwise", "refused"), outcome


def test_the_seed_set_draws_every_pattern() -> None:
    drawn = {f for seed in SEEDS for f in features_of(seed)}
    assert drawn == set(FEATURES), set(FEATURES) - drawn
