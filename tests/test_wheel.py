"""The ordinary build gives the whole agent: a wheel built by ``pip wheel`` (from the sdist) carries the AVX-512
CO-RE object (compiled by setup.py's build hook against cri_resmgr/ebpf/x86_64/vmlinux.h), and once installed into a
fresh venv the program loads, attaches and counts through the installed package, and the agent's avx512 collector
attaches on its defaults, with the checkout off sys.path and no build tool on PATH. The build runs on a copy of the
sources, so the checkout's own build/ and object are not used."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
LIBBPF_HEADER = Path("/usr/include/bpf/bpf_helpers.h")
OBJECT = "cri_resmgr/ebpf/avx512.bpf.o"

# Run by the fresh venv's interpreter from a directory outside the checkout: the package must come from the venv.
LOAD_SCRIPT = """
import json, subprocess, sys
import cri_resmgr
from cri_resmgr.ebpf import avx512 as A
src = A.LibbpfSource(A.DEFAULT_OBJECT, 1024, key_by_tgid=True)
try:
    p = subprocess.Popen([sys.executable, "-c", "import time\\nfor _ in range(50): time.sleep(0.002)"])
    p.wait()
    mine = [c.switches for k, c in src.read().counts.items() if k.tgid == p.pid]
finally:
    src.close()
# The agent's avx512 collector on its defaults (libbpf only: no bcc fallback may hide a missing object).
from cri_resmgr.collectors.avx512 import Avx512Collector
from cri_resmgr.config import build_config
from cri_resmgr.topology import discover
cfg = build_config({"collectors": {"avx512": {"loader": "libbpf"}}}, env={"NODE_NAME": "wheel-test"})
col = Avx512Collector(cfg.collectors.avx512, cfg.paths, discover(cfg.paths.sysfs))
probe = col.probe()
collector = {"ok": probe.ok, "reason": probe.reason, "source": type(col.source).__name__}
col.close()
print(json.dumps({"package": cri_resmgr.__file__, "object": str(A.DEFAULT_OBJECT), "attached": src.attached,
                  "switches": mine, "path": sys.path, "collector": collector}))
"""


def _has_avx512f() -> bool:
    return any(line.startswith("flags") and "avx512f" in line.split()
               for line in Path("/proc/cpuinfo").read_text().splitlines())


def _copy_sources(dst: Path) -> Path:
    """What an sdist holds (pyproject.toml, setup.py, README.md, the package), minus any object built in place."""
    for f in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy2(REPO / f, dst / f)
    shutil.copytree(REPO / "cri_resmgr", dst / "cri_resmgr",
                    ignore=shutil.ignore_patterns("__pycache__", "*.bpf.o", "*.pyc"))
    return dst


def _build_wheel(src: Path, out: Path, env: dict[str, str] | None = None, isolated: bool = True) -> tuple[Path, str]:
    """``pip wheel`` of a source tree or an sdist: an isolated PEP 517 build, as a user would run it, or (quicker,
    for the tests of setup.py's own messages) with this venv's setuptools."""
    isolation = [] if isolated else ["--no-build-isolation"]
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", *isolation, "-w", str(out), str(src)],
                       capture_output=True, text=True, timeout=180, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    (wheel,) = out.glob("cri_resmgr-*.whl")
    return wheel, r.stdout + r.stderr


def _venv_builds_wheels() -> bool:
    """This venv's setuptools can build the wheel itself (>= 70.1 has bdist_wheel built in; older ones need the
    wheel package), so a test of setup.py's messages can skip the isolated environment's set-up. Asked of a fresh
    interpreter in an empty directory, so that nothing on this process's path (a folder named ``wheel``) answers."""
    probe = "try:\n import setuptools.command.bdist_wheel\nexcept ImportError:\n import wheel.bdist_wheel"
    with tempfile.TemporaryDirectory() as empty:
        return subprocess.run([sys.executable, "-I", "-c", probe], cwd=empty, capture_output=True,
                              timeout=60).returncode == 0


