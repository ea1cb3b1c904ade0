"""``cri-resmgr demo``: labelled sample workloads in cgroups of their own, next to the agent, so the UI and /metrics
show live, meaningful data within a minute on any Linux machine (as root).

Workloads (namespace ``demo``, each its own pod):

- ``avx512-loop``: 512-bit FMAs in a loop, a small C program compiled with ``gcc -O2 -mavx512f`` into a temporary
  directory at start; without gcc (or on a CPU without AVX-512F) a numpy loop instead (numpy picks the widest
  SIMD the CPU has);
- ``scalar-loop``: a pure-Python integer loop (no vector state at all);
- ``membw-hog``: numpy copies between two 64 MiB arrays, larger than most L3 caches: memory bandwidth.

Each runs in ``<cgroup root>/cri-resmgr-demo/<name>`` (in every v1 controller hierarchy, and in the v2 tree —
on hybrid hosts in both, so eBPF attribution by cgroup id works) with a CFS quota (``--cpu-quota`` CPUs, so the
demo never takes a whole small machine), and is registered through ``collectors.cgroup.extra_cgroups``.
Ctrl-C (or SIGTERM) stops the agent, then the workloads, then removes the cgroups and the temporary directory.
cgroup files: Documentation/admin-guide/cgroup-v2.rst ("cgroup.procs", "cpu.max", "cgroup.subtree_control");
cgroup-v1/cgroups.rst and scheduler/sched-bwc.rst (``cpu.cfs_quota_us``); cgroup-v1/cpusets.rst.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from .collectors.cgroup import CgroupLayout, detect_layout
from .config import Config, ConfigError, load_config
from .exitcode import ExitCode
from .serve import serve

log = logging.getLogger("cri_resmgr.demo")

DEMO_DIR = "cri-resmgr-demo"
NAMESPACE = "demo"
CFS_PERIOD_US = 100_000

AVX512_C = r"""
/* cri-resmgr demo: 512-bit fused multiply-adds until killed. */
#include <immintrin.h>
int main(void) {
    __m512 a = _mm512_set1_ps(1.0001f), b = _mm512_set1_ps(0.9999f), c = _mm512_setzero_ps();
    for (;;) {
        for (int i = 0; i < 1 << 20; i++) c = _mm512_fmadd_ps(a, b, c);
        __asm__ volatile("" : "+v"(c));  /* keep the loop: the result is "used" */
    }
}
"""
NUMPY_VECTOR_LOOP = "import numpy as np\na = np.random.rand(512, 512)\nwhile True:\n    a = (a @ a) % 1.0\n"
SCALAR_LOOP = "x = 1\nwhile True:\n    x = (x * 1103515245 + 12345) & 0x7FFFFFFF\n"
MEMBW_HOG = ("import numpy as np\na = np.ones(8 << 20)\nb = np.empty_like(a)\n"
             "while True:\n    np.copyto(b, a)\n    np.copyto(a, b)\n")


def remove_cgroup_dirs(dirs, attempts: int = 50, delay_seconds: float = 0.1) -> list[str]:
    """rmdir each cgroup directory in order (children first); a cgroup whose tasks are still exiting
    answers EBUSY, so each is retried briefly. Returns the ones that could not be removed."""
    failed = []
    for d in dirs:
        for _ in range(attempts):
            try:
                d.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError:
                time.sleep(delay_seconds)
        else:
            failed.append(str(d))
    return failed


@dataclass
class Workload:
    name: str
    argv: list[str]
    how: str
    proc: subprocess.Popen | None = None


@dataclass
class DemoCgroups:
    layout: CgroupLayout
    roots: list[Path] = field(default_factory=list)  # hierarchies the workloads join
    created: list[Path] = field(default_factory=list)  # directories made, parents first

    @classmethod
    def for_layout(cls, layout: CgroupLayout) -> DemoCgroups:
        roots: list[Path] = []
        cands = [layout.root] if layout.version == 2 else [layout.cpuacct, layout.cpu, layout.memory, layout.cpuset,
                                                           layout.unified]
        for p in cands:
            if p is not None and p.resolve() not in [r.resolve() for r in roots]:
                roots.append(p)
        return cls(layout, roots)

    def _mkdir(self, d: Path, parent: Path) -> None:
        if d.exists():
            return
        d.mkdir()
        self.created.append(d)
        if (d / "cpuset.cpus").exists() and (parent / "cpuset.mems").exists() and self.layout.version == 1:
            # v1 cpusets start empty and refuse tasks until cpus and mems are set (cgroup-v1/cpusets.rst 1.4).
            (d / "cpuset.cpus").write_text((parent / "cpuset.cpus").read_text())
            (d / "cpuset.mems").write_text((parent / "cpuset.mems").read_text())

    def create(self, names: list[str], quota_cpus: float) -> None:
        for root in self.roots:
            top = root / DEMO_DIR
            if root == self.layout.root and self.layout.version == 2:
                _enable_controllers(root, ("cpu", "memory"))
            self._mkdir(top, root)
            if self.layout.version == 2 and root == self.layout.root:
                _enable_controllers(top, ("cpu", "memory"))
            for n in names:
                self._mkdir(top / n, top)
                if quota_cpus > 0:
                    quota = max(1000, int(quota_cpus * CFS_PERIOD_US))
                    if (top / n / "cpu.max").exists():
                        (top / n / "cpu.max").write_text(f"{quota} {CFS_PERIOD_US}\n")
                    elif (top / n / "cpu.cfs_quota_us").exists():
                        (top / n / "cpu.cfs_period_us").write_text(f"{CFS_PERIOD_US}\n")
                        (top / n / "cpu.cfs_quota_us").write_text(f"{quota}\n")

    def add(self, name: str, pid: int) -> None:
        for root in self.roots:
            (root / DEMO_DIR / name / "cgroup.procs").write_text(f"{pid}\n")

    def pids(self) -> set[int]:
        out: set[int] = set()
        for d in self.created:
            with contextlib.suppress(OSError, ValueError):  # gone already, or being removed
                out |= {int(x) for x in (d / "cgroup.procs").read_text().split()}
        return out

    def remove(self) -> list[str]:
        """rmdir children first; a cgroup with tasks cannot be removed, so retry briefly. Returns failures."""
        return remove_cgroup_dirs(reversed(self.created))


def _enable_controllers(cg: Path, names: tuple[str, ...]) -> None:
    avail = set((cg / "cgroup.controllers").read_text().split()) if (cg / "cgroup.controllers").exists() else set()
    want = [f"+{n}" for n in names if n in avail]
    if want:
        try:
            (cg / "cgroup.subtree_control").write_text(" ".join(want) + "\n")
        except OSError as e:
            log.warning("cannot enable %s in %s: %s", want, cg / "cgroup.subtree_control", e.strerror)


def cpu_has_avx512f(proc_root: Path) -> bool:
    """``avx512f`` in the flags of /proc/cpuinfo (Documentation/filesystems/proc.rst; arch/x86 cpufeatures)."""
    try:
        text = (proc_root / "cpuinfo").read_text()
    except OSError:
        return False
    return any(line.startswith("flags") and " avx512f" in line for line in text.splitlines())


def build_workloads(tmp: Path, proc_root: Path) -> list[Workload]:
    py = sys.executable
    gcc = shutil.which("gcc")
    avx: Workload | None = None
    if gcc and cpu_has_avx512f(proc_root):
        src, exe = tmp / "avx512_loop.c", tmp / "avx512_loop"
        src.write_text(AVX512_C)
        r = subprocess.run([gcc, "-O2", "-mavx512f", "-o", str(exe), str(src)], capture_output=True, text=True,
                           timeout=120)
        if r.returncode == 0:
            avx = Workload("avx512-loop", [str(exe)], f"C, compiled with {gcc} -O2 -mavx512f")
        else:
            log.warning("gcc could not build the AVX-512 loop (%s); using the numpy loop", r.stderr.strip()[:200])
    if avx is None:
        why = "no gcc" if not gcc else "CPU without AVX-512F" if not cpu_has_avx512f(proc_root) else "gcc failed"
        avx = Workload("avx512-loop", [py, "-c", NUMPY_VECTOR_LOOP], f"numpy matmul loop ({why})")
    return [
        avx,
        Workload("scalar-loop", [py, "-c", SCALAR_LOOP], "pure-Python integer loop"),
        Workload("membw-hog", [py, "-c", MEMBW_HOG], "numpy copies of 64 MiB arrays"),
    ]


def demo_config(user_config: Path | None, workloads: list[Workload]) -> dict:
    """The user's configuration file (if any) plus the demo's extra cgroups."""
    data = yaml.safe_load(Path(user_config).read_text()) if user_config else {}
    data = data or {}
    cg = data.setdefault("collectors", {}).setdefault("cgroup", {})
    extra = list(cg.get("extra_cgroups") or [])
    extra += [{"name": w.name, "path": f"{DEMO_DIR}/{w.name}", "namespace": NAMESPACE, "pod": w.name}
              for w in workloads]
    cg["extra_cgroups"] = extra
    return data


def stop_workloads(workloads: list[Workload], timeout: float = 5.0) -> None:
    for w in workloads:
        if w.proc and w.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(w.proc.pid, signal.SIGTERM)
    deadline = time.time() + timeout
    for w in workloads:
        if not w.proc:
            continue
        try:
            w.proc.wait(max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(w.proc.pid, signal.SIGKILL)
            w.proc.wait()


def run_demo(cfg: Config, config_path: Path | None, flags: dict, cpu_quota: float, clean: bool) -> int:
    """``cfg`` is the user's configuration (``config_path`` and ``flags`` applied); the agent runs with it plus the
    demo's workloads as extra cgroups."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if os.geteuid() != 0:
        print("cri-resmgr demo: needs root to create cgroups for its workloads", file=sys.stderr)
        return ExitCode.FAIL
    layout = detect_layout(cfg.paths.cgroup)
    if layout is None:
        print(f"cri-resmgr demo: no cgroup hierarchy with CPU accounting under {cfg.paths.cgroup}", file=sys.stderr)
        return ExitCode.FAIL
    cgroups = DemoCgroups.for_layout(layout)
    if clean:
        return clean_leftovers(cgroups)
    if any((r / DEMO_DIR).exists() for r in cgroups.roots):
        print(f"cri-resmgr demo: {cgroups.roots[0] / DEMO_DIR} exists: another demo is running, or one was "
              "killed (SIGKILL leaves no chance to clean up); stop it, or run `cri-resmgr demo --clean`",
              file=sys.stderr)
        return ExitCode.FAIL
    tmp = Path(tempfile.mkdtemp(prefix="cri-resmgr-demo-"))
    workloads: list[Workload] = []
    stopping: dict[str, int | None] = {"signal": None}

    def early_stop(signum, _frame):  # a signal during set-up: clean up instead of leaving cgroups behind
        stopping["signal"] = signum
        raise KeyboardInterrupt

    old = {s: signal.signal(s, early_stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        workloads = build_workloads(tmp, cfg.paths.proc)
        cgroups.create([w.name for w in workloads], cpu_quota)
        for w in workloads:
            # A session of its own: Ctrl-C reaches the demo only, which then stops the workloads in order.
            w.proc = subprocess.Popen(w.argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                      start_new_session=True)
            cgroups.add(w.name, w.proc.pid)
        conf = tmp / "demo-config.yaml"
        conf.write_text(yaml.safe_dump(demo_config(config_path, workloads), sort_keys=False))
        try:
            run_cfg = load_config(conf, flags=flags)
        except ConfigError as e:
            print(e.render(), file=sys.stderr)
            return ExitCode.CONFIG
        host, port = cfg.listen_address()
        shown = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
        quota = f"{cpu_quota:g} CPU each" if cpu_quota > 0 else "no CPU limit"
        print(f"\ncri-resmgr demo: {len(workloads)} workloads in {cgroups.roots[0] / DEMO_DIR} ({quota})", flush=True)
        for w in workloads:
            print(f"  {NAMESPACE}/{w.name}/{w.name}  pid {w.proc.pid if w.proc else '-'}  {w.how}", flush=True)
        print(f"  UI      http://{shown}:{port}/ui/\n  metrics http://{shown}:{port}/metrics\n"
              "  Ctrl-C stops the agent and the workloads and removes the cgroups.\n", flush=True)
        for s, h in old.items():
            signal.signal(s, h)
        rc: int = serve(run_cfg, conf, flags)  # returns on SIGINT/SIGTERM (its own handlers)
    except KeyboardInterrupt:
        rc = ExitCode.OK if stopping["signal"] else ExitCode.FAIL
    finally:
        for s in old:
            signal.signal(s, signal.SIG_IGN)  # a second Ctrl-C must not interrupt the clean-up
        stop_workloads(workloads)
        left = cgroups.remove()
        shutil.rmtree(tmp, ignore_errors=True)
        for s, h in old.items():
            signal.signal(s, h)
        if left:
            print(f"cri-resmgr demo: could not remove {', '.join(left)}", file=sys.stderr)
            rc = rc or ExitCode.FAIL
        else:
            print("cri-resmgr demo: workloads stopped, cgroups removed", flush=True)
    return rc


def clean_leftovers(cgroups: DemoCgroups) -> int:
    """Kill the tasks left in the demo's cgroups by a demo that was killed, then remove the cgroups."""
    found = []
    for root in cgroups.roots:
        top = root / DEMO_DIR
        if not top.is_dir():
            continue
        kids = [p for p in top.iterdir() if p.is_dir()]
        cgroups.created += [top] + kids  # parents first: remove() goes children first
        found.append(top)
    pids = cgroups.pids()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    left = cgroups.remove()
    if left:
        print(f"cri-resmgr demo: could not remove {', '.join(left)}", file=sys.stderr)
        return 1
    print(f"cri-resmgr demo: removed {len(found)} leftover demo cgroup tree(s), killed {len(pids)} task(s)")
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cpu-quota", type=float, default=0.5,
                   help="CFS quota of each workload in CPUs (default 0.5; 0: no limit)")
    p.add_argument("--clean", action="store_true",
                   help="remove the cgroups (and kill the workloads) a killed demo left behind, then exit")
