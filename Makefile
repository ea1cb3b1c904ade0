# One command to run the agent, one to run the tests; each does its own set-up.
#   make run    # venv + install, then the agent on its embedded defaults (http://127.0.0.1:8891)
#   make test   # venv + install (+ apt packages when root), then the test suite
#   make bench  # benchmarks (not part of the suite)
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# Debian packages the tests use: promtool (prometheus).
APT_PACKAGES ?= prometheus
ARGS ?=

.PHONY: setup apt run test test-unit bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "Python >= 3.11 is required"'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[test]'
	@touch $@

apt:
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		missing=""; for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
		if [ -n "$$missing" ]; then \
			echo "apt-get install$$missing"; \
			export DEBIAN_FRONTEND=noninteractive; \
			apt-get install -y -q $$missing >/dev/null || { apt-get update -q >/dev/null && apt-get install -y -q $$missing >/dev/null; }; \
		fi; \
	else echo "not root or no apt-get: skipping system packages ($(APT_PACKAGES)); tests that need them will skip"; fi

run: setup
	$(BIN)/cri-resmgr run $(ARGS)

test: setup apt
	$(BIN)/python -m pytest -q -ra

test-unit: setup
	$(BIN)/python -m pytest -q -ra -m "not integration"

bench: setup
	$(BIN)/python bench/store_bench.py
	$(BIN)/python bench/metrics_bench.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
