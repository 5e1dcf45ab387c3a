# kvpool — developer entry points. `make help` lists them.
# Every target that needs Python first runs `install`, which is idempotent (a stamp file tracks
# the inputs), so `make test` works on a fresh machine with nothing but Python 3.11 and root.

SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# protocol first: every other component depends on kvpool-protocol, and pip must find the
# local editable copy in the same install command.
COMPONENTS := protocol operator controller gateway kernels worker
SRC_DIRS := $(foreach c,$(COMPONENTS),$(c)/src)
STAMP := $(VENV)/.kvpool-installed
QUICK ?=

.DEFAULT_GOAL := help

.PHONY: help
help: ## Show this help
	@awk 'BEGIN {FS = ":.*## "} /^[a-zA-Z0-9_%-]+:.*## / {printf "  \033[36m%-18s\033[0m %s\n", $$1, $$2}' $(MAKEFILE_LIST)

##@ Setup
.PHONY: install system-deps
install: system-deps $(STAMP) ## Create .venv; install torch==2.13.0 (CPU), then every component editable with test extras

system-deps: ## Install the Debian packages the tests need (redis-server, libibverbs1), once
	@tools/ensure-system-deps.sh

$(STAMP): $(foreach c,$(COMPONENTS),$(c)/pyproject.toml) requirements-dev.txt
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@echo "kvpool: installing Python packages into $(VENV) (first time: several minutes)"
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q torch==2.13.0 -r requirements-dev.txt \
	  $(foreach c,$(COMPONENTS),-e ./$(c)[test])
	@# NIXL's meta package: after nixl-cu13 (a worker dependency), without its deps, or pip
	@# pulls both CUDA variants (~470 MB). LMCache imports nixl._api.
	$(BIN)/python -m pip install -q --no-deps nixl==1.5.2
	@touch $@

# The hash-parity tests' second venv (protocol/tests/vllm_venv.py): lmcache 0.5.6 with the real
# vLLM 0.33.0 on CPU, kept out of .venv. tools/run_tests.py builds it before protocol's tests.
.PHONY: vllm-venv
vllm-venv: install ## Build .kvpool/vllm-venv (the real vLLM over the project .venv's lmcache and torch) for protocol's parity tests, once (~2 min, 0.9 GB)
	$(BIN)/python protocol/tests/vllm_venv.py

##@ Demo
.PHONY: demo
demo: install ## Run examples/cpu-demo.yaml locally (kvpool-operator up) and replay an agent workload through it
	@mkdir -p bench-results
	PYTHONHASHSEED=0 LMCACHE_TRACK_USAGE=false $(BIN)/kvpool-operator demo -f examples/cpu-demo.yaml --plot bench-results/demo.png

.PHONY: demo-cluster
demo-cluster: install ## make demo's workload the way a user runs it: kvpool-operator cluster up, helm install, kubectl apply/wait/get
	@mkdir -p bench-results
	PYTHONHASHSEED=0 LMCACHE_TRACK_USAGE=false $(BIN)/kvpool-operator cluster demo -f examples/cpu-demo.yaml --plot bench-results/demo-cluster.png

##@ Checks
.PHONY: lint fmt test test-%
lint: install ## ruff (lint + format check), mypy --strict, import-linter contracts
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy $(SRC_DIRS)
	$(BIN)/lint-imports

fmt: install ## Format and auto-fix with ruff
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

test: install ## Run every component's tests (each in its own pytest process; builds .kvpool/vllm-venv first)
	$(BIN)/python tools/run_tests.py

test-%: install ## Run one component's tests, e.g. make test-controller
	$(BIN)/python tools/run_tests.py $*

KIND_CLUSTER ?= kvpool
.PHONY: e2e-kind
e2e-kind: install ## Run the operator's flows against a kind cluster (e2e/tests/test_kind.py); creates KIND_CLUSTER if missing
	@command -v kind >/dev/null && command -v kubectl >/dev/null || { echo "make e2e-kind: needs kind and kubectl on PATH (https://kind.sigs.k8s.io)"; exit 1; }
	@kind get clusters 2>/dev/null | grep -qx '$(KIND_CLUSTER)' || kind create cluster --name '$(KIND_CLUSTER)' --wait 120s
	@mkdir -p .kvpool && kind get kubeconfig --name '$(KIND_CLUSTER)' > .kvpool/kind-kubeconfig
	cd e2e && KUBECONFIG=$(CURDIR)/.kvpool/kind-kubeconfig ../$(BIN)/python -m pytest -q -rs tests/test_kind.py

##@ Generated files
.PHONY: generate verify-generated
generate: install ## Write crds/*.yaml, charts/kvpool/crds/ and charts/kvpool/values.schema.json from the API models
	$(BIN)/python -m kvpool.operator.gen

verify-generated: install ## Fail if the generated CRDs or values schema drifted from the API models
	$(BIN)/python -m kvpool.operator.gen --check

##@ Benchmarks
.PHONY: bench bench-%
bench: install ## Run every component's benchmark and the fleet's (QUICK=1 for the reduced run); JSON in bench-results/
	@set -e; for c in $(COMPONENTS); do \
	  if [ -f $$c/bench/run.py ]; then $(MAKE) --no-print-directory bench-$$c QUICK=$(QUICK); fi; \
	done
	@$(MAKE) --no-print-directory bench-fleet QUICK=$(QUICK)

.PHONY: bench-fleet
bench-fleet: install ## kvpool vs sglang-router, vllm-router, Dynamo on a simulated fleet and a real trace; the simulator checked against it; 1000-instance scale (bench-results/fleet.json)
	@mkdir -p bench-results
	PYTHONHASHSEED=0 LMCACHE_TRACK_USAGE=false $(BIN)/python gateway/bench/fleet/run.py $(if $(QUICK),--quick) --out bench-results/fleet.json

bench-%: install ## Run one component's benchmark, e.g. make bench-controller QUICK=1
	@mkdir -p bench-results
	PYTHONHASHSEED=0 LMCACHE_TRACK_USAGE=false $(BIN)/python $*/bench/run.py $(if $(QUICK),--quick) --out bench-results/$*.json

##@ Chaos
.PHONY: chaos
chaos: install ## Kill -9, freeze and cut off each component of a local domain under a trace replay (~8 min; QUICK=1: the e2e suite's reduced run); bench-results/chaos.json and chaos.md
	@mkdir -p bench-results && rm -rf .kvpool/chaos
	cd e2e && LMCACHE_TRACK_USAGE=false ../$(BIN)/python -m chaos $(if $(QUICK),--reduced) \
	  --out ../bench-results/chaos.json --workdir ../.kvpool/chaos

##@ Housekeeping
.PHONY: clean
clean: ## Remove the virtualenv, caches and benchmark results
	rm -rf $(VENV) .kvpool/vllm-venv bench-results .mypy_cache .ruff_cache .hypothesis
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
