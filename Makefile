# make demo  - trains the tiny transformer, eager vs compiled side by side
# make test  - ruff + the test suite
# Each sets up .venv on first use (torch pinned to the CPU build this machine
# has on disk; on a GPU machine install torch your usual way first).

PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
TORCH   ?= torch==2.13.0
STAMP   := $(VENV)/.hocompile-installed

.PHONY: demo test lint bench clean

$(STAMP): pyproject.toml Makefile
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[test,peers]" "triton==3.9.0"
	# emerging-optimizers 0.3.0 declares Python >= 3.12 but runs on 3.11; pinned (a 999.9.9 placeholder
	# exists). It imports triton (above) for its optional SYRK kernels.
	$(BIN)/pip install -q --no-deps --ignore-requires-python emerging-optimizers==0.3.0 absl-py
	# megatron-core 0.19.2 (cp311 wheel, declares Python >= 3.12): tests/test_megatron.py compiles its Muon.
	# Its other needs here are packaging and triton (above); without apex or Transformer Engine it falls back.
	$(BIN)/pip install -q --no-deps --ignore-requires-python megatron-core==0.19.2
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/tiny_transformer.py

lint: $(STAMP)
	$(BIN)/ruff check hocompile tests examples benchmarks
	$(BIN)/mypy hocompile --ignore-missing-imports

# Two workers, one test file each at a time (module fixtures stay per file): ~15 min on the 2-core
# machine without bf16 units (ONEDNN_MAX_CPU_ISA=AVX2), 14.8 min with them (README: the figures).
test: $(STAMP) lint
	$(BIN)/python -m pytest -q -n 2 --dist loadfile

bench: $(STAMP)
	$(BIN)/pip install -q -e ".[bench]"
	$(BIN)/python benchmarks/muon_step.py --shapes gpt2-layer
	$(BIN)/python benchmarks/train_precision.py

clean:
	rm -rf $(VENV) .pytest_cache
