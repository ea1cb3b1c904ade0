"""perf collector: the syscall layer's wire format, event resolution, multiplexing arithmetic, the
descriptor budget, and real software-event counts on real cgroups (root)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cri_resmgr import metrics as M
from cri_resmgr.collectors import perf_event as pe
from cri_resmgr.collectors.cgroup import CgroupCollector
from cri_resmgr.collectors.identity import ContainerIdentity
from cri_resmgr.collectors.perf import PerfCollector, find_perf_cgroup_root, plan_selection
from cri_resmgr.collectors.perfmon import EventResolveError, encode_perfmon, load_perfmon, resolve
from cri_resmgr.config import CgroupCollectorConfig, ExtraCgroup, PerfCollectorConfig, PerfPriority
from cri_resmgr.topology import discover

from .integration.helpers import CGROUP_ROOT, RealCgroup, can_make_cgroups

PERFMON = Path(__file__).parent / "fixtures" / "perfmon"
SW_EVENTS = ["cycles", "instructions", "cpu-clock", "context-switches", "page-faults"]


# -- wire format -----------------------------------------------------------------------------------
def test_perf_event_attr_matches_the_uapi_layout():
    A = pe.PerfEventAttr
    # offsets of include/uapi/linux/perf_event.h, PERF_ATTR_SIZE_VER0..VER8 boundaries included
    assert (A.type.offset, A.size.offset, A.config.offset, A.sample_period.offset) == (0, 4, 8, 16)
    assert (A.read_format.offset, A.flags.offset, A.wakeup_events.offset, A.bp_type.offset) == (32, 40, 48, 52)
    assert (A.config1.offset, A.config2.offset) == (56, 64)  # VER0 = 64, VER1 = 72
    assert (A.branch_sample_type.offset, A.sample_regs_user.offset, A.clockid.offset) == (72, 80, 92)
    assert (A.aux_watermark.offset, A.sig_data.offset, A.config3.offset) == (104, 120, 128)
    assert ctypes.sizeof(A) == 136 == pe.PERF_ATTR_SIZE_VER8
    a = pe.make_attr(pe.PERF_TYPE_RAW, 0x412E, 7)
    raw = bytes(a)
    assert struct.unpack_from("=IIQ", raw, 0) == (pe.PERF_TYPE_RAW, 136, 0x412E)
    assert struct.unpack_from("=Q", raw, 56)[0] == 7
    assert struct.unpack_from("=Q", raw, 32)[0] == 0b1111  # TOTAL_TIME_ENABLED|RUNNING|ID|GROUP


def test_group_read_is_decoded_and_short_buffers_are_refused():
    data = struct.pack("=QQQ", 2, 2_000, 1_000) + struct.pack("=QQ", 111, 5) + struct.pack("=QQ", 222, 9)
    r = pe.parse_group_read(data)
    assert (r.time_enabled_ns, r.time_running_ns, r.values) == (2_000, 1_000, {5: 111, 9: 222})
    with pytest.raises(ValueError, match="cannot hold 2"):
        pe.parse_group_read(data[:-1])
    with pytest.raises(ValueError, match="too short"):
        pe.parse_group_read(b"\0" * 8)


def test_multiplexed_counts_are_scaled_by_enabled_over_running():
    assert pe.scale_count(1_000, 2_000_000, 1_000_000) == 2_000.0  # counted half the time
    assert pe.scale_count(300, 4_000, 1_000) == 1_200.0
    assert pe.scale_count(500, 1_000, 1_000) == 500.0  # never multiplexed
    assert pe.scale_count(0, 0, 0) == 0.0  # cgroup never ran on that CPU: an exact zero
    assert pe.scale_count(0, 5_000, 0) is None  # enabled but never on a counter: unknown, not zero


# -- event resolution ------------------------------------------------------------------------------
def test_generic_raw_and_aliased_event_names_resolve():
    c = resolve("cycles")
    assert (c.key, c.type, c.config) == ("cycles", pe.PERF_TYPE_HARDWARE, pe.PERF_COUNT_HW_CPU_CYCLES)
    assert resolve("cache-misses").key == "llc_misses" and resolve("cache-references").key == "llc_references"
    assert (resolve("cpu-clock").type, resolve("cpu-clock").key) == (pe.PERF_TYPE_SOFTWARE, "cpu_clock")
    r = resolve("r412e")
    assert (r.type, r.config, r.key) == (pe.PERF_TYPE_RAW, 0x412E, "")
    a = resolve("llc_misses=r412e")
    assert (a.key, a.config, a.name) == ("llc_misses", 0x412E, "llc_misses=r412e")
    with pytest.raises(EventResolveError, match="perfmon_path"):
        resolve("LONGEST_LAT_CACHE.MISS")
    with pytest.raises(EventResolveError, match="unknown metric 'bogus'"):
        resolve("bogus=cycles")


def test_perfmon_json_names_resolve_to_core_pmu_encodings():
    events = load_perfmon(PERFMON)
    m = resolve("llc_misses=LONGEST_LAT_CACHE.MISS", events)
    assert (m.type, m.config, m.key) == (pe.PERF_TYPE_RAW, 0x412E, "llc_misses")  # = the architectural event
    assert resolve("longest_lat_cache.reference", events).config == 0x4F2E
    assert resolve("CYCLE_ACTIVITY.STALLS_MEM_ANY", events).config == 0xA3 | 0x14 << 8 | 20 << 24
    assert resolve("UOPS_ISSUED.STALL_CYCLES", events).config == 0x0E | 0x01 << 8 | 1 << 23 | 1 << 24
    off = resolve("OFFCORE_RESPONSE.DEMAND_DATA_RD.L3_MISS.ANY_SNOOP", events)
    assert (off.config, off.config1) == (0x01B7, 0x3FBC000001)  # first EventCode, MSRValue into config1
    assert "UNC_CHA_LLC_LOOKUP.DATA_READ" not in events
    with pytest.raises(EventResolveError, match="uncore"):
        encode_perfmon({"EventName": "UNC_X", "Unit": "CHA", "EventCode": "0x34"})
    with pytest.raises(EventResolveError, match="nor in the perfmon files"):
        resolve("NO_SUCH.EVENT", events)


def test_perfmon_list_format_and_bad_files(tmp_path):
    (tmp_path / "old.json").write_text(
        '[{"EventCode": "0x3C", "UMask": "0x00", "EventName": "CPU_CLK_UNHALTED.THREAD_P"}]')
    assert load_perfmon(tmp_path / "old.json")["CPU_CLK_UNHALTED.THREAD_P"].config == 0x3C
    (tmp_path / "bad.json").write_text('{"nothing": 1}')
    with pytest.raises(EventResolveError, match="not a perfmon event file"):
        load_perfmon(tmp_path / "bad.json")


def test_unresolvable_configured_events_are_reported_by_name_and_the_rest_kept():
    col = PerfCollector(Path("/nonexistent"), PerfCollectorConfig(events=["cpu-clock", "NO_SUCH.EVENT", "r12zz"]))
    assert [e.name for e in col.events] == ["cpu-clock"]
    assert set(col.unsupported) == {"NO_SUCH.EVENT", "r12zz"}


# -- selection within the descriptor budget --------------------------------------------------------
def _ident(n: str) -> ContainerIdentity:
    return ContainerIdentity(n, "uid", "Burstable", "containerd", f"/x/{n}", name=n, pod="p", namespace="ns")


def test_selection_stays_within_budget_and_skips_the_rest_in_rank_order():
    ranked = [(_ident("a"), False, 6), (_ident("b"), False, 6), (_ident("c"), False, 8), (_ident("d"), False, 2)]
    chosen, skipped = plan_selection(ranked, set(), budget=14, full=True)
    assert [i.container_id for i in chosen] == ["a", "b", "d"]  # c does not fit, the smaller d still does
    assert [i.container_id for i in skipped] == ["c"]


def test_between_reselections_incumbents_stay_and_priority_evicts_the_lowest():
    ranked = [(_ident("p"), True, 6), (_ident("busy"), False, 6), (_ident("a"), False, 6), (_ident("b"), False, 6)]
    chosen, skipped = plan_selection(ranked, {"a", "b"}, budget=12, full=False)
    assert [i.container_id for i in chosen] == ["p", "a"]  # the newly busy one waits for the reselection
    assert {i.container_id for i in skipped} == {"busy", "b"}
    chosen, _ = plan_selection(ranked, {"a", "b"}, budget=12, full=True)
    assert [i.container_id for i in chosen] == ["p", "busy"]


# -- real perf_event on real cgroups (root) --------------------------------------------------------
class PerfCgroup(RealCgroup):
    """A RealCgroup that also exists in the hierarchy carrying perf_event (v2 unified tree, or a v1 mount)."""

    def __init__(self, perf_root: Path | None = None, **kw):
        super().__init__(**kw)
        self.perf_root = perf_root

    def _controller_roots(self) -> list[Path]:
        roots = super()._controller_roots()
        if self.perf_root is not None and self.perf_root.resolve() not in [r.resolve() for r in roots]:
            roots.append(self.perf_root)
        return roots


def _need_root():
    reason = can_make_cgroups()
    if reason:
        pytest.skip(reason)
    if find_perf_cgroup_root(CGROUP_ROOT) is None:
        pytest.skip("no hierarchy with the perf_event controller")


def _busy(seconds: float = 30.0) -> subprocess.Popen:
    # Bounded busy loop that also touches fresh memory now and then (page faults); exits on its own
    # even if a test dies before killing it.
    # (a fresh anonymous mapping each time: malloc could reuse already-faulted heap pages)
    code = ("import mmap, time\nt = n = time.time()\n"
            f"while time.time() - t < {seconds}:\n"
            "    if time.time() > n:\n"
            "        m = mmap.mmap(-1, 1 << 20); m.write(b'x' * (1 << 20)); m.close(); n = time.time() + 0.05\n")
    return subprocess.Popen([sys.executable, "-c", code])


@pytest.fixture
def containers():
    made: list[tuple[PerfCgroup, subprocess.Popen | None]] = []

    def make(n: int = 1, busy: bool = True) -> list[PerfCgroup]:
        root = find_perf_cgroup_root(CGROUP_ROOT)
        out = []
        for _ in range(n):
            cg = PerfCgroup(root.path).create()
            p = _busy() if busy else None
            if p:
                cg.add(p.pid)
            made.append((cg, p))
            out.append(cg)
        return out

    yield make
    for cg, p in made:
        if p:
            p.kill()
            p.wait()
        cg.remove()


def _value(samples, metric: str, cid: str, **labels) -> float | None:
    for s in samples:
        if (s.metric == metric and s.labels.get("container_id") == cid
                and all(s.labels.get(k) == v for k, v in labels.items())):
            return s.value
    return None


def _perf_fds(pid: int | str = "self") -> int:
    n = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            n += os.readlink(f"/proc/{pid}/fd/{fd}") == "anon_inode:[perf_event]"
        except OSError:
            continue
    return n


def _collector(cfg: PerfCollectorConfig, cgroup_cfg: CgroupCollectorConfig | None = None):
    disc = CgroupCollector(CGROUP_ROOT, cgroup_cfg)
    return disc, PerfCollector(CGROUP_ROOT, cfg, disc, discover(Path("/sys")))


def test_software_events_count_a_busy_real_cgroup_and_hardware_ones_fail_by_name(containers):
    _need_root()
    (cg,) = containers(1)
    cid = cg.container_id
    disc, col = _collector(PerfCollectorConfig(events=SW_EVENTS))
    try:
        assert col.probe().ok
        disc.collect(time.time())
        t0, s0 = time.time(), col.collect(time.time())
        u0 = disc.containers[cid].stats.cpu_usage_seconds
        time.sleep(1.5)
        disc.collect(time.time())
        t1, s1 = time.time(), col.collect(time.time())
        u1 = disc.containers[cid].stats.cpu_usage_seconds
        clock = _value(s1, M.CONTAINER_PERF_CPU_CLOCK.name, cid) - _value(s0, M.CONTAINER_PERF_CPU_CLOCK.name, cid)
        # The cpu-clock event of a busy loop counts ~1 CPU-second per second, like the cgroup's own accounting.
        assert clock == pytest.approx(u1 - u0, rel=0.15), (clock, u1 - u0)
        assert clock / (t1 - t0) > 0.1  # counting, even on a machine shared with other work
        assert _value(s1, M.CONTAINER_PAGE_FAULTS.name, cid) > _value(s0, M.CONTAINER_PAGE_FAULTS.name, cid)
        assert _value(s1, M.CONTAINER_PERF_CONTEXT_SWITCHES.name, cid) is not None
        assert _value(s1, M.CONTAINER_PERF_MONITORED.name, cid, reason="") == 1.0
        supported = {s.labels["event"]: s for s in s1 if s.metric == M.PERF_EVENT_SUPPORTED.name}
        if supported["cycles"].value == 0.0:  # this machine: no hardware PMU for guests
            assert "ENOENT" in supported["cycles"].labels["error"] and "cycles" in col.summary()
            assert _value(s1, M.CONTAINER_CYCLES.name, cid) is None
        else:  # a machine with a PMU counts them
            assert _value(s1, M.CONTAINER_CYCLES.name, cid) > 0
        assert supported["cpu-clock"].value == 1.0
        # one group per CPU of the container's cpuset, one fd per supported event
        n_cpus = len(col._target_cpus(disc.containers[cid].identity))
        assert _perf_fds() >= col.watched[cid].fds == n_cpus * len(col.supported_events)
    finally:
        col.close()
    assert not col.watched


def test_derived_cpi_is_the_ratio_of_the_two_counter_deltas(containers):
    """Cycles and instructions mapped onto software events (no PMU here): the derivation runs on real counts."""
    _need_root()
    (cg,) = containers(1)
    cid = cg.container_id
    disc, col = _collector(PerfCollectorConfig(events=["cycles=cpu-clock", "instructions=page-faults"]))
    try:
        disc.collect(time.time())
        s0 = col.collect(time.time())
        assert _value(s0, M.CONTAINER_CPI.name, cid) is None  # needs two reads
        subprocess.run([sys.executable, "-c", "x = bytearray(64 << 20)"], check=True)  # unrelated: not in cg
        time.sleep(1.0)
        s1 = col.collect(time.time())
        dc = _value(s1, M.CONTAINER_CYCLES.name, cid) - _value(s0, M.CONTAINER_CYCLES.name, cid)
        di = _value(s1, M.CONTAINER_INSTRUCTIONS.name, cid) - _value(s0, M.CONTAINER_INSTRUCTIONS.name, cid)
        cpi = _value(s1, M.CONTAINER_CPI.name, cid)
        if di > 0:
            assert cpi == pytest.approx(dc / di)
        else:
            assert cpi is None
        assert dc > 1e8  # ~1 s of cpu-clock in ns
    finally:
        col.close()


def test_descriptor_budget_is_honoured_with_many_cgroups(containers):
    _need_root()
    idle = containers(5, busy=False)
    (busy,) = containers(1, busy=True)
    n_cpus = len(discover(Path("/sys")).online)
    per = n_cpus * 3  # 3 software events per CPU
    prio = idle[0]
    disc, col = _collector(PerfCollectorConfig(
        events=["cpu-clock", "context-switches", "page-faults"], max_descriptors=2 * per, cpuset_only=False,
        priority=[PerfPriority(container_id=prio.container_id)], reselect_interval_seconds=0.5))
    base_fds = _perf_fds()
    try:
        disc.collect(time.time())
        col.collect(time.time())
        time.sleep(0.6)  # CPU usage rates need two reads; then a full reselection ranks by them
        s = col.collect(time.time())
        ours = {c.container_id for c in idle + [busy]}
        watched = set(col.watched) & ours
        assert prio.container_id in watched and busy.container_id in watched, (watched, col.summary())
        assert sum(w.fds for w in col.watched.values()) <= 2 * per
        assert _perf_fds() - base_fds <= 2 * per
        skipped = {i.container_id for i in idle[1:]}
        assert skipped <= set(col.skipped) and all(col.skipped[c].reason == "budget" for c in skipped)
        for c in skipped:
            assert _value(s, M.CONTAINER_PERF_MONITORED.name, c, reason="budget") == 0.0
        assert "skipped" in col.summary() and next(
            x.value for x in s if x.metric == M.PERF_CONTAINERS_SKIPPED.name) >= len(skipped)
    finally:
        col.close()
    assert _perf_fds() == base_fds


def test_extra_cgroups_are_watched_first(containers):
    _need_root()
    (cg,) = containers(1, busy=False)
    others = containers(2, busy=True)
    n_cpus = len(discover(Path("/sys")).online)
    disc, col = _collector(PerfCollectorConfig(events=["cpu-clock"], max_descriptors=n_cpus, cpuset_only=False),
                           CgroupCollectorConfig(extra_cgroups=[ExtraCgroup(name="demo", path=cg.rel)]))
    try:
        col.collect(time.time())
        assert list(col.watched) == ["demo"]
        assert {o.container_id for o in others} <= set(col.skipped)
    finally:
        col.close()


@pytest.fixture
def v1_perf_event_mount():
    """Mount a cgroup v1 perf_event hierarchy (as kubelet hosts on cgroup v1 have) for one test."""
    reason = can_make_cgroups()
    if reason:
        pytest.skip(reason)
    mnt = CGROUP_ROOT / "perf_event"
    if (CGROUP_ROOT / "cgroup.controllers").exists():
        pytest.skip("pure cgroup v2 host: no v1 hierarchies")
    if mnt.exists():
        pytest.skip(f"{mnt} already exists (mounted by the host)")
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "cgroup", "-o", "perf_event", "cgroup", str(mnt)], capture_output=True,
                       text=True)
    if r.returncode != 0:
        mnt.rmdir()
        pytest.skip(f"cannot mount a v1 perf_event hierarchy: {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        _unmount_v1_perf_event(mnt)


def _perf_event_on_v1() -> bool:
    line = next((ln for ln in Path("/proc/cgroups").read_text().splitlines() if ln.startswith("perf_event")), "")
    return line.split()[1:2] != ["0"]


def _unmount_v1_perf_event(mnt: Path) -> None:
    """Unmount and make sure the kernel destroys the hierarchy, so perf_event goes back to the v2 tree.

    A v1 hierarchy is only destroyed if it has no child cgroups when it is unmounted
    (kernel/cgroup/cgroup.c, cgroup_kill_sb); a just-removed child can still be dying then, and the
    hierarchy would linger unmounted, holding perf_event. Mounting it again and unmounting once the
    children are gone retries the destruction.
    """
    deadline = time.time() + 30
    # Children left by a failed test would keep the hierarchy alive: remove them deepest first.
    for d in sorted((p for p in mnt.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
        with contextlib.suppress(OSError):
            d.rmdir()
    subprocess.run(["umount", str(mnt)], check=False)
    while _perf_event_on_v1() and time.time() < deadline:
        time.sleep(0.5)
        if not _perf_event_on_v1():
            break
        subprocess.run(["mount", "-t", "cgroup", "-o", "perf_event", "cgroup", str(mnt)], check=False)
        subprocess.run(["umount", str(mnt)], check=False)
    mnt.rmdir()
    assert not _perf_event_on_v1(), "the v1 perf_event hierarchy was not destroyed"


def test_v1_perf_event_hierarchy_is_used_when_mounted(v1_perf_event_mount):
    root = find_perf_cgroup_root(CGROUP_ROOT)
    assert root.kind == "cgroup v1 perf_event" and root.path == v1_perf_event_mount
    cg = PerfCgroup(v1_perf_event_mount).create()
    p = _busy()
    disc, col = _collector(PerfCollectorConfig(events=["cpu-clock"]))
    try:
        cg.add(p.pid)
        disc.collect(time.time())
        s0 = col.collect(time.time())
        u0 = disc.containers[cg.container_id].stats.cpu_usage_seconds
        time.sleep(1.0)
        disc.collect(time.time())
        s1 = col.collect(time.time())
        u1 = disc.containers[cg.container_id].stats.cpu_usage_seconds
        clock = M.CONTAINER_PERF_CPU_CLOCK.name
        d = _value(s1, clock, cg.container_id) - _value(s0, clock, cg.container_id)
        assert d > 0.1 and d == pytest.approx(u1 - u0, rel=0.15), (d, u1 - u0)
        assert "cgroup v1 perf_event" in col.summary()
    finally:
        col.close()
        p.kill()
        p.wait()
        cg.remove()


def test_enabled_and_running_time_and_descriptors_are_reported_per_container(containers):
    """Software events never multiplex (running == enabled); what is checked is that the kernel's times
    arrive and that the descriptors held are those the container's CPUs x events need."""
    _need_root()
    (cg,) = containers(1)
    cid = cg.container_id
    events = ["cpu-clock", "page-faults"]
    disc, col = _collector(PerfCollectorConfig(events=events))
    try:
        disc.collect(time.time())
        s0 = col.collect(time.time())
        time.sleep(1.0)
        s1 = col.collect(time.time())
        enabled = _value(s1, M.CONTAINER_PERF_ENABLED.name, cid) - _value(s0, M.CONTAINER_PERF_ENABLED.name, cid)
        running = _value(s1, M.CONTAINER_PERF_RUNNING.name, cid) - _value(s0, M.CONTAINER_PERF_RUNNING.name, cid)
        assert 0.2 < running <= enabled  # the busy process ran for much of the second
        fds = _value(s1, M.CONTAINER_PERF_DESCRIPTORS.name, cid)
        assert fds == len(col.watched[cid].groups) * len(events) == col.watched[cid].fds
        assert _perf_fds() >= fds
    finally:
        col.close()


