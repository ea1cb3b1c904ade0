"""RDT collector on the FUSE resctrl emulator (tests/resctrlfs.py) with fixture cgroup trees."""

from __future__ import annotations

import math
import os
import uuid
from pathlib import Path

import numpy as np
import pytest

from cri_resmgr import metrics as M
from cri_resmgr.agent import Agent
from cri_resmgr.collectors.base import CollectorUnavailable
from cri_resmgr.collectors.cgroup import CgroupCollector
from cri_resmgr.collectors.rdt import (
    ESTIMATE_UNIT_SHARE,
    GROUP_PREFIX,
    IDLE_REASON,
    MBM_IDLE_REFRESHES,
    STATIC_REFRESH_SECONDS,
    Counter,
    RdtCollector,
    counter_delta,
    estimate_bytes,
    parse_mon_features,
    parse_mon_value,
)
from cri_resmgr.config import CgroupCollectorConfig, RdtCollectorConfig, build_config

from .cgroupfs import Values, make_v2
from .resctrlfs import ResctrlEmulator, fuse_unavailable


# -- pure parsing and arithmetic -------------------------------------------------------------------
def test_mon_values_parse_counts_and_the_kernels_non_values():
    assert parse_mon_value("123456\n").value == 123456
    for word in ("Unavailable", "Error", "Unassigned"):
        v = parse_mon_value(word + "\n")
        assert (v.value, v.status) == (None, word)
    assert parse_mon_value("").status == "malformed" and parse_mon_value(None).status == "missing"
    assert parse_mon_value("-5").status == "malformed"


def test_mon_features_skip_bmec_config_entries():
    text = "llc_occupancy\nmbm_total_bytes\nmbm_total_bytes_config\nmbm_local_bytes\nmbm_local_bytes_config\n"
    assert parse_mon_features(text) == {"llc_occupancy", "mbm_total_bytes", "mbm_local_bytes"}
    assert parse_mon_features("") == frozenset()


def test_counter_wrap_yields_positive_delta():
    assert counter_delta(100, 250, 24) == 150
    assert counter_delta((1 << 24) - 10, 5, 24) == 15  # wrapped once
    assert counter_delta(1000, 10, 64) == 10  # 64 bits: a smaller value is a reset, not a wrap
    c = Counter()
    assert c.advance((1 << 32) - 100, 32) == (1 << 32) - 100
    assert c.advance(50, 32) == (1 << 32) + 50  # the running total keeps growing past the width


# -- fixtures --------------------------------------------------------------------------------------
@pytest.fixture
def emulator(tmp_path):
    reason = fuse_unavailable()
    if reason:
        pytest.skip(reason)
    mounted = []

    def make(**kw) -> ResctrlEmulator:
        emu = ResctrlEmulator(**kw).mount(tmp_path / f"resctrl{len(mounted)}")
        mounted.append(emu)
        return emu

    yield make
    for col in _OPEN:  # a collector keeps its resctrl files open: close it first, as the agent does at stop
        col.close()
    _OPEN.clear()
    for emu in mounted:
        emu.unmount()


_OPEN: list[RdtCollector] = []


class Node:
    """A cgroup v2 fixture tree with Kubernetes container cgroups and their thread ids."""

    def __init__(self, root: Path):
        self.root = root
        self.next_tid = 1000
        self.rel: dict[str, str] = {}

    def add(self, n_threads: int = 2, qos: str = "burstable") -> tuple[str, list[int]]:
        cid = uuid.uuid4().hex + uuid.uuid4().hex
        rel = f"kubepods/{qos}/pod{uuid.uuid4()}/{cid}".replace("/guaranteed/", "/")
        make_v2(self.root, rel, Values())
        tids = list(range(self.next_tid, self.next_tid + n_threads))
        self.next_tid += n_threads
        self.rel[cid] = rel
        self.set_threads(cid, tids)
        return cid, tids

    def set_threads(self, cid: str, tids: list[int]) -> None:
        (self.root / self.rel[cid] / "cgroup.threads").write_text("".join(f"{t}\n" for t in tids))
        (self.root / self.rel[cid] / "cgroup.procs").write_text(f"{tids[0]}\n" if tids else "")

    def remove(self, cid: str) -> None:
        import shutil

        shutil.rmtree(self.root / self.rel.pop(cid))


@pytest.fixture
def node(tmp_path):
    return Node(tmp_path / "cgroup")


def _collector(emu: ResctrlEmulator, node: Node, idle_refresh_seconds: float = 0.0, **cfg) -> RdtCollector:
    # The fixture's containers make traffic without using CPU time (their cpu.stat stands still), which no
    # real container does: these tests read the counters every run (idle_refresh_seconds 0); reading them
    # only for containers that ran is tested on its own below.
    col = RdtCollector(emu.mountpoint, node.root, RdtCollectorConfig(**cfg),
                       CgroupCollector(node.root, CgroupCollectorConfig(idle_refresh_seconds=idle_refresh_seconds)))
    _OPEN.append(col)
    return col


def _series(samples, metric: str, **labels) -> dict[tuple, float]:
    return {tuple(sorted(s.labels.items())): s.value for s in samples
            if s.metric == metric and all(s.labels.get(k) == v for k, v in labels.items())}


def _one(samples, metric: str, **labels) -> float | None:
    vals = list(_series(samples, metric, **labels).values())
    assert len(vals) <= 1, vals
    return vals[0] if vals else None


# -- behaviour on the emulator ---------------------------------------------------------------------
def test_bandwidth_rates_from_advancing_counters_are_within_1pct_of_truth(emulator, node):
    emu = emulator(domains=(0, 1))
    truth, threads = {}, {}
    for i, rate in enumerate((2.5e9, 0.8e9, 0.15e9)):
        cid, tids = node.add(n_threads=2)
        truth[cid], threads[cid] = rate, tids
        for j, tid in enumerate(tids):  # two threads, split 3:1, across two L3 domains
            share = 0.75 if j == 0 else 0.25
            emu.set_task(tid, mbm_total={0: rate * share, 1: rate * share / 2}, mbm_local={0: rate * share * 0.9},
                         occupancy={0: (i + 1) * 2**20 * (j + 1)})
    emu.set_task(1, mbm_total={0: 1e9})  # a task outside any container, counted in the root group only
    col = _collector(emu, node)
    s0 = col.collect(1000.0)
    assert len(col.groups) == 3 and not col.unmonitored
    for cid, tids in threads.items():  # every thread of the container is in its MON group
        assert emu._tasks_of(emu.root.mon_groups[GROUP_PREFIX + cid]) == tids
    emu.advance(2.0)
    s1 = col.collect(1002.0)
    for cid, rate in truth.items():
        for dom, expect in ((0, rate), (1, rate / 2)):
            d = (_one(s1, M.CONTAINER_MEMORY_BANDWIDTH.name, container_id=cid, scope="total", cache_id=str(dom))
                 - _one(s0, M.CONTAINER_MEMORY_BANDWIDTH.name, container_id=cid, scope="total", cache_id=str(dom)))
            assert d / 2.0 == pytest.approx(expect, rel=0.01), (cid, dom)
        local = (_one(s1, M.CONTAINER_MEMORY_BANDWIDTH.name, container_id=cid, scope="local", cache_id="0")
                 - _one(s0, M.CONTAINER_MEMORY_BANDWIDTH.name, container_id=cid, scope="local", cache_id="0"))
        assert local / 2.0 == pytest.approx(rate * 0.9, rel=0.01)
        assert _one(s1, M.CONTAINER_RDT_MONITORED.name, container_id=cid) == 1.0
    occ = _series(s1, M.CONTAINER_LLC_OCCUPANCY.name, cache_id="0")
    assert sorted(occ.values()) == [3 * 2**20, 6 * 2**20, 9 * 2**20]
    # node total per L3 domain: every task, inside containers or not
    node_d0 = (_one(s1, M.NODE_MEMORY_BANDWIDTH.name, scope="total", cache_id="0")
               - _one(s0, M.NODE_MEMORY_BANDWIDTH.name, scope="total", cache_id="0"))
    assert node_d0 / 2.0 == pytest.approx(sum(truth.values()) + 1e9, rel=0.01)
    assert _one(s1, M.NODE_LLC_OCCUPANCY.name, cache_id="0") == 18 * 2**20
    assert _one(s1, M.RDT_MON_GROUPS.name) == 3.0 and _one(s1, M.RDT_RMIDS.name) == 16.0


