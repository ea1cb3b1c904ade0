"""The AVX-512 collector's row (Columns, only changed containers computed) against the per-sample computation
it replaced: every container's window updated on every run, on a fixture v2 tree with a fake BPF source; and how
cgroup ids made between walks are settled, there and (as root) on the machine's cgroup2 tree, by file handle."""

import os
import random
import shutil
import uuid

import numpy as np
import pytest

from cri_resmgr import metrics as M
from cri_resmgr.collectors import avx512 as A
from cri_resmgr.collectors.avx512 import Avx512Collector, RatioWindow, choose_attribution, next_active
from cri_resmgr.collectors.cgroup import detect_layout
from cri_resmgr.collectors.cgroup_ids import OUTSIDE, CgroupHandles, CgroupIdResolver
from cri_resmgr.config import Avx512CollectorConfig, Paths
from cri_resmgr.ebpf.avx512 import Avx512Source, CounterKey, Counts, CpuTotals, Snapshot
from cri_resmgr.store import Store
from cri_resmgr.topology import Topology

from .cgroupfs import Values, make_v2
from .integration.helpers import CGROUP_ROOT, can_make_cgroups

UID = "0f3e6a4e-8a3b-4c1d-9e2f-1a2b3c4d5e6f"


class FakeSource(Avx512Source):
    def __init__(self) -> None:
        super().__init__("fake", False, 4096)
        self.counts: dict[CounterKey, Counts] = {}
        self.cpus = [CpuTotals(0, 0, 0), CpuTotals(0, 0, 0)]

    def read(self) -> Snapshot:
        return Snapshot(dict(self.counts), list(self.cpus), self.capacity)

    def retire(self, keys):
        return {k: self.counts.pop(k) for k in keys if k in self.counts}


def rel(n: int) -> str:
    return f"kubepods/burstable/pod{UID}/{n:064x}"


_update = RatioWindow.update


class RefWindow(RatioWindow):
    def update(self, *a):  # not counted as the collector's work
        return _update(self, *a)


def fake_collector(root, t: list[float], cfg: Avx512CollectorConfig | None = None) -> Avx512Collector:
    """A collector over the cgroup tree at ``root`` reading a FakeSource, on the clock ``t[0]``."""
    col = Avx512Collector(cfg or Avx512CollectorConfig(), Paths(cgroup=root), Topology(), clock=lambda: t[0])
    col.source = FakeSource()
    col.attribution = choose_attribution("cgroup_id", detect_layout(root))
    col._cg = CgroupIdResolver(root)
    return col


def reference(windows, active, totals, cids, t, cfg):
    """The old collect(): every container's window and flag updated on every run."""
    out = {}
    for cid in cids:
        total = totals.get(cid, Counts())
        win = windows.setdefault(cid, RefWindow([(0.0, 0, 0)]))
        ratio = win.update(t, total.avx512_switches, total.switches, cfg.window_seconds)
        active[cid] = next_active(active.get(cid, False), ratio, cfg.active_threshold, cfg.active_hysteresis)
        out[cid] = (float(total.avx512_switches), float(total.switches), ratio, 1.0 if active[cid] else 0.0)
    return out


