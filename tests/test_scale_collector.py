"""Collection at scale (issue 17): change-driven container discovery (inotify), descriptors kept open,
pressure stall information per container."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from cri_resmgr import metrics as M
from cri_resmgr.collectors.cgroup import CgroupCollector, detect_layout, parse_pressure
from cri_resmgr.collectors.discovery import ContainerDiscovery, parse_events
from cri_resmgr.config import CgroupCollectorConfig
from tests.cgroupfs import Values, make_v1, make_v2
from tests.integration.helpers import CGROUP_ROOT, RealCgroup, can_make_cgroups


def _rel(qos: str = "burstable") -> tuple[str, str]:
    cid = uuid.uuid4().hex + uuid.uuid4().hex
    return cid, f"kubepods/{qos}/pod{uuid.uuid4()}/{cid}"


# -- inotify discovery -----------------------------------------------------------------------------
def test_inotify_events_decode_with_padded_names():
    import struct

    buf = struct.pack("iIII", 3, 0x40000100, 0, 16) + b"pod1234\0" + b"\0" * 8
    buf += struct.pack("iIII", 4, 0x8000, 0, 0)
    assert parse_events(buf) == [(3, 0x40000100, "pod1234"), (4, 0x8000, "")]
    assert parse_events(b"") == [] and parse_events(b"\x01\x02") == []


def test_container_created_and_removed_between_cycles_is_seen_without_a_new_walk(tmp_path: Path):
    root = tmp_path / "cgroup"
    first, rel1 = _rel()
    make_v2(root, rel1, Values())
    d = ContainerDiscovery(root)
    assert [i.container_id for i in d.containers()] == [first] and d.mode == "inotify"
    walks = d.walks_total
    gen = d.generation
    assert d.containers() and d.generation == gen  # nothing changed: nothing done

    cid, rel = _rel("besteffort")  # a new pod directory and its container, made between two cycles
    (root / rel).mkdir(parents=True)
    got = {i.container_id: i for i in d.containers()}
    assert set(got) == {first, cid} and got[cid].qos_class == "BestEffort" and d.generation > gen
    os.rmdir(root / rel)
    os.rmdir((root / rel).parent)
    assert [i.container_id for i in d.containers()] == [first]
    gone_pod = (root / rel1).parent
    for p in sorted(gone_pod.rglob("*"), reverse=True):
        p.unlink() if p.is_file() else p.rmdir()
    gone_pod.rmdir()  # a whole pod removed: its container goes too
    assert d.containers() == []
    assert d.walks_total == walks  # all of it from events
    d.close()


def test_discovery_equals_a_walk_on_every_layout(tmp_path: Path):
    for i, driver in enumerate(("kubepods/burstable/pod{uid}/{cid}",
                                "kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{uidu}.slice/"
                                "cri-containerd-{cid}.scope")):
        uid = str(uuid.uuid4())
        make_v1(tmp_path / str(i), driver.format(uid=uid, uidu=uid.replace("-", "_"), cid=f"{i:064x}"), Values())
        root = tmp_path / str(i) / "cpuacct"
        walk = ContainerDiscovery(root, use_inotify=False).containers()
        ino = ContainerDiscovery(root)
        assert ino.containers() == walk and len(walk) == 1
        ino.close()


def test_real_cgroup_container_appears_and_goes_by_inotify():
    reason = can_make_cgroups()
    if reason:
        pytest.skip(reason)
    layout = detect_layout(CGROUP_ROOT)
    col = CgroupCollector(CGROUP_ROOT, CgroupCollectorConfig(runtime_socket=None))
    col.collect(time.time())
    disc = col.discovery(layout.root)
    walks = disc.walks_total
    cg = RealCgroup().create()
    try:
        col.collect(time.time())
        assert cg.container_id in col.containers
        assert disc.mode == "inotify" and disc.walks_total == walks
    finally:
        cg.remove()
    col.collect(time.time())
    assert cg.container_id not in col.containers and disc.walks_total == walks
    col.close()


def test_files_are_kept_open_and_reread_and_closed_with_their_container(tmp_path: Path):
    cid, rel = _rel()
    make_v2(tmp_path, rel, Values(usage_ns=5_000_000_000))
    col = CgroupCollector(tmp_path)
    col.collect(0.0)
    fds = col.open_descriptors
    assert fds >= 4
    make_v2(tmp_path, rel, Values(usage_ns=7_000_000_000))  # rewritten in place, as the kernel's files change
    s = col.collect(1.0)
    assert col.open_descriptors == fds
    assert [x.value for x in s if x.metric == M.CONTAINER_CPU_USAGE.name] == [7.0]
    import shutil

    shutil.rmtree(tmp_path / rel)
    col.collect(2.0)
    assert col.open_descriptors == 0 and col.containers == {}
    col.close()


def test_kept_open_files_are_each_containers_own_under_shared_path_templates(tmp_path: Path):
    # The descriptors are keyed by one tuple of path templates for all containers (not ~8 paths of ~150
    # characters held per container); each descriptor is, as the kernel says, the file of its own container.
    from cri_resmgr.collectors.cgroup import _templates

    made = [_rel(q) for q in ("burstable", "besteffort", "burstable")]
    for i, (_cid, rel) in enumerate(made):
        make_v2(tmp_path, rel, Values(usage_ns=(i + 1) * 1_000_000_000))
    col = CgroupCollector(tmp_path)
    s = col.collect(0.0)
    tracked = list(col._tracked.values())
    assert len(tracked) == 3
    assert all(t.paths is _templates(col._layout, col.cfg.pressure) for t in tracked)
    for t in tracked:
        assert t.files.fds and all(k in t.paths for k in t.files.fds)
        for key, fd in t.files.fds.items():
            real = os.readlink(f"/proc/self/fd/{fd}")
            assert real == os.path.realpath(t.files.path_of(key)), (key, real)
            assert real.startswith(f"{tmp_path}{t.ident.cgroup_path}/")
    usage = {x.labels["container_id"]: x.value for x in s if x.metric == M.CONTAINER_CPU_USAGE.name}
    assert usage == {cid: float(i + 1) for i, (cid, _) in enumerate(made)}
    col.read_log = []
    col.collect(1.0)
    assert col.read_log[0] and all(os.path.isfile(p) for p in col.read_log[0])  # the log names real files
    col.close()


def _containers(root: Path, n: int) -> list[tuple[str, str]]:
    """``n`` v2 fixture containers under ``root``, the i-th having used i + 1 CPU seconds: (id, relative path)."""
    out = [_rel() for _ in range(n)]
    for i, (_cid, rel) in enumerate(out):
        make_v2(root, rel, Values(usage_ns=(i + 1) * 1_000_000_000))
    return out


def _fds_under(root: Path) -> int:
    """Descriptors this process holds on files under ``root``, as the kernel lists them (/proc/self/fd)."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}").startswith(f"{root}/")
        except OSError:
            continue  # the directory's own descriptor, closed while listed
    return n


