import dataclasses
from pathlib import Path

import pytest

from cri_resmgr import metrics as M
from cri_resmgr.collectors.cgroup import CgroupCollector, detect_layout, find_containers
from cri_resmgr.collectors.identity import parse_container_path
from cri_resmgr.config import CgroupCollectorConfig, ExtraCgroup

from .cgroupfs import Values, make_v1, make_v2

CID = "a" * 64
CID2 = "0123456789abcdef" * 4
UID = "12345678-aaaa-bbbb-cccc-0123456789ab"
UID_ = UID.replace("-", "_")

PATHS = {
    "cgroupfs-containerd-burstable": (f"kubepods/burstable/pod{UID}/{CID}", "Burstable", "containerd"),
    "cgroupfs-guaranteed": (f"kubepods/pod{UID}/{CID}", "Guaranteed", "containerd"),
    "cgroupfs-crio-besteffort": (f"kubepods/besteffort/pod{UID}/crio-{CID}", "BestEffort", "cri-o"),
    "systemd-containerd-burstable": (
        f"kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice/cri-containerd-{CID}.scope",
        "Burstable", "containerd"),
    "systemd-crio-guaranteed": (f"kubepods.slice/kubepods-pod{UID_}.slice/crio-{CID}.scope", "Guaranteed", "cri-o"),
    "systemd-besteffort-kind": (
        f"kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-besteffort.slice/"
        f"kubelet-kubepods-besteffort-pod{UID_}.slice/cri-containerd-{CID}.scope", "BestEffort", "containerd"),
}


@pytest.mark.parametrize("case", sorted(PATHS))
def test_identity_from_path(case):
    path, qos, runtime = PATHS[case]
    ident = parse_container_path("/" + path)
    assert ident is not None, path
    assert (ident.container_id, ident.pod_uid, ident.qos_class, ident.runtime) == (CID, UID, qos, runtime)


@pytest.mark.parametrize("path", [
    f"kubepods/burstable/pod{UID}",  # the pod itself
    f"kubepods.slice/kubepods-pod{UID_}.slice/crio-conmon-{CID}.scope",  # CRI-O monitor
    f"system.slice/containerd.service/{CID}",  # not under kubepods
    f"kubepods/burstable/notapod/{CID}",
    "kubepods/burstable/pod123/abc",
])
def test_non_containers_are_ignored(path):
    assert parse_container_path(path) is None


@pytest.mark.parametrize("version", [1, 2])
def test_collects_container_values(tmp_path: Path, version: int):
    v = Values()
    rel = PATHS["cgroupfs-containerd-burstable"][0]
    (make_v1 if version == 1 else make_v2)(tmp_path, rel, v)
    (make_v1 if version == 1 else make_v2)(tmp_path, f"kubepods/besteffort/pod{UID}/{CID2}",
                                           Values(usage_ns=1_000_000_000, cpus="1"))
    col = CgroupCollector(tmp_path)
    assert col.probe().ok and col.probe().reason == f"cgroup v{version}"
    samples = col.collect(0.0)
    by = {(s.metric, s.labels["container_id"]): s for s in samples}
    assert by[(M.CONTAINER_CPU_USAGE.name, CID)].value == pytest.approx(5.0)
    assert by[(M.CONTAINER_CPU_USAGE.name, CID2)].value == pytest.approx(1.0)
    assert by[(M.CONTAINER_CPU_PERIODS.name, CID)].value == 100
    assert by[(M.CONTAINER_CPU_THROTTLED_PERIODS.name, CID)].value == 7
    assert by[(M.CONTAINER_CPU_THROTTLED.name, CID)].value == pytest.approx(0.25)
    assert by[(M.CONTAINER_MEMORY_USAGE.name, CID)].value == 100 * 2**20
    assert by[(M.CONTAINER_MEMORY_WORKING_SET.name, CID)].value == 70 * 2**20
    cs = by[(M.CONTAINER_CPUSET_CPUS.name, CID)]
    assert cs.value == 2 and "cpus" not in cs.labels
    assert col.cpusets() == {CID: frozenset({0, 1}), CID2: frozenset({1})}
    assert by[(M.CONTAINER_CPU_USAGE.name, CID)].labels["qos_class"] == "Burstable"
    assert by[(M.CONTAINER_CPU_USAGE.name, CID2)].labels["qos_class"] == "BestEffort"
    assert set(col.containers) == {CID, CID2}


