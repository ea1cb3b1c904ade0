"""The perf_event_open(2) syscall layer, kept in one small module.

No maintained Python binding opens events in cgroup mode, so this wraps the syscall with ctypes. The
layout of ``struct perf_event_attr`` and every constant below are the kernel's userspace ABI, from
``include/uapi/linux/perf_event.h`` (and the perf_event_open(2) man page):

- ``perf_event_attr`` is versioned by its ``size`` field; this is ``PERF_ATTR_SIZE_VER8`` (136 bytes,
  kernel 6.3+). Older kernels accept it as long as the fields they do not know are zero (kernel/events/
  core.c, ``perf_copy_attr``), so one layout serves every kernel.
- cgroup mode: ``pid`` is an fd of the cgroup's directory in a hierarchy with the perf_event controller,
  ``flags`` has ``PERF_FLAG_PID_CGROUP``, and ``cpu`` must be a CPU (cgroup events are per-CPU only).
- read format ``PERF_FORMAT_GROUP | TOTAL_TIME_ENABLED | TOTAL_TIME_RUNNING | ID`` on a group leader
  returns ``u64 nr; u64 time_enabled; u64 time_running; {u64 value; u64 id;}[nr]``.

Everything here either returns a value or raises :class:`PerfOpenError` carrying the errno; policy
(which events, which cgroups, what to do on ENOENT) lives in :mod:`cri_resmgr.collectors.perf`.
"""

from __future__ import annotations

import ctypes
import errno as errno_mod
import fcntl
import os
import platform
import struct
from dataclasses import dataclass

from ..libc import LIBC

# -- constants from include/uapi/linux/perf_event.h ------------------------------------------------
PERF_TYPE_HARDWARE = 0
PERF_TYPE_SOFTWARE = 1
PERF_TYPE_TRACEPOINT = 2
PERF_TYPE_HW_CACHE = 3
PERF_TYPE_RAW = 4

# enum perf_hw_id
PERF_COUNT_HW_CPU_CYCLES = 0
PERF_COUNT_HW_INSTRUCTIONS = 1
PERF_COUNT_HW_CACHE_REFERENCES = 2
PERF_COUNT_HW_CACHE_MISSES = 3
PERF_COUNT_HW_BRANCH_INSTRUCTIONS = 4
PERF_COUNT_HW_BRANCH_MISSES = 5
PERF_COUNT_HW_BUS_CYCLES = 6
PERF_COUNT_HW_STALLED_CYCLES_FRONTEND = 7
PERF_COUNT_HW_STALLED_CYCLES_BACKEND = 8
PERF_COUNT_HW_REF_CPU_CYCLES = 9

# enum perf_sw_ids
PERF_COUNT_SW_CPU_CLOCK = 0
PERF_COUNT_SW_TASK_CLOCK = 1
PERF_COUNT_SW_PAGE_FAULTS = 2
PERF_COUNT_SW_CONTEXT_SWITCHES = 3
PERF_COUNT_SW_CPU_MIGRATIONS = 4
PERF_COUNT_SW_PAGE_FAULTS_MIN = 5
PERF_COUNT_SW_PAGE_FAULTS_MAJ = 6
PERF_COUNT_SW_ALIGNMENT_FAULTS = 7
PERF_COUNT_SW_EMULATION_FAULTS = 8

# HW cache events: config = id | (op << 8) | (result << 16)
PERF_COUNT_HW_CACHE_LL = 2
PERF_COUNT_HW_CACHE_OP_READ = 0
PERF_COUNT_HW_CACHE_OP_WRITE = 1
PERF_COUNT_HW_CACHE_RESULT_ACCESS = 0
PERF_COUNT_HW_CACHE_RESULT_MISS = 1

PERF_FORMAT_TOTAL_TIME_ENABLED = 1 << 0
PERF_FORMAT_TOTAL_TIME_RUNNING = 1 << 1
PERF_FORMAT_ID = 1 << 2
PERF_FORMAT_GROUP = 1 << 3

