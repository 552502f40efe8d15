# rolloutfleet developer entry points. The README names `make demo` and `make test`; CI runs `make test`.
# Every target installs what it needs: a fresh machine needs only Python >= 3.11, Go >= 1.26 and make.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
# Three distributions (pyproject.toml: the operator; worker_image/: the worker; digest/: shared by both).
PROJECTS := pyproject.toml worker_image/pyproject.toml digest/pyproject.toml constraints.txt
STAMP := $(VENV)/.installed-$(shell cat $(PROJECTS) 2>/dev/null | cksum | cut -d' ' -f1)
PYTEST_ARGS ?=

.PHONY: install binaries lint test test-unit test-integration demo crds clean

$(STAMP): $(PROJECTS)
	@echo "==> installing rolloutfleet and its dev/worker extras into $(VENV) (first time: a few minutes)"
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PIP) install -q --upgrade pip
	@$(PIP) install -q -c constraints.txt -e ./digest -e ./worker_image -e '.[dev,worker]'
	@rm -f $(VENV)/.installed-* && touch $@

install: $(STAMP)

# The demo serves simulated engines: the package alone, no worker extra (torch with its CUDA wheels is
# gigabytes), unless the full install is already there. tests/integration/test_demo.py runs it without torch.
DEMO_STAMP := $(VENV)/.installed-demo-$(shell cat $(PROJECTS) 2>/dev/null | cksum | cut -d' ' -f1)
$(DEMO_STAMP): $(PROJECTS)
	@echo "==> installing rolloutfleet (no extras: the demo needs no torch) into $(VENV)"
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PIP) install -q --upgrade pip
	@$(PIP) install -q -c constraints.txt -e ./digest -e .
	@touch $@

# The local control plane (kube-apiserver, controller-manager, scheduler, etcd, kwok, kubectl, helm) and
# Flux's source- and kustomize-controller (the Git-driven tier, tests/integration/gitops), built from Go
# modules and cached in ~/.cache/rolloutfleet (cold: ~20 min + ~6-13 min on 2 cores; warm: seconds).
binaries: install
	@$(PY) -m rolloutfleet.sandbox.binaries
	@$(PY) -m rolloutfleet.sandbox.flux

crds: install
	@$(VENV)/bin/rolloutfleet crds

lint: install
	@echo "==> ruff, mypy, import-linter, CRD drift"
	@$(VENV)/bin/ruff check .
	@$(VENV)/bin/ruff format --check .
	@$(VENV)/bin/mypy
	@$(VENV)/bin/lint-imports
	@$(VENV)/bin/rolloutfleet crds --check

# pytest exits 5 when it selects no test; that is not a failure of a narrowed run.
define run_pytest
	@$(PY) -m pytest $(1) $(PYTEST_ARGS); rc=$$?; if [ $$rc -eq 5 ]; then echo "pytest: no tests selected"; rc=0; fi; exit $$rc
endef

test-unit: install
	$(call run_pytest,-m "unit or contract")

test-integration: binaries
	$(call run_pytest,-m "integration or chart")

# Everything CI runs: install, build/reuse the control plane, lint, then every default tier.
test: binaries lint
	$(call run_pytest,)

# The demo builds (or reuses) only what its cluster runs: etcd, kube-apiserver, kube-controller-manager,
# kube-scheduler and kwok (not kubectl or helm).
demo: $(if $(wildcard $(STAMP)),$(STAMP),$(DEMO_STAMP))
	@$(VENV)/bin/rolloutfleet sandbox demo

# Both container images, built and checked with podman instead of Docker (scripts/images.sh: container tools,
# stand-in bases, both builds, sizes, hadolint, tests/images, the demo with the operator container). Root only.
.PHONY: images
images: install
	@scripts/images.sh all

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