def test_row_computes_only_changed_containers_and_equals_the_per_sample_values(tmp_path, monkeypatch):
    root = tmp_path / "cg"
    live_n = list(range(1, 7))
    for n in live_n:
        make_v2(root, rel(n), Values())
    t = [10.0]
    cfg = Avx512CollectorConfig(interval_seconds=2, window_seconds=6)
    col = fake_collector(root, t, cfg)
    src = col.source
    col._attach_t = 0.0
    calls = [0]

    def counted(self, *a):
        calls[0] += 1
        return _update(self, *a)

    monkeypatch.setattr(RatioWindow, "update", counted)
    store = Store(3600)
    rng = random.Random(7)
    windows: dict = {}
    active: dict = {}
    gone_totals: dict[str, Counts] = {}  # what a removed container's keys had (its final counts)
    computed = []
    next_n = 7
    for run in range(60):
        t[0] += 2.0
        # some containers run (a few with AVX-512), most stay as they were; now and then one goes, one comes
        for n in live_n:
            k = CounterKey(os.stat(root / rel(n)).st_ino)
            if rng.random() < 0.3:
                c = src.counts.get(k, Counts())
                sw = rng.randint(1, 50)
                avx = rng.randint(0, sw) if n % 3 == 0 else 0
                src.counts[k] = Counts(c.avx512_switches + avx, c.switches + sw, 10**9 * run if avx else 0)
        if run % 15 == 14:
            n = live_n.pop(0)
            gone_totals[f"{n:064x}"] = src.counts.get(CounterKey(os.stat(root / rel(n)).st_ino), Counts())
            shutil.rmtree(root / rel(n))
            make_v2(root, rel(next_n), Values())
            live_n.append(next_n)
            next_n += 1
        src.cpus = [CpuTotals(c.avx512_switches + run, c.switches + 2 * run, 0) for c in src.cpus]
        calls[0] = 0
        row = col.collect_row(t[0])
        store.append_columns("avx512", t[0], row, 2.0)
        computed.append(calls[0] - 2)  # (the two CPUs' windows are updated every run)
        cids = [f"{n:064x}" for n in live_n]
        totals = {f"{n:064x}": src.counts.get(CounterKey(os.stat(root / rel(n)).st_ino), Counts()) for n in live_n}
        want = reference(windows, active, totals, cids, t[0], cfg)
        got = {}
        for (metric, lab), v in zip(row.keys, row.values.tolist(), strict=True):
            if "container_id" in lab:
                got.setdefault(lab["container_id"], {})[metric] = v
        assert sorted(got) == sorted(cids)
        for cid in cids:
            g = got[cid]
            assert (g[M.CONTAINER_AVX512_SWITCHES.name], g[M.CONTAINER_CONTEXT_SWITCHES.name],
                    g[M.CONTAINER_AVX512_RATIO.name], g[M.CONTAINER_AVX512_ACTIVE.name]) == want[cid], (run, cid)
            last = totals[cid].last_avx512_ns
            assert np.isnan(g[M.CONTAINER_AVX512_LAST_USE.name]) == (last == 0)
        cpu_ratio = [v for (m, _), v in zip(row.keys, row.values.tolist(), strict=True) if m == M.CPU_AVX512_RATIO.name]
        assert len(cpu_ratio) == 2
    # The point: idle containers are not computed again (about 30% run each cycle, six containers).
    assert sum(computed[5:]) < 0.75 * 6 * len(computed[5:])


def test_removed_container_drops_its_state(tmp_path):
    root = tmp_path / "cg"
    for n in (1, 2):
        make_v2(root, rel(n), Values())
    t = [10.0]
    col = fake_collector(root, t)
    col.collect_row(t[0])
    assert set(col._quiet) == {f"{1:064x}", f"{2:064x}"}
    shutil.rmtree(root / rel(2))
    t[0] += 2
    row = col.collect_row(t[0])
    assert set(col._quiet) == set(col._windows) == {f"{1:064x}"}
    assert {lab.get("container_id") for _, lab in row.keys} == {f"{1:064x}", None}


def test_the_periodic_rescan_keeps_the_row_and_its_keys_when_no_container_changed(tmp_path):
    """The walk of the v2 tree every RESCAN_SECONDS makes identities anew; the same containers keep their row (the
    keys list is the same object, so the store's column plan stands), a container that came gets a new one."""
    from cri_resmgr.collectors.avx512 import RESCAN_SECONDS

    root = tmp_path / "cg"
    for n in (1, 2, 3):
        make_v2(root, rel(n), Values())
    t = [10.0]
    col = fake_collector(root, t)
    keys = col.collect_row(t[0]).keys
    walked = col._scanned_at
    t[0] += RESCAN_SECONDS + 1
    again = col.collect_row(t[0])
    assert col._scanned_at > walked, "the tree was walked again"
    assert again.keys is keys
    make_v2(root, rel(4), Values())
    t[0] += RESCAN_SECONDS + 1
    grown = col.collect_row(t[0]).keys
    assert grown is not keys and sum(lab.get("container_id") == f"{4:064x}" for _, lab in grown) == 5
    col.close()