def test_groups_of_a_container_that_did_not_run_are_read_only_at_the_idle_refresh(containers):
    """A container whose CPU usage stands still has its groups read only every refresh_runs runs (its counts,
    and their enabled/running times, stand while it does not run); its series stay, with the same values.
    A busy one is read every run."""
    _need_root()
    (busy,) = containers(1)
    (idle,) = containers(1, busy=False)
    disc, col = _collector(PerfCollectorConfig(events=["cpu-clock", "context-switches"], interval_seconds=1.0),
                           CgroupCollectorConfig(runtime_socket=None, idle_refresh_seconds=4.0))
    try:
        assert col.refresh_runs == 4
        idle_read, busy_read, busy_clock, idle_clock = [], [], [], []
        for _ in range(9):
            disc.collect(time.time())
            now = time.time()
            s = col.collect(now)
            # whether the groups were read in this run (other containers on this machine may be watched too)
            idle_read.append(col.watched[idle.container_id].read_at == now)
            busy_read.append(col.watched[busy.container_id].read_at == now)
            busy_clock.append(_value(s, M.CONTAINER_PERF_CPU_CLOCK.name, busy.container_id))
            idle_clock.append(_value(s, M.CONTAINER_PERF_CPU_CLOCK.name, idle.container_id))
            assert _value(s, M.CONTAINER_PERF_ENABLED.name, idle.container_id) is not None
            time.sleep(0.2)
        assert all(busy_read), busy_read
        assert idle_read[0] and not all(idle_read), idle_read
        gaps = [i for i, r in enumerate(idle_read) if r]
        assert all(b - a <= col.refresh_runs for a, b in zip(gaps, gaps[1:], strict=False)) and gaps[-1] >= 9 - 4, gaps
        assert all(b > a for a, b in zip(busy_clock, busy_clock[1:], strict=False)), busy_clock
        assert idle_clock[0] is not None and set(idle_clock) == {idle_clock[0]}, idle_clock
    finally:
        col.close()
        disc.close()


