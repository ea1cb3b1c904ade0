# One command to run the agent, one to run the tests; each does its own set-up.
#   make run    # venv + install, then the agent on its embedded defaults (http://127.0.0.1:8891)
#   make test   # venv + install (+ apt packages when root), then the test suite
#   make bench  # benchmarks (not part of the suite)
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# Debian packages the tests use: promtool and the Prometheus server (prometheus), headless Chromium for the
# web UI test (chromium, driven by Playwright), gcc for the demo's AVX512 loop; clang, libbpf-dev for
# `make bpf` and the wheel's build hook (setup.py), bpftool for bench/avx512_bench.py,
# python3-bpfcc for the avx512 bcc fallback's tests, linux-perf for bench/avx512_bench.py,
# fuse3 (libfuse3) for the FUSE resctrl emulator of the RDT tests (tests/resctrlfs.py); containerd, runc and
# busybox-static for the CRI relay's tests against a real runtime (tests/integration/containerd.py);
# debian-archive-keyring for fetching Debian 13's containerd 1.7 privately for the NRI tests
# (tests/integration/nri/containerd17.py: apt-get download + dpkg -x, the system's apt state untouched).
APT_PACKAGES ?= prometheus chromium gcc libc6-dev clang bpftool libbpf-dev python3-bpfcc linux-perf fuse3 containerd runc busybox-static debian-archive-keyring mount curl
# What `make run` needs: the toolchain that builds the eBPF object (the agent itself never runs clang).
RUN_APT_PACKAGES ?= clang libbpf-dev
ARGS ?=

.PHONY: setup apt apt-run bpf run lint test test-unit bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml setup.py
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "Python >= 3.11 is required"'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[test]'
	@touch $@

apt: PKGS = $(APT_PACKAGES)
apt-run: PKGS = $(RUN_APT_PACKAGES)
apt apt-run:
	@bash tools/apt-install.sh $(PKGS)

# The AVX-512 eBPF object in the checkout: CO-RE, compiled against the minimal BTF-derived header the repository
# keeps for x86_64 (cri_resmgr/ebpf/x86_64/vmlinux.h), so neither bpftool nor the build host's BTF is needed.
# Same source, header and flags as the wheel's build hook (setup.py). Skipped when clang or libbpf-dev is
# missing; the agent then reports the avx512 collector down with the reason. The agent never needs clang itself.
BPF_DIR := cri_resmgr/ebpf
BPF_OBJ := $(BPF_DIR)/avx512.bpf.o
VMLINUX_DIR := $(BPF_DIR)/x86_64
BPF_CFLAGS ?= -O2 -g -target bpf -D__TARGET_ARCH_x86 -Wall -Werror

bpf:
	@if command -v clang >/dev/null && [ -e /usr/include/bpf/bpf_helpers.h ]; then \
		$(MAKE) --no-print-directory $(BPF_OBJ); \
	else echo "clang or libbpf-dev missing: skipping the eBPF build ($(BPF_OBJ))"; fi

$(BPF_OBJ): $(BPF_DIR)/avx512.bpf.c $(BPF_DIR)/avx512.h $(VMLINUX_DIR)/vmlinux.h
	clang $(BPF_CFLAGS) -I$(VMLINUX_DIR) -I$(BPF_DIR) -c $< -o $@

run: setup apt-run bpf
	$(BIN)/cri-resmgr run $(ARGS)

# The code health gates alone (tests/test_code_health.py runs the same two commands inside `make test`).
lint: setup
	$(BIN)/ruff check .
	$(BIN)/mypy

test: setup apt bpf
	$(BIN)/python -m pytest -q -ra

test-unit: setup
	$(BIN)/python -m pytest -q -ra -m "not integration"

bench: setup bpf
	$(BIN)/python bench/store_bench.py
	$(BIN)/python bench/metrics_bench.py
	$(BIN)/python bench/collect_cycle_bench.py
	$(BIN)/python bench/relay_bench.py
	@if [ "$$(id -u)" = 0 ]; then $(BIN)/python bench/nri_bench.py; else echo "bench/nri_bench.py skipped: needs root"; fi
	$(BIN)/python bench/rebalancer_bench.py
	$(BIN)/python bench/heatmap_bench.py
	@if [ "$$(id -u)" = 0 ]; then $(BIN)/python bench/avx512_bench.py; else echo "bench/avx512_bench.py skipped: needs root"; fi

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache $(BPF_OBJ)