@pytest.mark.integration
def test_wheel_carries_the_co_re_object_and_loads_it_from_a_fresh_venv(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("loading BPF programs needs root (CAP_BPF+CAP_PERFMON)")
    if shutil.which("clang") is None or not LIBBPF_HEADER.exists():
        pytest.skip("building the object needs clang and libbpf-dev (apt: clang libbpf-dev)")
    from cri_resmgr.ebpf.probe import probe_capabilities

    # What this host must offer to load any CO-RE program (the object itself is what the test builds).
    caps = probe_capabilities(Path("/sys"), Path("/proc"), REPO / OBJECT, Path("/lib/modules"))
    problems = [c.reason for c in (caps.kernel, caps.privileges, caps.btf, caps.libbpf) if not c.ok]
    if problems:
        pytest.skip("; ".join(problems))

    (tmp_path / "src").mkdir()
    src = _copy_sources(tmp_path / "src")
    # sdist first, then the wheel from it (what `python -m build` does): the sdist must carry setup.py and the header
    r = subprocess.run([sys.executable, "-c", "import sys; from setuptools import build_meta as b; "
                        "print(b.build_sdist(sys.argv[1]))", str(tmp_path / "sdist")], cwd=src, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    sdist = tmp_path / "sdist" / r.stdout.split()[-1]
    wheel, _ = _build_wheel(sdist, tmp_path / "dist")
    with zipfile.ZipFile(wheel) as z:
        head = z.read(OBJECT)[:20]
        assert head[:4] == b"\x7fELF" and head[18] == 247  # e_machine EM_BPF (include/uapi/linux/elf-em.h)
        assert "cri_resmgr/ebpf/x86_64/vmlinux.h" in z.namelist()

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    py = venv / "bin" / "python"
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                               capture_output=True, text=True, check=True).stdout.strip())
    # The wheel goes in with the main venv's pip (--no-deps, no network); its dependencies (numpy, pydantic, ...)
    # come from the main venv's site-packages, appended after the fresh one. A path added by a .pth line is not a
    # site directory, so the main venv's editable-install hook (another .pth) does not run: the checkout stays out.
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile", "--target", str(site),
                    str(wheel)], check=True, timeout=120, capture_output=True)
    (site / "zz_main_venv_deps.pth").write_text(sysconfig.get_path("purelib") + "\n")

    run_dir = tmp_path / "elsewhere"
    run_dir.mkdir()
    # No build tool reachable: PATH holds only the fresh venv's bin.
    env = {"PATH": str(venv / "bin"), "HOME": str(tmp_path), "LANG": "C.UTF-8"}
    r = subprocess.run([str(py), "-c", LOAD_SCRIPT], cwd=run_dir, env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert Path(got["package"]).is_relative_to(site), got["package"]
    assert Path(got["object"]) == site / OBJECT
    assert REPO not in [Path(p or run_dir).resolve() for p in got["path"]], got["path"]  # '' is the cwd
    assert sorted(got["attached"]) == ["tp_btf/sched_switch", "tp_btf/x86_fpu_regs_deactivated"]
    assert got["switches"] and got["switches"][0] >= 50, got  # each sleep switches the child out
    if _has_avx512f():
        assert got["collector"]["ok"] and got["collector"]["source"] == "LibbpfSource", got["collector"]
    else:  # machines of this kind differ: on a CPU without AVX-512 the collector is down for that reason alone
        assert not got["collector"]["ok"] and "CPU without avx512f" in got["collector"]["reason"], got["collector"]

    # The console script reports the object and libbpf as present.
    script = site / "bin" / "cri-resmgr"  # pip --target puts console scripts there; run it with the fresh venv's python
    v = subprocess.run([str(py), str(script), "--version"], cwd=run_dir, env=env, capture_output=True, text=True,
                       timeout=60)
    assert v.returncode == 0, v.stderr
    lines = {ln.split()[0]: ln.split()[1] for ln in v.stdout.splitlines()[1:]}
    assert lines["ebpf-object"] == "yes" and lines["libbpf"] == "yes", v.stdout
    assert str(site / OBJECT) in v.stdout


def test_wheel_without_clang_says_the_object_is_missing(tmp_path):
    """A build host without clang still builds the wheel, without the object, and says so."""
    src = _copy_sources(tmp_path)
    no_tools = tmp_path / "bin"
    no_tools.mkdir()
    env = {**os.environ, "PATH": str(no_tools)}
    wheel, log = _build_wheel(src, tmp_path / "dist", env, isolated=not _venv_builds_wheels())
    assert "avx512.bpf.o NOT BUILT: clang not found" in log
    with zipfile.ZipFile(wheel) as z:
        assert OBJECT not in z.namelist()
    isolation = [] if not _venv_builds_wheels() else ["--no-build-isolation"]
    strict = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", *isolation, "-q", "-w",
                             str(tmp_path / "d2"), str(src)], capture_output=True, text=True, timeout=180,
                            env={**env, "CRI_RESMGR_REQUIRE_BPF": "1"})
    assert strict.returncode != 0 and "NOT BUILT" in strict.stdout + strict.stderr


def test_version_lists_each_optional_part_as_this_install_has_it():
    from cri_resmgr import __version__
    from cri_resmgr.ebpf.avx512 import DEFAULT_OBJECT, find_bcc

    r = subprocess.run([sys.executable, "-m", "cri_resmgr.cli", "--version"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    first, *rest = r.stdout.splitlines()
    assert first == f"cri-resmgr {__version__}"
    got = {ln.split()[0]: ln.split()[1] for ln in rest}
    assert set(got) == {"ebpf-object", "libbpf", "bcc", "highspy"}
    assert got["ebpf-object"] == ("yes" if DEFAULT_OBJECT.exists() else "no")
    assert got["bcc"] == ("yes" if find_bcc() else "no")
    try:
        import highspy  # noqa: F401
        assert got["highspy"] == "yes"
    except ImportError:
        assert got["highspy"] == "no"