PERF_FLAG_FD_NO_GROUP = 1 << 0
PERF_FLAG_FD_OUTPUT = 1 << 1
PERF_FLAG_PID_CGROUP = 1 << 2
PERF_FLAG_FD_CLOEXEC = 1 << 3

# attr.flags bit positions (the bitfield that follows read_format)
ATTR_FLAG_DISABLED = 1 << 0
ATTR_FLAG_INHERIT = 1 << 1
ATTR_FLAG_PINNED = 1 << 2
ATTR_FLAG_EXCLUDE_HV = 1 << 6

PERF_ATTR_SIZE_VER8 = 136

# _IOR('$', 7, __u64 *): PERF_EVENT_IOC_ID (dir=read 2, size 8, type '$' 0x24, nr 7)
PERF_EVENT_IOC_ID = (2 << 30) | (8 << 16) | (ord("$") << 8) | 7

# Syscall numbers (arch/x86/entry/syscalls/syscall_64.tbl, include/uapi/asm-generic/unistd.h).
_NR_PERF_EVENT_OPEN = {"x86_64": 298, "aarch64": 241, "riscv64": 241, "i686": 336, "i386": 336}


class PerfEventAttr(ctypes.Structure):
    """``struct perf_event_attr`` (PERF_ATTR_SIZE_VER8); unions are represented by their first member."""

    _fields_ = [
        ("type", ctypes.c_uint32),
        ("size", ctypes.c_uint32),
        ("config", ctypes.c_uint64),
        ("sample_period", ctypes.c_uint64),  # union with sample_freq
        ("sample_type", ctypes.c_uint64),
        ("read_format", ctypes.c_uint64),
        ("flags", ctypes.c_uint64),  # disabled:1, inherit:1, pinned:1, exclusive:1, exclude_user:1, ...
        ("wakeup_events", ctypes.c_uint32),  # union with wakeup_watermark
        ("bp_type", ctypes.c_uint32),
        ("config1", ctypes.c_uint64),  # union with bp_addr, kprobe_func, uprobe_path
        ("config2", ctypes.c_uint64),  # union with bp_len, kprobe_addr, probe_offset
        ("branch_sample_type", ctypes.c_uint64),
        ("sample_regs_user", ctypes.c_uint64),
        ("sample_stack_user", ctypes.c_uint32),
        ("clockid", ctypes.c_int32),
        ("sample_regs_intr", ctypes.c_uint64),
        ("aux_watermark", ctypes.c_uint32),
        ("sample_max_stack", ctypes.c_uint16),
        ("reserved_2", ctypes.c_uint16),
        ("aux_sample_size", ctypes.c_uint32),
        ("reserved_3", ctypes.c_uint32),  # aux_action in 6.13+
        ("sig_data", ctypes.c_uint64),
        ("config3", ctypes.c_uint64),
    ]


assert ctypes.sizeof(PerfEventAttr) == PERF_ATTR_SIZE_VER8


class PerfOpenError(OSError):
    """perf_event_open failed; ``errno`` says why (ENOENT/EOPNOTSUPP: event not supported here,
    EMFILE/ENFILE: out of descriptors, EACCES/EPERM: not allowed, EBADF: cgroup not in a perf_event hierarchy)."""


UNSUPPORTED_ERRNOS = frozenset({errno_mod.ENOENT, errno_mod.EOPNOTSUPP, errno_mod.EINVAL, errno_mod.ENODEV})
DESCRIPTOR_ERRNOS = frozenset({errno_mod.EMFILE, errno_mod.ENFILE})


@dataclass(frozen=True)
class GroupReading:
    """One read of a group leader: the shared enabled/running times and each member's raw value by id."""

    time_enabled_ns: int
    time_running_ns: int
    values: dict[int, int]


