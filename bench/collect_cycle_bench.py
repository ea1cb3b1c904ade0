"""One full collection cycle (cgroup + perf + RDT + SST) for 200 containers: CPU time per cycle, CPU share
at a 1 s interval, resident memory; side by side with the cgroup collector alone, measured in the same run.

Set-up (this process plays "the machine"):
- 200 container cgroups. As root they are real (kubepods/burstable/pod<uid>/<id> in every v1 controller
  and in the hierarchy that carries perf_event), each holding one sleeping process, so perf opens real
  software-event groups per (cgroup, CPU) and RDT syncs real thread ids. Without root: a fixture cgroup
  tree (tests/cgroupfs.py) and no perf.
- resctrl: the FUSE emulator (tests/resctrlfs.py, root only), 2 L3 domains, counters advancing.
- sysfs: the 2-socket SST-BF fixture xeon-2s-112c-snc2 (224 CPUs) for the SST collector.

Each variant runs in a child process ("the agent"): 3 warm-up cycles (perf opens, RDT makes its MON groups),
then timed cycles back to back, writing every sample into the store like the agent does. The emulator's
FUSE server runs in this process, so its work is not charged to the child; real resctrl reads cost a
kernel IPI per file instead.

    sudo .venv/bin/python bench/collect_cycle_bench.py [--containers 200] [--cycles 10]
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import _util  # noqa: F401  (puts the repo on sys.path)

REPO = Path(__file__).resolve().parent.parent
SW_AND_HW_EVENTS = ["cycles", "instructions", "cache-references", "cache-misses", "cpu-clock", "context-switches",
                    "page-faults"]


def _rss_kib() -> int:
    lines = Path("/proc/self/status").read_text().splitlines()
    return int(next(ln.split()[1] for ln in lines if ln.startswith("VmRSS:")))


def child(spec: dict) -> None:
    from cri_resmgr.collectors.cgroup import CgroupCollector
    from cri_resmgr.collectors.perf import PerfCollector
    from cri_resmgr.collectors.rdt import RdtCollector
    from cri_resmgr.collectors.sst import SstCollector
    from cri_resmgr.config import CgroupCollectorConfig, PerfCollectorConfig, RdtCollectorConfig, SstCollectorConfig
    from cri_resmgr.store import Columns, Store
    from cri_resmgr.topology import discover

    rss_imports = _rss_kib()
    cgroup_root = Path(spec["cgroup_root"])
    cg = CgroupCollector(cgroup_root, CgroupCollectorConfig())
    cols = {"cgroup": cg}
    if "perf" in spec["collectors"]:
        cols["perf"] = PerfCollector(cgroup_root, PerfCollectorConfig(events=SW_AND_HW_EVENTS), cg,
                                     discover(Path("/sys")))
    if "rdt" in spec["collectors"]:
        cols["rdt"] = RdtCollector(Path(spec["resctrl"]), cgroup_root, RdtCollectorConfig(), cg)
    if "sst" in spec["collectors"]:
        sysfs = Path(spec["sysfs"])
        cols["sst"] = SstCollector(sysfs, SstCollectorConfig(isst_device=Path(spec["isst"])), discover(sysfs))
    store = Store(retention_seconds=spec["retention"])
    per: dict[str, float] = {n: 0.0 for n in cols}
    samples_per_cycle = 0

    def cycle(timed: bool) -> int:
        n = 0
        now = time.time()
        for name, col in cols.items():
            t0 = time.process_time()
            probe = col.probe()
            # as the agent stores a run (Agent.run_collector_once, no series rules): a vector row where the
            # collector gives one
            row = col.collect_row(now) if probe.ok else []
            if isinstance(row, Columns):
                store.append_columns(name, now, row, 1.0)
                n_samples = int((row.values == row.values).sum())
            else:
                store.append(name, now, row, 1.0)
                n_samples = len(row)
            if timed:
                per[name] += time.process_time() - t0
            n += n_samples
        return n

    for _ in range(3):
        cycle(False)
    c0, w0 = time.process_time(), time.perf_counter()
    for _ in range(spec["cycles"]):
        samples_per_cycle = cycle(True)
    cpu = (time.process_time() - c0) / spec["cycles"]
    wall = (time.perf_counter() - w0) / spec["cycles"]
    out = {"cpu_per_cycle_s": cpu, "wall_per_cycle_s": wall, "rss_kib": _rss_kib(), "rss_imports_kib": rss_imports,
           "maxrss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
           "per_collector_cpu_s": {k: v / spec["cycles"] for k, v in per.items()},
           "samples_per_cycle": samples_per_cycle, "series": store.series_count,
           "store_kib": sum(t.nbytes() for t in store.tables.values()) / 1024,
           "rows_kept": max((t.capacity for t in store.tables.values()), default=0),
           "perf_watched": len(cols["perf"].watched) if "perf" in cols else 0,
           "perf_fds": sum(w.fds for w in cols["perf"].watched.values()) if "perf" in cols else 0,
           "rdt_groups": len(cols["rdt"].groups) if "rdt" in cols else 0,
           "rdt_status": cols["rdt"].status() if "rdt" in cols else "",
           "sst_status": cols["sst"].status() if "sst" in cols else ""}
    for c in cols.values():
        c.close()
    print(json.dumps(out))


def run_child(spec: dict) -> dict:
    r = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True, text=True,
                       timeout=600)
    if r.returncode != 0:
        raise SystemExit(f"child failed:\n{r.stderr}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--containers", type=int, default=200)
    ap.add_argument("--cycles", type=int, default=10)
    ap.add_argument("--retention", type=float, default=3600.0, help="store retention (the agent's default: 3600 s)")
    ap.add_argument("--child")
    args = ap.parse_args()
    if args.child:
        child(json.loads(args.child))
        return

    sys.path.insert(0, str(REPO))
    from cri_resmgr.collectors.perf import find_perf_cgroup_root
    from cri_resmgr.topology.fixtures import MACHINES, build_sysfs
    from tests.cgroupfs import Values, make_v1
    from tests.integration.helpers import CGROUP_ROOT, can_make_cgroups
    from tests.resctrlfs import ResctrlEmulator, fuse_unavailable
    from tests.test_perf import PerfCgroup

    tmp = Path(tempfile.mkdtemp(prefix="cri-resmgr-bench-"))
    sysfs = build_sysfs(MACHINES["xeon-2s-112c-snc2"], tmp / "sys")
    real = can_make_cgroups() is None and find_perf_cgroup_root(CGROUP_ROOT) is not None
    cgroups, procs, emu = [], [], None
    try:
        if real:
            perf_root = find_perf_cgroup_root(CGROUP_ROOT).path
            for _ in range(args.containers):
                cg = PerfCgroup(perf_root).create()
                p = subprocess.Popen(["sleep", "3600"])
                cg.add(p.pid)
                cgroups.append(cg)
                procs.append(p)
            cgroup_root = CGROUP_ROOT
            tids = [p.pid for p in procs]
        else:
            cgroup_root = tmp / "cgroup"
            tids = []
            for i in range(args.containers):
                rel = f"kubepods/burstable/pod{i:08d}-0000-0000-0000-000000000000/{i:064x}"
                make_v1(cgroup_root, rel, Values())
                (cgroup_root / "cpuacct" / rel / "tasks").write_text(f"{10000 + i}\n")
                tids.append(10000 + i)
        collectors = ["perf", "rdt", "sst"] if real else ["sst"]
        spec = {"cgroup_root": str(cgroup_root), "sysfs": str(sysfs), "isst": str(tmp / "no-isst"),
                "cycles": args.cycles, "collectors": [], "retention": args.retention}
        if fuse_unavailable() is None:
            emu = ResctrlEmulator(domains=(0, 1), num_rmids=args.containers + 64)
            emu.mount(tmp / "resctrl", cache_seconds=60)
            for i, tid in enumerate(tids):
                emu.set_task(tid, mbm_total={0: 1e8 + i, 1: 5e7}, mbm_local={0: 9e7}, occupancy={0: 1 << 20})
            spec["resctrl"] = str(tmp / "resctrl")
            stop = threading.Event()

            def tick():
                while not stop.wait(0.25):
                    emu.advance(0.25)

            threading.Thread(target=tick, daemon=True).start()
            if "rdt" not in collectors:
                collectors.append("rdt")
        base = run_child({**spec, "collectors": []})
        full = run_child({**spec, "collectors": collectors})
        snap = None
        if emu is not None:
            # The same cycle with the resctrl tree copied to tmpfs after a sync: what the collector itself
            # costs when file reads are as cheap as on kernfs, without the FUSE round trips to this process.
            from cri_resmgr.collectors.cgroup import CgroupCollector
            from cri_resmgr.collectors.rdt import RdtCollector

            prep = RdtCollector(tmp / "resctrl", cgroup_root, discovery=CgroupCollector(cgroup_root))
            prep.collect(time.time())
            shutil.copytree(tmp / "resctrl", tmp / "resctrl-snapshot")
            snap = run_child({**spec, "collectors": collectors, "resctrl": str(tmp / "resctrl-snapshot")})
            prep.close()
    finally:
        if emu:
            stop.set()
            emu.unmount()
        for p in procs:
            p.kill()
            p.wait()
        for cg in cgroups:
            cg.remove()

    cols = [("cgroup alone", base), ("full, FUSE resctrl", full)] + ([("full, resctrl on tmpfs", snap)] if snap else [])
    print(f"collection cycle, {args.containers} containers ({'real cgroups' if real else 'fixture cgroups'}; "
          f"collectors: cgroup + {' + '.join(collectors)}), mean of {args.cycles} timed cycles, "
          f"store retention {args.retention:g} s")

    def row(label, fn, unit, target=""):
        print(f"{label:<52}" + "".join(f"{fn(r):>20.1f} {unit:<2}" for _, r in cols) + f"   {target}")

    print(f"{'':<52}" + "".join(f"{name:>23}" for name, _ in cols) + "   target")
    row("CPU time per cycle", lambda r: r["cpu_per_cycle_s"] * 1e3, "ms")
    row("CPU share at 1 s interval", lambda r: r["cpu_per_cycle_s"] * 100, "%", "<= 2 % of one core")
    row("wall time per cycle", lambda r: r["wall_per_cycle_s"] * 1e3, "ms")
    row("resident memory (VmRSS)", lambda r: r["rss_kib"] / 1024, "MB", "<= 80 MB")
    row("  of it, after imports", lambda r: r["rss_imports_kib"] / 1024, "MB")
    row("store series", lambda r: r["series"], "")
    row("  the store's rows now", lambda r: r["store_kib"] / 1024, "MB")
    # After a full retention the sealed blocks hold every series' history. The collected values here come
    # from idle processes (they compress to almost nothing), so project with what busy containers' series
    # cost, measured in this run on agent-shaped data (bench/store_bench.py).
    from store_bench import agent_shaped_store

    shaped = agent_shaped_store(containers=200, rows=1024)
    tab = shaped.tables["cgroup"]
    per_sample = sum(b.nbytes() for b in tab.blocks) / (sum(b.n for b in tab.blocks) * len(tab.keys))
    row(f"VmRSS projected at full retention ({per_sample:.2f} B/sample)",
        lambda r: (r["rss_kib"] * 1024 + r["series"] * r["rows_kept"] * per_sample) / 2**20, "MB", "<= 80 MB")
    for name, r in cols:
        print(f"{name}: CPU per cycle by collector: " + ", ".join(
            f"{k} {v * 1e3:.1f} ms" for k, v in r["per_collector_cpu_s"].items()))
    print(f"perf: {full['perf_watched']} containers on {full['perf_fds']} descriptors; "
          f"rdt: {full['rdt_groups']} MON groups; sst: {full['sst_status']}")

if __name__ == "__main__":
    main()