def test_groups_share_their_read_templates_and_each_descriptor_is_its_own_groups_file(emulator, node):
    """Every MON group reads the same (file, cache id, template) list, with its directory put in only to open a
    file (~0.45 MB of per-group paths at 1,000 containers); the descriptors kept open are, by /proc/self/fd,
    each its own group's counter files, and the read log names the real files."""
    emu = emulator(domains=(0, 1))
    for i in range(3):
        _, (tid,) = node.add(n_threads=1)
        emu.set_task(tid, mbm_total={0: 1e8 * (i + 1)}, occupancy={0: (i + 1) << 20})
    col = _collector(emu, node)
    col.read_log = []
    for t in range(3):
        col.collect(1000.0 + 2 * t)
        emu.advance(2.0)
    groups = list(col.groups.values())
    assert len(groups) == 3 and all(g.reads is groups[0].reads for g in groups)
    assert all("\0" in path for _, _, path in groups[0].reads) and len(groups[0].reads) == 2 * 3
    for g in groups:
        assert g.read_fds is not None and len(g.read_fds) == len(g.reads)
        opened = [os.readlink(f"/proc/self/fd/{fd}") for fd in g.read_fds]
        assert opened == [f"{g.path}/mon_data/mon_L3_{c:02d}/{f}" for f, c, _ in g.reads]
        assert all(p in col.read_log[-1] for p in opened)


def test_counter_wrap_yields_positive_rate(emulator, node):
    emu = emulator(domains=(0,), width_bits=24)
    cid, (tid, _) = node.add()
    emu.set_task(tid, mbm_total={0: 3e6})  # 3 MB/s: a 24-bit counter (16 MiB) wraps every ~5.6 s
    col = _collector(emu, node, mbm_counter_width_bits=24)
    col.collect(0.0)
    emu.set_counter(f"mon_groups/{GROUP_PREFIX}{cid}", 0, "mbm_total_bytes", (1 << 24) - 1_000_000)
    s0 = col.collect(1.0)
    emu.advance(2.0)  # +6 MB: past 2**24
    s1 = col.collect(3.0)
    raw = int((emu.mountpoint / f"mon_groups/{GROUP_PREFIX}{cid}/mon_data/mon_L3_00/mbm_total_bytes").read_text())
    assert raw < 1_000_000 * 6  # the file did wrap
    d = (_one(s1, M.CONTAINER_MEMORY_BANDWIDTH.name, container_id=cid, scope="total")
         - _one(s0, M.CONTAINER_MEMORY_BANDWIDTH.name, container_id=cid, scope="total"))
    assert d == pytest.approx(6e6, rel=0.01)


def test_unavailable_and_error_readings_are_not_counted_and_said(emulator, node):
    emu = emulator(domains=(0, 1))
    cid, (tid, _) = node.add()
    emu.set_task(tid, mbm_total={0: 1e9, 1: 1e9}, occupancy={0: 1 << 20, 1: 1 << 20})
    col = _collector(emu, node)
    s0 = col.collect(0.0)
    g = f"mon_groups/{GROUP_PREFIX}{cid}"
    emu.set_status(g, 0, "mbm_total_bytes", "Unavailable")
    emu.set_status(g, 1, "llc_occupancy", "Error")
    emu.advance(1.0)
    s1 = col.collect(1.0)
    # not counted: the counter holds the bytes seen up to the last valid reading
    assert (_one(s1, M.CONTAINER_MEMORY_BANDWIDTH.name, container_id=cid, scope="total", cache_id="0")
            == _one(s0, M.CONTAINER_MEMORY_BANDWIDTH.name, container_id=cid, scope="total", cache_id="0"))
    assert _one(s1, M.CONTAINER_LLC_OCCUPANCY.name, container_id=cid, cache_id="1") is None
    assert _one(s1, M.CONTAINER_MEMORY_BANDWIDTH.name, container_id=cid, scope="total", cache_id="1") is not None
    assert "1 Unavailable" in col.status() and "1 Error" in col.status()
    emu.set_status(g, 0, "mbm_total_bytes", None)
    emu.advance(1.0)
    s2 = col.collect(2.0)
    d = (_one(s2, M.CONTAINER_MEMORY_BANDWIDTH.name, container_id=cid, scope="total", cache_id="0")
         - _one(s0, M.CONTAINER_MEMORY_BANDWIDTH.name, container_id=cid, scope="total", cache_id="0"))
    assert d == pytest.approx(2e9, rel=0.01)  # the bytes of the unreadable interval are not lost


def test_rmid_exhaustion_lowers_the_budget_reports_unmonitored_and_recovers(emulator, node):
    emu = emulator(num_rmids=4)  # RMID 0 is the root group's: three for MON groups, as far as one can see
    emu.next_rmid += 1  # ... but one is taken where no group shows it (an RMID in limbo): ENOSPC comes early
    cids = [node.add()[0] for _ in range(3)]
    col = _collector(emu, node)
    s = col.collect(0.0)
    assert len(col.groups) == 2 and len(col.unmonitored) == 1
    (cid,) = col.unmonitored
    assert _one(s, M.CONTAINER_RDT_MONITORED.name, container_id=cid, reason="rmid_exhausted") == 0.0
    assert "no free RMID: Out of RMIDs" in col.unmonitored[cid][1]
    assert "unmonitored 1" in col.status() and "Out of RMIDs" in col.status()
    mkdirs = sum(c.startswith("mkdir") for c in emu.commands)
    s = col.collect(1.0)  # the budget is now what held: two groups, one of them rotating
    assert col.capacity == 2 and _one(s, M.RDT_RMID_BUDGET.name) == 2.0
    assert len(col.groups) == 2 and emu.used_rmids() <= 4
    assert sum(c.startswith("mkdir") for c in emu.commands) - mkdirs <= 1  # no mkdir storm while exhausted
    reasons = sorted(f"{dict(k)['reason']}={v:g}" for c in cids
                     for k, v in _series(s, M.CONTAINER_RDT_MONITORED.name, container_id=c).items())
    assert reasons == ["ranked=1", "rotation=1", "rotation_wait=0"]
    gone = next(iter(col.groups))
    node.remove(gone)
    col.collect(2.0)  # the exited container's group is removed, its RMID given to a waiting one
    assert gone not in col.groups and not (emu.mountpoint / "mon_groups" / (GROUP_PREFIX + gone)).exists()
    assert set(col.groups) == set(cids) - {gone} and not col.unmonitored


