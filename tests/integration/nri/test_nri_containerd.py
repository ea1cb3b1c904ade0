"""The NRI plugin (``cri-resmgr nri``, a real subprocess) registered with a real containerd 1.7: placements,
adoption, resize, moves and faults, each read back from the kernel's cgroup files.

The machine has 2 CPUs and the shared pool keeps at least one, so one whole-CPU Guaranteed container at a time
can be exclusive."""

from __future__ import annotations

import json
import shutil
import signal
import time

import grpc
import pytest

from cri_resmgr.sysfs import parse_cpulist

from ..cri import PodSpec, container_config, guaranteed
from ..helpers import CGROUP_ROOT
from ..relay.harness import cgroup_cpuset, container_pid, cpus_allowed_list
from .harness import NriPluginProcess

pytestmark = pytest.mark.integration

ALL = frozenset({0, 1})


def cgroup_path(kubelet, cid: str) -> str:
    return json.loads(kubelet.status(cid, verbose=True).info["info"])["runtimeSpec"]["linux"]["cgroupsPath"]


def cpuset_of(kubelet, cid: str) -> frozenset[int]:
    return parse_cpulist(cgroup_cpuset(cgroup_path(kubelet, cid)))


def wait_cpuset(kubelet, cid: str, want: frozenset[int], timeout: float = 10) -> frozenset[int]:
    deadline = time.time() + timeout
    got = cpuset_of(kubelet, cid)
    while got != want and time.time() < deadline:
        time.sleep(0.1)
        got = cpuset_of(kubelet, cid)
    return got


def cpu_quota_us(kubelet, cid: str) -> int:
    return int((CGROUP_ROOT / "cpu" / cgroup_path(kubelet, cid).lstrip("/") / "cpu.cfs_quota_us").read_text())


@pytest.fixture
def plugin(containerd17, tmp_path):
    p = NriPluginProcess(tmp_path / "nri", containerd17.nri_socket)
    yield p
    p.stop(signal.SIGKILL)


def test_guaranteed_container_gets_an_exclusive_cpu_and_besteffort_avoids_it(plugin, kubelet):
    plugin.start()
    b = kubelet.run_pod(PodSpec("b", qos="BestEffort"))
    bid = kubelet.run_container(b, container_config("idle"))
    assert cpuset_of(kubelet, bid) == ALL  # alone: the whole shared pool
    g = kubelet.run_pod(PodSpec("g", qos="Guaranteed"))
    gid = kubelet.run_container(g, guaranteed("work", 1000))
    excl, shared = cpuset_of(kubelet, gid), cpuset_of(kubelet, bid)
    assert len(excl) == 1 and shared == ALL - excl, (excl, shared, plugin.log())
    # the task itself runs there, and the engine's books say the same
    assert parse_cpulist(cpus_allowed_list(container_pid(kubelet.status(gid, verbose=True)))) == excl
    st = plugin.client().state()
    assert {k: parse_cpulist(v) for k, v in st.exclusive.items()} == {gid: excl}
    # a second whole-CPU container cannot be exclusive too (the pool keeps one CPU): creation is refused
    g2 = kubelet.run_pod(PodSpec("g2", qos="Guaranteed"))
    with pytest.raises(grpc.RpcError) as e:
        kubelet.create(g2, guaranteed("more", 1000))
    assert "insufficient CPUs" in e.value.details()
    # stopping the exclusive container gives its CPU back to the shared one
    kubelet.stop_remove_container(gid)
    assert wait_cpuset(kubelet, bid, ALL) == ALL
    m = plugin.client().metrics()
    assert 'cri_resmgr_nri_requests_total{event="CreateContainer",result="ok"} 2.0\n' in m, m
    assert 'cri_resmgr_nri_requests_total{event="CreateContainer",result="error"} 1.0\n' in m, m
    assert 'cri_resmgr_nri_request_duration_seconds_count{event="StartContainer"} 2\n' in m, m
    assert "cri_resmgr_nri_connected 1.0\n" in m and "cri_resmgr_relay_exclusive_cpus 0.0\n" in m, m


def test_plugin_started_after_pods_exist_adopts_them(plugin, kubelet):
    b = kubelet.run_pod(PodSpec("b", qos="BestEffort"))
    bid = kubelet.run_container(b, container_config("idle"))
    plugin.start()
    st = plugin.client().state()
    assert [c.id for c in st.containers if c.placement == "shared"] == [bid], st
    # the adopted container leaves the CPU a new exclusive container takes, in the same create
    g = kubelet.run_pod(PodSpec("g", qos="Guaranteed"))
    gid = kubelet.run_container(g, guaranteed("work", 1000))
    excl = cpuset_of(kubelet, gid)
    assert len(excl) == 1 and cpuset_of(kubelet, bid) == ALL - excl


