"""The relay in front of a real containerd, driven as kubelet drives it (tests/integration/cri.py).

This machine has 2 CPUs: one exclusive CPU leaves one for the shared pool (relay.min_shared_cpus = 1).
"""

from __future__ import annotations

import json
import os
import signal
import stat
import time
from pathlib import Path

import grpc
import pytest
from cri_api.v1 import api_pb2 as pb

from cri_resmgr.sysfs import parse_cpulist

from ..cri import PodSpec, container_config, guaranteed
from ..helpers import wait_for
from .harness import RelayProcess, cgroup_cpuset, container_pid, cpus_allowed_list

pytestmark = pytest.mark.integration

ONLINE = parse_cpulist(Path("/sys/devices/system/cpu/online").read_text())


@pytest.fixture
def relay(containerd, tmp_path):
    procs: list[RelayProcess] = []

    def make(config: dict | None = None, start: bool = True, **kw) -> RelayProcess:
        r = RelayProcess(tmp_path / f"relay{len(procs)}", containerd.socket, config, **kw)
        procs.append(r)
        return r.start() if start else r

    yield make
    for r in procs:
        r.stop()


def two_cpus():
    if len(ONLINE) < 2:
        pytest.skip("needs at least 2 online CPUs (one exclusive, one shared)")


def kernel_view(k, relay_state, cid: str) -> dict:
    st = k.status(cid, verbose=True)
    view = next(c for c in relay_state.containers if c.id == cid)
    return {
        "relay": view.cpus,
        "cgroup": cgroup_cpuset(view.cgroup_path),
        "proc": cpus_allowed_list(container_pid(st)),
        "status": st.status.resources.linux.cpuset_cpus,
    }


def test_lifecycle_places_exclusive_and_shared_cpus_where_the_kernel_enforces_them(relay, kubelets):
    two_cpus()
    r = relay()
    k = kubelets(r.socket)
    ctl = r.client()
    gpod = k.run_pod(PodSpec("guaranteed", qos="Guaranteed"))
    g = k.run_container(gpod, guaranteed("app", 1000))
    bpod = k.run_pod(PodSpec("burstable", qos="Burstable"))
    b = k.run_container(bpod, container_config("app", cpu_milli_request=250, cpu_milli_limit=500))

    s = ctl.state()
    gv = next(c for c in s.containers if c.id == g)
    bv = next(c for c in s.containers if c.id == b)
    assert (gv.placement, gv.qos_class, gv.cpu_request_milli) == ("exclusive", "Guaranteed", 1000)
    assert (bv.placement, bv.qos_class, bv.cpu_request_milli, bv.cpu_limit_milli) == ("shared", "Burstable", 250, 500)
    excl = parse_cpulist(gv.cpus)
    assert len(excl) == 1 and s.exclusive == {g: gv.cpus}
    assert parse_cpulist(bv.cpus) == ONLINE - excl == parse_cpulist(s.shared_pool)
    for cid, want in ((g, gv.cpus), (b, bv.cpus)):
        seen = kernel_view(k, s, cid)
        assert set(seen.values()) == {want}, seen
    assert gv.mems == "0" and gv.state == "running"

    # The exclusive container goes: its CPU returns to the pool and the shared container gets it back.
    k.stop_remove_container(g)
    wait_for(lambda: parse_cpulist(kernel_view(k, ctl.state(), b)["cgroup"]) == ONLINE, timeout=10,
             what="shared container back on all CPUs")
    seen = kernel_view(k, ctl.state(), b)
    assert parse_cpulist(seen["proc"]) == ONLINE and parse_cpulist(seen["status"]) == ONLINE
    k.stop_remove_pod(gpod)
    k.stop_remove_pod(bpod)
    s = ctl.state()
    assert s.containers == [] and s.pods == 0 and s.exclusive == {}

    text = ctl.metrics()
    assert 'cri_resmgr_relay_requests_total{method="CreateContainer",code="OK"} 2' in text
    assert 'cri_resmgr_relay_request_duration_seconds_bucket{method="CreateContainer",le="5e-05"}' in text