def test_the_kept_open_count_is_what_the_kernel_shows_through_churn_gone_reads_and_shedding(tmp_path: Path):
    """open_descriptors is counted where files open and close (status() reports it after every run), so it must
    equal the descriptors the kernel lists for the tree after every kind of change; a container whose read finds
    it gone after opening some of its files was the case that drifted (counted low, so the limit and
    the shedding went by a wrong figure)."""
    root = tmp_path / "cgroup"
    rels = [rel for _cid, rel in _containers(root, 4)]
    col = CgroupCollector(root)
    seen = []

    def check(now: float) -> None:
        col.collect(now)
        seen.append(col.open_descriptors)
        assert col.open_descriptors == _fds_under(root), now

    check(0.0)
    assert col.open_descriptors >= 16
    make_v2(root, rels[0], Values(usage_ns=9_000_000_000))  # a change: its full read re-reads kept files
    check(1.0)
    _cid, half = _rel()
    make_v2(root, half, Values())
    (root / half / "cpu.stat").unlink()  # its read opens the other files, then finds no CPU accounting: gone
    check(2.0)
    check(3.0)
    import shutil

    shutil.rmtree(root / rels[1])  # a container removed
    check(4.0)
    _cid, rel = _rel()
    make_v2(root, rel, Values())  # and one added
    check(5.0)
    col.kept_open_limit = 6  # lowered: the last containers' files are closed
    check(6.0)
    assert 0 < col.open_descriptors <= 6
    col.kept_open_limit = 1 << 16
    check(7.0)
    col.close()
    assert _fds_under(root) == 0 and col.open_descriptors == 0
    assert len(set(seen)) > 2  # the count moved through the changes (not one figure that happened to match)