class _Only(CgroupCollector):
    """The machine's containers narrowed to the test's own (other tests may make and remove containers on this
    machine meanwhile, and any change of the set makes the collector select again)."""

    def __init__(self, only: set[str]):
        super().__init__(CGROUP_ROOT, CgroupCollectorConfig(runtime_socket=None, idle_refresh_seconds=60.0))
        self.only = only

    def identities(self, layout, found=None):
        return [i for i in super().identities(layout, found) if i.container_id in self.only]


def test_an_unchanged_selection_stands_and_a_new_container_is_ranked_and_watched(containers, monkeypatch):
    """While the containers, their CPUs and the budget stay the same, a run neither ranks nor plans nor opens;
    a new container makes the next run select again, and it is watched."""
    _need_root()
    first = containers(3, busy=False)
    disc = _Only({c.container_id for c in first})
    col = PerfCollector(CGROUP_ROOT, PerfCollectorConfig(events=["cpu-clock", "page-faults"]), disc,
                        discover(Path("/sys")))
    ranks = []
    real_rank = col._rank
    monkeypatch.setattr(col, "_rank", lambda *a, **k: ranks.append(1) or real_rank(*a, **k))
    try:
        col.collect(time.time())
        assert len(ranks) == 1 and set(col.watched) == disc.only
        for _ in range(3):
            s = col.collect(time.time())
        assert len(ranks) == 1, "nothing changed: no ranking"
        assert all(_value(s, M.CONTAINER_PERF_MONITORED.name, c.container_id, reason="") == 1.0 for c in first)
        (new,) = containers(1, busy=False)
        disc.only.add(new.container_id)
        s = col.collect(time.time())
        assert len(ranks) == 2 and new.container_id in col.watched
        assert _value(s, M.CONTAINER_PERF_CPU_CLOCK.name, new.container_id) is not None
    finally:
        col.close()


