/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * Map layouts shared by the CO-RE program (avx512.bpf.c), the bcc fallback (avx512_bcc.c) and the Python
 * reader (cri_resmgr/ebpf/avx512.py mirrors these structs with ctypes; tests/test_avx512_loader.py checks the
 * sizes against the object's BTF). Plain __u64/__u32 only, so both kernel-header worlds can include it.
 */
#ifndef CRI_RESMGR_AVX512_H
#define CRI_RESMGR_AVX512_H

/* arch/x86/include/asm/fpu/types.h: enum xfeature { ..., XFEATURE_OPMASK = 5, XFEATURE_ZMM_Hi256 = 6,
 * XFEATURE_Hi16_ZMM = 7, ... }. Bit 6 covers the upper 256 bits of zmm0-15. */
#define AVX512_XFEATURE_ZMM_HI256 (1ULL << 6)

/* Key of the per-CPU hash "counts". cgroup_id is bpf_get_current_cgroup_id() (the task's cgroup on the
 * default = v2 hierarchy); tgid is 0 unless the loader asked for per-process keys (v1-only hosts). */
struct avx512_key {
	__u64 cgroup_id;
	__u32 tgid;
	__u32 pad;
};

/* Value of "counts", one per CPU. Monotonic: nothing in the kernel ever resets them. */
struct avx512_counts {
	__u64 avx512_switches;  /* switches out whose saved FPU state had ZMM_Hi256 in use */
	__u64 switches;         /* all switches out (sched_switch with this task as prev) */
	__u64 last_avx512_ns;   /* bpf_ktime_get_ns() (CLOCK_MONOTONIC) of the last AVX-512 switch */
};

/* Value of the one-entry per-CPU array "cpu_totals": per-CPU sums that do not depend on the hash. */
struct avx512_cpu_totals {
	__u64 avx512_switches;
	__u64 switches;
	__u64 failed_inserts;   /* events not counted per key because "counts" was full */
};

/* Load-time configuration, .rodata ("const volatile"), written by the loader before load. */
struct avx512_config {
	__u32 key_by_tgid;
	__u32 pad;
};

#endif