# -- pressure stall information --------------------------------------------------------------------
def test_pressure_files_parse_some_and_full_totals_in_seconds():
    p = parse_pressure("some avg10=0.00 avg60=1.50 avg300=0.20 total=1234567\n"
                       "full avg10=0.00 avg60=0.00 avg300=0.00 total=890\n")
    assert (p.some_seconds, p.full_seconds) == (1.234567, 0.00089)
    assert parse_pressure("some avg10=0.00 avg60=0.00 avg300=0.00 total=5\n") == parse_pressure(b"some total=5")
    assert parse_pressure("").some_seconds is None
    bad = parse_pressure("some avg10=x total=abc\nfull garbage\nnone total=3\n")
    assert (bad.some_seconds, bad.full_seconds) == (None, None)


def test_pressure_of_a_real_container_on_one_cpu_with_three_busy_loops():
    reason = can_make_cgroups()
    if reason:
        pytest.skip(reason)
    layout = detect_layout(CGROUP_ROOT)
    if layout.unified is None or not (layout.unified / "cpu.pressure").exists():
        pytest.skip("no PSI in the cgroup v2 tree (CONFIG_PSI off or psi=0)")
    cg = RealCgroup().create()
    procs = []
    try:
        if layout.version == 1 and layout.cpuset is not None:
            (layout.cpuset / cg.rel / "cpuset.cpus").write_text("0")
        for _ in range(3):  # three runnable tasks on one CPU: two always wait (cpu "some" stall)
            p = subprocess.Popen([sys.executable, "-c", "import time\nt=time.time()\nwhile time.time()-t<20: pass"])
            procs.append(p)
            cg.add(p.pid)
        col = CgroupCollector(CGROUP_ROOT, CgroupCollectorConfig(runtime_socket=None))
        s0 = col.collect(time.time())
        time.sleep(1.5)
        s1 = col.collect(time.time())
        direct = parse_pressure((layout.unified / cg.rel / "cpu.pressure").read_text())

        def val(samples, res, kind):
            return next(x.value for x in samples if x.metric == M.CONTAINER_PRESSURE_STALLED.name
                        and x.labels["container_id"] == cg.container_id and x.labels["resource"] == res
                        and x.labels["kind"] == kind)

        stalled = val(s1, "cpu", "some") - val(s0, "cpu", "some")
        assert stalled > 0.5  # ~1.5 s x at least one waiting task, whatever else runs on the machine
        assert val(s1, "cpu", "some") <= direct.some_seconds
        for res in ("memory", "io"):
            assert val(s1, res, "some") >= 0 and val(s1, res, "full") >= 0
        off = CgroupCollector(CGROUP_ROOT, CgroupCollectorConfig(runtime_socket=None, pressure=False))
        assert not [x for x in off.collect(time.time()) if x.metric == M.CONTAINER_PRESSURE_STALLED.name]
        off.close()
        col.close()
    finally:
        for p in procs:
            p.kill()
            p.wait()
        cg.remove()


