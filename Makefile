# One command to run the agent, one to run the tests; each does its own set-up.
#   make run    # venv + install, then the agent on its embedded defaults (http://127.0.0.1:8891)
#   make test   # venv + install (+ apt packages when root), then the test suite
#   make bench  # benchmarks (not part of the suite)
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# Debian packages the tests use: promtool and the Prometheus server (prometheus), headless Chromium for the
# web UI test (chromium, driven by Playwright), gcc for the demo's AVX512 loop; clang, bpftool, libbpf-dev for
# `make bpf`, python3-bpfcc for the avx512 bcc fallback's tests, linux-perf for bench/avx512_bench.py,
# fuse3 (libfuse3) for the FUSE resctrl emulator of the RDT tests (tests/resctrlfs.py); containerd, runc and
# busybox-static for the CRI relay's tests against a real runtime (tests/integration/containerd.py).
APT_PACKAGES ?= prometheus chromium gcc libc6-dev clang bpftool libbpf-dev python3-bpfcc linux-perf fuse3 containerd runc busybox-static
# What `make run` needs: the toolchain that builds the eBPF object (the agent itself never runs clang).
RUN_APT_PACKAGES ?= clang bpftool libbpf-dev
ARGS ?=

.PHONY: setup apt apt-run bpf run test test-unit bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "Python >= 3.11 is required"'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[test]'
	@touch $@

apt: PKGS = $(APT_PACKAGES)
apt-run: PKGS = $(RUN_APT_PACKAGES)
apt apt-run:
	@bash tools/apt-install.sh $(PKGS)

# The AVX-512 eBPF object: CO-RE, compiled against a vmlinux.h that bpftool generates from the running
# kernel's BTF (build/bpf/vmlinux.h, not committed). Skipped when clang, bpftool or libbpf-dev is missing;
# the agent then reports the avx512 collector down with the reason. The agent never needs clang itself.
BPF_DIR := cri_resmgr/ebpf
BPF_OBJ := $(BPF_DIR)/avx512.bpf.o
VMLINUX_H := build/bpf/vmlinux.h
BPF_CFLAGS ?= -O2 -g -target bpf -D__TARGET_ARCH_x86 -Wall -Werror

bpf:
	@if command -v clang >/dev/null && command -v bpftool >/dev/null && [ -e /usr/include/bpf/bpf_helpers.h ] \
		&& [ -e /sys/kernel/btf/vmlinux ]; then $(MAKE) --no-print-directory $(BPF_OBJ); \
	else echo "clang, bpftool, libbpf-dev or kernel BTF missing: skipping the eBPF build ($(BPF_OBJ))"; fi

$(VMLINUX_H):
	@mkdir -p $(@D)
	bpftool btf dump file /sys/kernel/btf/vmlinux format c > $@.tmp && mv $@.tmp $@

$(BPF_OBJ): $(BPF_DIR)/avx512.bpf.c $(BPF_DIR)/avx512.h $(VMLINUX_H)
	clang $(BPF_CFLAGS) -I$(dir $(VMLINUX_H)) -I$(BPF_DIR) -c $< -o $@

run: setup apt-run bpf
	$(BIN)/cri-resmgr run $(ARGS)

test: setup apt bpf
	$(BIN)/python -m pytest -q -ra

test-unit: setup
	$(BIN)/python -m pytest -q -ra -m "not integration"

bench: setup bpf
	$(BIN)/python bench/store_bench.py
	$(BIN)/python bench/metrics_bench.py
	$(BIN)/python bench/collect_cycle_bench.py
	$(BIN)/python bench/relay_bench.py
	$(BIN)/python bench/rebalancer_bench.py
	$(BIN)/python bench/heatmap_bench.py
	@if [ "$$(id -u)" = 0 ]; then $(BIN)/python bench/avx512_bench.py; else echo "bench/avx512_bench.py skipped: needs root"; fi

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache $(BPF_OBJ)
