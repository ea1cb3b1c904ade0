"""Cost of the AVX-512 eBPF collector, each figure next to a baseline measured in the same run.

1. Per event, from the kernel's own accounting: ``sysctl kernel.bpf_stats_enabled=1``, then ``run_time_ns /
   run_cnt`` of each program (``bpftool prog show id N``) while ``perf bench sched pipe`` and an AVX-512 loop
   run. Target <= 200 ns per event and program.
2. Whole system: ``perf bench sched pipe`` (Debian linux-perf) without and with the program attached,
   interleaved, medians; free-running and with both tasks pinned to one CPU (every op is then two context
   switches on that CPU: the worst case). bpf_stats is off here, as in production. Target <= 3 %.
   A third column attaches empty programs to the same two hooks (bench/avx512_empty.bpf.c, compiled here
   when clang is present): the floor that any program on these tracepoints pays for the kernel's dispatch.
3. Agent memory: VmRSS of ``cri-resmgr run`` with collectors.avx512 disabled and enabled (interleaved
   starts, medians), and the collector's run time from /api/v1/collectors. Target <= +40 MB.

Needs root, bpftool, perf, gcc and the object from ``make bpf``.

    sudo .venv/bin/python bench/avx512_bench.py [--reps 15] [--loops 20000]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _util  # noqa: F401  (puts the repo on sys.path)
import httpx
import yaml

from cri_resmgr.ebpf.avx512 import DEFAULT_OBJECT, LibbpfSource
from cri_resmgr.ebpf.libbpf import BpfObject

REPO = Path(__file__).resolve().parent.parent
WORKLOADS = REPO / "tests/integration/workloads"
EMPTY_SRC = Path(__file__).resolve().parent / "avx512_empty.bpf.c"
VMLINUX_H = REPO / "cri_resmgr/ebpf/x86_64/vmlinux.h"  # the BTF-derived header the wheel's build uses


def sh(*argv: str, **kw) -> str:
    return subprocess.run(argv, check=True, capture_output=True, text=True, **kw).stdout


def sysctl_get(key: str) -> str:
    return sh("sysctl", "-n", key).strip()


def sysctl_set(key: str, value: str) -> None:
    sh("sysctl", "-q", "-w", f"{key}={value}")


def pipe_usecs_per_op(loops: int, pin: str | None) -> float:
    argv = ["perf", "bench", "sched", "pipe", "-l", str(loops)]
    if pin is not None:
        argv = ["taskset", "-c", pin, *argv]
    out = sh(*argv)
    m = re.search(r"([\d.]+)\s+usecs/op", out)
    if not m:
        raise RuntimeError(f"unexpected perf bench output:\n{out}")
    return float(m.group(1))


def build_avx_loop(tmp: Path) -> Path:
    exe = tmp / "avx512_loop"
    sh("gcc", "-O2", "-mavx512f", "-o", str(exe), str(WORKLOADS / "avx512_loop.c"))
    return exe


def per_event_cost(loops: int, avx_loop: Path, empty: Path | None) -> dict[str, tuple[int, int]]:
    """The collector's programs and (baseline) the empty ones, attached together to the same workload."""
    old = sysctl_get("kernel.bpf_stats_enabled")
    sysctl_set("kernel.bpf_stats_enabled", "1")
    src = LibbpfSource(DEFAULT_OBJECT, 4096, key_by_tgid=False)
    base = BpfObject(empty) if empty else None
    try:
        if base:
            base.load()
            base.attach_all()
        avx = subprocess.Popen([str(avx_loop), "3"])
        for _ in range(3):
            pipe_usecs_per_op(loops, None)
        avx.wait()
        out = {}
        ids = {**src.obj.program_ids(), **(base.program_ids() if base else {})}
        for name, pid in ids.items():
            info = json.loads(sh("bpftool", "prog", "show", "id", str(pid), "--json"))
            out[name] = (int(info.get("run_time_ns", 0)), int(info.get("run_cnt", 0)))
        return out
    finally:
        src.close()
        if base:
            base.close()
        sysctl_set("kernel.bpf_stats_enabled", old)


def build_empty(tmp: Path) -> Path | None:
    if not (shutil.which("clang") and VMLINUX_H.exists()):
        return None
    out = tmp / "avx512_empty.bpf.o"
    sh("clang", "-O2", "-g", "-target", "bpf", "-D__TARGET_ARCH_x86", f"-I{VMLINUX_H.parent}", "-c", str(EMPTY_SRC),
       "-o", str(out))
    return out