# -- series under control --------------------------------------------------------------------------
def _agent(tmp_path: Path, series: dict):
    from cri_resmgr.agent import Agent
    from cri_resmgr.config import build_config
    from cri_resmgr.topology.fixtures import MACHINES, build_sysfs

    sysfs = build_sysfs(MACHINES["small-offline-isolated"], tmp_path / "sys")
    cg = tmp_path / "cgroup"
    cids = []
    for _ in range(3):
        cid, rel = _rel()
        make_v2(cg, rel, Values())
        cids.append(cid)
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "stat").write_text("".join(f"cpu{i} {i} 0 0 100 0 0 0 0\n" for i in range(7)))
    cfg = build_config({"state_dir": str(tmp_path / "state"), "run_dir": str(tmp_path / "run"),
                        "paths": {"sysfs": str(sysfs), "cgroup": str(cg), "proc": str(proc)},
                        "collectors": {"cgroup": {"runtime_socket": None}}, "series": series}, env={"NODE_NAME": "t"})
    a = Agent(cfg)
    a.topology = __import__("cri_resmgr.topology", fromlist=["discover"]).discover(sysfs)
    a._build_collectors()
    return a, cids


def test_disabled_families_are_not_stored_and_dropped_labels_merge_series(tmp_path: Path):
    from fastapi.testclient import TestClient

    from cri_resmgr.web.app import create_app

    drop = {"cri_resmgr_container_cpu_usage_seconds_total": ["container_id", "pod_uid"],
            "cri_resmgr_cpu_busy_seconds_total": ["cpu", "core"]}
    a, cids = _agent(tmp_path, {"disable": ["cri_resmgr_container_memory_*"], "drop_labels": drop})
    a.run_collector_once("cgroup")
    a.run_collector_once("cpu")
    assert a.health["cgroup"].up and a.health["cpu"].up
    names = set(a.store.metrics())
    assert M.CONTAINER_MEMORY_USAGE.name not in names and M.CONTAINER_MEMORY_WORKING_SET.name not in names
    assert M.CONTAINER_CPU_THROTTLED.name in names  # the rest of the collector's families stay
    usage = a.store.select(M.CONTAINER_CPU_USAGE.name)
    # three containers with the same (empty) names: one series, their sum
    assert len(usage) == 1 and "container_id" not in usage[0].label_dict
    _, vals = a.store.raw(usage[0], 0, time.time() + 1)
    assert vals[-1] == 3 * 5.0
    per_cpu = a.store.select(M.CPU_BUSY.name)
    assert per_cpu and all("cpu" not in r.label_dict for r in per_cpu)

    client = TestClient(create_app(a))
    summary = client.get("/api/v1/series/summary").json()
    fams = {f["family"]: f for f in summary["families"]}
    assert fams[M.CONTAINER_CPU_THROTTLED.name]["series"] == 3
    assert fams[M.CONTAINER_CPU_USAGE.name]["dropped_labels"] == ["container_id", "pod_uid"]
    assert not fams[M.CONTAINER_MEMORY_USAGE.name]["enabled"] and fams[M.CONTAINER_MEMORY_USAGE.name]["series"] == 0
    assert fams[M.CONTAINER_MEMORY_USAGE.name]["disabled_samples"] == 3
    text = client.get("/metrics").text
    assert f'cri_resmgr_store_family_series{{family="{M.CONTAINER_CPU_THROTTLED.name}"}} 3' in text
    assert f'cri_resmgr_series_disabled_samples_total{{family="{M.CONTAINER_MEMORY_USAGE.name}"}} 3' in text
    a.collectors["cgroup"].close()