def test_a_container_without_its_perf_cgroup_is_watched_once_that_directory_appears(containers):
    """runc makes a container's directory in one hierarchy after another: a container seen before its
    directory exists in the perf_event hierarchy is skipped, and watched by the first run after it appears
    (the selection is otherwise unchanged, so this is what makes the run select again)."""
    _need_root()
    root = find_perf_cgroup_root(CGROUP_ROOT)
    (other,) = containers(1, busy=False)
    late = PerfCgroup(None, unified=False)  # the v1 controllers only, for now
    later = PerfCgroup(root.path)
    later.rel = late.rel
    disc = _Only({other.container_id, late.container_id})
    col = PerfCollector(CGROUP_ROOT, PerfCollectorConfig(events=["cpu-clock"]), disc, discover(Path("/sys")))
    try:
        late.create()
        if root.path.resolve() in [r.resolve() for r in late._controller_roots()]:
            pytest.skip("the perf_event hierarchy is one of the accounting ones here")
        for _ in range(2):
            s = col.collect(time.time())
            assert col.skipped[late.container_id].reason == "no_perf_cgroup"
            assert _value(s, M.CONTAINER_PERF_MONITORED.name, late.container_id, reason="no_perf_cgroup") == 0.0
        later.create()
        s = col.collect(time.time())
        assert late.container_id in col.watched and late.container_id not in col.skipped
        assert _value(s, M.CONTAINER_PERF_MONITORED.name, late.container_id, reason="") == 1.0
    finally:
        col.close()
        later.remove()
        late.remove()