def test_rotation_covers_every_container_and_scaled_rates_match_the_truth(emulator, node):
    emu = emulator(num_rmids=5, domains=(0,))  # four MON groups for eight containers
    truth = {}
    for i in range(8):
        cid, (tid, _) = node.add(n_threads=2, qos="guaranteed" if i == 1 else "burstable")
        truth[cid] = (i + 1) * 1e8
        emu.set_task(tid, mbm_total={0: truth[cid]})
    vip = next(iter(truth))
    guaranteed = list(truth)[1]
    col = _collector(emu, node, rotation_slice_seconds=2.0, rotation_share=0.5,
                     priority=[{"container_id": vip[:8] + "*"}])
    first: dict[str, float] = {}
    seen_reasons: dict[str, set[str]] = {c: set() for c in truth}
    for t in range(41):
        s = col.collect(float(t))
        assert len(col.groups) <= 4 and emu.used_rmids() <= 5 and not col.issues
        for cid in truth:
            for labels, v in _series(s, M.CONTAINER_RDT_MONITORED.name, container_id=cid).items():
                seen_reasons[cid].add(f"{dict(labels)['reason']}={v:g}")
            if cid in col.groups and cid not in first:
                first[cid] = float(t)
        emu.advance(1.0)
    assert seen_reasons[vip] == {"priority=1"} and seen_reasons[guaranteed] == {"ranked=1"}
    for cid in set(truth) - {vip, guaranteed}:  # the rest took turns
        assert seen_reasons[cid] == {"rotation=1", "rotation_wait=0"}, seen_reasons[cid]
    for cid, rate in truth.items():
        est = _one(s, M.CONTAINER_MEMORY_BANDWIDTH.name, container_id=cid, scope="total")
        watched = _one(s, M.CONTAINER_RDT_MONITORED_SECONDS.name, container_id=cid)
        elapsed = 40.0 - first[cid]
        assert est / elapsed == pytest.approx(rate, rel=0.02), cid
        if cid in (vip, guaranteed):
            assert watched == elapsed
        else:
            assert 0 < watched < elapsed / 2


def test_stale_groups_from_an_earlier_run_are_removed_and_live_ones_adopted(emulator, node):
    emu = emulator()
    live, _ = node.add()
    mg = emu.mountpoint / "mon_groups"
    (mg / (GROUP_PREFIX + "deadbeef" * 8)).mkdir()
    (mg / (GROUP_PREFIX + live)).mkdir()
    (mg / "someone-else").mkdir()
    (emu.mountpoint / "gold").mkdir()
    (emu.mountpoint / "gold/mon_groups" / (GROUP_PREFIX + "cafe" * 16)).mkdir()
    before = list(emu.commands)
    col = _collector(emu, node)
    col.collect(0.0)
    assert sorted(p.name for p in mg.iterdir()) == sorted([GROUP_PREFIX + live, "someone-else"])
    assert list((emu.mountpoint / "gold/mon_groups").iterdir()) == []
    assert [c for c in emu.commands[len(before):] if c.startswith("mkdir")] == []  # adopted, not recreated
    assert list(col.groups) == [live]


def test_failed_task_write_surfaces_last_cmd_status(emulator, node):
    emu = emulator()
    cid, (t1, t2) = node.add()
    (emu.mountpoint / "gold").mkdir()
    emu.move_task_to_ctrl(t1, "gold")  # e.g. a CAT class given by another tool: not in the root CTRL_MON group
    col = _collector(emu, node)
    s = col.collect(0.0)
    (issue,) = col.issues  # the group follows the first thread (in "gold"); the stray one cannot join it
    assert (emu.mountpoint / "gold" / "mon_groups" / (GROUP_PREFIX + cid)).is_dir()
    assert issue.last_cmd_status == "Can't move task to different control group"
    assert issue.error == "Invalid argument" and str(t2) in issue.operation
    assert "last_cmd_status: Can't move task to different control group" in col.status()
    assert _one(s, M.RDT_WRITE_ERRORS.name) == 1.0


def test_tasks_are_synced_every_cycle_and_groups_removed_with_their_container(emulator, node):
    emu = emulator()
    cid, tids = node.add(n_threads=1)
    col = _collector(emu, node)
    col.collect(0.0)
    tasks = emu.mountpoint / "mon_groups" / (GROUP_PREFIX + cid) / "tasks"
    assert tasks.read_text().split() == [str(t) for t in tids]
    node.set_threads(cid, tids + [4242])  # a thread that existed before sync, or moved in later
    col.collect(1.0)
    assert sorted(tasks.read_text().split()) == sorted([str(t) for t in tids] + ["4242"])
    writes = [c for c in emu.commands if c.startswith("write")]
    col.collect(2.0)
    assert [c for c in emu.commands if c.startswith("write")] == writes  # nothing to write when in sync
    node.remove(cid)
    col.collect(3.0)
    assert not tasks.parent.exists() and emu.owner(4242) is emu.root  # tasks went back to the parent group
    col.close()


@pytest.mark.parametrize("features, has_bw, has_occ", [
    (("mbm_total_bytes", "mbm_local_bytes"), True, False),  # MBM-only
    (("llc_occupancy",), False, True),  # CMT-only
])
def test_mbm_only_and_cmt_only_trees(emulator, node, features, has_bw, has_occ):
    emu = emulator(features=features)
    cid, (tid, _) = node.add()
    emu.set_task(tid, mbm_total={0: 1e9}, mbm_local={0: 1e9}, occupancy={0: 1 << 20})
    col = _collector(emu, node)
    assert col.probe().ok
    col.collect(0.0)
    emu.advance(1.0)
    s = col.collect(1.0)
    assert bool(_series(s, M.CONTAINER_MEMORY_BANDWIDTH.name, container_id=cid)) == has_bw
    assert bool(_series(s, M.CONTAINER_LLC_OCCUPANCY.name, container_id=cid)) == has_occ
    assert bool(_series(s, M.NODE_MEMORY_BANDWIDTH.name)) == has_bw
    assert not col.issues


def test_allocation_only_system_is_reported_not_fatal(emulator, node, tmp_path):
    emu = emulator(monitoring=False, allocation=("MB",))
    node.add()
    col = _collector(emu, node)
    p = col.probe()
    assert not p.ok and "no L3 monitoring" in p.reason and "MB" in p.reason
    with pytest.raises(CollectorUnavailable, match="allocation only"):
        col.collect(0.0)
    cfg = build_config({"paths": {"resctrl": str(emu.mountpoint), "cgroup": str(node.root)}}, env={})
    agent = Agent(cfg)
    agent._build_collectors()
    agent.run_collector_once("rdt")
    h = agent.health["rdt"]
    assert (h.up, h.errors_total) == (False, 0) and "no L3 monitoring" in h.reason


def test_resctrl_not_mounted_is_reported(tmp_path, node):
    node.add()
    col = RdtCollector(tmp_path / "no-resctrl", node.root)
    assert "not mounted" in col.probe().reason
    with pytest.raises(CollectorUnavailable, match="not mounted"):
        col.collect(0.0)


def test_containers_go_into_a_configured_control_group(emulator, node):
    emu = emulator()
    (emu.mountpoint / "gold").mkdir()
    cid, (t1, t2) = node.add()
    emu.move_task_to_ctrl(t1, "gold")
    emu.move_task_to_ctrl(t2, "gold")
    col = _collector(emu, node, control_group="gold")
    col.collect(0.0)
    assert (emu.mountpoint / "gold/mon_groups" / (GROUP_PREFIX + cid)).is_dir() and not col.issues
    assert emu.owner(t1).name == GROUP_PREFIX + cid