def test_without_rules_samples_pass_untouched():
    from cri_resmgr.collectors.series import SeriesFilter
    from cri_resmgr.config import SeriesConfig
    from cri_resmgr.store import Sample

    s = [Sample("a", {"x": "1"}, 1.0), Sample("a", {"x": "2"}, 2.0)]
    assert SeriesFilter(lambda: SeriesConfig()).apply(s) == s
    f = SeriesFilter(lambda: SeriesConfig(drop_labels={"a": ["x"]}))
    assert f.apply(s) == [Sample("a", {}, 3.0)]


def test_past_the_descriptor_limit_files_are_opened_per_read_and_values_stay_right(tmp_path: Path):
    _containers(tmp_path, 3)
    col = CgroupCollector(tmp_path)
    col.collect(0.0)  # computes the limit from RLIMIT_NOFILE
    col.kept_open_limit = 5  # room for one container's files only
    s = col.collect(1.0)
    assert 0 < col.open_descriptors <= 5
    assert sorted(x.value for x in s if x.metric == M.CONTAINER_CPU_USAGE.name) == [1.0, 2.0, 3.0]
    col.close()


def test_poll_says_whether_the_set_changed(tmp_path: Path):
    root = tmp_path / "cgroup"
    (root / "kubepods").mkdir(parents=True)
    d = ContainerDiscovery(root)
    assert d.containers() == [] and d.poll() is False
    cid, rel = _rel()
    (root / rel).mkdir(parents=True)
    assert d.poll() is True and d.poll() is False
    assert [i.container_id for i in d.containers()] == [cid]
    d.close()


# -- change-driven reading -------------------------------------------------------------------------
def _by(samples, metric: str) -> dict[str, float]:
    return {s.labels["container_id"]: s.value for s in samples if s.metric == metric}


@pytest.mark.parametrize("make", [make_v1, make_v2])
def test_idle_container_changing_only_memory_is_read_within_the_refresh_bound(tmp_path: Path, make):
    """CPU usage and cpuset unchanged: memory is read again at the latest after idle_refresh_seconds worth of
    runs, and the runs in between repeat the last value (no gap, no zero)."""
    cid, rel = _rel()
    make(tmp_path, rel, Values(usage_ns=5_000_000_000, mem=100 * 2**20))
    cfg = CgroupCollectorConfig(runtime_socket=None, interval_seconds=5.0, idle_refresh_seconds=20.0)
    col = CgroupCollector(tmp_path, cfg, use_inotify=False)
    assert col.refresh_cycles == 4
    mem = M.CONTAINER_MEMORY_USAGE.name
    assert _by(col.collect(0.0), mem) == {cid: 100 * 2**20}
    make(tmp_path, rel, Values(usage_ns=5_000_000_000, mem=300 * 2**20))  # only memory changes
    seen = []
    for k in range(1, 6):
        seen.append(_by(col.collect(float(k)), mem)[cid])
    first_new = seen.index(300 * 2**20)
    assert first_new >= 1, "the run right after the change still carries the old value: memory is not read"
    assert first_new < col.refresh_cycles, "read again within refresh_cycles runs"
    assert seen[:first_new] == [100 * 2**20] * first_new and seen[first_new:] == [300 * 2**20] * (5 - first_new)
    make(tmp_path, rel, Values(usage_ns=6_000_000_000, mem=50 * 2**20))  # CPU moved: everything is read at once
    got = col.collect(10.0)
    assert _by(got, mem)[cid] == 50 * 2**20 and _by(got, M.CONTAINER_CPU_USAGE.name)[cid] == 6.0
    col.close()