def test_v1_combined_cpu_cpuacct_dir(tmp_path: Path):
    make_v1(tmp_path, PATHS["systemd-containerd-burstable"][0], Values(), combined_cpu_dir=True)
    samples = CgroupCollector(tmp_path).collect(0.0)
    assert any(s.metric == M.CONTAINER_CPU_USAGE.name and s.value == 5.0 for s in samples)


def test_working_set_floor_at_zero(tmp_path: Path):
    make_v2(tmp_path, PATHS["cgroupfs-guaranteed"][0], Values(mem=10, inactive_file=50))
    samples = CgroupCollector(tmp_path).collect(0.0)
    assert [s.value for s in samples if s.metric == M.CONTAINER_MEMORY_WORKING_SET.name] == [0]


def test_container_gone_mid_scan_is_skipped(tmp_path: Path):
    make_v2(tmp_path, PATHS["cgroupfs-guaranteed"][0], Values())
    ghost = tmp_path / f"kubepods/pod{UID}/{CID2}"
    ghost.mkdir(parents=True)  # directory exists but its files are gone (removal in progress)
    samples = CgroupCollector(tmp_path).collect(0.0)
    assert {s.labels["container_id"] for s in samples} == {CID}


def test_extra_cgroups_are_watched(tmp_path: Path):
    make_v2(tmp_path, "demo/busy", Values(usage_ns=2_000_000_000))
    cfg = CgroupCollectorConfig(extra_cgroups=[ExtraCgroup(name="busy", path="demo/busy", pod="demo-pod")])
    samples = CgroupCollector(tmp_path, cfg).collect(0.0)
    s = [s for s in samples if s.metric == M.CONTAINER_CPU_USAGE.name]
    assert len(s) == 1 and s[0].value == 2.0 and s[0].labels["container"] == "busy"
    assert s[0].labels["pod"] == "demo-pod" and s[0].labels["namespace"] == "default"


def test_no_hierarchy_is_reported(tmp_path: Path):
    col = CgroupCollector(tmp_path / "absent")
    p = col.probe()
    assert not p.ok and "no cgroup hierarchy" in p.reason


def test_this_machine_hierarchy_is_detected():
    layout = detect_layout(Path("/sys/fs/cgroup"))
    if layout is None:
        pytest.skip("no cgroup filesystem mounted at /sys/fs/cgroup")
    assert layout.version in (1, 2)
    find_containers(layout.root)  # walking the real tree must not raise


def test_names_from_runtime_prefer_kubelet_labels_then_cri_metadata():
    from cri_api.v1 import api_pb2 as pb

    from cri_resmgr.collectors.names import ContainerNames, names_from

    sb = pb.PodSandbox(id="s1", metadata=pb.PodSandboxMetadata(name="meta-pod", namespace="meta-ns", uid="u"))
    labelled = pb.Container(id="c1", pod_sandbox_id="s1", metadata=pb.ContainerMetadata(name="meta-c"),
                            labels={"io.kubernetes.pod.name": "p", "io.kubernetes.pod.namespace": "ns",
                                    "io.kubernetes.container.name": "c"})
    bare = pb.Container(id="c2", pod_sandbox_id="s1", metadata=pb.ContainerMetadata(name="meta-c"))
    orphan = pb.Container(id="c3", pod_sandbox_id="gone", metadata=pb.ContainerMetadata(name="x"))
    assert names_from([labelled, bare, orphan], [sb]) == {
        "c1": ContainerNames("ns", "p", "c"), "c2": ContainerNames("meta-ns", "meta-pod", "meta-c"),
        "c3": ContainerNames("", "", "x")}