def make_attr(type_: int, config: int, config1: int = 0, config2: int = 0, group_read: bool = True) -> PerfEventAttr:
    a = PerfEventAttr()
    a.type = type_
    a.size = PERF_ATTR_SIZE_VER8
    a.config = config
    a.config1 = config1
    a.config2 = config2
    fmt = PERF_FORMAT_TOTAL_TIME_ENABLED | PERF_FORMAT_TOTAL_TIME_RUNNING | PERF_FORMAT_ID
    a.read_format = fmt | (PERF_FORMAT_GROUP if group_read else 0)
    # Counting starts at open (disabled=0). exclude_hv: the hypervisor's cycles are not the container's,
    # and some PMUs reject counting them without privilege.
    a.flags = ATTR_FLAG_EXCLUDE_HV
    return a


def _syscall_number() -> int:
    nr = _NR_PERF_EVENT_OPEN.get(platform.machine())
    if nr is None:
        raise PerfOpenError(errno_mod.ENOSYS, f"perf_event_open: unknown syscall number on {platform.machine()}")
    return nr


def perf_event_open(attr: PerfEventAttr, pid: int, cpu: int, group_fd: int = -1, flags: int = 0) -> int:
    """Return a new event fd (close-on-exec) or raise :class:`PerfOpenError`."""
    fd = LIBC.syscall(ctypes.c_long(_syscall_number()), ctypes.byref(attr), ctypes.c_int(pid), ctypes.c_int(cpu),
                      ctypes.c_int(group_fd), ctypes.c_ulong(flags | PERF_FLAG_FD_CLOEXEC))
    if fd < 0:
        e = ctypes.get_errno()
        raise PerfOpenError(e, os.strerror(e))
    return int(fd)


def open_cgroup_event(attr: PerfEventAttr, cgroup_fd: int, cpu: int, group_fd: int = -1) -> int:
    return perf_event_open(attr, cgroup_fd, cpu, group_fd, PERF_FLAG_PID_CGROUP)


def event_id(fd: int) -> int:
    """The kernel's id of an event (PERF_EVENT_IOC_ID), the key of its value in a group read."""
    buf = bytearray(8)
    fcntl.ioctl(fd, PERF_EVENT_IOC_ID, buf, True)
    return struct.unpack("=Q", buf)[0]


def group_read_size(members: int) -> int:
    return 8 * 3 + 16 * members


def parse_group_read(data: bytes) -> GroupReading:
    """Decode ``{nr, time_enabled, time_running, {value, id}[nr]}``; raises ValueError on a short buffer."""
    if len(data) < 24:
        raise ValueError(f"perf group read too short: {len(data)} bytes")
    nr, enabled, running = struct.unpack_from("=QQQ", data, 0)
    if len(data) < group_read_size(nr):
        raise ValueError(f"perf group read of {len(data)} bytes cannot hold {nr} values")
    flat = struct.unpack_from(f"={2 * nr}Q", data, 24)  # value, id, value, id, ... in one call
    return GroupReading(enabled, running, dict(zip(flat[1::2], flat[0::2], strict=True)))


def read_group(fd: int, members: int) -> GroupReading:
    return parse_group_read(os.read(fd, group_read_size(members)))


def scale_count(value: int, time_enabled_ns: int, time_running_ns: int) -> float | None:
    """Estimate the full count of a multiplexed event: ``value * enabled / running``.

    perf_event_open(2), "time_enabled / time_running": when more events are open than the PMU has
    counters, the kernel time-slices them, and the ratio extrapolates. ``running == 0`` with
    ``enabled > 0`` means the event never got a counter: the count is unknown (None), not zero.
    ``enabled == 0`` (a cgroup event whose cgroup never ran on that CPU) is an exact zero.
    """
    if time_running_ns == 0:
        return 0.0 if time_enabled_ns == 0 and value == 0 else None
    if time_running_ns >= time_enabled_ns:
        return float(value)
    return value * (time_enabled_ns / time_running_ns)
