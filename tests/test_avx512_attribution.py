"""cgroup id -> container and pid -> container, on fixture trees (tests/cgroupfs.py, tests/avx512fs.py)."""

import os
import shutil

import pytest

from cri_resmgr.collectors.avx512 import RatioWindow, choose_attribution, next_active
from cri_resmgr.collectors.base import CollectorUnavailable
from cri_resmgr.collectors.cgroup import detect_layout, find_containers
from cri_resmgr.collectors.cgroup_ids import (
    CgroupIdResolver,
    PidResolver,
    owning_container,
    parse_proc_cgroup,
    path_in_hierarchy,
    scan_cgroup_ids,
)
from cri_resmgr.collectors.identity import parse_container_path

from .avx512fs import add_process
from .cgroupfs import Values, make_v1, make_v2

UID = "0f3e6a4e-8a3b-4c1d-9e2f-1a2b3c4d5e6f"
CID = "a" * 64
CID2 = "b" * 64
C1 = f"kubepods/burstable/pod{UID}/{CID}"
C2 = f"kubepods/besteffort/pod{UID.replace('0f', '1f')}/{CID2}"


def test_scan_maps_every_directory_inode_to_its_path(tmp_path):
    (tmp_path / "a/b/c").mkdir(parents=True)
    (tmp_path / "a/file").write_text("x")
    ids = scan_cgroup_ids(tmp_path)
    assert ids[os.stat(tmp_path).st_ino] == "/"
    assert ids[os.stat(tmp_path / "a/b/c").st_ino] == "/a/b/c"
    assert sorted(ids.values()) == ["/", "/a", "/a/b", "/a/b/c"]  # files are not cgroups
    assert scan_cgroup_ids(tmp_path / "absent") == {}
    assert sorted(scan_cgroup_ids(tmp_path, max_depth=0).values()) == ["/", "/a"]


def test_owning_container_is_the_nearest_ancestor():
    ident = parse_container_path("/" + C1)
    by_path = {ident.cgroup_path: ident}
    assert owning_container("/" + C1, by_path) is ident
    assert owning_container(C1 + "/init.scope/sub", by_path) is ident  # systemd inside the container
    assert owning_container(f"/kubepods/burstable/pod{UID}", by_path) is None  # the pod itself
    assert owning_container("/", by_path) is None


def test_cgroup_id_resolver_on_a_v2_tree(tmp_path):
    root = tmp_path / "cg"
    make_v2(root, C1, Values())
    make_v2(root, C2, Values())
    (root / C1 / "nested").mkdir()
    (root / "system.slice/cron.service").mkdir(parents=True)
    r = CgroupIdResolver(root)
    r.refresh(find_containers(root))
    ino = lambda rel: os.stat(root / rel).st_ino  # noqa: E731
    assert r.container(ino(C1)).container_id == CID
    assert r.container(ino(C1 + "/nested")).container_id == CID
    assert r.container(ino(C2)).container_id == CID2 and r.container(ino(C2)).qos_class == "BestEffort"
    assert r.container(ino("system.slice/cron.service")) is None and r.alive(ino("system.slice/cron.service"))
    assert r.alive(ino(".")) and r.container(ino(".")) is None  # the root cgroup
    gone = ino(C2)
    shutil.rmtree(root / C2)
    r.refresh(find_containers(root))
    assert not r.alive(gone) and r.container(gone) is None


def test_parse_proc_cgroup_v1_v2_and_odd_lines():
    text = ("12:cpu,cpuacct:/kubepods/burstable/pod1/abc\n4:memory:/m\n1:name=systemd:/user.slice\n"
            "0::/weird:path\nbad line\nx:cpu:/y\n")
    entries = parse_proc_cgroup(text)
    assert [e.hierarchy_id for e in entries] == [12, 4, 1, 0]
    assert entries[0].controllers == ("cpu", "cpuacct")
    assert path_in_hierarchy(entries, "cpuacct") == "/kubepods/burstable/pod1/abc"
    assert path_in_hierarchy(entries, None) == "/weird:path"  # only the first two colons separate fields
    assert path_in_hierarchy(entries, "cpuset") is None
    assert parse_proc_cgroup("") == []


def test_pid_resolver_maps_processes_through_proc_cgroup(tmp_path):
    cg = tmp_path / "cgroup"
    make_v1(cg, C1, Values())
    make_v1(cg, C2, Values())
    proc = tmp_path / "proc"
    add_process(proc, 100, {"cpu": "/" + C1, "cpuacct": "/" + C1, "memory": "/" + C1})
    add_process(proc, 101, {"cpu,cpuacct": "/" + C2 + "/sub"})
    add_process(proc, 102, {"cpuacct": "/system.slice/sshd.service"})
    add_process(proc, 103, {"memory": "/" + C1})  # no cpuacct hierarchy line
    layout = detect_layout(cg)
    att = choose_attribution("auto", layout)
    assert att.mode == "pid" and att.controller == "cpuacct"
    r = PidResolver(proc, att.controller)
    r.refresh(find_containers(att.ident_layout.root))
    assert r.container(100).container_id == CID
    assert r.container(101).container_id == CID2
    assert r.container(102) is None and r.alive(102)
    assert r.container(103) is None
    assert not r.alive(999) and r.container(999) is None
    assert r.alive(0) and r.container(0) is None  # the idle task


def test_attribution_mode_follows_the_layout(tmp_path):
    v2 = tmp_path / "v2"
    make_v2(v2, C1, Values())
    att = choose_attribution("auto", detect_layout(v2))
    assert (att.mode, att.v2_root) == ("cgroup_id", v2)
    assert choose_attribution("pid", detect_layout(v2)).controller is None  # the 0:: line on v2

    hybrid = tmp_path / "hybrid"
    make_v1(hybrid, C1, Values())
    make_v2(hybrid / "unified", C1, Values())
    att = choose_attribution("auto", detect_layout(hybrid))
    assert (att.mode, att.v2_root, att.ident_layout.root) == ("cgroup_id", hybrid / "unified", hybrid / "unified")
    assert [c.container_id for c in find_containers(att.ident_layout.root)] == [CID]
    assert choose_attribution("pid", detect_layout(hybrid)).mode == "pid"

    v1 = tmp_path / "v1"
    make_v1(v1, C1, Values())
    assert choose_attribution("auto", detect_layout(v1)).mode == "pid"
    with pytest.raises(CollectorUnavailable, match="needs a cgroup v2 tree"):
        choose_attribution("cgroup_id", detect_layout(v1))


def test_ratio_window_uses_the_increase_over_the_window():
    w = RatioWindow([(0.0, 0, 0)])
    assert w.update(1.0, 90, 100, window=10) == pytest.approx(0.9)  # since attach
    assert w.update(5.0, 95, 200, window=10) == pytest.approx(95 / 200)
    assert w.update(12.0, 95, 300, window=10) == pytest.approx(5 / 200)  # base moved to t=1 (older than 10 s)
    assert w.update(20.0, 95, 300, window=10) == 0.0  # no switches in the window: did not run
    assert w.update(21.0, 3, 10, window=10) == 0.0  # counters went back (reload): history restarts
    assert w.update(22.0, 13, 20, window=10) == pytest.approx(1.0)


def test_active_has_hysteresis_around_the_threshold():
    th, hy = 0.1, 0.5
    seq, state = [0.05, 0.11, 0.08, 0.051, 0.049, 0.09, 0.1], []
    a = False
    for r in seq:
        a = next_active(a, r, th, hy)
        state.append(a)
    assert state == [False, True, True, True, False, False, True]