def test_second_exclusive_container_is_refused_when_the_pool_would_be_empty(relay, kubelets):
    two_cpus()
    r = relay()
    k = kubelets(r.socket)
    p = k.run_pod(PodSpec("g", qos="Guaranteed"))
    k.run_container(p, guaranteed("one", 1000))
    with pytest.raises(grpc.RpcError) as e:
        k.create(p, guaranteed("two", 1000))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "insufficient CPUs" in e.value.details() and "default/g/two" in e.value.details()
    # the refused request never reached containerd
    names = [c.metadata.name for c in k.c.runtime.ListContainers(pb.ListContainersRequest()).containers
             if c.pod_sandbox_id == p.sandbox_id]
    assert names == ["one"]


def test_move_applies_the_cpuset_and_records_it(relay, kubelets):
    two_cpus()
    r = relay({"relay": {"allow_move_exclusive": False}})
    k = kubelets(r.socket)
    ctl = r.client()
    p = k.run_pod(PodSpec("mover", qos="Burstable"))
    cid = k.run_container(p, container_config("app", cpu_milli_request=100))
    target = str(max(ONLINE))
    rec = ctl.move(cid, target, who="test", why="noisy neighbour")
    assert rec.result == "applied", rec
    assert (rec.to_cpus, rec.who, rec.why) == (target, "test", "noisy neighbour")
    assert parse_cpulist(rec.from_cpus) == ONLINE
    s = ctl.state()
    seen = kernel_view(k, s, cid)
    assert set(seen.values()) == {target}, seen
    assert next(c for c in s.containers if c.id == cid).placement == "pinned"
    assert [m.to_cpus for m in ctl.moves()] == [target]

    # An exclusive container is not moved unless configured; a CPU outside the pool is refused.
    gp = k.run_pod(PodSpec("excl", qos="Guaranteed"))
    g = k.run_container(gp, guaranteed("app", 1000))
    s = ctl.state()
    g_cpus = s.exclusive[g]
    refused = ctl.move(g, str(min(ONLINE - parse_cpulist(g_cpus))), who="test")
    assert refused.result == "refused" and "exclusive" in refused.error
    # the pinned shared container was squeezed off the exclusive CPU; moving it there is refused
    assert parse_cpulist(kernel_view(k, s, cid)["cgroup"]) == ONLINE - parse_cpulist(g_cpus)
    refused = ctl.move(cid, g_cpus, who="test")
    assert refused.result == "refused" and "outside the shared pool" in refused.error
    assert [m.result for m in ctl.moves()] == ["applied", "refused", "refused"]
    log_lines = (r.tmp / "state" / "relay-moves.jsonl").read_text().splitlines()
    assert len(log_lines) == 3


def test_kubelet_resize_keeps_the_relays_cpuset(relay, kubelets):
    two_cpus()
    r = relay()
    k = kubelets(r.socket)
    ctl = r.client()
    p = k.run_pod(PodSpec("resize", qos="Guaranteed"))
    g = k.run_container(p, guaranteed("app", 1000))
    cpus = ctl.state().exclusive[g]
    # kubelet's in-place resize sends the new limits and no cpuset (static CPU manager off)
    k.c.runtime.UpdateContainerResources(pb.UpdateContainerResourcesRequest(
        container_id=g, linux=pb.LinuxContainerResources(cpu_shares=1024, cpu_period=100000, cpu_quota=100000,
                                                         memory_limit_in_bytes=128 << 20)), timeout=10)
    s = ctl.state()
    seen = kernel_view(k, s, g)
    assert set(seen.values()) == {cpus}, seen
    assert k.status(g).status.resources.linux.memory_limit_in_bytes == 128 << 20
    assert next(c for c in s.containers if c.id == g).memory_limit_bytes == 128 << 20


