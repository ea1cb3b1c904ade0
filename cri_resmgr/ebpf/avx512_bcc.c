// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/*
 * avx512_bcc.c - the same counting as avx512.bpf.c, for bcc (the fallback loader on kernels without BTF
 * that have kernel headers). bcc compiles this text at run time with the running kernel's headers; the
 * loader passes -DAVX512_MAP_ENTRIES=<n> -DAVX512_KEY_BY_TGID=<0|1> and -I<this directory>.
 *
 * Hooks are classic tracepoints: bcc builds `args` from the tracefs format files
 * (events/x86_fpu/x86_fpu_regs_deactivated/format: field `u64 xfeatures`, copied by TP_fast_assign from
 * the XSAVE header of the state just saved - arch/x86/include/asm/trace/fpu.h; events/sched/sched_switch).
 * See avx512.bpf.c for why bit 6 of xfeatures and for the context the hooks run in.
 */
#include <linux/sched.h>

#include "avx512.h"

BPF_PERCPU_HASH(counts, struct avx512_key, struct avx512_counts, AVX512_MAP_ENTRIES);
BPF_PERCPU_ARRAY(cpu_totals, struct avx512_cpu_totals, 1);

static __always_inline struct avx512_counts *task_counts(struct avx512_cpu_totals *tot)
{
	struct avx512_key key = {};
	struct avx512_counts zero = {};
	struct avx512_counts *c;

	key.cgroup_id = bpf_get_current_cgroup_id();
#if AVX512_KEY_BY_TGID
	key.tgid = bpf_get_current_pid_tgid() >> 32;
#endif
	c = counts.lookup(&key);
	if (c)
		return c;
	counts.insert(&key, &zero);
	c = counts.lookup(&key);
	if (!c)
		tot->failed_inserts++;
	return c;
}

TRACEPOINT_PROBE(sched, sched_switch)
{
	int zero = 0;
	struct task_struct *prev = (struct task_struct *)bpf_get_current_task();
	struct avx512_cpu_totals *tot;
	struct avx512_counts *c;

	if (prev->flags & PF_KTHREAD)  /* no user FPU state: see avx512.bpf.c */
		return 0;
	tot = cpu_totals.lookup(&zero);
	if (!tot)
		return 0;
	tot->switches++;
	c = task_counts(tot);
	if (c)
		c->switches++;
	return 0;
}

TRACEPOINT_PROBE(x86_fpu, x86_fpu_regs_deactivated)
{
	int zero = 0;
	struct avx512_cpu_totals *tot;
	struct avx512_counts *c;

	if (!(args->xfeatures & AVX512_XFEATURE_ZMM_HI256))
		return 0;
	tot = cpu_totals.lookup(&zero);
	if (!tot)
		return 0;
	tot->avx512_switches++;
	c = task_counts(tot);
	if (c) {
		c->avx512_switches++;
		c->last_avx512_ns = bpf_ktime_get_ns();
	}
	return 0;
}
