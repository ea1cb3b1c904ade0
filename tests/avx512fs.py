"""Fake sysfs/procfs trees for the AVX-512 capability probe and pid attribution, in the kernel's formats:

- ``sys/kernel/btf/vmlinux``: raw BTF, header + type + string sections (include/uapi/linux/btf.h,
  Documentation/bpf/btf.rst); types are left empty, only the string section matters to the probe;
- ``sys/kernel/tracing/events/<system>/<event>/format`` (Documentation/trace/events.rst, "Event formats");
- ``proc/self/status`` ``CapEff`` (Documentation/filesystems/proc.rst), ``proc/cpuinfo`` ``flags``,
  ``proc/sys/kernel/osrelease``, ``proc/<pid>/cgroup`` (man 7 cgroups).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path

ALL_CAPS = (1 << 41) - 1  # CapEff of root on a 6.x kernel: capabilities 0..40
CAP_BPF_PERFMON = (1 << 39) | (1 << 38)
TRACEPOINT_NAMES = ["btf_trace_x86_fpu_regs_deactivated", "btf_trace_sched_switch"]


def make_btf(names: list[str]) -> bytes:
    strings = b"\0" + b"".join(n.encode() + b"\0" for n in ["int", "fpu", *names])
    hdr_len = 24
    return struct.pack("<HBBIIIII", 0xEB9F, 1, 0, hdr_len, 0, 0, 0, len(strings)) + strings


@dataclass
class Host:
    release: str = "6.18.44-fc-v1045"
    cap_eff: int = ALL_CAPS
    cpu_flags: str = "fpu vme de pse tsc msr pae mce cx8 apic sse sse2 avx avx2 avx512f avx512dq avx512cd avx512bw"
    btf_names: list[str] | None = field(default_factory=lambda: list(TRACEPOINT_NAMES))  # None: no BTF
    tracefs_events: list[str] | None = field(default_factory=lambda: ["x86_fpu/x86_fpu_regs_deactivated",
                                                                      "sched/sched_switch"])  # None: unmounted
    kheaders: bool = False


def _w(p: Path, data: str | bytes) -> None:
    p.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, bytes):
        p.write_bytes(data)
    else:
        p.write_text(data)


def make_host(root: Path, h: Host) -> tuple[Path, Path]:
    """Write sys/ and proc/ under root; returns (sysfs, proc)."""
    sysfs, proc = root / "sys", root / "proc"
    sysfs.mkdir(parents=True, exist_ok=True)
    proc.mkdir(parents=True, exist_ok=True)
    _w(proc / "sys/kernel/osrelease", h.release + "\n")
    _w(proc / "self/status", f"Name:\tcri-resmgr\nUid:\t0\t0\t0\t0\nCapInh:\t0000000000000000\n"
                             f"CapPrm:\t{h.cap_eff:016x}\nCapEff:\t{h.cap_eff:016x}\nCapBnd:\t{ALL_CAPS:016x}\n")
    cpu = "processor\t: {n}\nvendor_id\t: GenuineIntel\nmodel name\t: Intel(R) Xeon(R)\nflags\t\t: {f}\n\n"
    _w(proc / "cpuinfo", "".join(cpu.format(n=n, f=h.cpu_flags) for n in range(2)))
    if h.btf_names is not None:
        _w(sysfs / "kernel/btf/vmlinux", make_btf(h.btf_names))
    if h.tracefs_events is not None:
        (sysfs / "kernel/tracing/events").mkdir(parents=True, exist_ok=True)
        for ev in h.tracefs_events:
            _w(sysfs / "kernel/tracing/events" / ev / "format", f"name: {ev.split('/')[1]}\nID: 1\nformat:\n")
    if h.kheaders:
        _w(sysfs / "kernel/kheaders.tar.xz", b"\xfd7zXZ\0")
    return sysfs, proc


def add_process(proc: Path, pid: int, v1_paths: dict[str, str], v2_path: str = "/") -> None:
    """``/proc/<pid>/cgroup`` for a process on a v1 host: one line per hierarchy (controllers joined by ',')."""
    lines = [f"{i + 1}:{ctrls}:{path}" for i, (ctrls, path) in enumerate(v1_paths.items())]
    lines.append(f"0::{v2_path}")
    _w(proc / str(pid) / "cgroup", "\n".join(lines) + "\n")
