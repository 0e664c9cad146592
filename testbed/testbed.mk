# Testbed targets; the top-level Makefile includes this file.
# TOPOLOGY picks the simulated GPU fleet for `make testbed-up`.
TOPOLOGY ?= examples/clusters/two-pool.yaml

.PHONY: testbed-build testbed-up testbed-down testbed-status testbed-bench

testbed-build: ## build etcd, Kubernetes, KWOK, Helm and versitygw into ~/.cache/topotrain/bin
	testbed/build.sh

testbed-up: testbed-build ## start the local Kubernetes + GPU fleet + S3 (TOPOLOGY=examples/clusters/...)
	$(VENV)/bin/python -m testbed up --topology $(TOPOLOGY)

testbed-down: ## stop every testbed process (data stays in .testbed/; add ARGS=--purge to delete it)
	$(VENV)/bin/python -m testbed down $(ARGS)

testbed-status: ## show the testbed's processes, endpoints and logs
	$(VENV)/bin/python -m testbed status

testbed-bench: testbed-build ## 1,000 simulated GPU nodes: time to Ready and memory per component
	$(VENV)/bin/python bench/testbed_scale.py