def test_missing_runtime_socket_is_reported_and_names_stay_empty(tmp_path: Path):
    from cri_resmgr.collectors.names import RuntimeNames

    make_v2(tmp_path, PATHS["cgroupfs-guaranteed"][0], Values())
    col = CgroupCollector(tmp_path, names=RuntimeNames(tmp_path / "no.sock"))
    samples = col.collect(0.0)
    assert {s.labels["container"] for s in samples} == {""}
    assert col.status().startswith("cgroup v2; discovery: inotify")
    assert col.status().endswith(f"; no runtime socket at {tmp_path / 'no.sock'}: container and pod names unknown")


def test_unreachable_runtime_socket_is_reported_not_fatal(tmp_path: Path):
    from cri_resmgr.collectors.names import RuntimeNames

    class Denied(type(tmp_path)):
        def exists(self):
            raise PermissionError(13, "Permission denied")

    make_v2(tmp_path, PATHS["cgroupfs-guaranteed"][0], Values())
    names = RuntimeNames(tmp_path / "x.sock")
    names.socket_path = Denied(tmp_path / "x.sock")
    col = CgroupCollector(tmp_path, names=names)
    assert any(s.metric == M.CONTAINER_CPU_USAGE.name for s in col.collect(0.0))
    assert "cannot reach runtime socket" in col.status() and "Permission denied" in col.status()


def test_containers_in_scanned_paths_equal_a_walk(tmp_path: Path):
    from cri_resmgr.collectors.cgroup import containers_in
    from cri_resmgr.collectors.cgroup_ids import scan_cgroup_ids

    for case in PATHS.values():
        make_v2(tmp_path, case[0], Values())
    (tmp_path / "system.slice" / "containerd.service").mkdir(parents=True)
    (tmp_path / "kubepods" / "burstable" / f"pod{UID}" / CID / "nested").mkdir(parents=True)
    key = lambda i: i.cgroup_path  # noqa: E731
    walked = sorted(find_containers(tmp_path), key=key)
    assert len(walked) == len(PATHS)
    assert sorted(containers_in(scan_cgroup_ids(tmp_path).values()), key=key) == walked


def test_the_same_container_found_by_two_discoveries_is_one_identity_held_weakly(tmp_path: Path):
    # the cgroup collector walks its hierarchy, the AVX-512 collector the v2 tree and its cgroup-id scan: each
    # is handed the identity (and label set) another holds, and a container no one holds any longer is let go
    import gc

    from cri_resmgr.collectors import identity
    from cri_resmgr.collectors.cgroup import containers_in
    from cri_resmgr.collectors.cgroup_ids import scan_cgroup_ids

    own = "fedcba9876543210" * 4  # paths no other test parses (their identities may still be held elsewhere)
    cases = [path.replace(CID, own) for path, _, _ in PATHS.values()]
    for path in cases:
        make_v2(tmp_path / "v2", path, Values())
        make_v1(tmp_path / "v1", path, Values())
    key = lambda i: i.cgroup_path  # noqa: E731
    v1 = sorted(find_containers(tmp_path / "v1" / "cpu"), key=key)
    v2 = sorted(find_containers(tmp_path / "v2"), key=key)
    scanned = sorted(containers_in(scan_cgroup_ids(tmp_path / "v2").values()), key=key)
    assert len(v1) == len(cases)
    assert all(a is b is c for a, b, c in zip(v1, v2, scanned, strict=True))
    ident = v1[0]
    assert ident.labels() is v2[0].labels()
    assert dict(ident.labels()) == {"namespace": "", "pod": "", "container": "", "container_id": own,
                                    "pod_uid": UID, "qos_class": ident.qos_class}
    named = dataclasses.replace(ident, name="web", pod="p", namespace="ns")
    assert dict(named.labels()) == {**dict(ident.labels()), "container": "web", "pod": "p", "namespace": "ns"}
    paths = [i.cgroup_path for i in v1]
    assert all(p in identity._BY_PATH for p in paths)
    del v1, v2, scanned, ident, named
    gc.collect()
    assert not any(p in identity._BY_PATH for p in paths)