def test_tasks_moved_away_by_someone_else_come_back_after_verification(emulator, node):
    emu = emulator()
    cid, (tid,) = node.add(n_threads=1)
    _usage(node, cid, 1.0)
    now = [0.0]
    col = RdtCollector(emu.mountpoint, node.root, RdtCollectorConfig(), CgroupCollector(node.root),
                       clock=lambda: now[0])
    _OPEN.append(col)
    col.collect(0.0)
    group = emu.root.mon_groups[GROUP_PREFIX + cid]
    assert emu.owner(tid) is group
    emu.move_task_to_ctrl(tid, "")  # another tool put it back into the root group
    now[0] = 10.0
    col.collect(10.0)
    assert emu.owner(tid) is emu.root  # not re-read yet: reading tasks walks every thread of the machine
    now[0] = 10.0 + 60.0
    col.collect(70.0)
    assert emu.owner(tid) is emu.root  # due, but the container did not run: nothing to count, nothing checked
    _usage(node, cid, 2.0)
    now[0] = 71.0
    col.collect(71.0)
    assert emu.owner(tid) is group  # it ran: verified and moved back


def test_pod_annotation_keeps_a_mon_group_when_rmids_run_short(emulator, node):
    from cri_resmgr.collectors.names import ContainerNames

    emu = emulator(num_rmids=3)  # two MON groups for four containers
    cids = [node.add()[0] for _ in range(4)]
    key = "rdt-monitor.cri-resource-manager.intel.com"
    # What the runtime's CRI answers for these containers (names.py keeps the annotations of this domain).
    answers = {cids[3]: ContainerNames("ns", "db", "main", ((f"{key}/container.main", "true"),)),
               cids[2]: ContainerNames("ns", "web", "main", ((f"{key}/pod", "false"),))}

    class Runtime:
        error = None

        def names(self, ids=()):
            return answers

    col = RdtCollector(emu.mountpoint, node.root, RdtCollectorConfig(rotation_slice_seconds=1.0),
                       CgroupCollector(node.root, names=Runtime()))
    _OPEN.append(col)
    for t in range(6):
        s = col.collect(float(t))
        assert _one(s, M.CONTAINER_RDT_MONITORED.name, container_id=cids[3], reason="priority") == 1.0
        assert _one(s, M.CONTAINER_RDT_MONITORED.name, container_id=cids[2], reason="priority") is None
        assert len(col.groups) == 2


def test_rmids_in_limbo_answer_ebusy_without_lowering_the_budget(emulator, node):
    emu = emulator(num_rmids=4)  # three MON groups for five containers: one rotates
    emu.limbo_seconds = 1.5  # a rotated-out RMID is busy for a while (its cache lines are still tagged)
    cids = [node.add()[0] for _ in range(5)]
    now = [0.0]
    col = RdtCollector(emu.mountpoint, node.root, RdtCollectorConfig(rotation_slice_seconds=2.0),
                       CgroupCollector(node.root), clock=lambda: now[0])
    _OPEN.append(col)
    busy = 0
    watched: set[str] = set()
    for t in range(12):
        now[0] = float(t)
        s = col.collect(float(t))
        busy += any("RMIDs busy in limbo" in r for _, r in col.unmonitored.values())
        busy += bool(_series(s, M.CONTAINER_RDT_MONITORED.name, reason="rmid_limbo"))
        assert col.capacity == 3 and _one(s, M.RDT_RMID_BUDGET.name) == 3.0  # EBUSY is not "out of RMIDs"
        watched |= set(col.groups)
        emu.advance(1.0)
    assert busy > 0  # limbo was met, for real
    assert watched == set(cids)  # and rotation still went round everyone
    assert emu.used_rmids() <= 4


def test_a_class_change_moves_the_mon_group_and_the_counter_goes_on(emulator, node):
    """An RDT class (engineer C's controller, or another tool) moves the container's threads to the CTRL_MON
    group ``gold``: the kernel takes them out of the MON group; the collector notices at verification, makes
    the group again under ``gold`` and keeps counting from where it was."""
    emu = emulator(domains=(0,))
    (emu.mountpoint / "gold").mkdir()
    cid, tids = node.add(n_threads=2)
    for tid in tids:
        emu.set_task(tid, mbm_total={0: 5e8 if tid == tids[0] else 0.0})
    now = [0.0]
    col = RdtCollector(emu.mountpoint, node.root, RdtCollectorConfig(),  # every run read (see _collector)
                       CgroupCollector(node.root, CgroupCollectorConfig(idle_refresh_seconds=0)), clock=lambda: now[0])
    _OPEN.append(col)
    seen = []

    def step(t: float) -> None:
        now[0] = t
        s = col.collect(t)
        seen.append(_one(s, M.CONTAINER_MEMORY_BANDWIDTH.name, container_id=cid, scope="total"))
        emu.advance(1.0)

    step(0.0)
    step(1.0)
    assert (emu.mountpoint / "mon_groups" / (GROUP_PREFIX + cid)).is_dir()
    for tid in tids:
        emu.move_task_to_ctrl(tid, "gold")
    step(70.0)  # past TASKS_VERIFY_SECONDS: the writes back fail EINVAL, the group is marked
    step(71.0)  # ... and made again under gold
    step(72.0)
    step(73.0)
    assert (emu.mountpoint / "gold" / "mon_groups" / (GROUP_PREFIX + cid)).is_dir()
    assert not (emu.mountpoint / "mon_groups" / (GROUP_PREFIX + cid)).exists()
    assert emu.owner(tids[0]).name == GROUP_PREFIX + cid
    assert all(b >= a for a, b in zip(seen, seen[1:], strict=False))  # never backwards
    # Counted: 0-2 s in the first group, 71-73 s in the new one (70-71 s went to gold, no group of ours); one
    # second of 73 unwatched, so the total is scaled by 73/72.
    assert seen[-1] == pytest.approx(2e9 * 73 / 72, rel=0.01)
    assert seen[-1] - seen[-2] == pytest.approx(5e8 * 73 / 72 + 1.5e9 * (73 / 72 - 72 / 71), rel=0.01)


def test_rows_keep_their_keys_list_between_rotation_slices_and_store_like_samples(emulator, node):
    """The vector row: the same keys list object while the series stay the same (the store resolves them only
    on change), a new one when rotation changes them; stored through Columns it reads back like the samples."""
    from cri_resmgr.store import Store

    emu = emulator(num_rmids=3, domains=(0, 1))  # two MON groups for four containers: rotation
    for i in range(4):
        _cid, (tid,) = node.add(n_threads=1)
        emu.set_task(tid, mbm_total={0: (i + 1) * 1e8, 1: 5e7}, occupancy={0: 1 << 20})
    col = _collector(emu, node, rotation_slice_seconds=4.0, rotation_share=1.0)
    by_rows, by_samples = Store(600), Store(600)
    lists = []
    for t in range(12):
        row = col.collect_row(float(t))
        assert len(row.keys) == len(row.values) and not any(v != v for v in row.values.tolist())
        lists.append(row.keys)
        by_rows.append_columns("rdt", float(t), row)
        by_samples.append("rdt", float(t), row.samples())
        emu.advance(1.0)
    same = sum(a is b for a, b in zip(lists, lists[1:], strict=False))
    assert same >= 6, "between slice boundaries the keys list is reused"
    assert any(a is not b for a, b in zip(lists, lists[1:], strict=False)), "a new slice makes a new list"
    assert by_rows.series_count == by_samples.series_count
    assert sorted((r.metric, r.labels, v) for r, _, v in by_rows.latest()) == \
        sorted((r.metric, r.labels, v) for r, _, v in by_samples.latest())