def test_restarted_relay_restores_the_cache_and_allocates_nothing_twice(relay, kubelets):
    two_cpus()
    r = relay()
    k = kubelets(r.socket)
    p = k.run_pod(PodSpec("survivor", qos="Guaranteed"))
    g = k.run_container(p, guaranteed("app", 1000))
    before = r.client().state()
    # saves are coalesced (at most one per 0.2 s): the running container is in the file within a moment
    cache = r.tmp / "state" / "relay-cache.json"
    wait_for(lambda: any(c["id"] == g and c["state"] == "running"
                         for c in json.loads(cache.read_text())["containers"]), timeout=5, what="cache saved")
    r.stop(signal.SIGKILL)
    assert r.socket.is_socket()  # a killed relay leaves its socket behind
    r.start()
    assert "removing stale socket" in r.log()
    after = r.client().state()
    assert after.exclusive == before.exclusive == {g: before.exclusive[g]}
    assert next(c for c in after.containers if c.id == g).reason == next(
        c for c in before.containers if c.id == g).reason  # from the saved cache, not re-adopted
    with pytest.raises(grpc.RpcError) as e:
        k.create(p, guaranteed("second", 1000))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_cache_is_rebuilt_from_the_runtime_when_the_saved_one_is_lost(relay, kubelets):
    two_cpus()
    r = relay()
    k = kubelets(r.socket)
    p = k.run_pod(PodSpec("adopted", qos="Guaranteed"))
    g = k.run_container(p, guaranteed("app", 1000))
    cpus = r.client().state().exclusive[g]
    r.stop(signal.SIGKILL)
    r2 = relay()  # a fresh state_dir: the saved cache is gone
    s = r2.client().state()
    assert s.exclusive == {g: cpus}
    v = next(c for c in s.containers if c.id == g)
    assert (v.qos_class, v.cpu_request_milli, v.pod, v.reason) == ("Guaranteed", 1000, "adopted", "adopted at resync")


def test_killed_container_process_is_detected_and_its_cpus_released(relay, kubelets):
    two_cpus()
    r = relay()
    k = kubelets(r.socket)
    ctl = r.client()
    p = k.run_pod(PodSpec("crashy", qos="Guaranteed"))
    g = k.run_container(p, guaranteed("app", 1000))
    assert g in ctl.state().exclusive
    os.kill(container_pid(k.status(g, verbose=True)), signal.SIGKILL)
    wait_for(lambda: g not in ctl.state().exclusive, timeout=10, what="exited container's CPUs released")
    assert next(c for c in ctl.state().containers if c.id == g).state == "exited"
    # kubelet re-creates the crashed container: never refused for insufficient CPU
    cfg = guaranteed("app", 1000)
    cfg.metadata.attempt = 1
    g2 = k.run_container(p, cfg)
    s = ctl.state()
    assert list(s.exclusive) == [g2]
    assert set(kernel_view(k, s, g2).values()) == {s.exclusive[g2]}


def test_runtime_restart_answers_unavailable_quickly_then_reconnects(relay, kubelets, containerd):
    r = relay()
    k = kubelets(r.socket)
    rt = k.c.runtime
    assert rt.Version(pb.VersionRequest(), timeout=5).runtime_name == "containerd"
    containerd.stop()
    try:
        t0 = time.monotonic()
        codes = []
        for _ in range(3):
            with pytest.raises(grpc.RpcError) as e:
                rt.Version(pb.VersionRequest(), timeout=5)
            codes.append(e.value.code())
        assert time.monotonic() - t0 < 3, "UNAVAILABLE must come at once, not at the deadline"
        assert set(codes) == {grpc.StatusCode.UNAVAILABLE}
    finally:
        containerd.start()

    def version_ok():
        try:
            return rt.Version(pb.VersionRequest(), timeout=2).runtime_name
        except grpc.RpcError:
            return None

    assert wait_for(version_ok, timeout=15, what="relay forwarding again") == "containerd"
    assert 'code="UNAVAILABLE"' in r.client().metrics()


def test_relay_socket_follows_runtime_socket_owner_and_mode(relay, containerd):
    r = relay()
    rs, cs = os.stat(r.socket), os.stat(containerd.socket)
    assert (rs.st_uid, rs.st_gid) == (cs.st_uid, cs.st_gid)
    assert stat.S_IMODE(rs.st_mode) == (stat.S_IMODE(cs.st_mode) & 0o770 or 0o660)
    assert stat.S_ISSOCK(rs.st_mode)


def test_only_one_relay_per_node_and_a_live_socket_is_never_taken(relay, tmp_path):
    r = relay()
    second = relay({"run_dir": str(r.tmp / "run")}, start=False)
    second.start(wait=False)
    assert second.proc.wait(20) == 1
    assert "already running" in second.log()
    # another run_dir, same socket: the socket is alive, so the relay refuses it
    third = relay({"relay": {"socket": str(r.socket)}}, start=False)
    third.start(wait=False)
    assert third.proc.wait(20) == 1
    assert f"something is listening on {r.socket}" in third.log()
    assert r.proc.poll() is None