def test_runtime_names_refresh_early_once_per_new_id_then_only_periodically(tmp_path: Path):
    from cri_resmgr.collectors.names import RuntimeNames

    sock = tmp_path / "rt.sock"
    sock.touch()
    t = [100.0]
    names = RuntimeNames(sock, refresh_seconds=10, clock=lambda: t[0])
    calls = []
    names._refresh = lambda now: (calls.append(now), setattr(names, "_at", now))
    names.names(["a"])
    assert calls == [100.0]  # first use
    t[0] = 102.0
    names.names(["a"])  # still unknown after a refresh: no early retry
    assert calls == [100.0]
    names.names(["a", "b"])  # a new id: one early refresh
    assert calls == [100.0, 102.0]
    t[0] = 103.5
    names.names(["a", "b"])
    assert calls == [100.0, 102.0]
    t[0] = 112.5
    names.names(["a", "b"])  # periodic
    assert calls == [100.0, 102.0, 112.5]


def test_sandbox_pause_containers_get_their_pods_names():
    from cri_api.v1 import api_pb2 as pb

    from cri_resmgr.collectors.names import ContainerNames, sandbox_names

    sb = pb.PodSandbox(id="s1", metadata=pb.PodSandboxMetadata(name="p", namespace="ns", uid="u"))
    assert sandbox_names([sb]) == {"s1": ContainerNames("ns", "p", "")}


def test_names_carry_only_cri_resource_manager_annotations_of_pod_and_container():
    from cri_api.v1 import api_pb2 as pb

    from cri_resmgr.collectors.names import names_from

    sb = pb.PodSandbox(id="s1", metadata=pb.PodSandboxMetadata(name="p", namespace="ns", uid="u"),
                       annotations={"rdt-monitor.cri-resource-manager.intel.com/pod": "true", "other/x": "big"})
    c = pb.Container(id="c1", pod_sandbox_id="s1", metadata=pb.ContainerMetadata(name="c"),
                     annotations={"rdt-monitor.cri-resource-manager.intel.com/container.c": "false"})
    got = names_from([c], [sb])["c1"]
    assert got.annotations == (("rdt-monitor.cri-resource-manager.intel.com/container.c", "false"),
                               ("rdt-monitor.cri-resource-manager.intel.com/pod", "true"))


@pytest.mark.parametrize("version", [1, 2])
def test_cpuset_changes_make_no_new_series(tmp_path: Path, version: int):
    """Shared-pool changes (cpuset 0-1 -> 1 -> 0-3 -> 0-1) keep one cpuset series per container: the value
    is the CPU count; the CPU list is the collector's latest reading (``cpusets``), not a label."""
    from cri_resmgr.store import Matcher, Store

    rel = f"kubepods/burstable/pod{UID}/{CID}"
    (make_v1 if version == 1 else make_v2)(tmp_path, rel, Values(cpus="0-1"))
    files = ([tmp_path / "cpuset" / rel / "cpuset.effective_cpus", tmp_path / "cpuset" / rel / "cpuset.cpus"]
             if version == 1 else [tmp_path / rel / "cpuset.cpus.effective"])
    col = CgroupCollector(tmp_path)
    store = Store(600)
    name = M.CONTAINER_CPUSET_CPUS.name
    for t, cpus, n in ((1.0, "0-1", 2), (2.0, "1", 1), (3.0, "0-3", 4), (4.0, "0-1", 2)):
        for f in files:
            f.write_text(cpus + "\n")
        store.append("cgroup", t, col.collect(t), 1.0)
        refs = store.select(name)
        assert len(refs) == 1 and "cpus" not in refs[0].label_dict, [r.label_dict for r in refs]
        assert store.latest(name)[0][2] == n
        assert col.cpusets() == {CID: frozenset(range(4) if n == 4 else (1,) if n == 1 else (0, 1))}
    assert len(store.select(name, [Matcher("container_id", "=", CID)])) == 1
    col.close()


