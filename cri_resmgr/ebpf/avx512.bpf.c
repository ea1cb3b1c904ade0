// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/*
 * avx512.bpf.c - per cgroup (or per process) and per CPU: how many context switches leave AVX-512 state
 * (upper halves of zmm0-15) live, out of all context switches.
 *
 * Built by `make bpf` and by the wheel's build hook (setup.py): clang -O2 -g -target bpf against
 * x86_64/vmlinux.h, a minimal header derived from the kernel's BTF with only the fields read here, every record
 * preserve_access_index (CO-RE: field offsets are relocated by libbpf at load time against the running kernel's
 * BTF, so the object is tied neither to the build kernel nor to a BTF on the build host).
 *
 * Hooks (BTF-enabled raw tracepoints; no trace-buffer record is built, the program gets the arguments):
 *
 * - tp_btf/sched_switch: include/trace/events/sched.h, TP_PROTO(bool preempt, struct task_struct *prev,
 *   struct task_struct *next, unsigned int prev_state). Fired in __schedule() (kernel/sched/core.c) before
 *   context_switch(), with the runqueue locked and interrupts off; prev is the task being switched out.
 *   Kernel threads (the idle task included) are skipped: they have no user FPU state, so the fpu hook
 *   below never fires for them and they cannot count towards either side of the ratio.
 *
 * - tp_btf/x86_fpu_regs_deactivated: arch/x86/include/asm/trace/fpu.h, TP_PROTO(struct fpu *fpu). Fired
 *   by switch_fpu() (arch/x86/include/asm/fpu/sched.h; switch_fpu_prepare() before 6.8), called from
 *   __switch_to() (arch/x86/kernel/process_64.c) in the context of the old task, right after
 *   save_fpregs_to_fpstate() has XSAVE'd its registers. Only user tasks whose registers were live fire it
 *   (not kernel threads, not tasks with TIF_NEED_FPU_LOAD already set).
 *   XSAVES/XSAVEOPT write the XSTATE_BV field of the XSAVE header as XINUSE & RFBM (Intel SDM vol. 1,
 *   13.8 "Operation of XSAVEOPT/XSAVES"): bit 6 (ZMM_Hi256) is set only when the upper halves of zmm0-15 are
 *   not in their initial (zero) state - i.e. the task executed 512-bit instructions on zmm0-15 since the
 *   last VZEROUPPER/VZEROALL. The tracepoint's own `xfeatures` field is this same header word.
 *
 * Not used on purpose: fpu->avx512_timestamp (and /proc/<pid>/arch_status, derived from it) is stamped
 * when any of opmask, ZMM_Hi256 or Hi16_ZMM is in use (arch/x86/kernel/fpu/core.c update_avx_timestamp(),
 * XFEATURE_MASK_AVX512); glibc's EVEX string functions use ymm16-31 and opmask registers, which marks
 * nearly every process. See docs/avx512.md.
 *
 * Both hooks key by the switched-out task's cgroup on the default (v2) hierarchy, read as
 * task->cgroups->dfl_cgrp->kn->id - what bpf_get_current_cgroup_id() returns (kernel/bpf/helpers.c,
 * include/linux/cgroup.h cgroup_id()), read directly because the helper costs ~30 ns more per event here.
 *
 * Maps: "counts", a per-CPU hash keyed by struct avx512_key (no atomics, no cache-line bouncing), and
 * "cpu_totals", a one-entry per-CPU array. Both are monotonic; user space never clears them, it only
 * deletes keys of cgroups/processes that have gone (after reading them one last time). The hash is sized
 * by the loader; when it is full, inserts fail and cpu_totals.failed_inserts counts every lost event.
 */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_tracing.h>
#include <bpf/bpf_core_read.h>

#include "avx512.h"

char LICENSE[] SEC("license") = "Dual BSD/GPL";

/* Written by the loader before load (bpf_map__set_initial_value on .rodata); the verifier then treats it
 * as a constant and drops the branch not taken. */
const volatile struct avx512_config avx512_config = {};

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_HASH);
	__uint(max_entries, 4096); /* overridden by collectors.avx512.map_entries (bpf_map__set_max_entries) */
	__type(key, struct avx512_key);
	__type(value, struct avx512_counts);
} counts SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct avx512_cpu_totals);
} cpu_totals SEC(".maps");

/* Kernels before 5.16 (commit 87d0e5be0fac "x86/fpu: Provide struct fpstate") embed the register buffer in
 * struct fpu as `union fpregs_state state`; later ones point to it through fpu->fpstate. CO-RE picks the
 * branch that matches the running kernel's BTF; the other one is dead code for the verifier. */
struct fpu___pre_fpstate {
	union fpregs_state state;
} __attribute__((preserve_access_index));

static __always_inline __u64 saved_xfeatures(struct fpu *fpu)
{
	/* tp_btf arguments are BTF-typed pointers: plain loads, which the verifier turns into fault-safe
	 * ones where needed, instead of bpf_probe_read_kernel() calls. */
	if (bpf_core_field_exists(fpu->fpstate))
		return fpu->fpstate->regs.xsave.header.xfeatures;
	return ((struct fpu___pre_fpstate *)fpu)->state.xsave.header.xfeatures;
}

/* include/linux/sched.h; unchanged since 2.6 */
#define PF_KTHREAD 0x00200000

static __always_inline struct avx512_cpu_totals *this_cpu_totals(void)
{
	__u32 zero = 0;

	return bpf_map_lookup_elem(&cpu_totals, &zero);
}

/* This task's counters on this CPU, created on first use. NULL (and failed_inserts counted) when the map
 * is full. An insert can also lose a race with the same key on another CPU (-EEXIST): the second lookup
 * then finds the entry. */
static __always_inline struct avx512_counts *task_counts(struct task_struct *task, struct avx512_cpu_totals *tot)
{
	struct avx512_key key = {};
	struct avx512_counts zero = {};
	struct avx512_counts *c;

	key.cgroup_id = task->cgroups->dfl_cgrp->kn->id;
	if (avx512_config.key_by_tgid)
		key.tgid = task->tgid;
	c = bpf_map_lookup_elem(&counts, &key);
	if (c)
		return c;
	bpf_map_update_elem(&counts, &key, &zero, BPF_NOEXIST);
	c = bpf_map_lookup_elem(&counts, &key);
	if (!c)
		tot->failed_inserts++;
	return c;
}

SEC("tp_btf/sched_switch")
int BPF_PROG(avx512_switch, bool preempt, struct task_struct *prev)
{
	struct avx512_cpu_totals *tot;
	struct avx512_counts *c;

	if (prev->flags & PF_KTHREAD)
		return 0;
	tot = this_cpu_totals();
	if (!tot)
		return 0;
	tot->switches++;
	c = task_counts(prev, tot);
	if (c)
		c->switches++;
	return 0;
}

SEC("tp_btf/x86_fpu_regs_deactivated")
int BPF_PROG(avx512_fpu, struct fpu *fpu)
{
	struct avx512_cpu_totals *tot;
	struct avx512_counts *c;

	if (!(saved_xfeatures(fpu) & AVX512_XFEATURE_ZMM_HI256))
		return 0;
	tot = this_cpu_totals();
	if (!tot)
		return 0;
	tot->avx512_switches++;
	/* switch_fpu() runs in the old task's context: current is the task whose state was just saved */
	c = task_counts(bpf_get_current_task_btf(), tot);
	if (c) {
		c->avx512_switches++;
		c->last_avx512_ns = bpf_ktime_get_ns();
	}
	return 0;
}
