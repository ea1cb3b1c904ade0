"""Build hook: compile the AVX-512 CO-RE eBPF object into the wheel.

Everything else about the package is declared in pyproject.toml; this file only adds one step to ``build_py``:
``cri_resmgr/ebpf/avx512.bpf.c`` is compiled with clang against the BTF-derived header the project keeps for
x86_64 (``cri_resmgr/ebpf/x86_64/vmlinux.h``, CO-RE: libbpf relocates field offsets to the running kernel when
the agent loads it), so the build host needs clang and libbpf-dev's headers but neither BTF nor bpftool.

Without clang (or the libbpf headers) the build still succeeds and says loudly that the wheel has no object; the
agent then falls back to bcc or reports the avx512 collector down with the reason, and ``cri-resmgr --version``
shows the object as missing. Set ``CRI_RESMGR_REQUIRE_BPF=1`` to make a missing toolchain fail the build instead.
``make bpf`` compiles the same source with the same flags into the checkout (for editable installs).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

EBPF = Path("cri_resmgr") / "ebpf"
SOURCE = EBPF / "avx512.bpf.c"
OBJECT = "avx512.bpf.o"
VMLINUX_DIR = EBPF / "x86_64"  # the program hooks x86_fpu tracepoints: x86_64 is its only architecture
# -g: BTF and .BTF.ext (the CO-RE relocations) come from the debug info; keep in step with the Makefile's BPF_CFLAGS.
CFLAGS = ["-O2", "-g", "-target", "bpf", "-D__TARGET_ARCH_x86", "-Wall", "-Werror"]
LIBBPF_HEADER = Path("/usr/include/bpf/bpf_helpers.h")


def missing_toolchain(clang: str | None, include: Path) -> str | None:
    """Why the object cannot be built here, or None."""
    if clang is None:
        return "clang not found on PATH (Debian: apt install clang)"
    if not include.exists():
        return f"{include} not found (Debian: apt install libbpf-dev)"
    return None


class BuildPyWithBpf(build_py):
    """``build_py`` plus the CO-RE object: into build_lib for a wheel, into the source tree for an editable install."""

    def run(self) -> None:
        super().run()
        if self.editable_mode:
            self.compile_bpf(EBPF / OBJECT)
        else:
            obj = Path(self.build_lib) / EBPF / OBJECT
            obj.unlink(missing_ok=True)  # build_lib is reused between builds: never ship an earlier build's object
            self.compile_bpf(obj)

    def compile_bpf(self, obj: Path) -> None:
        clang = shutil.which("clang")
        why = missing_toolchain(clang, LIBBPF_HEADER)
        if why is not None:
            msg = (f"cri-resmgr: {obj.name} NOT BUILT: {why}. This build carries no AVX-512 eBPF object; the agent "
                   "will report the avx512 collector down (or use bcc where installed). Install clang and libbpf-dev "
                   "and rebuild to include it.")
            if os.environ.get("CRI_RESMGR_REQUIRE_BPF") == "1":
                raise SystemExit(msg)
            print("\n" + "!" * 100 + "\n" + msg + "\n" + "!" * 100 + "\n", file=sys.stderr)
            return
        assert clang is not None
        obj.parent.mkdir(parents=True, exist_ok=True)
        cmd = [clang, *CFLAGS, f"-I{VMLINUX_DIR}", f"-I{EBPF}", "-c", str(SOURCE), "-o", str(obj)]
        print("cri-resmgr: " + " ".join(cmd), file=sys.stderr)
        subprocess.run(cmd, check=True)


setup(cmdclass={"build_py": BuildPyWithBpf})