def test_idle_runs_keep_the_row_and_its_values_and_store_like_samples(containers):
    """Runs in which no watched container ran return the same keys list (the store resolves nothing) with the
    same counts; stored through Columns the rows read back like the samples. A busy container's counts move
    every run."""
    from cri_resmgr.store import Store

    _need_root()
    idle = containers(2, busy=False)
    (busy,) = containers(1, busy=True)
    disc = _Only({c.container_id for c in [*idle, busy]})
    col = PerfCollector(CGROUP_ROOT, PerfCollectorConfig(events=["cpu-clock", "context-switches"]), disc,
                        discover(Path("/sys")))
    by_rows, by_samples = Store(600), Store(600)
    rows = []
    try:
        for k in range(6):
            t = 1000.0 + k
            row = col.collect_row(t)
            rows.append(row)
            by_rows.append_columns("perf", t, row)
            by_samples.append("perf", t, row.samples())
            time.sleep(0.1)
        assert all(a.keys is b.keys for a, b in zip(rows[1:], rows[2:], strict=False)), "the same keys list"
        clock = M.CONTAINER_PERF_CPU_CLOCK.name
        for c in idle:
            seen = {_value(r.samples(), clock, c.container_id) for r in rows}
            assert len(seen) == 1 and None not in seen, seen
        moving = [_value(r.samples(), clock, busy.container_id) for r in rows]
        assert all(b > a for a, b in zip(moving, moving[1:], strict=False)), moving
        assert col.idle_groups >= 2
        assert by_rows.series_count == by_samples.series_count
        assert sorted((r.metric, r.labels, v) for r, _, v in by_rows.latest()) == \
            sorted((r.metric, r.labels, v) for r, _, v in by_samples.latest())
    finally:
        col.close()
