"""First steps of hocompile alone (no eager run) for benchmarks/first_step.py's models, fresh cache.

    ONEDNN_MAX_CPU_ISA=AVX2 OPENBLAS_CORETYPE=Haswell \\
        .venv/bin/python benchmarks/first_step_hocompile_only.py moe-views 1

For a CPU kind where eager's own steps do not fit a run: without bf16 units eager's bf16 Muon runs at
~2.6 GFLOP/s (GPT-2 small: minutes a step). Steps 1 and 2 and the median of steps 3-4. The second
argument: 1 compiled, 0 eager.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import benchmarks.first_step as first_step

    model, compiled = sys.argv[1], sys.argv[2] == "1"
    started = time.perf_counter()
    times = first_step._child(model, compiled, tempfile.mkdtemp(), warm=2, steps=2)
    rounded = {k: round(v, 2) for k, v in times.items()}
    print(json.dumps({"model": model, "compiled": compiled, **rounded,
                      "total_s": round(time.perf_counter() - started, 1)}))


if __name__ == "__main__":
    main()