def test_counters_of_containers_that_did_not_run_are_read_only_at_the_idle_refresh(emulator, node):
    """A container whose CPU usage stands still has its occupancy read only every refresh_runs runs and its MBM
    counters only every MBM_IDLE_REFRESHES-th of those refreshes (the bytes counted meanwhile are all there at
    the next read); one whose usage moves is read every run. Which files a run read is taken from the
    collector's read log (the list the benchmark's C floor reader replays)."""
    emu = emulator(domains=(0,))
    busy, (tb,) = node.add(n_threads=1)
    idle, (ti,) = node.add(n_threads=1)
    emu.set_task(tb, mbm_total={0: 1e8}, occupancy={0: 1 << 20})
    emu.set_task(ti, mbm_total={0: 3e8}, occupancy={0: 2 << 20})  # traffic without CPU: shows when it is read
    col = _collector(emu, node, idle_refresh_seconds=8.0, interval_seconds=2.0)
    col.read_log = []
    assert col.refresh_runs == 4 and MBM_IDLE_REFRESHES == 4
    total = M.CONTAINER_MEMORY_BANDWIDTH.name
    seen: dict[str, list[float]] = {busy: [], idle: []}
    idle_groups = []
    runs = 40
    for t in range(runs):
        (node.root / node.rel[busy] / "cpu.stat").write_text(f"usage_usec {(t + 1) * 10**6}\n")
        s = col.collect(float(t))
        for cid in seen:
            seen[cid].append(_one(s, total, container_id=cid, scope="total"))
            assert _one(s, M.CONTAINER_LLC_OCCUPANCY.name, container_id=cid) is not None, "occupancy carried"
        idle_groups.append(col.idle_groups)
        emu.advance(1.0)
    assert idle_groups[0] == 0 and set(idle_groups[1:]) == {0, 1}
    assert all(b > a for a, b in zip(seen[busy][1:], seen[busy][2:], strict=False)), "read every run"
    base = str(col.groups[idle].path)
    occ_runs = [t for t, files in enumerate(col.read_log) if f"{base}/mon_data/mon_L3_00/llc_occupancy" in files]
    mbm_runs = [t for t, files in enumerate(col.read_log) if f"{base}/mon_data/mon_L3_00/mbm_total_bytes" in files]
    every = col.refresh_runs
    assert occ_runs[0] == 0 and all(b - a <= every for a, b in zip(occ_runs, occ_runs[1:], strict=False)), occ_runs
    assert len(occ_runs) < runs / 2, "occupancy not read every run"
    assert set(mbm_runs) < set(occ_runs) and len(mbm_runs) >= 3, "MBM only at some of the refreshes"
    assert all(b - a <= every * MBM_IDLE_REFRESHES for a, b in zip(mbm_runs, mbm_runs[1:], strict=False)), mbm_runs
    assert len(occ_runs) >= 2 * len(mbm_runs), "the refreshes in between read occupancy alone"
    steps = [i for i in range(1, runs) if seen[idle][i] != seen[idle][i - 1]]
    assert steps and set(steps) <= set(mbm_runs), (steps, mbm_runs)
    # what the idle one's counter said at its last read is all its traffic up to then: nothing lost
    assert seen[idle][steps[-1]] == pytest.approx(3e8 * steps[-1], rel=0.01)
    assert _one(s, M.CONTAINER_RDT_MONITORED_SECONDS.name, container_id=idle) == float(runs - 1)


def test_resctrl_directories_are_listed_only_on_change_and_a_group_removed_behind_our_back_comes_back(
        emulator, node, monkeypatch):
    """info/, the L3 domains, the CTRL_MON groups and our MON groups change only with a remount or a
    mkdir/rmdir: they are listed at the first run, then only when a kept-open counter file says its group is
    gone (someone removed it: it is made again, the exported counter goes on) or every STATIC_REFRESH_SECONDS."""
    emu = emulator(domains=(0, 1))
    cid, (tid,) = node.add(n_threads=1)
    emu.set_task(tid, mbm_total={0: 1e8, 1: 5e7}, occupancy={0: 1 << 20})
    now = [0.0]
    col = RdtCollector(emu.mountpoint, node.root, RdtCollectorConfig(),  # every run read (see _collector)
                       CgroupCollector(node.root, CgroupCollectorConfig(idle_refresh_seconds=0)), clock=lambda: now[0])
    _OPEN.append(col)
    listed: list[int] = []  # per run: directory listings under the resctrl mount
    real_scandir, real_listdir = os.scandir, os.listdir
    count = [0]

    def scandir(p="."):
        count[0] += str(p).startswith(str(emu.mountpoint))
        return real_scandir(p)

    def listdir(p="."):
        count[0] += str(p).startswith(str(emu.mountpoint))
        return real_listdir(p)

    monkeypatch.setattr(os, "scandir", scandir)
    monkeypatch.setattr(os, "listdir", listdir)
    seen = []
    group = emu.mountpoint / "mon_groups" / (GROUP_PREFIX + cid)

    def step(t: float) -> None:
        now[0] = t
        count[0] = 0
        s = col.collect(t)
        listed.append(count[0])
        seen.append(_one(s, M.CONTAINER_MEMORY_BANDWIDTH.name, container_id=cid, scope="total", cache_id="0"))
        assert _one(s, M.NODE_MEMORY_BANDWIDTH.name, scope="total", cache_id="0") is not None
        emu.advance(1.0)

    for t in range(5):
        step(float(t))
    assert listed[0] > 0 and listed[1:] == [0, 0, 0, 0]
    assert group.is_dir() and seen[-1] == pytest.approx(4e8, rel=0.01)
    os.rmdir(group)  # someone else's rmdir: the thread goes back to the root group, the RMID is freed
    assert emu.owner(tid) is emu.root
    for t in range(5, 9):
        step(float(t))
    assert listed[5] == 0 and listed[6] > 0  # the failed read in run 5 makes run 6 look
    assert group.is_dir() and emu.owner(tid).name == GROUP_PREFIX + cid  # made again, the thread back in
    assert all(b >= a for a, b in zip(seen, seen[1:], strict=False))  # the exported counter never goes back
    assert seen[-1] > seen[4]  # ... and goes on counting in the new group
    step(9.0)
    step(9.0 + STATIC_REFRESH_SECONDS)
    assert listed[-2] == 0 and listed[-1] > 0  # and now and then anyway


