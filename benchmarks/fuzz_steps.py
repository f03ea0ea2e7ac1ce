"""The differential fuzzer (tests/fuzz_steps.py) over many seeds: compiled with every pass off vs eager.

    .venv/bin/python benchmarks/fuzz_steps.py --seeds 500 [--start 0]

Prints one line per seed (verdict, the patterns it drew) and a summary; exit status 1 if any seed
computed a step that differs from eager without refusing, or one the self-check had to catch. Each
seed's optimizer module is written to a temporary folder that is kept, to rerun a seed by hand.
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.fuzz_steps import check  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=200)
    parser.add_argument("--start", type=int, default=0)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="hocompile-fuzz-"))
    counts: collections.Counter[str] = collections.Counter()
    start = time.perf_counter()
    for seed in range(args.start, args.start + args.seeds):
        outcome = check(seed, root)
        counts[outcome.verdict] += 1
        print(f"{seed:5d} {outcome.verdict:8s} {','.join(outcome.features)} {outcome.detail}", flush=True)
    seconds = time.perf_counter() - start
    print(f"{dict(counts)} in {seconds:.0f} s; modules in {root}")
    return 1 if counts["WRONG"] or counts["caught"] else 0


if __name__ == "__main__":
    sys.exit(main())