def test_a_missing_file_is_not_reopened_every_read_and_is_picked_up_when_it_appears(tmp_path: Path, monkeypatch):
    import os

    from cri_resmgr.collectors import cgroup as cg

    path = str(tmp_path / "cpu.pressure")
    opens = []
    real_open = os.open
    monkeypatch.setattr(cg.os, "open", lambda p, *a: (opens.append(p), real_open(p, *a))[1])
    files = cg.OpenFiles()
    for _ in range(200):
        assert files.read(path) is None
    assert 1 < len(opens) <= 12, "tried again with a growing gap (1, 2, 4, ... up to ABSENT_RETRY_MAX reads)"
    (tmp_path / "cpu.pressure").write_text("some avg10=0.00 avg60=0.00 avg300=0.00 total=5\n")
    got = [files.read(path) for _ in range(cg.ABSENT_RETRY_MAX + 1)]
    first = next(i for i, b in enumerate(got) if b is not None)
    assert first <= cg.ABSENT_RETRY_MAX and all(b is not None and b.endswith(b"total=5\n") for b in got[first:])
    n = len(opens)
    files.read(path)
    assert len(opens) == n, "kept open once found"
    files.close()


def test_pressure_files_that_appear_later_are_read(tmp_path: Path):
    """A container whose v2 PSI files are missing at first (made later) gets its pressure series within a few
    cycles, without re-opening the missing files on every cycle before that."""
    from cri_resmgr.collectors.cgroup import ABSENT_RETRY_MAX

    rel = PATHS["cgroupfs-guaranteed"][0]
    make_v1(tmp_path, rel, Values())
    (tmp_path / "unified" / rel).mkdir(parents=True)
    (tmp_path / "unified" / "cgroup.controllers").write_text("cpu memory io\n")
    col = CgroupCollector(tmp_path, use_inotify=False)
    psi = M.CONTAINER_PRESSURE_STALLED.name
    assert not [s for s in col.collect(0.0) if s.metric == psi]
    for r in ("cpu", "memory", "io"):
        (tmp_path / "unified" / rel / f"{r}.pressure").write_text(
            "some avg10=0.00 avg60=0.00 avg300=0.00 total=2000000\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=0\n")
    for cycle in range(1, ABSENT_RETRY_MAX + 2):
        got = [s for s in col.collect(float(cycle)) if s.metric == psi]
        if got:
            break
    assert len(got) == 6 and {s.value for s in got if s.labels["kind"] == "some"} == {2.0}
    col.close()


@pytest.mark.parametrize("version", [1, 2])
def test_row_keys_stay_the_same_list_until_the_containers_change(tmp_path: Path, version: int):
    from cri_resmgr.store import Store

    make = make_v1 if version == 1 else make_v2
    make(tmp_path, PATHS["cgroupfs-containerd-burstable"][0], Values())
    col = CgroupCollector(tmp_path, use_inotify=False)
    a, b = Store(), Store()
    row1 = col.collect_row(1.0)
    row2 = col.collect_row(2.0)
    assert row2.keys is row1.keys and len(row1.keys) == len(row1.values)
    make(tmp_path, f"kubepods/besteffort/pod{UID}/{CID2}", Values(usage_ns=1_000_000_000, cpus="1"))
    row3 = col.collect_row(3.0)
    assert row3.keys is not row1.keys and len(row3.keys) > len(row1.keys)
    assert all(k in row3.keys for k in row1.keys)
    for t, row in ((1.0, row1), (2.0, row2), (3.0, row3)):
        a.append_columns("cgroup", t, row)
        b.append("cgroup", t, row.samples())
    assert a.series_count == b.series_count == len(row3.samples())
    assert sorted((r.metric, r.labels, v) for r, _, v in a.latest()) == \
        sorted((r.metric, r.labels, v) for r, _, v in b.latest())
    col.close()