def _count_walks(monkeypatch) -> list[int]:
    """Walks of the v2 tree (CgroupIdResolver.scan) from now on: ``[n]``."""
    walks = [0]
    scan = CgroupIdResolver.scan

    def counted(self):
        walks[0] += 1
        return scan(self)

    monkeypatch.setattr(CgroupIdResolver, "scan", counted)
    return walks


def _switches(row, cid: str) -> float:
    return next(v for (m, lab), v in zip(row.keys, row.values.tolist(), strict=True)
                if m == M.CONTAINER_CONTEXT_SWITCHES.name and lab["container_id"] == cid)


def _new_scope_every_run(col, root, t: list[float], n: int) -> dict[int, CounterKey]:
    """``n`` runs 2 s apart, before each a new non-container cgroup (a systemd scope) with 10 switches counted."""
    key_of = {}
    for run in range(1, n + 1):
        t[0] += 2.0
        d = root / "system.slice" / f"run-{run}.scope"
        d.mkdir(parents=True)
        key_of[run] = CounterKey(os.stat(d).st_ino)
        col.source.counts[key_of[run]] = Counts(0, 10, 0)
        col.collect_row(t[0])
    return key_of


def test_unknown_cgroup_ids_wait_for_a_walk_at_most_every_few_seconds_and_lose_no_counts(tmp_path, monkeypatch):
    """Where cgroup ids cannot be looked up by file handle (here a fixture tree, not cgroup2), cgroups made every
    run that are not containers (a node's systemd scopes) do not make the collector walk the v2 tree every run:
    their ids wait, neither attributed nor retired, for a walk UNKNOWN_RESCAN_SECONDS after the last. A new
    container is walked for at once (inotify); a sub-cgroup made in a container waits like the others and its
    counts, kept by the kernel, are the container's from the walk on; a removed one is retired then."""

    root = tmp_path / "cg"
    make_v2(root, rel(1), Values())
    t = [10.0]
    col = fake_collector(root, t)
    src = col.source
    walks = _count_walks(monkeypatch)
    col.collect_row(t[0])
    assert walks[0] == 1
    key_of = _new_scope_every_run(col, root, t, 4)
    assert walks[0] == 1, "no walk for them within UNKNOWN_RESCAN_SECONDS of the last"
    assert all(k in src.counts for k in key_of.values()), "not retired while unknown"
    sub = root / rel(1) / "init.scope"  # a sub-cgroup in container 1, made between walks
    sub.mkdir()
    src.counts[CounterKey(os.stat(sub).st_ino)] = Counts(0, 7, 0)
    (root / "system.slice" / "run-1.scope").rmdir()
    t[0] += A.UNKNOWN_RESCAN_SECONDS - 8.0  # 10 s after the walk
    row = col.collect_row(t[0])
    assert walks[0] == 2
    assert _switches(row, f"{1:064x}") == 7.0, "the sub-cgroup's counts are its container's from the walk on"
    assert key_of[1] not in src.counts and all(key_of[r] in src.counts for r in (2, 3, 4)), "the removed retired"
    make_v2(root, rel(2), Values())  # a new container: inotify, a walk at once
    t[0] += 2.0
    d = root / rel(2)
    src.counts[CounterKey(os.stat(d).st_ino)] = Counts(0, 5, 0)
    row = col.collect_row(t[0])
    assert walks[0] == 3 and _switches(row, f"{2:064x}") == 5.0
    col.close()


# -- on the machine's real cgroup2 tree: new cgroup ids looked up by file handle, no walk ----------------------
def _real_v2_tree():
    """A fresh directory of this machine's cgroup2 hierarchy, or the reason there is none."""
    why = can_make_cgroups()
    if why:
        return None, why
    layout = detect_layout(CGROUP_ROOT)
    v2 = layout.root if layout.version == 2 else layout.unified
    if v2 is None:
        return None, "no cgroup2 hierarchy on this machine"
    h, why = CgroupHandles.open(v2)
    if h is None and "not permitted" in why:  # root without CAP_DAC_READ_SEARCH (a restricted container)
        return None, why
    if h is not None:
        h.close()
    root = v2 / f"crirm-test-handles-{uuid.uuid4().hex[:12]}"
    root.mkdir()
    return root, ""