def test_every_runs_estimates_follow_the_scaling_rule_for_watched_and_rotated_out_containers(emulator, node):
    """The estimates are computed for all containers at once: each run's value of every container is what was
    seen times elapsed / watched time (for a container not watched all along, 1 otherwise) in whole bytes
    (rounded down; an extrapolated one to its unit), never below the value before it, whether its group was read
    this run, is idle, or was rotated out."""
    emu = emulator(num_rmids=4, domains=(0, 1))  # three MON groups for six containers
    for i in range(6):
        _cid, (tid,) = node.add(n_threads=1)
        emu.set_task(tid, mbm_total={0: (i + 1) * 1e8, 1: 5e7}, mbm_local={0: 2e7})
    col = _collector(emu, node, rotation_slice_seconds=3.0, rotation_share=0.5)
    before: dict[tuple, float] = {}
    checked = 0
    for t in range(30):
        s = col.collect(float(t))
        for cid, w in col.watches.items():
            for (fname, cache_id), seen in w.observed.items():
                scope = "total" if fname == "mbm_total_bytes" else "local"
                got = _one(s, M.CONTAINER_MEMORY_BANDWIDTH.name, container_id=cid, scope=scope,
                           cache_id=str(cache_id))
                scale = max(1.0, (t - w.first_read) / w.watched_seconds) if w.gaps and w.watched_seconds > 0 \
                    else 1.0
                # extrapolated: in units of a power of two bytes, the largest within 1/128 of a watched second's
                unit = 2.0 ** math.floor(math.log2(seen / w.watched_seconds / ESTIMATE_UNIT_SHARE)) \
                    if scale > 1 and seen / w.watched_seconds >= 2 * ESTIMATE_UNIT_SHARE else 1.0
                want = max(math.floor(math.floor(seen * scale) / unit) * unit, before.get((cid, fname, cache_id), 0.0))
                assert unit == 1.0 or unit <= seen / w.watched_seconds / ESTIMATE_UNIT_SHARE
                assert got == want, (t, cid, fname, cache_id)
                before[(cid, fname, cache_id)] = got
                checked += w.gaps
        emu.advance(1.0)
    assert checked > 100, "rotated containers were checked"


def test_an_extrapolated_estimate_costs_the_store_a_byte_a_row_and_stays_within_a_percent_of_a_run():
    """A container rotated out keeps growing at what it was seen doing per watched second, times each run's
    elapsed time, which jitters: in whole bytes its steps differ in their low bytes every run. In units of at most
    1/128 of a watched second's bytes they differ by a few units, which the store codes in one byte a row
    (through its own block codec), while the estimate stays within a unit of the exact one."""
    from cri_resmgr.store.tsdb import Block

    rng = np.random.default_rng(3)
    seen, watched, first = np.array([3.7e10, 1.23e9, 5e3]), np.array([100.0, 100.0, 100.0]), 0.0
    t = 400.0 + np.cumsum(2.0 + rng.uniform(-1e-3, 1e-3, 256))  # runs 2 s apart, +-1 ms of wake-up jitter
    scale = (t - first)[:, None] / watched[None, :]
    exact = np.floor(seen * scale)
    est = np.vstack([estimate_bytes(seen, s, watched) for s in scale])
    unit = np.exp2(np.floor(np.log2(seen / watched / ESTIMATE_UNIT_SHARE)))
    unit[seen / watched < 2 * ESTIMATE_UNIT_SHARE] = 1.0
    assert unit.tolist() == [2.0 ** 21, 2.0 ** 16, 1.0]  # 3.7e8 and 1.23e7 B/s; 50 B/s: whole bytes
    assert ((exact - est >= 0) & (exact - est < unit)).all() and (est % unit == 0).all()
    assert (unit <= seen / watched / ESTIMATE_UNIT_SHARE + (unit == 1)).all()  # < 1 % of a second's bytes
    steps = np.diff(est, axis=0) / unit
    assert (steps.max(axis=0) - steps.min(axis=0) <= 3).all()  # 2 s +- 1 ms: +-0.05 % of ~350 units, and floor
    exact_block, est_block = Block(0, t, exact), Block(0, t, est)
    assert [est_block.width_of(c) for c in range(2)] == [1, 1]
    assert all(exact_block.width_of(c) >= 2 for c in range(2))
    # watched all along (scale 1): exactly what was counted, whatever the rate
    assert estimate_bytes(seen, np.ones(3), watched).tolist() == seen.tolist()


def test_estimates_never_go_back_across_a_close_and_reopen(emulator, node):
    """Disabling the collector removes its groups but keeps what it knows of each container: once enabled again
    the estimates go on from what was written, never below it (rotation makes their scale fall while a
    container is watched again)."""
    emu = emulator(num_rmids=3, domains=(0,))  # two MON groups for four containers
    for i in range(4):
        _cid, (tid,) = node.add(n_threads=1)
        emu.set_task(tid, mbm_total={0: (i + 1) * 1e8})
    cfg = dict(rotation_slice_seconds=2.0, rotation_share=1.0)
    col = _collector(emu, node, **cfg)
    last: dict[tuple, float] = {}
    for t in range(24):
        if t in (7, 15):
            col.reconfigure(RdtCollectorConfig(enabled=False, **cfg))
            col.reconfigure(RdtCollectorConfig(**cfg))
        s = col.collect(float(t))
        for labels, v in _series(s, M.CONTAINER_MEMORY_BANDWIDTH.name).items():
            assert v >= last.get(labels, 0.0), (t, labels)
            last[labels] = v
        emu.advance(1.0)


def test_probe_looks_at_resctrl_only_when_collect_does_and_a_new_group_is_not_read_back(emulator, node, monkeypatch):
    """The agent probes before every run: within STATIC_REFRESH_SECONDS of a look whose reads all went through,
    the probe answers from it (no listing of info/, no read of mon_features); after a failed read, or
    STATIC_REFRESH_SECONDS later, it looks again. A MON group this run made holds no task: its ``tasks`` is not
    read back before the container's threads are written to it."""
    emu = emulator(domains=(0, 1))
    cid, (tid,) = node.add(n_threads=1)
    emu.set_task(tid, mbm_total={0: 1e8, 1: 5e7}, occupancy={0: 1 << 20})
    now = [0.0]
    col = RdtCollector(emu.mountpoint, node.root, RdtCollectorConfig(),
                       CgroupCollector(node.root, CgroupCollectorConfig(idle_refresh_seconds=0)), clock=lambda: now[0])
    _OPEN.append(col)
    mount = str(emu.mountpoint)
    looked = [0]
    task_reads: list[str] = []
    real_scandir, real_open = os.scandir, os.open

    def scandir(p="."):
        looked[0] += str(p).startswith(mount)
        return real_scandir(p)

    def open_(p, flags, *a, **kw):
        if str(p).startswith(mount) and str(p).endswith("/tasks") and not flags & (os.O_WRONLY | os.O_RDWR):
            task_reads.append(str(p))
        return real_open(p, flags, *a, **kw)

    monkeypatch.setattr(os, "scandir", scandir)
    monkeypatch.setattr(os, "open", open_)
    per_run = []
    for t in range(4):
        now[0] = float(t)
        looked[0] = 0
        assert col.probe().ok
        col.collect(float(t))
        per_run.append(looked[0])
        emu.advance(1.0)
    assert per_run[0] > 0 and per_run[1:] == [0, 0, 0]
    group_tasks = str(emu.mountpoint / "mon_groups" / (GROUP_PREFIX + cid) / "tasks")
    assert group_tasks not in task_reads  # made in run 0: empty, not read back
    assert emu.owner(tid).name == GROUP_PREFIX + cid  # ... and the thread was written to it
    os.rmdir(emu.mountpoint / "mon_groups" / (GROUP_PREFIX + cid))  # someone else's: the next read fails
    now[0] = 4.0
    col.collect(4.0)
    looked[0] = 0
    assert col.probe().ok and looked[0] > 0  # the failed read makes the probe look
    col.collect(5.0)
    now[0] = 5.0 + STATIC_REFRESH_SECONDS
    looked[0] = 0
    assert col.probe().ok and looked[0] > 0  # looked again after STATIC_REFRESH_SECONDS


