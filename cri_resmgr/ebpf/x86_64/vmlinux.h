/* SPDX-License-Identifier: GPL-2.0-only */
/*
 * Minimal vmlinux.h for x86_64: only the kernel types avx512.bpf.c uses, and in them only the fields it reads.
 *
 * Derived from the kernel's BTF (`bpftool btf dump file /sys/kernel/btf/vmlinux format c`, Linux 6.18) and
 * cut down by hand. It is not a layout: every record carries preserve_access_index, so clang emits a CO-RE
 * relocation for each field access and libbpf resolves it by name against the running kernel's BTF at load
 * time (https://nakryiko.com/posts/bpf-core-reference-guide/ "Defining own CO-RE-relocatable type
 * definitions"). Field order, sizes of the other members and padding therefore do not matter, and a build host
 * needs no BTF. Keeping the header small keeps the object small (the full dump is ~2.8 MB of C) and the build
 * reproducible on any host with clang and libbpf-dev.
 *
 * Update it when avx512.bpf.c reads a new field: add the field (type as in the BTF dump) to the record here.
 */
#ifndef __VMLINUX_H__
#define __VMLINUX_H__

typedef signed char __s8;
typedef unsigned char __u8;
typedef short int __s16;
typedef short unsigned int __u16;
typedef int __s32;
typedef unsigned int __u32;
typedef long long int __s64;
typedef long long unsigned int __u64;
typedef __u16 __be16;
typedef __u32 __be32;
typedef __u32 __wsum;
typedef __u32 u32;
typedef __u64 u64;
typedef int pid_t;
typedef _Bool bool;

enum {
	false = 0,
	true = 1,
};

/* include/uapi/linux/bpf.h: enum bpf_map_type and the bpf_map_update_elem() flags */
enum bpf_map_type {
	BPF_MAP_TYPE_PERCPU_HASH = 5,
	BPF_MAP_TYPE_PERCPU_ARRAY = 6,
};

enum {
	BPF_ANY = 0,
	BPF_NOEXIST = 1,
	BPF_EXIST = 2,
};

#pragma clang attribute push (__attribute__((preserve_access_index)), apply_to = record)

/* include/linux/kernfs.h (u64 id since 5.5, commit 67c0496e87d1 "kernfs: convert kernfs_node->id from union
 * kernfs_node_id to u64") */
struct kernfs_node {
	u64 id;
};

/* include/linux/cgroup-defs.h */
struct cgroup {
	struct kernfs_node *kn;
};

struct css_set {
	struct cgroup *dfl_cgrp;
};

/* include/linux/sched.h */
struct task_struct {
	unsigned int flags;
	pid_t tgid;
	struct css_set *cgroups;
};

/* arch/x86/include/asm/fpu/types.h */
struct xstate_header {
	u64 xfeatures;
};

struct xregs_state {
	struct xstate_header header;
};

union fpregs_state {
	struct xregs_state xsave;
};

struct fpstate {
	union fpregs_state regs;
};

struct fpu {
	struct fpstate *fpstate;
};

#pragma clang attribute pop

#endif /* __VMLINUX_H__ */
