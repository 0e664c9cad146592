# topotrain developer targets. `make demo` and `make test` do their own set-up.
SHELL := /bin/bash
VENV = $(shell scripts/bootstrap.sh trainer | tail -n 1)
BIN = $(shell testbed/build.sh | tail -n 1)
# This checkout's code first: the cached venv is shared by every checkout on the machine.
export PYTHONPATH := $(CURDIR)/operator:$(CURDIR)/trainer_image:$(CURDIR)/sdk:$(CURDIR)

.PHONY: help venv test chaos unit lint crds demo bench kind-e2e clean
help:
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed -E 's/:.*## /\t/' | sort

venv: ## create the cached Python environment (with torch)
	@scripts/bootstrap.sh trainer

test: ## everything CI runs: lint, mypy, unit, integration, trainer and e2e tests
	scripts/test.sh

chaos: ## the bounded seeded chaos soak (60 overlapping faults; docs/reliability.md)
	scripts/test.sh tests/chaos -m chaos

unit: ## pure unit tests only (no cluster, no torch processes)
	scripts/test.sh tests/unit

lint: ## ruff + mypy --strict + the layer contract (lint-imports)
	$(VENV)/bin/ruff check operator trainer_image tests bench testbed scripts
	$(VENV)/bin/mypy --strict operator/topotrain trainer_image/topotrain_trainer
	$(VENV)/bin/lint-imports

crds: ## regenerate the CRDs from the API models (top level and chart)
	$(VENV)/bin/topotrain crd -o crds/
	cp crds/topotrain.io_trainingjobs.yaml crds/topotrain.io_trainingjobtemplates.yaml charts/topotrain/crds/

demo: ## the main job: operator + placement + failure + recovery + elastic resize on the testbed
	PATH="$(BIN):$$PATH" $(VENV)/bin/python -m testbed.demo

bench: ## all benchmarks (tables on stdout)
	PATH="$(BIN):$$PATH" $(VENV)/bin/python bench/placement.py
	PATH="$(BIN):$$PATH" $(VENV)/bin/python bench/checkpoint.py
	PATH="$(BIN):$$PATH" $(VENV)/bin/python bench/recovery.py
	PATH="$(BIN):$$PATH" $(VENV)/bin/python bench/goodput.py
	PATH="$(BIN):$$PATH" $(VENV)/bin/python bench/testbed_scale.py

kind-e2e: ## the real-data-plane suite on a kind cluster built offline (docs/kind.md)
	scripts/kind-e2e.sh

-include testbed/testbed.mk