def test_monitored_seconds_are_exported_in_whole_milliseconds_and_the_store_codes_them_as_steps(emulator, node):
    """Run times are arbitrary floats; the monitored-seconds counter goes out as exact k / 1000 values (still
    monotonic), which the store keeps as narrow steps instead of ~5 XOR bytes a row."""
    import numpy as np

    from cri_resmgr.store import Store
    from cri_resmgr.store.tsdb import Block

    emu = emulator(domains=(0, 1))
    cid, (tid,) = node.add(n_threads=1)
    emu.set_task(tid, mbm_total={0: 1e8, 1: 5e7}, occupancy={0: 1 << 20})
    col = _collector(emu, node)
    store = Store(3600)
    seen = []
    for k in range(40):
        t = 1000.0 + k * 2.000123456 + (k % 3) * 0.000377
        row = col.collect_row(t)
        store.append_columns("rdt", t, row, 2.0)
        emu.advance(1.0)
        seen.append(_one(row.samples(), M.CONTAINER_RDT_MONITORED_SECONDS.name, container_id=cid))
    assert all(v is not None and round(v * 1000) / 1000 == v for v in seen)  # (the store's test of k / 10**d)
    assert all(b >= a for a, b in zip(seen, seen[1:], strict=False)) and seen[-1] == pytest.approx(78.0, abs=0.01)
    # The store's block codec on this series: a byte or two a row (the float sums took 4 or more).
    ts = 1000.0 + np.arange(len(seen)) * 2.0
    assert Block(0, ts, np.array(seen)[:, None]).width_of(0) <= 2
    assert Block(0, ts, np.array([x + 1e-9 * k for k, x in enumerate(seen)])[:, None]).width_of(0) >= 4


def _usage(node: Node, cid: str, seconds: float) -> None:
    (node.root / node.rel[cid] / "cpu.stat").write_text(f"usage_usec {int(seconds * 10**6)}\n")


def test_a_container_that_becomes_busy_has_its_counters_read_on_the_next_run(emulator, node):
    """The idle skip lasts only while CPU usage stands still: the first run after it moves reads the counters
    (the bytes counted meanwhile are all there)."""
    emu = emulator(domains=(0,))
    cid, (tid,) = node.add(n_threads=1)
    _usage(node, cid, 1.0)
    col = _collector(emu, node, idle_refresh_seconds=60.0, interval_seconds=2.0)
    assert col.refresh_runs == 30
    total = M.CONTAINER_MEMORY_BANDWIDTH.name
    seen = []
    idle = []
    for t in range(8):
        if t == 6:
            _usage(node, cid, 2.0)  # it ran between runs 5 and 6, and made traffic
        s = col.collect(float(t))
        seen.append(_one(s, total, container_id=cid, scope="total"))
        idle.append(col.idle_groups)
        if t == 5:
            emu.set_task(tid, mbm_total={0: 1e8})
        emu.advance(1.0)
    assert idle[1:6] == [1] * 5 and seen[:6] == [0.0] * 6, "idle: not read (and nothing to read)"
    assert idle[6] == 0 and seen[6] == pytest.approx(1e8, rel=0.01), "read on the first run after its usage moved"


def _idle_rotation(emulator, node, slice_seconds: float = 2.0):
    emu = emulator(num_rmids=3, domains=(0,))  # two MON groups: one ranked, one rotating, for four containers
    fixed, (tf,) = node.add(n_threads=1, qos="guaranteed")
    others = [node.add(n_threads=1)[0] for _ in range(3)]
    for cid in [fixed, *others]:
        _usage(node, cid, 1.0)
    emu.set_task(tf, mbm_total={0: 1e8})
    col = _collector(emu, node, idle_refresh_seconds=8.0, interval_seconds=1.0,
                     rotation_slice_seconds=slice_seconds, rotation_share=0.5)
    return emu, col, fixed, others


@pytest.mark.parametrize("cgroup_every", [1, 3])
def test_idle_containers_are_watched_once_then_count_their_still_time_and_stop_the_rotation(emulator, node,
                                                                                             cgroup_every):
    """A container watched once that then stands still (CPU usage unchanged between the cgroup collector's
    reads) made no traffic (MBM counts only while its tasks run): that time counts as watched, never more than
    the time elapsed, so its rate is not scaled up, and the rotating group stays where it is instead of being
    moved (rmdir, mkdir, a baseline) onto containers with nothing to count. Also with the cgroup collector
    reading every third run (as at the default 5 s against 2 s): the runs in between go over the same snapshot,
    and the credit is the same up to the last read."""
    emu, col, fixed, others = _idle_rotation(emulator, node)
    mkdirs = []
    for t in range(30):
        if t == 1:  # each ran once (so each is due a watch), then stands still
            for cid in others:
                _usage(node, cid, 2.0)
        if t % cgroup_every == 0:
            col.discovery.collect(float(t))  # the cgroup collector's run, as the agent makes it
        made = set(col.groups)
        s = col.collect(float(t))
        mkdirs.append(len(set(col.groups) - made))
        for cid in others:
            w = col.watches.get(cid)
            if w is not None and w.first_read is not None:
                secs = _one(s, M.CONTAINER_RDT_MONITORED_SECONDS.name, container_id=cid)
                assert secs is not None and secs <= t - w.first_read + 1e-9, (t, cid)
        emu.advance(1.0)
    assert all(col.watches[c].first_read is not None for c in others), "every container watched once"
    assert sum(mkdirs[10:]) == 0, f"no group moved once all were watched: {mkdirs}"
    for cid in others:
        w = col.watches[cid]
        secs = _one(s, M.CONTAINER_RDT_MONITORED_SECONDS.name, container_id=cid)
        assert secs == pytest.approx(29 - w.first_read, abs=cgroup_every + 0.001), "its still time counts as watched"
        assert not w.ran_unwatched


def test_a_container_that_runs_while_unwatched_is_not_credited_and_gets_the_next_rotation_slot(emulator, node):
    """Time in which an unwatched container ran is not counted as watched (its bytes are unknown: its rate
    is scaled for it), and it goes before the group holders at the next slice boundary."""
    emu, col, fixed, others = _idle_rotation(emulator, node)
    for t in range(13):
        if t == 1:
            for cid in others:
                _usage(node, cid, 2.0)
        col.discovery.collect(float(t))
        col.collect(float(t))
        emu.advance(1.0)
    busy = next(c for c in others if c not in col.groups)
    w = col.watches[busy]
    credited = w.watched_seconds
    assert credited > 0 and not w.ran_unwatched
    tid = int((node.root / node.rel[busy] / "cgroup.threads").read_text().split()[0])
    emu.set_task(tid, mbm_total={0: 2e8})
    _usage(node, busy, 5.0)  # it runs, in the middle of a slice (13 s; slices of 2 s)
    col.discovery.collect(13.0)
    col.collect(13.0)
    assert w.ran_unwatched and busy not in col.groups
    assert w.watched_seconds == credited, "its unwatched run time was not counted"
    emu.advance(1.0)
    _usage(node, busy, 6.0)
    col.discovery.collect(14.0)
    col.collect(14.0)
    assert busy in col.groups, "a group at the first slice boundary after it ran"
    assert w.watched_seconds == credited, "the new group's first read is a baseline"


