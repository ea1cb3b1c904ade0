"""Block-IO and real-time classes on real containerd containers through the relay: the running container's
cgroup files show its class, a SIGHUP with changed classes updates it, a bad reload keeps the old classes, a
bad class config stops the relay at start with exit 2, and a container writing with direct I/O to a loop device
under a 1 MiB/s class is held to 1 MiB/s (± 20%)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from cri_api.v1 import api_pb2 as pb

from cri_resmgr.placement.controllers.blockio import parse_device_values
from cri_resmgr.placement.controllers.rt import RUNTIME

from ...controller_cgroups import bfq_missing, loop_device, sample
from ..cri import PodSpec, container_config
from ..helpers import AgentProcess, wait_for
from .harness import RelayProcess

pytestmark = pytest.mark.integration

MiB = 1 << 20
BLKIO = Path("/sys/fs/cgroup/blkio")
CPU = Path("/sys/fs/cgroup/cpu")
BLOCKIO_POD = "blockioclass.cri-resource-manager.intel.com/pod"
RT_POD = "rtclass.cri-resource-manager.intel.com/pod"


@pytest.fixture
def loopdev(tmp_path):
    if not (BLKIO / "blkio.throttle.write_bps_device").exists():
        pytest.skip("no cgroup v1 blkio hierarchy with throttling")
    if not (CPU / RUNTIME).exists():
        pytest.skip("no cgroup v1 cpu.rt_runtime_us (RT group scheduling)")
    with loop_device(tmp_path, 32 * MiB) as dev_mm:
        yield dev_mm


def controls(dev: str, write_bps: int, rt_us: int) -> dict:
    weight = {"weight": 200} if bfq_missing() is None else {}  # kernels with and without BFQ both run this
    return {"controls": {"blockio": {"classes": {"slow": {**weight,
                                                          "devices": [{"devices": dev, "write_bps": write_bps}]}}},
                         "rt": {"classes": {"audio": {"runtime_us": rt_us}}}}}


def cgroup_of(relay: RelayProcess, cid: str) -> str:
    return next(c.cgroup_path for c in relay.client().state().containers if c.id == cid).strip("/")


def wbps(path: str) -> dict[str, int]:
    return parse_device_values((BLKIO / path / "blkio.throttle.write_bps_device").read_text())


def rt_runtime(path: str) -> int:
    return int((CPU / path / RUNTIME).read_text())


def reload(relay: RelayProcess, config: dict) -> None:
    relay.config_path.write_text(yaml.safe_dump({**relay.config, **config}))
    mark = len(relay.log())
    relay.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: "reload" in relay.log()[mark:], timeout=10, what="the relay to log the reload")


def test_classes_are_enforced_live_updated_and_measured(containerd, kubelets, tmp_path, loopdev):
    dev, mm = loopdev
    r = RelayProcess(tmp_path / "relay", containerd.socket, controls(dev, MiB, 20000)).start()
    # The agent's /api/v1/containers shows the classes from the relay's state.
    (tmp_path / "agent-dir").mkdir()
    agent = AgentProcess(tmp_path / "agent-dir", {
        "relay": {"control_socket": str(r.control)},
        "collectors": {c: {"enabled": False} for c in ("avx512", "perf", "rdt", "sst")}})
    agent.start(wait=False)
    try:
        k = kubelets(r.socket)
        pod = k.run_pod(PodSpec("ctl", qos="Burstable", annotations={BLOCKIO_POD: "slow", RT_POD: "audio"}))
        sync = tmp_path / "sync"
        sync.mkdir()
        # The writer waits for the test's go (after the class is in place), then writes 3 MiB with O_DIRECT.
        cfg = container_config("writer", cpu_milli_request=100, command=[
            "sh", "-c", "until [ -e /sync/go ]; do sleep 0.02; done; "
                        "exec /bin/busybox dd if=/dev/zero of=/dev/crirm-disk bs=65536 count=48 oflag=direct"])
        cfg.devices.append(pb.Device(container_path="/dev/crirm-disk", host_path=dev, permissions="rw"))
        cfg.mounts.append(pb.Mount(container_path="/sync", host_path=str(sync), readonly=True))
        cid = k.run_container(pod, cfg)
        path = cgroup_of(r, cid)
        wait_for(lambda: wbps(path) == {mm: MiB}, timeout=10, what="the blkio class on the container cgroup")
        assert bfq_missing() or (BLKIO / path / "blkio.bfq.weight").read_text().strip() == "200"
        wait_for(lambda: rt_runtime(path) == 20000, timeout=10, what="the RT grant")
        parents = [str(Path(path).parents[i]) for i in range(len(Path(path).parts) - 1)]
        assert all(rt_runtime(p) >= 20000 for p in parents), {p: rt_runtime(p) for p in parents}
        # A task in the container's cgroup can now be SCHED_FIFO (sched-rt-group.rst: not with 0 runtime).
        probe = ("import os,sys\nopen(sys.argv[1],'w').write(str(os.getpid()))\n"
                 "os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1)); print('ok')")
        out = subprocess.run([sys.executable, "-c", probe, str(CPU / path / "cgroup.procs")], capture_output=True,
                             text=True)
        assert out.stdout.strip() == "ok", out.stderr

        view = next(c for c in r.client().state().containers if c.id == cid)
        assert view.controls == {"blockio": "slow", "rt": "audio"} and view.control_errors == {}
        text = r.client().metrics()
        assert sample(text, "cri_resmgr_container_blockio_class", container_id=cid, **{"class": "slow"}) == 1
        assert sample(text, "cri_resmgr_control_class_containers", control="rt", **{"class": "audio"}) == 1

        # The measured throttle: 3 MiB written with O_DIRECT under a 1 MiB/s class, timed from the go to the
        # container's exit (containerd's finished_at; the same host clock).
        go = time.time()
        (sync / "go").write_text("")
        st = wait_for(lambda: (s := k.status(cid).status).state == pb.CONTAINER_EXITED and s, timeout=30,
                      what="the writer to finish")
        assert st.exit_code == 0, st
        seconds = st.finished_at / 1e9 - go
        rate = 3 * MiB / seconds
        print(f"container under a 1 MiB/s class wrote 3 MiB with O_DIRECT in {seconds:.3f} s: {rate / MiB:.3f} MiB/s")
        assert 0.8 * MiB <= rate <= 1.2 * MiB, f"{rate / MiB:.2f} MiB/s over {seconds:.2f} s"

        # SIGHUP with changed classes: a running container follows.
        pod2 = k.run_pod(PodSpec("ctl2", qos="Burstable", annotations={BLOCKIO_POD: "slow", RT_POD: "audio"}))
        c2 = k.run_container(pod2, container_config("idle", cpu_milli_request=100))
        p2 = cgroup_of(r, c2)
        wait_for(lambda: wbps(p2) == {mm: MiB} and rt_runtime(p2) == 20000, timeout=10, what="classes on c2")
        agent.wait_ready()
        seen = wait_for(lambda: next((c for c in agent.get("/api/v1/containers") if c["container_id"] == c2), None),
                        timeout=15, what="the agent to list c2")
        assert (seen["controls"], seen["control_errors"]) == ({"blockio": "slow", "rt": "audio"}, {})
        reload(r, controls(dev, 2 * MiB, 30000))
        wait_for(lambda: wbps(p2) == {mm: 2 * MiB} and rt_runtime(p2) == 30000, timeout=10,
                 what="the reloaded classes on the running container")
        # A bad reload (unknown device) is rejected: the running classes stay.
        reload(r, controls("/dev/crirm-no-such-disk", 4 * MiB, 40000))
        assert "reload rejected" in r.log() and "matches no block device" in r.log()
        bad = controls(dev, 4 * MiB, 40000)
        bad["controls"]["rdt"] = {"partitions": {"a": {"l3": "60%"}, "b": {"l3": "50%"}}}
        mark = len(r.log())
        reload(r, bad)
        assert "reload rejected" in r.log()[mark:] and "over 100%" in r.log()[mark:]
        time.sleep(1)
        assert wbps(p2) == {mm: 2 * MiB} and rt_runtime(p2) == 30000
        # A relay restarted with other classes adopts the running container and enforces them.
        r.stop()
        r.config_path.write_text(yaml.safe_dump({**r.config, **controls(dev, 3 * MiB, 25000)}))
        r.start()
        wait_for(lambda: wbps(p2) == {mm: 3 * MiB} and rt_runtime(p2) == 25000, timeout=15,
                 what="the restarted relay's classes on the adopted container")
        # Stop: the grant goes back up the tree.
        k.stop_remove_pod(pod2)
        top = p2.split("/")[0]
        wait_for(lambda: rt_runtime(top) == 0, timeout=10, what="RT runtime released")
        assert "no blkio" not in r.log(), "a cgroup missing at CreateContainer is not an error"
        assert sample(r.client().metrics(), "cri_resmgr_control_errors_total", control="blockio") == 0
    except AssertionError:
        print("relay log:\n" + "\n".join(line for line in r.log().splitlines() if "h2proxy" not in line))
        raise
    finally:
        agent.stop()
        r.stop()


BUDGET = int((CPU / RUNTIME).read_text()) if (CPU / RUNTIME).exists() else 950000


@pytest.mark.parametrize("controls, key, why", [
    ({"rdt": {"partitions": {"a": {"l3": "0-5"}, "b": {"l3": "4-11"}}}}, "controls.rdt", "overlap partition a"),
    ({"rdt": {"partitions": {"a": {"l3": "60%"}, "b": {"l3": "50%"}}}}, "controls.rdt", "over 100%"),
    ({"blockio": {"classes": {"x": {"devices": [{"devices": "/dev/crirm-none*", "write_bps": 1}]}}}},
     "controls.blockio.classes.x.devices[0].devices", "matches no block device"),
    ({"rt": {"classes": {"x": {"runtime_us": BUDGET + 1}}}}, "controls.rt.classes.x.runtime_us",
     "exceeds the node's RT budget"),
], ids=["overlapping-partitions", "over-100-percent", "unknown-device", "rt-over-budget"])
def test_bad_class_config_stops_the_relay_at_start_with_exit_2(containerd, tmp_path, controls, key, why):
    r = RelayProcess(tmp_path / "relay", containerd.socket, {"controls": controls})
    r.start(wait=False)
    assert r.proc.wait(timeout=30) == 2, r.log()
    assert f"{key}:" in r.log() and why in r.log(), r.log()
    r.stop()


def test_rdt_class_puts_the_containers_threads_in_its_group(containerd, kubelets, tmp_path):
    from ...resctrlfs import ResctrlEmulator, fuse_unavailable
    from .harness import container_pid

    why = fuse_unavailable()
    if why:
        pytest.skip(why)
    emu = ResctrlEmulator().mount(tmp_path / "resctrl")
    r = RelayProcess(tmp_path / "relay", containerd.socket, {
        "paths": {"resctrl": str(emu.mountpoint)},
        "controls": {"rdt": {"l3_cache_bytes": 12 * MiB, "partitions": {
            "exclusive": {"l3": "50%", "classes": {"Guaranteed": {}}},
            "shared": {"l3": "50%", "classes": {"BestEffort": {"l3": "2MiB", "mb": "30%"}}}},
            "defaults": {"BestEffort": "BestEffort"}}}})
    try:
        r.start()
        assert (emu.mountpoint / "BestEffort" / "schemata").read_text() == "L3:0=c0;1=c0\nMB:0=30;1=30\n"
        k = kubelets(r.socket)
        pod = k.run_pod(PodSpec("be", qos="BestEffort"))
        cid = k.run_container(pod, container_config("app"))
        pid = container_pid(k.status(cid, verbose=True))
        wait_for(lambda: str(pid) in (emu.mountpoint / "BestEffort" / "tasks").read_text().split(), timeout=10,
                 what="the container's init thread in the BestEffort group")
        view = next(c for c in r.client().state().containers if c.id == cid)
        assert view.controls == {"rdt": "BestEffort"} and view.control_errors == {}
    finally:
        r.stop()
        emu.unmount()