@pytest.mark.parametrize("make", [make_v1, make_v2])
def test_change_driven_reads_equal_full_reads_when_everything_changes(tmp_path: Path, make):
    ids = []
    for _ in range(4):
        cid, rel = _rel()
        ids.append((cid, rel))
        make(tmp_path, rel, Values())
    lazy = CgroupCollector(tmp_path, CgroupCollectorConfig(runtime_socket=None), use_inotify=False)
    full = CgroupCollector(tmp_path, CgroupCollectorConfig(runtime_socket=None, idle_refresh_seconds=0),
                           use_inotify=False)
    assert lazy.refresh_cycles > 1 and full.refresh_cycles == 1
    for k in range(6):
        for i, (_cid, rel) in enumerate(ids):
            make(tmp_path, rel, Values(usage_ns=(k + 1) * 10**9 + i, mem=(k + 2 + i) * 2**20, throttled=k,
                                       cpus="0-1" if k % 2 else "1"))
        a, b = lazy.collect_row(float(k)), full.collect_row(float(k))
        assert a.keys == b.keys and np.array_equal(a.values, b.values, equal_nan=True)
        assert lazy.full_reads == len(ids)
    lazy.close()
    full.close()


def test_idle_containers_cost_a_probe_and_keep_every_series_monotonic_in_the_store(tmp_path: Path):
    """Twenty idle containers and one busy one: after the first run, each run reads the busy one in full and
    about a refresh_cycles-th of the idle ones; every series gets a value in every row, counters never drop."""
    from cri_resmgr.store import Store

    rels = []
    for _ in range(21):
        _cid, rel = _rel()
        rels.append(rel)
        make_v1(tmp_path, rel, Values())
    cfg = CgroupCollectorConfig(runtime_socket=None, interval_seconds=1.0, idle_refresh_seconds=5.0)
    col = CgroupCollector(tmp_path, cfg, use_inotify=False)
    store = Store(600)
    reads = []
    for k in range(12):
        make_v1(tmp_path, rels[0], Values(usage_ns=(k + 6) * 10**9, mem=(k + 1) * 2**20))
        store.append_columns("cgroup", float(k), col.collect_row(float(k)), 1.0)
        reads.append(col.full_reads)
    assert reads[0] == 21
    assert all(1 <= r <= 1 + -(-21 // col.refresh_cycles) for r in reads[1:]), reads
    assert sum(reads[1:]) >= 11 + 20 * 11 // col.refresh_cycles - 20  # the idle ones are refreshed, spread out
    refs = store.select(M.CONTAINER_CPU_USAGE.name) + store.select(M.CONTAINER_MEMORY_USAGE.name)
    assert len(refs) == 42
    for ref in refs:
        ts, vals = store.raw(ref, 0.0, 11.0)
        assert len(ts) == 12 and not np.isnan(vals).any() and (vals > 0).all(), "a value in every row, never 0"
        if ref.metric == M.CONTAINER_CPU_USAGE.name:
            assert (np.diff(vals) >= 0).all()
    col.close()


def test_files_reading_the_same_are_not_parsed_again_and_a_change_is(tmp_path: Path, monkeypatch):
    """A full read whose files all read as at the last one keeps the last stats without parsing (the collector
    keeps a hash of the texts, not the texts); any file that changed is parsed."""
    from cri_resmgr.collectors import cgroup as C

    cid, rel = _rel()
    make_v2(tmp_path, rel, Values(mem=100 * 2**20))
    parsed = [0]
    real = C._parse

    def counting(*a, **kw):
        parsed[0] += 1
        return real(*a, **kw)

    monkeypatch.setattr(C, "_parse", counting)
    col = CgroupCollector(tmp_path, CgroupCollectorConfig(runtime_socket=None, idle_refresh_seconds=0),
                          use_inotify=False)
    mem = M.CONTAINER_MEMORY_USAGE.name
    for k in range(4):
        assert _by(col.collect(float(k)), mem) == {cid: 100 * 2**20}
    assert parsed[0] == 1
    make_v2(tmp_path, rel, Values(mem=100 * 2**20 + 4096))  # one file, a few bytes
    assert _by(col.collect(4.0), mem) == {cid: 100 * 2**20 + 4096}
    assert parsed[0] == 2
    assert not any(isinstance(v, list) and v and isinstance(v[0], bytes)
                   for t in col._order for v in vars(t).values())  # no texts kept
    col.close()
