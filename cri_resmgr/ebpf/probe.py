"""Can the AVX-512 program run here, and with which loader? Every check reports a reason instead of
raising, and reads only under the configured roots (``paths.sysfs``, ``paths.proc``), so tests feed
fixture trees for the negative cases.

Parsing is kept apart from reading: ``parse_*`` functions take text or bytes.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from ..sysfs import read_text
from .avx512 import find_bcc
from .libbpf import Libbpf, LibbpfError

# Why 5.11: bpf_get_current_task_btf() (5.11) in the CO-RE program; before that: CAP_BPF and CAP_PERFMON
# (5.8), tp_btf programs (5.5), kernel BTF in /sys/kernel/btf/vmlinux (5.4), bpf_get_current_cgroup_id()
# (4.18). Kernels before 5.16 keep the FPU registers inside struct fpu (no fpstate); the CO-RE program has
# a branch for that. Only 6.18 is tested here.
MIN_KERNEL = (5, 11)

# include/uapi/linux/capability.h
CAP_SYS_ADMIN = 21
CAP_PERFMON = 38
CAP_BPF = 39

TRACEPOINTS = (("x86_fpu", "x86_fpu_regs_deactivated"), ("sched", "sched_switch"))
BTF_MAGIC = 0xEB9F
# include/uapi/linux/btf.h struct btf_header: magic u16, version u8, flags u8, hdr_len, type_off, type_len,
# str_off, str_len (u32 each); Documentation/bpf/btf.rst, "2.1 String Encoding"/"4.1 .BTF section".
_BTF_HEADER = struct.Struct("<HBBIIIII")


@dataclass(frozen=True)
class Check:
    ok: bool
    reason: str = ""


OK = Check(True)


# -- parsers --------------------------------------------------------------------------------------------
def parse_cap_eff(status_text: str) -> int | None:
    """``CapEff:`` of /proc/<pid>/status, a hex mask (Documentation/filesystems/proc.rst, table 1-2)."""
    m = re.search(r"^CapEff:\s*([0-9a-fA-F]+)\s*$", status_text, re.M)
    return int(m.group(1), 16) if m else None


def parse_kernel_release(text: str) -> tuple[int, int, int]:
    """``6.18.44-fc-v1045`` -> (6, 18, 44); /proc/sys/kernel/osrelease (= uname -r). ValueError if not
    starting with a version."""
    m = re.match(r"\s*(\d+)\.(\d+)(?:\.(\d+))?", text)
    if not m:
        raise ValueError(f"kernel release {text.strip()!r} does not start with MAJOR.MINOR")
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


def parse_cpu_flags(cpuinfo_text: str) -> frozenset[str]:
    """Flags of the first processor in /proc/cpuinfo (x86: ``flags : fpu vme ... avx512f ...``; the names
    are arch/x86/include/asm/cpufeatures.h's, as printed by arch/x86/kernel/cpu/proc.c)."""
    for line in cpuinfo_text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


def btf_has_names(data: bytes, names: list[str]) -> dict[str, bool]:
    """Whether each name is in the string section of a raw BTF blob (/sys/kernel/btf/vmlinux).
    Raises ValueError on a blob that is not BTF."""
    if len(data) < _BTF_HEADER.size:
        raise ValueError(f"BTF too short ({len(data)} bytes)")
    magic, version, _flags, hdr_len, _toff, _tlen, str_off, str_len = _BTF_HEADER.unpack_from(data)
    if magic != BTF_MAGIC:
        raise ValueError(f"not BTF: magic {magic:#06x}, expected {BTF_MAGIC:#06x}")
    start = hdr_len + str_off
    if version != 1 or start + str_len > len(data):
        raise ValueError(f"unsupported or truncated BTF (version {version}, strings end at {start + str_len} "
                         f"of {len(data)} bytes)")
    strings = data[start:start + str_len]
    return {n: (b"\0" + n.encode() + b"\0") in strings for n in names}


# -- checks ---------------------------------------------------------------------------------------------
def _stat_ok(p: Path, test: str) -> bool:
    """Path.is_dir()/exists() raise on EACCES (tracefs is root-only): a path we cannot see is absent."""
    try:
        return bool(getattr(p, test)())
    except OSError:
        return False


def check_kernel(proc: Path) -> tuple[Check, tuple[int, int, int] | None, str]:
    text = read_text(proc / "sys/kernel/osrelease")
    if text is None:
        return Check(False, f"cannot read {proc / 'sys/kernel/osrelease'}"), None, ""
    release = text.strip()
    try:
        version = parse_kernel_release(release)
    except ValueError as e:
        return Check(False, str(e)), None, release
    if version[:2] < MIN_KERNEL:
        return (Check(False, f"kernel {release} is older than the minimum {MIN_KERNEL[0]}.{MIN_KERNEL[1]}"),
                version, release)
    return OK, version, release


def check_privileges(proc: Path, version: tuple[int, int, int] | None) -> Check:
    text = read_text(proc / "self/status")
    caps = parse_cap_eff(text or "")
    if caps is None:
        return Check(False, f"cannot read CapEff from {proc / 'self/status'}")
    have = lambda c: bool(caps >> c & 1)  # noqa: E731
    if have(CAP_SYS_ADMIN):
        return OK
    if version is not None and version[:2] >= (5, 8) and have(CAP_BPF) and have(CAP_PERFMON):
        return OK
    missing = [n for c, n in ((CAP_BPF, "CAP_BPF"), (CAP_PERFMON, "CAP_PERFMON")) if not have(c)]
    need = "CAP_BPF+CAP_PERFMON or CAP_SYS_ADMIN" if version is None or version[:2] >= (5, 8) else "CAP_SYS_ADMIN"
    return Check(False, f"not root and no {need} (missing {', '.join(missing) or 'CAP_SYS_ADMIN'}; "
                        f"CapEff={caps:016x})")


def check_cpu(proc: Path) -> Check:
    text = read_text(proc / "cpuinfo")
    if text is None:
        return Check(False, f"cannot read {proc / 'cpuinfo'}")
    if "avx512f" not in parse_cpu_flags(text):
        return Check(False, f"CPU without avx512f in {proc / 'cpuinfo'} flags: no AVX-512 to count")
    return OK


def check_btf(sysfs: Path) -> Check:
    """Kernel BTF present, and it describes both tracepoints (tp_btf attaches by ``btf_trace_<name>``)."""
    path = sysfs / "kernel/btf/vmlinux"
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return Check(False, f"no kernel BTF at {path} (kernel built without CONFIG_DEBUG_INFO_BTF)")
    except OSError as e:
        return Check(False, f"cannot read kernel BTF {path}: {e.strerror}")
    names = [f"btf_trace_{tp}" for _, tp in TRACEPOINTS]
    try:
        found = btf_has_names(data, names)
    except ValueError as e:
        return Check(False, f"{path}: {e}")
    missing = [n.removeprefix("btf_trace_") for n, ok in found.items() if not ok]
    if missing:
        return Check(False, f"tracepoint {', '.join(missing)} missing: not in kernel BTF {path}")
    return OK


def tracefs_events(sysfs: Path) -> Path | None:
    """tracefs is mounted at /sys/kernel/tracing (and under debugfs at /sys/kernel/debug/tracing);
    Documentation/trace/ftrace.rst, "The File System"."""
    for d in (sysfs / "kernel/tracing/events", sysfs / "kernel/debug/tracing/events"):
        if _stat_ok(d, "is_dir"):
            return d
    return None


def check_tracefs(sysfs: Path) -> Check:
    events = tracefs_events(sysfs)
    if events is None:
        return Check(False, f"tracefs not mounted or not readable at {sysfs / 'kernel/tracing'} "
                            "(mount -t tracefs nodev /sys/kernel/tracing)")
    missing = [f"{sys_}/{tp}" for sys_, tp in TRACEPOINTS if not _stat_ok(events / sys_ / tp / "format", "exists")]
    if missing:
        return Check(False, f"tracepoint {', '.join(missing)} missing from {events}")
    return OK


def check_libbpf() -> Check:
    try:
        Libbpf()
    except LibbpfError as e:
        return Check(False, str(e))
    return OK


def check_object(path: Path) -> Check:
    if not _stat_ok(path, "is_file"):
        return Check(False, f"BPF object {path} not built (run `make bpf`, or build the wheel where clang and "
                            "libbpf-dev are installed)")
    return OK


def check_bcc() -> Check:
    return OK if find_bcc() is not None else Check(False, "bcc is not installed (Debian package python3-bpfcc)")


def check_kernel_headers(modules_dir: Path, release: str, sysfs: Path) -> Check:
    """bcc compiles against /lib/modules/<release>/build (or .../source), or the in-kernel headers archive
    /sys/kernel/kheaders.tar.xz (CONFIG_IKHEADERS, init/Kconfig; kernel/kheaders.c)."""
    if release:
        for sub in ("build", "source"):
            if _stat_ok(modules_dir / release / sub / "include", "is_dir"):
                return OK
    if _stat_ok(sysfs / "kernel/kheaders.tar.xz", "exists"):
        return OK
    build = modules_dir / (release or "?") / "build"
    return Check(False, f"no kernel headers for {release or 'this kernel'} in {build} "
                        f"and no {sysfs / 'kernel/kheaders.tar.xz'} (CONFIG_IKHEADERS)")


@dataclass(frozen=True)
class CapabilityReport:
    release: str
    kernel: Check
    privileges: Check
    cpu: Check
    btf: Check
    libbpf: Check
    object: Check
    tracefs: Check
    bcc: Check
    kernel_headers: Check

    def common(self) -> list[str]:
        return [c.reason for c in (self.kernel, self.privileges, self.cpu) if not c.ok]

    def libbpf_problems(self) -> list[str]:
        return [c.reason for c in (self.btf, self.libbpf, self.object) if not c.ok]

    def bcc_problems(self) -> list[str]:
        return [c.reason for c in (self.bcc, self.kernel_headers, self.tracefs) if not c.ok]


def probe_capabilities(sysfs: Path, proc: Path, object_path: Path, modules_dir: Path) -> CapabilityReport:
    sysfs, proc = Path(sysfs), Path(proc)
    kernel, version, release = check_kernel(proc)
    return CapabilityReport(
        release=release,
        kernel=kernel,
        privileges=check_privileges(proc, version),
        cpu=check_cpu(proc),
        btf=check_btf(sysfs),
        libbpf=check_libbpf(),
        object=check_object(Path(object_path)),
        tracefs=check_tracefs(sysfs),
        bcc=check_bcc(),
        kernel_headers=check_kernel_headers(Path(modules_dir), release, sysfs),
    )


Loader = Literal["libbpf", "bcc"]


@dataclass(frozen=True)
class LoaderChoice:
    loader: Loader | None
    reason: str  # why this loader, or why none


def choose_loader(preference: Literal["auto", "libbpf", "bcc"], report: CapabilityReport) -> LoaderChoice:
    """libbpf (CO-RE) first; bcc only where libbpf cannot work and bcc can (or when asked for)."""
    common = report.common()
    if common:
        return LoaderChoice(None, "; ".join(common))
    lp, bp = report.libbpf_problems(), report.bcc_problems()
    if preference in ("auto", "libbpf") and not lp:
        return LoaderChoice("libbpf", "libbpf CO-RE object")
    if preference == "libbpf":
        return LoaderChoice(None, "libbpf loader: " + "; ".join(lp))
    if not bp:
        why = "configured" if preference == "bcc" else "libbpf unusable: " + "; ".join(lp)
        return LoaderChoice("bcc", f"bcc fallback ({why})")
    if preference == "bcc":
        return LoaderChoice(None, "bcc loader: " + "; ".join(bp))
    return LoaderChoice(None, "no usable loader: libbpf: " + "; ".join(lp) + " | bcc: " + "; ".join(bp))
