"""Which optional parts this installation has (``cri-resmgr --version``).

The agent runs without any of them and reports the affected collector or feature down with the reason; this
answers "what did this install get" before it runs: whether the wheel carried the AVX-512 CO-RE object (it does
when its build host had clang), whether the system libbpf loads, whether bcc (the AVX-512 fallback) and highspy
(the rebalancer's exact optimum) are importable. Nothing here imports the heavy modules: probing bcc would load
LLVM.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from dataclasses import dataclass


@dataclass(frozen=True)
class Part:
    name: str
    present: bool
    detail: str


def _ebpf_object() -> Part:
    from .ebpf.avx512 import DEFAULT_OBJECT

    if DEFAULT_OBJECT.exists():
        return Part("ebpf-object", True, f"{DEFAULT_OBJECT} ({DEFAULT_OBJECT.stat().st_size} bytes)")
    return Part("ebpf-object", False, f"{DEFAULT_OBJECT} missing (built with clang + libbpf-dev: `make bpf` or "
                                      "rebuild the wheel on a host with clang)")


def _libbpf() -> Part:
    from .ebpf.libbpf import SONAME, Libbpf, LibbpfError

    try:
        lb = Libbpf()
    except LibbpfError as e:
        return Part("libbpf", False, str(e))
    try:
        return Part("libbpf", True, f"{SONAME} {lb.version()}")
    except AttributeError:  # libbpf < 0.7 has no libbpf_version_string()
        return Part("libbpf", True, SONAME)


def _bcc() -> Part:
    from .ebpf.avx512 import find_bcc

    where = find_bcc()
    return Part("bcc", where is not None, str(where) if where else "not installed (Debian package python3-bpfcc)")


def _python_package(dist: str, module: str, why: str) -> Part:
    if importlib.util.find_spec(module) is None:
        return Part(dist, False, f"not installed ({why})")
    try:
        return Part(dist, True, importlib.metadata.version(dist))
    except importlib.metadata.PackageNotFoundError:
        return Part(dist, True, "installed")


def optional_parts() -> list[Part]:
    return [
        _ebpf_object(),
        _libbpf(),
        _bcc(),
        _python_package("highspy", "highspy", "the rebalancer's exact optimum: pip install 'cri-resmgr[bench]'"),
    ]


def render(version: str) -> str:
    lines = [f"cri-resmgr {version}"]
    lines += [f"  {p.name:<12} {'yes' if p.present else 'no ':<3}  {p.detail}" for p in optional_parts()]
    return "\n".join(lines)
