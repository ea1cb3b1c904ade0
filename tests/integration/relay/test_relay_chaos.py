"""Chaos on a real containerd: pods churn through the relay as kubelet drives them (sequentially and
concurrently) while the test injects the faults a node sees, and a sampler reads the placement invariants from
the kernel's cgroup cpuset files throughout (never from the relay):

- no CPU in the cpusets of two running Guaranteed (exclusive, 1 CPU) containers;
- no running non-Guaranteed container's cpuset holds a running Guaranteed container's CPU;
- a running Guaranteed container has exactly its one CPU.

A sample counts only containers listed RUNNING both before and after their cpuset files were read (a
container that is running at two instants was running in between: states only move forward), so a
container stopping mid-sample is never a false alarm.

Injected: concurrent BestEffort + Guaranteed creates; kill -9 of the relay mid-burst and restart;
containerd restart with containers kept; a container that exits 1 and one the OOM killer ends (their CPUs
come back); a truncated, a wrong-shape and an ENOSPC cache (state_dir on a tiny tmpfs); a runtime that hangs
(SIGSTOP for 1.5 s) while creates are in flight; a CONTINUATION flood.
After each, the relay answers Version within 2 s.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import grpc
import hpack
import pytest
from cri_api.v1 import api_pb2 as pb

from cri_resmgr.sysfs import parse_cpulist

from ..cri import CriClient, PodSpec, container_config, guaranteed
from ..helpers import wait_for
from .harness import RelayProcess, cgroup_cpuset

pytestmark = pytest.mark.integration

ONLINE = parse_cpulist(Path("/sys/devices/system/cpu/online").read_text())


class KernelSampler(threading.Thread):
    def __init__(self, runtime_socket, parents: dict[str, tuple[str, str]]):
        super().__init__(daemon=True)
        self.client = CriClient(runtime_socket, timeout=2)
        self.parents = parents  # sandbox id -> (qos, cgroup parent), filled as pods are made
        self.stop_event = threading.Event()
        self.samples = 0
        self.mixed = 0  # samples with both an exclusive and a shared container running
        self.violations: list[str] = []
        self.phase = "start"

    def running(self) -> dict[str, str]:
        f = pb.ContainerFilter(state=pb.ContainerStateValue(state=pb.CONTAINER_RUNNING))
        items = self.client.runtime.ListContainers(pb.ListContainersRequest(filter=f), timeout=2).containers
        return {c.id: c.pod_sandbox_id for c in items}

    def sample(self) -> None:
        t = time.time()
        try:
            first = self.running()
        except grpc.RpcError:
            return  # containerd restarting
        cpus: dict[str, frozenset[int]] = {}
        for cid, pod in first.items():
            if pod not in self.parents:
                continue
            try:
                cpus[cid] = parse_cpulist(cgroup_cpuset(f"{self.parents[pod][1]}/{cid}"))
            except (OSError, ValueError):
                continue  # gone meanwhile
        try:
            second = self.running()
        except grpc.RpcError:
            return
        both = [cid for cid in cpus if cid in second]
        excl = [cid for cid in both if self.parents[first[cid]][0] == "Guaranteed"]
        shared = [cid for cid in both if cid not in excl]
        owner: dict[int, str] = {}
        for cid in excl:
            if len(cpus[cid]) != 1:
                self.violations.append(f"{self.phase}: exclusive {cid[:12]} has {sorted(cpus[cid])}")
            for cpu in cpus[cid]:
                if cpu in owner:
                    self.violations.append(f"{self.phase}: CPU {cpu} in {cid[:12]} and {owner[cpu][:12]}")
                owner[cpu] = cid
        for cid in shared:
            clash = cpus[cid] & owner.keys()
            if clash:
                self.violations.append(f"{self.phase} {t:.3f}: shared {cid[:12]} {sorted(cpus[cid])} on exclusive CPUs "
                                       f"{sorted(clash)} of {owner[min(clash)][:12]}")
        self.samples += 1
        self.mixed += bool(excl and shared)

    def run(self) -> None:
        while not self.stop_event.wait(0.05):
            self.sample()

    def stop(self) -> None:
        self.stop_event.set()
        self.join(10)
        self.client.close()


def version_within(socket_path, seconds: float) -> float:
    """Seconds until Version answers through ``socket_path`` (fresh connection); fails beyond ``seconds``."""
    t0 = time.monotonic()
    with CriClient(socket_path, timeout=seconds) as c:
        while True:
            try:
                c.runtime.Version(pb.VersionRequest(), timeout=max(0.1, seconds - (time.monotonic() - t0)))
                return time.monotonic() - t0
            except grpc.RpcError:
                assert time.monotonic() - t0 < seconds, f"no Version through the relay within {seconds}s"
                time.sleep(0.05)


def raw_frame(ftype: int, flags: int, sid: int, payload: bytes) -> bytes:
    return len(payload).to_bytes(3, "big") + bytes((ftype, flags)) + sid.to_bytes(4, "big") + payload


def continuation_flood(path, total: int) -> int | None:
    """HEADERS without END_HEADERS, then CONTINUATION frames; returns the GOAWAY error code received."""
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(10)
    s.connect(str(path))
    block = hpack.Encoder().encode([(":method", "POST"), (":scheme", "http"), (":authority", "x"),
                                    (":path", "/runtime.v1.RuntimeService/Version")])
    s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + raw_frame(4, 0, 0, b"") + raw_frame(1, 0, 1, block))
    chunk = raw_frame(9, 0, 1, b"\x00" * 16000) * 64
    sent = 0
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        while sent < total:
            s.sendall(chunk)
            sent += 16000 * 64
    buf = b""
    with contextlib.suppress(ConnectionResetError, TimeoutError):
        while data := s.recv(1 << 16):
            buf += data
    s.close()
    pos, code = 0, None
    while pos + 9 <= len(buf):
        n = int.from_bytes(buf[pos:pos + 3], "big")
        if buf[pos + 3] == 7:
            code = int.from_bytes(buf[pos + 13:pos + 17], "big")
        pos += 9 + n
    return code


def test_chaos_never_double_books_a_cpu_as_the_kernel_sees_it(containerd, kubelets, tmp_path):
    if len(ONLINE) < 2:
        pytest.skip("needs at least 2 online CPUs (one exclusive, one shared)")
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("needs root (tiny tmpfs for the ENOSPC cache)")
    state = tmp_path / "relay" / "state"
    state.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k,mode=0700", "tmpfs", str(state)], check=True)
    r = RelayProcess(tmp_path / "relay", containerd.socket)
    sampler: KernelSampler | None = None
    try:
        r.start()
        k = kubelets(r.socket)
        parents: dict[str, tuple[str, str]] = {}
        sampler = KernelSampler(containerd.socket, parents)
        sampler.start()
        sampler.phase = "burst"
        n = [0]

        def pod(qos: str, prefix: str = "p"):
            n[0] += 1
            spec = PodSpec(f"{prefix}{n[0]}", qos=qos)
            p = k.run_pod(spec)
            parents[p.sandbox_id] = (qos, containerd.cgroup_parent(qos, spec.uid))
            return p

        def launch(qos: str, results: list, cfg=None) -> None:
            try:
                p = pod(qos)
                c = cfg or (guaranteed("app", 1000) if qos == "Guaranteed" else container_config("app"))
                results.append((qos, k.run_container(p, c)))
            except grpc.RpcError as e:
                results.append((qos, e.code()))

        def burst(qos_list: list[str]) -> list:
            results: list = []
            threads = [threading.Thread(target=launch, args=(q, results)) for q in qos_list]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            return results

        # 1. kubelet starts pods in parallel: a BestEffort and a Guaranteed create milliseconds apart (the
        #    BestEffort one first), then both starts at once; the kernel is sampled while both run.
        for _round in range(3):
            be_pod, g_pod = pod("BestEffort"), pod("Guaranteed")
            gate = threading.Barrier(2)
            made: dict[str, str] = {}

            def create_start(p, cfg, key, delay, gate=gate, made=made):
                gate.wait()
                time.sleep(delay)
                made[key] = k.create(p, cfg)
                gate.wait()
                k.start(made[key])

            pair = [threading.Thread(target=create_start, args=(be_pod, container_config("app"), "be", 0)),
                    threading.Thread(target=create_start, args=(g_pod, guaranteed("app", 1000), "g", 0.003))]
            for t in pair:
                t.start()
            for t in pair:
                t.join(30)
            assert set(made) == {"be", "g"}, made
            time.sleep(0.6)  # longer than a reconcile interval: a stale pool would be seen by the sampler
            for cid in made.values():
                k.stop_remove_container(cid)
        res = burst(["BestEffort", "Guaranteed", "BestEffort", "Guaranteed", "BestEffort"])
        got = [x for q, x in res if q == "Guaranteed" and isinstance(x, str)]
        assert len(got) == 1, res  # one exclusive CPU on this node; the other is refused, never shared
        assert sum(1 for q, x in res if q == "Guaranteed" and x == grpc.StatusCode.RESOURCE_EXHAUSTED) == 1
        first_g = got[0]

        sampler.phase = "kill-9"
        # 2. kill -9 of the relay in the middle of a burst, and restart.
        results: list = []
        threads = [threading.Thread(target=launch, args=(q, results)) for q in ["BestEffort"] * 3]
        for t in threads:
            t.start()
        time.sleep(0.15)
        r.stop(signal.SIGKILL)
        for t in threads:
            t.join(60)
        r.start()
        version_within(r.socket, 2)
        ctl = r.client()
        assert ctl.state().exclusive.get(first_g) is not None

        sampler.phase = "containerd-restart"
        # 3. containerd restarts with its containers kept; kubelet's connection comes back.
        rt = k.c.runtime
        containerd.stop()
        with pytest.raises(grpc.RpcError):
            rt.Version(pb.VersionRequest(), timeout=2)
        containerd.start()
        t0 = time.monotonic()
        wait_for(lambda: _version_ok(rt), timeout=10, interval=0.05, what="kubelet's connection answered")
        back_after = time.monotonic() - t0
        assert back_after <= 1.0, f"kubelet's connection answered {back_after:.2f}s after containerd returned"
        version_within(r.socket, 2)
        wait_for(lambda: ctl.state().exclusive.get(first_g) is not None and ctl.state().runtime_up, timeout=10,
                 what="exclusive container kept across the runtime restart")
        res = burst(["BestEffort", "Guaranteed"])  # the exclusive CPU is still taken: refused, not shared
        assert [x for q, x in res if q == "Guaranteed"] == [grpc.StatusCode.RESOURCE_EXHAUSTED], res

        sampler.phase = "crash-oom"
        # 4. a crashing and an OOM-killed container give their CPUs back.
        k.stop_remove_container(first_g)
        crash_pod = pod("Guaranteed")
        crash = k.run_container(crash_pod, guaranteed("crash", 1000, command=["sh", "-c", "sleep 1; exit 1"]))
        wait_for(lambda: k.status(crash).status.state == pb.CONTAINER_EXITED, timeout=15, what="crash")
        assert k.status(crash).status.exit_code == 1
        oom_pod = pod("Guaranteed")  # never "insufficient CPU" after a crash
        oom = k.run_container(oom_pod, guaranteed("oom", 1000, memory=16 << 20,
                                                  command=["sh", "-c", "exec tail -c 200000000 /dev/zero"]))
        wait_for(lambda: k.status(oom).status.state == pb.CONTAINER_EXITED, timeout=30, what="OOM kill")
        st = k.status(oom).status
        # SIGKILL (137): only the OOM killer sends it here. containerd names the reason OOMKilled when its OOM
        # event arrived before the exit event, "Error" otherwise.
        assert st.exit_code == 137 and st.reason in ("OOMKilled", "Error"), (st.exit_code, st.reason)
        after = []
        launch("Guaranteed", after)
        assert isinstance(after[0][1], str), after  # the OOM-killed container's CPU came back
        last_g = after[0][1]

        sampler.phase = "cache"
        # 5. the cache file: truncated, wrong shape, then a full disk.
        cache = state / "relay-cache.json"
        for broken in (cache.read_text()[: len(cache.read_text()) // 2], '{"version":1,"pods":[1]}'):
            r.stop(signal.SIGKILL)
            cache.write_text(broken)
            r.start()
            version_within(r.socket, 2)
            assert ctl.state().exclusive.get(last_g) is not None  # rebuilt from the runtime
        assert len(list(state.glob("relay-cache.json.corrupt-*"))) == 2
        for f in state.glob("relay-cache.json.corrupt-*"):
            f.unlink()
        good = cache.read_text()
        filler = state / "filler"
        with contextlib.suppress(OSError), open(filler, "wb") as f:
            while True:
                f.write(b"\0" * 4096)
                f.flush()
        burst(["BestEffort", "BestEffort"])  # the cache grows; the disk is full
        wait_for(lambda: 'cri_resmgr_relay_cache_save_failures_total' in ctl.metrics()
                 and _metric(ctl.metrics(), "cri_resmgr_relay_cache_save_failures_total") >= 1, timeout=10,
                 what="a failed save counted")
        json.loads(cache.read_text())  # whole: the previous file (or a complete newer one), never half
        assert cache.read_text() == good or json.loads(cache.read_text())["version"] == 1
        filler.unlink()
        version_within(r.socket, 2)

        sampler.phase = "hung-runtime"
        # 6. the runtime hangs (SIGSTOP) while creates are in flight; when it answers again, so does the relay,
        #    and nothing it did meanwhile (pool updates, reconciles, all with deadlines) broke the books.
        hung: list = []
        threads = [threading.Thread(target=launch, args=(q, hung)) for q in ("BestEffort", "BestEffort")]
        os.kill(containerd.proc.pid, signal.SIGSTOP)
        try:
            for t in threads:
                t.start()
            time.sleep(1.5)
        finally:
            os.kill(containerd.proc.pid, signal.SIGCONT)
        for t in threads:
            t.join(60)
        version_within(r.socket, 2)
        assert all(isinstance(x, str) for _q, x in hung), hung  # the calls waited for the runtime, not failed
        assert all(t.alive for t in ctl.state().threads if t.name != "events"), ctl.state().threads

        sampler.phase = "flood"
        # 7. a CONTINUATION flood: that connection ends, the relay goes on.
        assert continuation_flood(r.socket, 17 << 20) == 0xB
        version_within(r.socket, 2)
        assert 'cri_resmgr_relay_streams_reset_total{reason="header_block"} 1' in ctl.metrics()

        # The relay's own check against the kernel agrees, and nothing needed repair at the end.
        inv = ctl.invariants()
        assert inv.violations == [], inv
        time.sleep(0.5)
    finally:
        if sampler is not None:
            sampler.stop()
        r.stop()
        subprocess.run(["umount", "-l", str(state)], check=False)
    print(f"samples {sampler.samples} (mixed {sampler.mixed}); kubelet's connection back {back_after:.2f}s "
          f"after containerd returned")
    if sampler.violations:
        print(r.log_path.read_text())
    assert sampler.violations == [], sampler.violations[:20]
    assert sampler.samples >= 50 and sampler.mixed >= 20, (sampler.samples, sampler.mixed)


def _version_ok(rt) -> bool:
    try:
        rt.Version(pb.VersionRequest(), timeout=0.5)
        return True
    except grpc.RpcError:
        return False


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0