def _remove_tree(root) -> None:
    for d in sorted((p for p in root.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
        d.rmdir()
    root.rmdir()


def test_cgroup_handles_name_live_cgroups_and_refuse_gone_ones_on_the_real_tree(tmp_path):
    root, why = _real_v2_tree()
    if root is None:
        pytest.skip(why)
    try:
        (root / "a" / "b").mkdir(parents=True)
        (root / "elsewhere").mkdir()
        h, reason = CgroupHandles.open(root / "a")
        assert h is not None, reason
        try:
            assert h.lookup(os.stat(root / "a").st_ino) == "/"
            assert h.lookup(os.stat(root / "a" / "b").st_ino) == "/b"
            assert h.lookup(os.stat(root / "elsewhere").st_ino) == OUTSIDE  # live, not under the tree
            gone = os.stat(root / "a" / "b").st_ino
            (root / "a" / "b").rmdir()
            assert h.lookup(gone) is None
            assert h.lookup((1 << 64) - 1) is None and h.lookup(-1) is None and h.lookup(1 << 64) is None
        finally:
            h.close()
    finally:
        _remove_tree(root)
    (tmp_path / "d").mkdir()
    none, reason = CgroupHandles.open(tmp_path / "d")  # a fixture tree: its handles are not cgroup ids
    assert none is None and "not a cgroup2 tree" in reason


def test_new_cgroup_ids_are_looked_up_by_handle_at_once_without_a_walk_on_the_real_tree(monkeypatch):
    """On the real hierarchy, ids of cgroups made between walks are settled in the run that first sees them:
    not a container's (a scope) -> kept, attributed to none; a sub-cgroup of a container -> that container's at
    once; removed -> retired at once. No walk of the tree for any of them."""
    root, why = _real_v2_tree()
    if root is None:
        pytest.skip(why)
    col = None
    try:
        (root / rel(1)).mkdir(parents=True)
        t = [10.0]
        col = fake_collector(root, t)
        src = col.source
        walks = _count_walks(monkeypatch)
        col.collect_row(t[0])
        assert walks[0] == 1 and col._cg.handles is not None, col._cg.handles_reason
        key_of = _new_scope_every_run(col, root, t, 4)
        assert all(k in src.counts for k in key_of.values()), "live scopes are not retired"
        assert all(col._cg.alive(k.cgroup_id) and col._cg.container(k.cgroup_id) is None for k in key_of.values())
        sub = root / rel(1) / "init.scope"  # a sub-cgroup in container 1, made between walks
        sub.mkdir()
        src.counts[CounterKey(os.stat(sub).st_ino)] = Counts(0, 7, 0)
        brief = root / "system.slice" / "run-5.scope"  # made and removed between two runs
        brief.mkdir()
        src.counts[brief_key := CounterKey(os.stat(brief).st_ino)] = Counts(0, 3, 0)
        brief.rmdir()
        t[0] += 2.0
        row = col.collect_row(t[0])
        assert _switches(row, f"{1:064x}") == 7.0, "the sub-cgroup's counts are its container's in the same run"
        assert brief_key not in src.counts, "an id no live cgroup has is retired in the run that sees it"
        t[0] += 20.0  # past UNKNOWN_RESCAN_SECONDS: still nothing to walk for
        col.collect_row(t[0])
        assert walks[0] == 1, "no walk: every new id was settled by its file handle"
        assert col._cg.handle_lookups_total == 6
        (root / "system.slice" / "run-1.scope").rmdir()  # a scope seen alive goes: asked by handle, no walk
        t[0] = col._checked_at + A.RESCAN_SECONDS - 1.0
        col.collect_row(t[0])
        assert key_of[1] in src.counts, "not asked before RESCAN_SECONDS"
        t[0] += 1.0
        asked, counted = col._cg.handle_lookups_total, len(src.counts)
        col.collect_row(t[0])
        assert walks[0] == 1, "the counted ids were asked by handle instead of a walk"
        assert col._cg.handle_lookups_total - asked == counted, "each counted id asked once"
        assert key_of[1] not in src.counts and all(key_of[r] in src.counts for r in (2, 3, 4))
        t[0] += A.WALK_SECONDS
        col.collect_row(t[0])
        assert walks[0] == 2, "the safety-net walk"
    finally:
        if col is not None:
            col.close()
        _remove_tree(root)
