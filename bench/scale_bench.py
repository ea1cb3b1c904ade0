"""Collection at scale: 200 and 1,000 kubelet-style containers, each collector and the whole agent, CPU per
cycle beside the floor of a minimal C reader of the same files, RSS now and projected, /metrics time and size.

Set-up (this process plays "the machine"; needs root):
- N container cgroups ``kubepods/<qos>/pod<uid>/<id>`` made in every v1 controller and in the v2 ``unified``
  tree (as runc does on hybrid hosts), each holding one sleeping process, or with ``--busy F`` a fraction F of
  them (spread evenly over the QoS classes) a busy one instead: bench/busy_loop.c, compiled with gcc in this run,
  spins ``--busy-spin-ms`` of CPU time every ``--busy-period`` seconds, so their CPU usage moves between any two
  reads of the collectors and no idle shortcut applies to them;
- resctrl: the FUSE emulator (tests/resctrlfs.py) with ``--rmids`` RMIDs (fewer than containers: the RDT
  collector's budget and rotation are part of what is measured), counters advancing;
- the floor: bench/floor_reader.c, compiled with gcc in this run, reads the files the cgroup and RDT
  collectors read (the list each collector reports), opened once and pread at offset 0 every cycle.

Each variant runs in a child process ("the agent"). Per collector: 3 warm-up cycles, then timed cycles back
to back, each writing into a store like the agent (perf with software events: the hardware ones answer ENOENT
here). Whole agent: ``Agent`` with its default configuration (every collector on; perf is down here unless
``--perf-sw-events``), at default intervals and, for 200 containers, with every interval at 1 s; CPU time of the
process over ``--seconds`` after a warm-up (by default until the RDT rotation has given every container its
turn, plus 15 s: the steady state; ``--warmup`` to choose). The agent is served as ``cri-resmgr run`` serves it
(serve.py: the FastAPI app under uvicorn, switch interval 1 ms), scraped over HTTP every 15 s by another process and
for the /metrics figures, so its RSS is the real agent's (``--no-serve``: the agent without its HTTP side, ~20 MB
less, as before). The FUSE server runs in this process, so its work is not charged to the child.

    sudo nice .venv/bin/python bench/scale_bench.py [--containers 200,1000] [--seconds 60]
    # every container running now and then (0.2 ms of CPU a second each by default)
    sudo nice .venv/bin/python bench/scale_bench.py --containers 1000 --agent-only --busy 1.0
    # before/after in the same set-up: the previous commit's agent alternating with this one's
    git archive HEAD | tar -x -C /tmp/head && cp cri_resmgr/ebpf/avx512.bpf.o /tmp/head/cri_resmgr/ebpf/
    sudo nice .venv/bin/python bench/scale_bench.py --containers 1000 --compare /tmp/head
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import _util  # noqa: F401  (puts the repo on sys.path)
import numpy as np

REPO = Path(__file__).resolve().parent.parent
SW_EVENTS = ["cycles", "instructions", "cpu-clock", "context-switches", "page-faults"]


def _rss_kib() -> int:
    lines = Path("/proc/self/status").read_text().splitlines()
    return int(next(ln.split()[1] for ln in lines if ln.startswith("VmRSS:")))


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _thread_cpu() -> dict[str, float]:
    """CPU seconds (user + system) of each live thread of this process, by Python thread name (threads not
    started by Python, e.g. py-spy's or numpy's, under their kernel name)."""
    import threading

    names = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for d in Path("/proc/self/task").iterdir():
        try:
            stat = (d / "stat").read_text()
        except OSError:  # the thread ended
            continue
        comm, fields = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
        name = names.get(int(d.name), comm)
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def _smaps_top(n: int = 8) -> str:
    """Where this process's RSS is, by mapping (anonymous, heap, stacks, each library file), biggest first."""
    by: dict[str, int] = {}
    name = "?"
    for ln in Path("/proc/self/smaps").read_text().splitlines():
        head = ln.split(None, 5)
        if len(head) >= 5 and "-" in head[0] and not head[0].endswith(":"):
            name = os.path.basename(head[5]) if len(head) > 5 else "[anon]"
        elif ln.startswith("Rss:"):
            by[name] = by.get(name, 0) + int(ln.split()[1])
    top = sorted(by.items(), key=lambda kv: -kv[1])[:n]
    return ", ".join(f"{k} {v / 1024:.1f} MB" for k, v in top)


class _Mallinfo2(ctypes.Structure):
    # glibc >= 2.33, mallinfo(3): every field a size_t
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]


def _heap_report() -> str:
    """Where the anonymous memory is: glibc malloc's arenas (bytes in use, free but held) and its own mmaps
    (mallinfo2), and Python's small-object allocator (pymalloc: arenas, bytes in used and in free blocks, from
    sys._debugmallocstats, which writes to fd 2)."""
    from cri_resmgr.libc import LIBC  # the C library the agent's own malloc calls go to

    parts = []
    fn = getattr(LIBC, "mallinfo2", None)
    if fn is not None:  # glibc >= 2.33
        fn.restype = _Mallinfo2
        m = fn()
        parts.append(f"malloc: arenas {m.arena / 2**20:.1f} MB (in use {m.uordblks / 2**20:.1f}, free "
                     f"{m.fordblks / 2**20:.1f}), own mmaps {m.hblkhd / 2**20:.1f} MB in {m.hblks}")
    with tempfile.TemporaryFile() as f:
        saved = os.dup(2)
        os.dup2(f.fileno(), 2)
        try:
            sys._debugmallocstats()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        f.seek(0)
        text = f.read().decode(errors="replace")
    got = {}
    for ln in text.splitlines():
        k, _, v = ln.partition("=")
        k = k.strip().lstrip("#").strip()
        if k in ("arenas allocated current", "bytes in allocated blocks", "bytes in available blocks",
                 "bytes in unused pools", "bytes lost to pool headers", "bytes lost to quantization",
                 "bytes lost to arena alignment"):
            got[k] = int(v.strip().replace(",", ""))
    if got:
        parts.append("pymalloc: " + ", ".join(
            f"{k} {v}" if k.startswith("arenas") else f"{k.removeprefix('bytes ')} {v / 2**20:.1f} MB"
            for k, v in got.items()))
    return "; ".join(parts)