def test_resize_of_an_exclusive_container_to_a_fraction_moves_it_to_the_shared_pool(plugin, kubelet):
    from cri_api.v1 import api_pb2 as pb

    plugin.start()
    g = kubelet.run_pod(PodSpec("g", qos="Guaranteed"))
    gid = kubelet.run_container(g, guaranteed("work", 1000))
    assert len(cpuset_of(kubelet, gid)) == 1
    res = pb.LinuxContainerResources(cpu_shares=512, cpu_period=100000, cpu_quota=50000,
                                     memory_limit_in_bytes=64 << 20)
    kubelet.c.runtime.UpdateContainerResources(pb.UpdateContainerResourcesRequest(container_id=gid, linux=res),
                                               timeout=30)
    assert cpuset_of(kubelet, gid) == ALL, plugin.log()  # no longer exclusive: the whole pool
    assert cpu_quota_us(kubelet, gid) == 50000  # and the rest of the resize applied as asked
    st = plugin.client().state()
    assert st.exclusive == {} and {c.id: c.placement for c in st.containers}[gid] == "shared"


def test_rebalancer_moves_a_container_through_the_control_socket(plugin, kubelet):
    """The rebalancer's move applier and metadata source, unchanged, on the plugin's control socket."""
    from cri_resmgr.rebalancer.relay_client import RelayMetadata, RelayMoveApplier

    plugin.start()
    b = kubelet.run_pod(PodSpec("b", qos="Burstable"))
    bid = kubelet.run_container(b, container_config("busy", cpu_milli_request=200))
    meta = RelayMetadata(plugin.client()).metadata()
    assert meta[bid].qos == "Burstable" and meta[bid].cpu_request == 0.2 and not meta[bid].exclusive
    done = RelayMoveApplier(plugin.client()).apply(bid, frozenset({1}), None, "test: through NRI UpdateContainers")
    assert done.ok, done
    assert cpuset_of(kubelet, bid) == {1}
    assert parse_cpulist(cpus_allowed_list(container_pid(kubelet.status(bid, verbose=True)))) == {1}
    refused = plugin.client().move(bid, "7", who="test")
    assert refused.result == "refused" and cpuset_of(kubelet, bid) == {1}
    assert [m.result for m in plugin.client().moves()] == ["applied", "refused"]


@pytest.mark.parametrize("cache", ["kept", "lost"])
def test_plugin_killed_and_restarted_books_nothing_twice(plugin, kubelet, cache):
    """With its cache the plugin knows its allocations; without (state_dir wiped) it learns them again from
    what Synchronize reports each container holds."""
    plugin.start()
    g = kubelet.run_pod(PodSpec("g", qos="Guaranteed"))
    gid = kubelet.run_container(g, guaranteed("work", 1000))
    excl = cpuset_of(kubelet, gid)
    plugin.stop(signal.SIGKILL)
    # created while no plugin runs: containerd lets it through with every CPU
    b = kubelet.run_pod(PodSpec("b", qos="BestEffort"))
    bid = kubelet.run_container(b, container_config("idle"))
    assert cpuset_of(kubelet, bid) == ALL
    if cache == "lost":
        shutil.rmtree(plugin.tmp / "state")
    plugin.start()  # registers again; Synchronize adopts the new container into the pool
    assert wait_cpuset(kubelet, bid, ALL - excl) == ALL - excl, plugin.log()
    assert cpuset_of(kubelet, gid) == excl
    st = plugin.client().state()
    assert {k: parse_cpulist(v) for k, v in st.exclusive.items()} == {gid: excl}
    g2 = kubelet.run_pod(PodSpec("g2", qos="Guaranteed"))
    with pytest.raises(grpc.RpcError):  # the restarted plugin knows the CPU is taken
        kubelet.create(g2, guaranteed("more", 1000))


def test_second_instance_refuses_to_start(plugin, tmp_path):
    plugin.start()
    twin = NriPluginProcess(plugin.tmp, plugin.config["nri"]["socket"], name="twin")
    twin.start(wait=False)
    assert twin.proc.wait(20) == 1
    assert "already running" in twin.log()


def test_containerd_restart_reconnects_and_keeps_placements(plugin, kubelet, containerd17):
    plugin.start()
    g = kubelet.run_pod(PodSpec("g", qos="Guaranteed"))
    gid = kubelet.run_container(g, guaranteed("work", 1000))
    excl = cpuset_of(kubelet, gid)
    containerd17.restart()
    plugin.wait_for("registered with the runtime", timeout=30, count=2)
    plugin.wait_for("synchronised", timeout=30, count=2)
    st = plugin.client().state()
    assert {k: parse_cpulist(v) for k, v in st.exclusive.items()} == {gid: excl}
    b = kubelet.run_pod(PodSpec("b", qos="BestEffort"))
    bid = kubelet.run_container(b, container_config("idle"))
    assert cpuset_of(kubelet, bid) == ALL - excl, plugin.log()