def test_a_container_never_seen_running_waits_as_idle_until_it_runs(emulator, node):
    """A container that stood still since it was first seen has nothing to count: it holds no group, says so
    (``reason="idle"``), and its counter starts when it runs, at the first slice boundary after."""
    emu, col, fixed, others = _idle_rotation(emulator, node)
    mkdirs = 0
    for t in range(12):
        col.discovery.collect(float(t))
        made = set(col.groups)
        s = col.collect(float(t))
        mkdirs += len(set(col.groups) - made)
        emu.advance(1.0)
    holder = [c for c in others if c in col.groups]
    waiting = [c for c in others if c not in col.groups]
    assert len(holder) == 1 and mkdirs == 2, "the rotating slot was filled once and then kept"
    for cid in waiting:
        assert _one(s, M.CONTAINER_RDT_MONITORED.name, container_id=cid) == 0.0
        assert _series(s, M.CONTAINER_RDT_MONITORED.name, container_id=cid, reason="idle")
    runs = waiting[0]
    _usage(node, runs, 3.0)
    got_at = None
    for t in range(12, 16):
        col.discovery.collect(float(t))
        s = col.collect(float(t))
        if runs in col.groups and got_at is None:
            got_at = t
        emu.advance(1.0)
    assert got_at == 12, "a group at the first slice boundary after it ran"
    assert _series(s, M.CONTAINER_RDT_MONITORED.name, container_id=runs, reason="rotation")


def test_a_reason_that_changes_mid_slice_lays_out_only_the_end_of_the_row(emulator, node, monkeypatch):
    """A container that runs while it waits changes its rdt_monitored reason (idle -> rotation_wait) without a
    group changing hands: only the unmonitored and node-level series at the end of the row are laid out again
    (at 1,000 containers a full layout of every watch took about a third of the collector's CPU), and the row
    is what a full layout of the same run gives."""
    emu, col, fixed, others = _idle_rotation(emulator, node, slice_seconds=4.0)
    for t in range(13):
        col.discovery.collect(float(t))
        col.collect(float(t))
        emu.advance(1.0)
    runs = next(c for c in others if c not in col.groups)
    assert col.unmonitored[runs][1] == IDLE_REASON
    _usage(node, runs, 3.0)
    layouts: list[int] = []
    full = col._layout_row
    monkeypatch.setattr(col, "_layout_row", lambda *a: layouts.append(1) or full(*a))
    groups, keys = list(col.groups), col._row.keys
    col.discovery.collect(13.0)
    s = col.collect(13.0)  # mid-slice (slices [12, 16))
    assert list(col.groups) == groups, "no group changed hands"
    assert _series(s, M.CONTAINER_RDT_MONITORED.name, container_id=runs, reason="rotation_wait") and \
        not _series(s, M.CONTAINER_RDT_MONITORED.name, container_id=runs, reason="idle")
    assert layouts == [], "the groups' and watches' part of the row stood"
    row = col._row
    assert row.keys is not keys and row.keys is col._row_keys, "a new keys list: the store resolves the change"
    tail = row.values[row.tail_at:].tolist()
    got = row.fill(13.0, tail)
    row.save()
    fresh = full(row.tail_keys, 4).fill(13.0, tail)
    assert got.keys == fresh.keys
    np.testing.assert_array_equal(got.values, fresh.values)
    emu.advance(1.0)
    col.discovery.collect(14.0)
    again = col.collect_row(14.0)
    assert again.keys is row.keys and layouts == [], "the next run keeps the row"


def test_without_the_idle_refresh_usage_is_not_trusted_and_idle_containers_keep_rotating(emulator, node):
    """With ``idle_refresh_seconds`` 0 (counters read every run) standing still is no sign of no traffic:
    nothing is credited and the rotation goes on as before."""
    emu, col, fixed, others = _idle_rotation(emulator, node)
    col.discovery.cfg = CgroupCollectorConfig(idle_refresh_seconds=0.0)
    assert col.refresh_runs == 1
    mkdirs = 0
    for t in range(30):
        col.discovery.collect(float(t))
        made = set(col.groups)
        col.collect(float(t))
        mkdirs += len(set(col.groups) - made)
        emu.advance(1.0)
    assert mkdirs >= 12
    assert all(col.watches[c].watched_seconds < 15 for c in others)


def test_a_ranked_group_stays_with_its_holder_until_a_challenger_uses_clearly_more_cpu(emulator, node):
    """Re-ranking at each slice boundary: a container holding the ranked group keeps it while a challenger of its
    QoS class uses less than 25 % and 0.05 CPU more than it (no rmdir/mkdir churn between near-equals), and loses
    it to one that does."""
    emu = emulator(num_rmids=3, domains=(0,))  # two MON groups: one ranked, one rotating
    a, b, c = (node.add(n_threads=1)[0] for _ in range(3))
    col = _collector(emu, node, rotation_slice_seconds=1.0, rotation_share=0.5)
    used = {a: 0.0, b: 0.0, c: 0.0}
    rate = {a: 0.50, b: 0.30, c: 0.0}  # CPU seconds a second
    ranked_holder = []
    for t in range(24):
        if t == 8:
            rate[b] = 0.60  # above a's 0.50, by 20 % (0.10 CPU): not clearly
        if t == 16:
            rate[b] = 0.70  # by 40 % and 0.20 CPU: clearly
            before_handover = list(emu.commands)
        for cid in used:
            used[cid] += rate[cid]
            _usage(node, cid, used[cid])
        col.discovery.collect(float(t))  # the cgroup collector's read: CPU use for the ranking
        s = col.collect(float(t))
        holders = [cid for cid in used if _one(s, M.CONTAINER_RDT_MONITORED.name, container_id=cid, reason="ranked")]
        assert len(holders) == 1 and len(col.groups) == 2
        ranked_holder.append(holders[0])
        emu.advance(1.0)
    assert set(ranked_holder[3:8]) == {a}, "the busiest holds the ranked group"
    assert set(ranked_holder[8:16]) == {a}, "a challenger 20 % busier does not take it"
    assert set(ranked_holder[18:]) == {b}, "one 40 % and 0.2 CPU busier does"
    assert sum(cmd.startswith("mkdir") and GROUP_PREFIX + a in cmd for cmd in before_handover) == 1, "a kept one group"


def test_the_idle_refresh_of_a_container_that_did_not_run_reads_counters_but_not_its_threads(emulator, node):
    """At the idle refresh (counters of a container whose CPU usage stood still, read again for occupancy) the
    container's thread list is not read nor its tasks synced: a thread that joined without running makes no
    traffic. Once the usage moves, the next run reads the list and moves the new thread into the group."""
    emu = emulator(domains=(0,))
    cid, tids = node.add(n_threads=1)
    _usage(node, cid, 1.0)
    col = _collector(emu, node, idle_refresh_seconds=8.0, interval_seconds=2.0)
    assert col.refresh_runs == 4
    col.read_log = []
    col.collect(0.0)
    tasks = emu.mountpoint / "mon_groups" / (GROUP_PREFIX + cid) / "tasks"
    threads = str(node.root / node.rel[cid] / "cgroup.threads")
    assert tasks.read_text().split() == [str(t) for t in tids] and threads in col.read_log[0]
    node.set_threads(cid, tids + [4242])  # joined, has not run: the usage stands
    for t in range(1, 9):
        col.collect(float(t))
        emu.advance(1.0)
    window = col.read_log[1:]
    refreshes = [log for log in window if any("mon_data" in p for p in log)]
    assert refreshes and len(refreshes) < len(window), "counters read at the refresh only"
    assert not any(threads in log for log in window), "the thread list is not read while the usage stands"
    assert "4242" not in tasks.read_text().split()
    _usage(node, cid, 1.5)
    col.collect(9.0)
    assert threads in col.read_log[-1] and any("mon_data" in p for p in col.read_log[-1])
    assert sorted(tasks.read_text().split()) == sorted([str(t) for t in tids] + ["4242"])