def _timed_render(expo) -> float:
    t = time.perf_counter()
    expo.render()
    return time.perf_counter() - t


class _Served:
    """The agent's HTTP side as ``cri-resmgr run`` starts it (serve.py): the FastAPI app with its own Exposition,
    under uvicorn, on a free loopback port, in a thread of this process (uvicorn leaves the signal handlers alone
    off the main thread). Its ``render()`` is a scrape of /metrics over HTTP, so the process holds what the real
    agent holds and the /metrics figure includes the HTTP layer."""

    def __init__(self, agent, switch_interval: float | None) -> None:
        import socket

        import uvicorn

        from cri_resmgr.web.app import create_app

        try:
            from cri_resmgr.web.server import Server
        except ImportError:  # a checkout from before web/server.py (--compare): uvicorn's own, as it served then
            Server = uvicorn.Server

        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        sys.setswitchinterval(switch_interval or 0.001)  # as serve.py sets it, unless the bench asks otherwise
        app = create_app(agent, check_host=True)
        try:  # as serve.py configures it (web/server.py), where the checkout has that
            from cri_resmgr.web.server import config

            cfg = config(app, "127.0.0.1", self.port, "warning")
        except ImportError:  # a checkout from before it: the settings serve.py had then
            cfg = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", access_log=False,
                                 lifespan="off")
        self.server = Server(cfg)
        self.thread = threading.Thread(target=self.server.run, name="uvicorn", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise SystemExit("the served agent did not start")
            time.sleep(0.05)

    def render(self) -> bytes:
        return scrape(self.port)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def _floor(binary: str, paths: list[str], cycles: int, tmp: str) -> tuple[float, float]:
    lst = Path(tmp) / f"floor-{os.getpid()}-{len(paths)}.txt"
    lst.write_text("".join(p + "\n" for p in paths))
    out = subprocess.run([binary, str(lst), str(cycles)], capture_output=True, text=True, check=True).stdout.split()
    return float(out[0]), float(out[1])


def _projected_rss(rss_kib: int, store) -> float:
    """RSS now plus what the store's series grow to at full retention, at the bytes per sample of
    agent-shaped data (bench/store_bench.py)."""
    from store_bench import agent_shaped_store

    from cri_resmgr.store.tsdb import Block

    shaped = agent_shaped_store(containers=50, rows=1024)
    tab = shaped.tables["cgroup"]
    ts, vals = tab.rows(0, tab.seq, np.arange(len(tab.keys)))
    per_sample: dict[int, float] = {}

    def bytes_per_sample(block_rows: int) -> float:
        """The shaped rows sealed in blocks of ``block_rows`` (the agent's wide tables seal sooner)."""
        if block_rows not in per_sample:
            blocks = [Block(i, ts[i:i + block_rows], vals[i:i + block_rows]) for i in range(0, len(ts), block_rows)]
            per_sample[block_rows] = sum(b.nbytes() for b in blocks) / (len(ts) * vals.shape[1])
        return per_sample[block_rows]

    from cri_resmgr.store import tsdb

    merged = getattr(tsdb, "compact_rows_for", None)  # (a checkout that merges sealed blocks)
    grow = 0.0
    for t in store.tables.values():
        rows = merged(t.capacity, t.block_rows, t.max_block_rows) if merged else t.block_rows
        grow += len(t.keys) * t.capacity * bytes_per_sample(rows) - t.nbytes()
    return (rss_kib * 1024 + max(0.0, grow)) / 2**20


def _decimal_scale(v: np.ndarray) -> int | None:
    """The smallest d of the store's SCALES with every finite value of ``v`` exactly k / 10**d, else None."""
    from cri_resmgr.store.tsdb import SCALES

    x = v[np.isfinite(v)]
    for d in SCALES:
        k = np.rint(x * 10.0 ** d)
        if (np.abs(k) < 2.0 ** 52).all() and ((k / 10.0 ** d).view(np.uint64) == x.view(np.uint64)).all():
            return d
    return None


def fill_to_retention(store, past: float = 0.0, each=None) -> dict[str, str]:
    """Write rows into every table of ``store`` through the agent's own write path (``Store.append_columns``), at
    the table's interval on a clock running ahead of the wall clock, until each holds its full retention: the
    store as it is after an hour, without waiting the hour. The values continue the rows the agent collected: each
    series takes its own real steps again, in the order they came (a counter keeps counting at its measured pace,
    a series not written in a real row is not written in the copy of that row), in integers of its decimal scale
    when all its values have one (so a counter in µs stays exact, as the collectors' values are), else in floats.
    ``past``: go on for that many retentions more, calling ``each(name, table)`` after every row written then (for
    what a table holds over time: bench/retention_bench.py)."""
    from cri_resmgr.store import tsdb
    from cri_resmgr.store.tsdb import Columns

    def merged_rows(tab) -> int:  # (a checkout from before sealed blocks were merged: the hot block's rows)
        f = getattr(tsdb, "compact_rows_for", None)
        return f(tab.capacity, tab.block_rows, tab.max_block_rows) if f else tab.block_rows

    out = {}
    for name, tab in list(store.tables.items()):
        with store.lock:
            named = tab.keys  # (once: in the store of this tree a list made when asked)
            cols = [c for c, k in enumerate(named) if k is not None]
            ts, real = tab.rows(tab.floor, tab.seq, np.array(cols, dtype=np.int64))
            keys = [(named[c][0], dict(named[c][1])) for c in cols]
        if len(ts) < 3 or not cols:
            continue
        interval = float(np.median(np.diff(ts)))
        scales = [_decimal_scale(real[:, i]) for i in range(len(cols))]
        mult = np.array([10.0 ** d if d is not None else 1.0 for d in scales])
        exact = np.array([d is not None for d in scales])
        k = np.where(exact, np.rint(real * mult), real)  # integers where the series has a decimal scale
        steps = np.nan_to_num(np.diff(k, axis=0))
        cur = np.nan_to_num(k[-1])
        t = float(ts[-1])
        target = tab.capacity + merged_rows(tab)
        more = int(past * tab.capacity)
        for j in range(target + more):
            i = j % len(steps)
            cur = cur + steps[i]
            vals = np.where(exact, cur / mult, cur)
            vals[np.isnan(real[i + 1])] = np.nan
            t += interval
            store.append_columns(name, t, Columns(keys, vals), interval)
            if j >= target and each is not None:
                each(name, tab)
        # The store's column plan holds the last keys list written (append_columns): here the fill's, label dicts
        # made for the fill, which the agent does not have (its plan holds the collector's own list). Let go of it,
        # or the RSS after the fill counts them (7 MB at 1,000 containers).
        getattr(store, "_plans", {}).pop(name, None)
        held = tab.seq - (tab.blocks[0].seq0 if tab.blocks else tab.seq - tab.hot_n)
        out[name] = (f"{len(cols)} series, {target + more} rows written at {interval:g} s, {held} held for a "
                     f"capacity of {tab.capacity}, {tab.nbytes() / 2**20:.1f} MiB")
    return out


def child_collector(spec: dict) -> dict:
    from cri_resmgr.collectors.cgroup import CgroupCollector, _paths, detect_layout
    from cri_resmgr.collectors.cpu import CpuCollector
    from cri_resmgr.collectors.perf import PerfCollector
    from cri_resmgr.collectors.rdt import RdtCollector
    from cri_resmgr.config import CgroupCollectorConfig, PerfCollectorConfig, RdtCollectorConfig
    from cri_resmgr.store import Store
    from cri_resmgr.topology import discover

    root = Path(spec["cgroup_root"])
    cg = CgroupCollector(root, CgroupCollectorConfig(runtime_socket=None))
    name = spec["collector"]
    topo = discover(Path("/sys"))
    col = {"cgroup": lambda: cg,
           "cpu": lambda: CpuCollector(Path("/proc"), topo),
           "perf": lambda: PerfCollector(root, PerfCollectorConfig(events=SW_EVENTS), cg, topo),
           "rdt": lambda: RdtCollector(Path(spec["resctrl"]), root, RdtCollectorConfig(), cg)}[name]()
    store = Store(retention_seconds=3600.0)

    def cycle() -> None:  # as the agent stores a run (Agent.run_collector_once, no series rules configured)
        row = col.collect_row(time.time()) if hasattr(col, "collect_row") else col.collect(time.time())
        if isinstance(row, list):
            store.append(name, time.time(), row, 1.0)
        else:
            store.append_columns(name, time.time(), row, 1.0)

    for _ in range(3):
        cycle()
    if name in ("cgroup", "rdt"):
        col.read_log = []  # the files each timed cycle reads: the floor reads the same, cycle by cycle
    cycles = spec["cycles"]
    per = []
    c0 = _cpu()
    for _ in range(cycles):
        t = _cpu()
        cycle()
        per.append(_cpu() - t)
    cpu = (_cpu() - c0) / cycles
    files: list[str] = []
    layout = detect_layout(root)
    floor_all = None
    n_files = 0.0
    if name == "cgroup":
        every = [p for i in cg.identities(layout) for p in _paths(layout, i.cgroup_path, True) if p]
        floor_all = _floor(spec["floor"], every, max(3, cycles), spec["tmp"])  # every file of every container
        log = cg.read_log or []
        files = [p for c in log for p in (*c, "%%")]  # each timed cycle's files, for the floor's cycle by cycle
        n_files = sum(map(len, log)) / max(1, len(log))
    elif name == "rdt":
        log = col.read_log or []
        files = [p for c in log for p in (*c, "%%")]  # as for cgroup: idle containers' counters are not read
        n_files = sum(map(len, log)) / max(1, len(log))
    floor = _floor(spec["floor"], files, max(3, cycles), spec["tmp"]) if files else None
    out = {"cpu_per_cycle_s": cpu, "samples": store.series_count, "files": n_files, "floor": floor,
           "floor_all": floor_all, "status": col.status() or ""}
    col.close()
    return out


def scrape(port: int) -> bytes:
    """GET /metrics from the served agent, as Prometheus does."""
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        if r.status != 200:
            raise SystemExit(f"/metrics answered {r.status}")
        return r.read()


def scrape_every(port: int, seconds: float) -> None:
    """A Prometheus scraping the served agent, run in a process of its own (``python -c``, below) so that its
    reads (4-5 MB a scrape at 1,000 containers) are not the agent's CPU; it ends when the agent is gone."""
    while True:
        time.sleep(seconds)
        scrape(port)


def warmup_for(containers: int, rmids: int, interval: float | None) -> float:
    """Seconds until the agent's RDT rotation (its default budget share and slice) has given every container a
    MON group once, plus 15 s (the collectors' first cycles): before that, RDT series are still being added, so
    every scrape rebuilds the exposition's plan and the window does not show the steady state."""
    from cri_resmgr.config import RdtCollectorConfig

    cfg = RdtCollectorConfig()
    if containers < rmids:  # (RMID 0 is resctrl's default group) a group each: no rotation
        return 15.0
    slots = max(1, int(rmids * cfg.rotation_share))
    rotating = containers - (rmids - slots)
    cycle = max(cfg.rotation_slice_seconds, interval or cfg.interval_seconds)
    return 15.0 + math.ceil(rotating / slots) * cycle


def child_agent(spec: dict) -> dict:
    import yaml

    from cri_resmgr.agent import Agent
    from cri_resmgr.config import load_config
    from cri_resmgr.export.exposition import Exposition

    cfgd = {"run_dir": spec["tmp"] + "/run", "state_dir": spec["tmp"] + "/state",
            "paths": {"resctrl": spec["resctrl"]},
            "collectors": {"cgroup": {"runtime_socket": None}}}
    if spec.get("perf_sw_events"):
        cfgd["collectors"]["perf"] = {"events": SW_EVENTS}
    if spec["interval"]:
        for c in ("cgroup", "cpu", "perf", "rdt", "sst", "avx512"):
            cfgd["collectors"].setdefault(c, {})["interval_seconds"] = spec["interval"]
    p = Path(spec["tmp"]) / "agent.yaml"
    p.write_text(yaml.safe_dump(cfgd))
    if spec.get("switch_interval"):  # what `cri-resmgr run` sets process-wide (serve.py): measure its cost
        sys.setswitchinterval(spec["switch_interval"])
    if spec.get("tracemalloc"):  # where the Python heap is, by line (slows the agent: memory figures only)
        import tracemalloc

        tracemalloc.start(8 if spec.get("tracemalloc_dump") else 1)
    agent = Agent(load_config(p), p)
    agent.start()
    served = _Served(agent, spec.get("switch_interval")) if spec.get("serve") else None
    scraper = None
    if served is not None:
        served.render()
        here = os.path.dirname(os.path.abspath(__file__))
        scraper = subprocess.Popen([sys.executable, "-c", f"import sys; sys.path.insert(0, {here!r}); "
                                    f"import scale_bench; scale_bench.scrape_every({served.port}, 15.0)"],
                                   stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(spec["warmup"])
    spy = None
    if spec.get("profile"):  # py-spy (the bench extra, not an agent dependency) samples this process from outside
        spy = subprocess.Popen([str(Path(sys.executable).with_name("py-spy")), "record", "--nonblocking", "--threads",
                                "--pid", str(os.getpid()), "--duration", str(int(spec["seconds"])), "--rate", "200",
                                "--format", "raw", "-o", spec["profile"]], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    import gc

    gc_time = [0.0, 0.0, 0.0]  # per generation: seconds spent collecting during the window (on any thread)
    gc_runs = [0, 0, 0]
    gc_start: list[float] = []

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            gc_start.append(time.perf_counter())
        elif gc_start:
            gc_time[info["generation"]] += time.perf_counter() - gc_start.pop()
            gc_runs[info["generation"]] += 1

    gc.callbacks.append(on_gc)
    c0, w0, th0 = _cpu(), time.monotonic(), _thread_cpu()
    time.sleep(spec["seconds"])
    wall = time.monotonic() - w0
    gc.callbacks.remove(on_gc)
    cpu_share = (_cpu() - c0) / wall
    th1 = _thread_cpu()
    threads = {k: (v - th0.get(k, 0.0)) / wall for k, v in th1.items() if v - th0.get(k, 0.0) > 0}
    if spy is not None:
        spy.wait()
    rss = _rss_kib()
    if spec.get("memory"):  # where the RSS is: heap freed but kept by malloc, Python objects by type
        from cri_resmgr.heap import release_free_heap

        release_free_heap()
        notes_mem = [f"RSS {rss / 1024:.1f} MB, after malloc_trim {_rss_kib() / 1024:.1f} MB",
                     "by mapping: " + _smaps_top(), _heap_report()]
        sizes: dict[str, list[int]] = {}
        for o in gc.get_objects():
            e = sizes.setdefault(type(o).__name__, [0, 0])
            e[0] += 1
            e[1] += sys.getsizeof(o)
        top = sorted(sizes.items(), key=lambda kv: -kv[1][1])[:10]
        notes_mem.append("gc-tracked objects (shallow): "
                         + ", ".join(f"{k} {n} {b / 2**20:.1f} MB" for k, (n, b) in top))
    expo = served if served is not None else Exposition(agent.store, agent.self_metrics)
    times = []
    size = 0
    for _ in range(5):
        t = time.perf_counter()
        size = len(expo.render())
        times.append(time.perf_counter() - t)
    health = {n: (h.up, h.reason[:160], h.last_duration_seconds) for n, h in agent.health.items()}
    # The 30 s rebalancer round and the 60 s checkpoint may fall outside a short window: one of each, timed
    # here (CPU of this thread) on the agent's store as the window left it.
    once = {}
    notes: dict[str, str] = {}
    notes["gc"] = (f"{sum(gc_runs)} collections in the window ({gc_runs[2]} of generation 2), "
                   f"{sum(gc_time) / wall * 100:.3f} % of a core ({gc_time[2] / wall * 100:.3f} % in generation 2)")
    if spec.get("memory"):
        notes["memory"] = "; ".join(notes_mem)
    if agent.rebalancer is not None:
        t = time.thread_time()
        agent.rebalancer.engine.run_once(now=agent.now())
        once["rebalancer_round_ms"] = (time.thread_time() - t) * 1e3
        if hasattr(agent.rebalancer, "tick"):  # a round of the loop, which may skip when nothing changed
            t = time.thread_time()
            agent.rebalancer.tick()
            once["rebalancer_tick_ms"] = (time.thread_time() - t) * 1e3
            gate = agent.rebalancer.gate
            notes["rebalancer"] = (f"rounds planned {gate.planned_total}, skipped {gate.skipped_total}; last planned "
                                   f"because: {gate.last_plan_reason}")
    from cri_resmgr.store import checkpoint

    # The agent's own checkpoint writer where it has one (it may write only what changed since its last
    # checkpoint); the first checkpoint of the run, then the next one after the collectors ran for 5 s more.
    save = agent.checkpointer.save if hasattr(agent, "checkpointer") else checkpoint.save
    for k in range(2):
        if k:
            time.sleep(5)
        t = time.thread_time()
        path = save(agent.store, agent.state_dir)
        once[f"checkpoint{k}_ms"] = (time.thread_time() - t) * 1e3
        once[f"checkpoint{k}_dir_mb"] = sum(f.stat().st_size for f in path.parent.iterdir()
                                            if f.name.startswith("store.")) / 1e6
        if hasattr(agent, "checkpointer"):
            once[f"checkpoint{k}_written_mb"] = agent.checkpointer.last.bytes_written / 1e6
    # /metrics as a Prometheus scrape sees it: 5 s after the last one (the collectors wrote rows between), not
    # straight after another render. One after the 5 s of the checkpoints, two more 5 s apart.
    spaced = [_timed_render(expo)]
    for k in range(2, 5):
        if k > 2:
            time.sleep(5)
            spaced.append(_timed_render(expo))
        if agent.rebalancer is not None and hasattr(agent.rebalancer, "tick"):  # more ticks, 5 s apart
            t = time.thread_time()
            rec = agent.rebalancer.tick()
            once[f"rebalancer_tick{k}_ms"] = (time.thread_time() - t) * 1e3
            gate = agent.rebalancer.gate
            notes[f"rebalancer tick {k}"] = ("planned because: " + str(gate.last_plan_reason) if rec is not None
                                             else "skipped: " + str(gate.last_skip.reason if gate.last_skip else None))
    once["metrics_spaced_ms"] = sorted(spaced)[1] * 1e3
    with agent.store.lock:
        once["store_rows_mb"] = sum(t.nbytes() for t in agent.store.tables.values()) / 2**20
    out = {"cpu_share": cpu_share, "rss_mb": rss / 1024, "projected_mb": _projected_rss(rss, agent.store),
           "series": agent.store.series_count, "metrics_ms": sorted(times)[2] * 1e3, "metrics_bytes": size,
           "health": health, "threads": threads, "once": once, "notes": notes, "served": served is not None,
           "warmup": spec["warmup"]}
    if scraper is not None:
        if scraper.poll() is not None:  # it stopped scraping: the window was not a scraped agent's
            out["notes"]["scraper"] = f"the scraper exited during the window (status {scraper.returncode})"
        scraper.kill()
        scraper.wait()
    if spec.get("fill"):  # the collectors stop; the store is filled to its retention and the RSS measured
        from cri_resmgr.heap import release_free_heap

        agent._stop.set()
        for ev in agent._wake.values():
            ev.set()
        for th in agent._threads.values():
            th.join(timeout=30)
        release_free_heap()
        rss_before = _rss_kib()
        mapping_before = _smaps_top()
        traced_before = None
        if spec.get("tracemalloc"):  # what the fill adds, by line (the RSS rise past the store's rows)
            import tracemalloc

            traced_before = tracemalloc.take_snapshot()
        c0 = _cpu()
        tables = fill_to_retention(agent.store)
        fill_cpu = _cpu() - c0
        if served is not None:  # a scrape of the full store, as Prometheus would make next
            expo.render()
        rss_full = _rss_kib()
        release_free_heap()
        with agent.store.lock:
            store_mb = sum(t.nbytes() for t in agent.store.tables.values()) / 2**20
        out["full_retention"] = {"rss_before_mb": rss_before / 1024, "rss_mb": rss_full / 1024,
                                 "rss_trimmed_mb": _rss_kib() / 1024, "by_mapping": _smaps_top(),
                                 "heap": _heap_report(),
                                 "by_mapping_before": mapping_before,
                                 "store_rows_mb": store_mb, "fill_cpu_s": fill_cpu, "tables": tables}
        if traced_before is not None:
            import tracemalloc

            diff = tracemalloc.take_snapshot().compare_to(traced_before, "lineno")
            out["notes"]["fill, traced growth"] = (
                f"{sum(d.size_diff for d in diff) / 2**20:.1f} MB; by line: " + ", ".join(
                    f"{d.traceback[0].filename.split('/')[-1]}:{d.traceback[0].lineno} {d.size_diff / 2**20:+.2f} "
                    f"({d.count_diff:+d})" for d in diff[:15]))
    if spec.get("tracemalloc"):
        import tracemalloc

        snap = tracemalloc.take_snapshot()
        if spec.get("tracemalloc_dump"):
            snap.dump(spec["tracemalloc_dump"])
        by_file = snap.statistics("filename")[:8]
        by_line = snap.statistics("lineno")[:15]
        out["notes"]["tracemalloc"] = (
            f"traced {sum(st.size for st in snap.statistics('filename')) / 2**20:.1f} MB; by file: "
            + ", ".join(f"{st.traceback[0].filename.split('/site-packages/')[-1].split('/cri_resmgr/')[-1]} "
                        f"{st.size / 2**20:.1f}" for st in by_file)
            + "; by line: " + ", ".join(f"{st.traceback[0].filename.split('/')[-1]}:{st.traceback[0].lineno} "
                                        f"{st.size / 2**20:.1f} ({st.count})" for st in by_line))
    if served is not None:
        served.stop()
    agent.stop()
    return out


def run_child(kind: str, spec: dict, script: str = __file__) -> dict:
    flags = ["-OO"] if spec.get("optimize") else []  # (--optimize: docstrings and asserts dropped)
    r = subprocess.run([sys.executable, *flags, script, "--child", kind, json.dumps(spec)], capture_output=True,
                       text=True, timeout=1800)
    if r.returncode != 0:
        raise SystemExit(f"child {kind} failed:\n{r.stderr[-4000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--containers", default="200,1000")
    ap.add_argument("--cycles", type=int, default=10)
    ap.add_argument("--seconds", type=float, default=60.0, help="whole-agent measurement window")
    ap.add_argument("--warmup", type=float, default=None,
                    help="whole agent: seconds before the window (default: 15 s after the RDT rotation has given "
                         "every container its turn, so that the window sees the steady state: ~145 s at 1,000 "
                         "containers and 256 RMIDs)")
    ap.add_argument("--rmids", type=int, default=256, help="RMIDs of the emulated resctrl")
    ap.add_argument("--perf-sw-events", action="store_true",
                    help="whole agent: perf counts software events (its default hardware events answer ENOENT here, "
                         "so by default perf is down in the whole-agent runs)")
    ap.add_argument("--compare", type=Path,
                    help="another checkout (e.g. `git archive HEAD | tar -x -C DIR`): its whole agent runs in the same "
                         "set-up, alternating with this one's, for a before/after under the same load")
    ap.add_argument("--interval", type=float, action="append", default=None,
                    help="whole agent: every collector at this interval (0: the defaults); repeat for several runs. "
                         "Default: the defaults, and 1 s as well at 200 containers or fewer without --compare")
    ap.add_argument("--pairs", type=int, default=2, help="with --compare: runs of this checkout and the other, "
                    "alternating, this many of each")
    ap.add_argument("--profile", type=Path, help="whole agent: write py-spy's collapsed stacks of each run here "
                    "(DIR/agent-N-interval-k.txt; needs py-spy: pip install -e '.[bench]')")
    ap.add_argument("--agent-only", action="store_true", help="skip the per-collector runs")
    ap.add_argument("--memory", action="store_true", help="whole agent: after the window, RSS after malloc_trim "
                    "and the Python objects by type")
    ap.add_argument("--fill", action="store_true",
                    help="whole agent: after the window, stop the collectors, write rows through the store's write "
                         "path on a clock running ahead until every table holds its full retention (values continuing "
                         "the collected series at their measured pace), then measure the RSS (fill_to_retention)")
    ap.add_argument("--tracemalloc", action="store_true", help="whole agent: trace Python allocations from the "
                    "start and print the largest by file and line at the end (slows the agent: not for CPU figures)")
    ap.add_argument("--tracemalloc-dump", metavar="FILE", help="with --tracemalloc: also write the final snapshot "
                    "here (tracemalloc.Snapshot.load reads it), for looking at allocations by traceback")
    ap.add_argument("--no-serve", action="store_true",
                    help="whole agent: without its HTTP side (by default the agent runs as `cri-resmgr run` starts it: "
                         "the FastAPI app under uvicorn, /metrics scraped over HTTP every 15 s and for the /metrics "
                         "figures; without it, the RSS lacks the web stack's ~20 MB)")
    ap.add_argument("--bytecode", action="store_true",
                    help="compile the checkouts' cri_resmgr to bytecode first, as an installed wheel has it (without, "
                         "with PYTHONDONTWRITEBYTECODE set, every agent compiles its sources: ~1 MB more RSS)")
    ap.add_argument("--optimize", action="store_true",
                    help="run the agents under python -OO (no docstrings, no asserts: ~4 MB less RSS at start; "
                         "with --bytecode, compiled for it too)")
    ap.add_argument("--collectors-only", action="store_true", help="skip the whole-agent runs")
    ap.add_argument("--switch-interval", type=float, action="append", default=None,
                    help="whole agent: sys.setswitchinterval in the agent (as serve.py sets 0.001); repeat to run "
                         "the agent once per value (0: Python's default)")
    ap.add_argument("--busy", type=float, default=0.0, metavar="F",
                    help="fraction of the containers (0..1) whose process runs a busy loop instead of sleeping "
                         "(bench/busy_loop.c): their CPU usage changes between the collectors' reads")
    ap.add_argument("--busy-period", type=float, default=1.0, help="--busy: seconds between two spins")
    ap.add_argument("--busy-spin-ms", type=float, default=0.2, help="--busy: CPU milliseconds of each spin")
    ap.add_argument("--child", nargs=2)
    args = ap.parse_args()
    if not 0.0 <= args.busy <= 1.0 or args.busy_period <= 0 or args.busy_spin_ms < 0:
        ap.error("--busy takes a fraction in 0..1, --busy-period a positive number, --busy-spin-ms >= 0")
    if args.child:
        kind, spec = args.child
        print(json.dumps((child_agent if kind == "agent" else child_collector)(json.loads(spec))))
        return

    if args.profile is not None:
        if not Path(sys.executable).with_name("py-spy").exists():
            ap.error("--profile needs py-spy in the venv: .venv/bin/pip install -e '.[bench]'")
        args.profile.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(REPO))
    from cri_resmgr.collectors.perf import find_perf_cgroup_root
    from tests.integration.helpers import CGROUP_ROOT, can_make_cgroups
    from tests.resctrlfs import ResctrlEmulator, fuse_unavailable
    from tests.test_perf import PerfCgroup

    why = can_make_cgroups() or fuse_unavailable()
    if why:
        raise SystemExit(f"scale_bench needs real cgroups and the resctrl emulator: {why}")
    tmp = Path(tempfile.mkdtemp(prefix="cri-resmgr-scale-"))
    floor_bin = tmp / "floor_reader"
    subprocess.run(["gcc", "-O2", "-o", str(floor_bin), str(REPO / "bench" / "floor_reader.c")], check=True)
    busy_cmd = None
    if args.busy > 0:
        busy_bin = tmp / "busy_loop"
        subprocess.run(["gcc", "-O2", "-o", str(busy_bin), str(REPO / "bench" / "busy_loop.c")], check=True)
        busy_cmd = [str(busy_bin), f"{args.busy_period:g}", f"{args.busy_spin_ms:g}"]
    sizes = [int(x) for x in args.containers.split(",")]
    other_script = None
    if args.compare is not None:
        other_script = str(args.compare / "bench" / "scale_bench.py")
        import shutil

        shutil.copy(__file__, other_script)  # the child side of this file runs on the other checkout's code
    if args.bytecode:  # as pip installs the wheel: the agents import bytecode instead of compiling their sources
        import compileall

        for tree in [REPO] + ([args.compare] if args.compare is not None else []):
            compileall.compile_dir(str(Path(tree) / "cri_resmgr"), quiet=1, optimize=2 if args.optimize else -1)
    perf_root = find_perf_cgroup_root(CGROUP_ROOT)
    cgroups: list = []
    procs: list[subprocess.Popen] = []
    emu = ResctrlEmulator(domains=(0, 1), num_rmids=args.rmids).mount(tmp / "resctrl", cache_seconds=60)
    stop = threading.Event()

    def tick() -> None:
        while not stop.wait(0.5):
            emu.advance(0.5)

    threading.Thread(target=tick, daemon=True).start()
    results = []
    try:
        for n in sizes:
            while len(cgroups) < n:
                qos = ("burstable", "besteffort", "guaranteed")[len(cgroups) % 3]
                cg = PerfCgroup(perf_root.path if perf_root else None, qos=qos)
                if qos == "guaranteed":
                    cg.rel = cg.rel.replace("kubepods/guaranteed/", "kubepods/")
                cg.create()
                k = len(cgroups)  # busy when the k-th container crosses a multiple of 1/F: F of them, evenly spread
                busy = busy_cmd is not None and math.floor((k + 1) * args.busy) > math.floor(k * args.busy)
                p = subprocess.Popen(busy_cmd if busy else ["sleep", "7200"])
                cg.add(p.pid)
                emu.set_task(p.pid, mbm_total={0: 1e8 + len(procs), 1: 5e7}, mbm_local={0: 9e7}, occupancy={0: 1 << 20})
                cgroups.append(cg)
                procs.append(p)
            base = {"cgroup_root": str(CGROUP_ROOT), "resctrl": str(tmp / "resctrl"), "floor": str(floor_bin),
                    "tmp": str(tmp), "cycles": args.cycles}
            per = {} if other_script or args.agent_only else {
                c: run_child("collector", {**base, "collector": c}) for c in ("cgroup", "cpu", "perf", "rdt")}
            agents: dict = {}
            intervals = [None if x == 0 else x for x in args.interval] if args.interval else \
                [None, 1.0] if n <= 200 and not other_script else [None]
            for interval in ([] if args.collectors_only else intervals):
                who_runs = [("this", __file__), ("other", other_script)] * args.pairs if other_script \
                    else [("this", __file__)]
                switches = args.switch_interval or [0.0]
                # each switch interval in turn, twice, alternating (the load on this machine drifts)
                runs = [(who, script, sw) for _ in range(2 if len(switches) > 1 else 1) for sw in switches
                        for who, script in who_runs]
                for k, (who, script, sw) in enumerate(runs):
                    d = tmp / f"agent-{n}-{interval}-{k}"
                    d.mkdir()
                    agents[(interval, who, k, sw)] = run_child(
                        "agent", {**base, "tmp": str(d), "interval": interval, "seconds": args.seconds,
                                  "warmup": warmup_for(n, args.rmids, interval) if args.warmup is None
                                  else args.warmup, "perf_sw_events": args.perf_sw_events, "switch_interval": sw,
                                  "memory": args.memory, "fill": args.fill, "serve": not args.no_serve,
                                  "optimize": args.optimize,
                                  "tracemalloc": args.tracemalloc, "tracemalloc_dump": args.tracemalloc_dump,
                                  "profile": str(args.profile / f"agent-{n}-{interval}-{k}.txt") if args.profile
                                  else None}, script)
            results.append((n, per, agents))
    finally:
        stop.set()
        emu.unmount()
        for p in procs:
            p.kill()
            p.wait()
        for cg in reversed(cgroups):
            cg.remove()

    load = (f"one process each, {args.busy:.0%} of them busy ({args.busy_spin_ms:g} ms of CPU every "
            f"{args.busy_period:g} s), the others sleeping" if args.busy else "one sleeping process each")
    print(f"scale bench (real kubelet-style cgroups, {load}; resctrl emulator with "
          f"{args.rmids} RMIDs; machine: {os.cpu_count()} CPUs shared with other work: figures are from a loaded "
          f"machine, the ratios to the floor measured in the same run are what counts)")
    for n, per, agents in results:
        print(f"\n== {n} containers ==")
        print(f"{'collector':<10}{'CPU/cycle':>12}{'series':>9}{'files':>8}{'C floor pread':>15}{'x floor':>9}"
              f"{'C open+read':>13}   status")
        for c, r in per.items():
            fl = r["floor"]
            ratio = f"{r['cpu_per_cycle_s'] / fl[0]:>8.1f}x" if fl and fl[0] > 0 else f"{'':>9}"
            print(f"{c:<10}{r['cpu_per_cycle_s'] * 1e3:>9.2f} ms{r['samples']:>9}{r['files']:>8.0f}"
                  + (f"{fl[0] * 1e3:>12.2f} ms{ratio}{fl[1] * 1e3:>10.2f} ms" if fl else f"{'':>15}{'':>9}{'':>13}")
                  + f"   {r['status'][:110]}")
            if r.get("floor_all"):
                fa = r["floor_all"][0]
                print(f"{'':<10}(the C floor of reading every file of every container each cycle: {fa * 1e3:.2f} ms "
                      f"pread; this collector's CPU per cycle is {r['cpu_per_cycle_s'] / fa:.2f}x that)")
        for (interval, who, k, sw), a in agents.items():
            label = "default intervals" if interval is None else f"all intervals {interval:g} s"
            if sw:
                label += f", switch interval {sw * 1e3:g} ms"
            elif args.switch_interval:
                label += ", default switch interval"
            if other_script:
                label += f", {'this checkout' if who == 'this' else args.compare} (run {k + 1})"
            label += ", served over HTTP" if a.get("served") else ", without the HTTP side (--no-serve)"
            print(f"whole agent, {label}: CPU {a['cpu_share'] * 100:.2f} % of a core (over {args.seconds:g} s "
                  f"from {a.get('warmup', math.nan):g} s after the start), "
                  f"RSS {a['rss_mb']:.1f} MB now, {a['projected_mb']:.1f} MB projected at full retention, "
                  f"{a['series']} series, /metrics {a['metrics_ms']:.1f} ms for {a['metrics_bytes'] / 1e6:.2f} MB "
                  f"(back to back; {a.get('once', {}).get('metrics_spaced_ms', math.nan):.1f} ms 5 s apart)")
            if a.get("threads"):
                print("    CPU by thread, % of a core: " + ", ".join(
                    f"{k} {v * 100:.2f}" for k, v in sorted(a["threads"].items(), key=lambda kv: -kv[1])))
            if a.get("full_retention"):
                f = a["full_retention"]
                print(f"    filled to full retention: RSS {f.get('rss_before_mb', math.nan):.1f} MB before the fill "
                      f"(after malloc_trim), {f['rss_mb']:.1f} MB after, after malloc_trim "
                      f"{f['rss_trimmed_mb']:.1f} MB; store rows {f['store_rows_mb']:.1f} MiB (fill took "
                      f"{f['fill_cpu_s']:.1f} s CPU)")
                if f.get("by_mapping"):
                    print(f"        RSS by mapping before the fill: {f.get('by_mapping_before')}")
                    print(f"        RSS by mapping after the fill: {f['by_mapping']}")
                if f.get("heap"):
                    print(f"        heap after the fill: {f['heap']}")
                for t, note in f["tables"].items():
                    print(f"        {t}: {note}")
            if a.get("once"):
                print("    after the window, once: " + ", ".join(f"{k} {v:.1f}" for k, v in a["once"].items()))
            for k, v in a.get("notes", {}).items():
                print(f"    {k}: {v[:1500]}")
            for name, (up, reason, dur) in a["health"].items():
                print(f"    {name:<8} {'up' if up else 'down':<5} last cycle {dur * 1e3:7.1f} ms wall  {reason[:100]}")


if __name__ == "__main__":
    main()