def pipe_overhead(reps: int, loops: int, pin: str | None, empty: Path | None) -> dict[str, list[float]]:
    """Interleaved runs of each variant, the order reversed every other round."""
    variants = ["without", "collector"] + (["empty"] if empty else [])
    out: dict[str, list[float]] = {v: [] for v in variants}
    for i in range(reps):
        for v in (variants if i % 2 == 0 else variants[::-1]):
            if v == "collector":
                src = LibbpfSource(DEFAULT_OBJECT, 4096, key_by_tgid=False)
                try:
                    out[v].append(pipe_usecs_per_op(loops, pin))
                finally:
                    src.close()
            elif v == "empty":
                with BpfObject(empty) as obj:
                    obj.load()
                    obj.attach_all()
                    out[v].append(pipe_usecs_per_op(loops, pin))
            else:
                out[v].append(pipe_usecs_per_op(loops, pin))
    return out


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def agent_rss(tmp: Path, avx512: bool, settle: float) -> tuple[int, float | None, str]:
    port = _free_port()
    cfg = tmp / f"agent-{int(avx512)}.yaml"
    cfg.write_text(yaml.safe_dump({
        "listen": f"127.0.0.1:{port}", "state_dir": str(tmp / "state"), "run_dir": str(tmp / "run"),
        "store": {"checkpoint": False},
        "collectors": {"avx512": {"enabled": avx512, "interval_seconds": 1.0}},
    }))
    p = subprocess.Popen([sys.executable, "-m", "cri_resmgr.cli", "run", "--config", str(cfg)],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO)
    try:
        deadline = time.time() + 30
        while time.time() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        else:
            raise RuntimeError("agent not ready")
        time.sleep(settle)
        col = {c["name"]: c for c in httpx.get(f"http://127.0.0.1:{port}/api/v1/collectors").json()}.get("avx512", {})
        return rss_kib(p.pid), col.get("last_duration_seconds") if avx512 else None, col.get("reason", "")
    finally:
        p.terminate()
        p.wait(20)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--loops", type=int, default=20000)
    ap.add_argument("--rss-reps", type=int, default=3)
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("needs root (BPF load, sysctl)")
    for tool in ("perf", "bpftool", "gcc", "sysctl", "taskset"):
        if not shutil.which(tool):
            sys.exit(f"{tool} not found (apt: linux-perf bpftool gcc procps util-linux)")
    if not DEFAULT_OBJECT.exists():
        sys.exit(f"{DEFAULT_OBJECT} missing: run `make bpf`")
    tmp = Path(tempfile.mkdtemp(prefix="avx512-bench-"))
    try:
        avx_loop = build_avx_loop(tmp)
        empty = build_empty(tmp)
        print("== per-event cost (kernel bpf_stats: run_time_ns / run_cnt; empty_* = baseline on the same hooks) ==")
        print(f"{'program':<16}{'events':>12}{'run_time_ms':>14}{'ns/event':>10}   target")
        for name, (ns, cnt) in per_event_cost(args.loops, avx_loop, empty).items():
            target = "" if name.startswith("empty") else "<= 200"
            print(f"{name:<16}{cnt:>12}{ns / 1e6:>14.1f}{(ns / cnt if cnt else float('nan')):>10.1f}   {target}")

        print(f"\n== perf bench sched pipe -l {args.loops}, {args.reps} interleaved reps, median usecs/op ==")
        print(f"{'mode':<18}{'without':>9}{'collector':>11}{'slowdown':>10}{'empty progs':>13}{'slowdown':>10}"
              "   (target <= 3 %)")
        for label, pin in (("free-running", None), ("pinned to cpu 0", "0")):
            r = pipe_overhead(args.reps, args.loops, pin, empty)
            b, w = statistics.median(r["without"]), statistics.median(r["collector"])
            e = statistics.median(r["empty"]) if empty else float("nan")
            print(f"{label:<18}{b:>9.3f}{w:>11.3f}{(w / b - 1) * 100:>9.1f}%{e:>13.3f}{(e / b - 1) * 100:>9.1f}%"
                  f"   spread without {min(r['without']):.2f}-{max(r['without']):.2f}")
        if empty is None:
            print("(empty-program baseline skipped: needs clang and libbpf-dev)")

        print(f"\n== agent VmRSS, {args.rss_reps} interleaved starts each, median ==")
        off, on, dur, reason = [], [], [], ""
        for _ in range(args.rss_reps):
            off.append(agent_rss(tmp, False, 3.0)[0])
            r, d, reason = agent_rss(tmp, True, 3.0)
            on.append(r)
            if d is not None:
                dur.append(d)
        mo, mn = statistics.median(off), statistics.median(on)
        print(f"{'avx512 disabled':<22}{mo / 1024:>8.1f} MiB")
        print(f"{'avx512 enabled':<22}{mn / 1024:>8.1f} MiB   (+{(mn - mo) / 1024:.1f} MiB; target <= +40; {reason})")
        if dur:
            print(f"{'collect() run time':<22}{statistics.median(dur) * 1e3:>8.2f} ms (median of the last runs)")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
