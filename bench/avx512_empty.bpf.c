// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/* Baseline for bench/avx512_bench.py: empty programs on the same two hooks as cri_resmgr/ebpf/avx512.bpf.c,
 * so the cost of merely attaching to sched_switch and x86_fpu_regs_deactivated (the kernel's BPF dispatch)
 * is measured apart from the collector's own work. Compiled by the bench with clang when present. */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_tracing.h>

char LICENSE[] SEC("license") = "Dual BSD/GPL";

SEC("tp_btf/sched_switch")
int BPF_PROG(empty_switch)
{
	return 0;
}

SEC("tp_btf/x86_fpu_regs_deactivated")
int BPF_PROG(empty_fpu)
{
	return 0;
}