def test_stalled_plugin_fails_open_and_recovers(plugin, kubelet):
    """SIGSTOP: the plugin cannot answer. containerd gives up after its 2 s plugin_request_timeout, drops the
    plugin and creates the container unchanged; on SIGCONT the plugin finds its connection gone, registers
    again, and Synchronize brings the container into the pool."""
    plugin.start()
    g = kubelet.run_pod(PodSpec("g", qos="Guaranteed"))
    gid = kubelet.run_container(g, guaranteed("work", 1000))
    excl = cpuset_of(kubelet, gid)
    plugin.proc.send_signal(signal.SIGSTOP)
    try:
        b = kubelet.run_pod(PodSpec("b", qos="BestEffort"))
        t0 = time.monotonic()
        bid = kubelet.run_container(b, container_config("idle"))
        assert time.monotonic() - t0 < 15
    finally:
        plugin.proc.send_signal(signal.SIGCONT)
    plugin.wait_for("synchronised", timeout=30, count=2)
    assert wait_cpuset(kubelet, bid, ALL - excl) == ALL - excl, plugin.log()


def test_sighup_rereads_the_config_and_rejects_a_broken_one(plugin):
    import yaml

    plugin.start()
    good = plugin.config_path.read_text()
    plugin.config_path.write_text(yaml.safe_dump({**plugin.config, "nri": {**plugin.config["nri"], "bogus": 1}}))
    plugin.proc.send_signal(signal.SIGHUP)
    plugin.wait_for("reload rejected", timeout=15)
    plugin.config_path.write_text(good)
    plugin.proc.send_signal(signal.SIGHUP)
    plugin.wait_for("configuration reloaded", timeout=15)
    assert plugin.proc.poll() is None and plugin.client().state().runtime.startswith("containerd 1.7")


def test_plugin_waits_for_a_runtime_that_is_not_there_yet(tmp_path):
    """No NRI socket: the plugin stays up, says why once, keeps retrying, and its control socket answers."""
    p = NriPluginProcess(tmp_path / "nri", tmp_path / "absent" / "nri.sock")
    p.start(wait=False)
    try:
        p.wait_for("cannot connect to", timeout=20)
        deadline = time.time() + 20
        while not p.control.exists() and time.time() < deadline:
            time.sleep(0.05)
        st = p.client().state()
        assert st.containers == [] and p.proc.poll() is None
        assert "cri_resmgr_nri_connected 0.0" in p.client().metrics()
        time.sleep(1.5)
        assert p.log().count("cannot connect to") == 1  # said once, not at every attempt
    finally:
        p.stop()


def test_container_that_exits_by_itself_releases_its_exclusive_cpu(plugin, kubelet):
    """No StopContainer from kubelet: containerd tells NRI about the exit itself, and the CPU goes back."""
    plugin.start()
    b = kubelet.run_pod(PodSpec("b", qos="BestEffort"))
    bid = kubelet.run_container(b, container_config("idle"))
    g = kubelet.run_pod(PodSpec("g", qos="Guaranteed"))
    gid = kubelet.run_container(g, guaranteed("short", 1000, command=["sh", "-c", "sleep 1; exit 3"]))
    excl = cpuset_of(kubelet, gid)
    assert len(excl) == 1 and cpuset_of(kubelet, bid) == ALL - excl
    assert wait_cpuset(kubelet, bid, ALL, timeout=15) == ALL, plugin.log()
    assert plugin.client().state().exclusive == {}


def test_agent_metrics_include_the_plugins(plugin, kubelet, tmp_path):
    """One scrape target per node in NRI mode too: the agent appends what the plugin's control socket renders."""
    import shutil as sh
    import subprocess

    from ..helpers import AgentProcess

    plugin.start()
    b = kubelet.run_pod(PodSpec("b", qos="BestEffort"))
    kubelet.run_container(b, container_config("idle"))
    agent = AgentProcess(tmp_path, {"relay": {"control_socket": str(plugin.control)}}).start()
    try:
        text = agent.get("/metrics")
        want = 'cri_resmgr_nri_requests_total{event="CreateContainer"'
        lines = [ln for ln in text.splitlines() if ln.startswith(want)]
        assert lines and float(lines[0].rsplit(" ", 1)[1]) >= 1, lines
        assert "cri_resmgr_collector_up{" in text
        if sh.which("promtool"):
            r = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True,
                               timeout=60)
            assert r.returncode == 0, r.stdout + r.stderr
    finally:
        assert agent.stop() == 0
