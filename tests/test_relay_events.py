"""Exits reported by GetContainerEvents (containerd >= 1.7, CRI-O) release CPUs at once.

containerd 1.6 (what this machine runs) has no GetContainerEvents, so the runtime here is a gRPC server
of the test's own speaking the real runtime.v1 API; the relay talks to it with its real client.
"""

from __future__ import annotations

import threading
import time
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from cri_api.v1 import api_pb2 as pb
from cri_api.v1 import api_pb2_grpc as pbg

from cri_resmgr.config import RelayConfig
from cri_resmgr.placement import model as C
from cri_resmgr.placement.engine import Engine, EngineSettings
from cri_resmgr.relay.core import CriFrontEnd
from cri_resmgr.relay.runtime import CriRuntime, RuntimeClient
from cri_resmgr.topology import discover
from cri_resmgr.topology.fixtures import MACHINES, build_sysfs


class EventRuntime(pbg.RuntimeServiceServicer):
    def __init__(self):
        self.updates: list[tuple[str, str]] = []
        self.updated = threading.Event()
        self.release = threading.Event()

    def GetContainerEvents(self, request, context):
        yield pb.ContainerEventResponse(container_id="exclusive1", container_event_type=pb.CONTAINER_STOPPED_EVENT)
        self.release.wait(10)

    def UpdateContainerResources(self, request, context):
        self.updates.append((request.container_id, request.linux.cpuset_cpus))
        self.updated.set()
        return pb.UpdateContainerResourcesResponse()


@pytest.fixture
def runtime(tmp_path):
    impl = EventRuntime()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    pbg.add_RuntimeServiceServicer_to_server(impl, server)
    sock = tmp_path / "rt.sock"
    server.add_insecure_port(f"unix:{sock}")
    server.start()
    yield sock, impl
    impl.release.set()
    server.stop(0)


def test_stopped_event_releases_exclusive_cpus_and_the_pool_grows_back(runtime, tmp_path):
    sock, impl = runtime
    topo = discover(build_sysfs(MACHINES["this-vm"], tmp_path / "sys"))
    (tmp_path / "state").mkdir()
    cfg = RelayConfig(runtime_socket=sock)
    client = RuntimeClient(sock, 5)
    engine = Engine(EngineSettings.from_relay_config(cfg), topo, tmp_path / "state", CriRuntime(client),
                    cgroup_root=tmp_path / "no-cgroups")
    relay = CriFrontEnd(cfg, engine, client, ThreadPoolExecutor(2).submit)
    common = dict(pod_id="p", namespace="ns", pod_name="pod", pod_uid="u", cgroup_parent="/kubepods/podu",
                  state=C.State.RUNNING, mems="0")
    engine.cache.containers["exclusive1"] = C.Container("exclusive1", name="a", qos_class="Guaranteed",
                                                        placement=C.Kind.EXCLUSIVE, cpus="1", **common)
    engine.cache.containers["shared1"] = C.Container("shared1", name="b", qos_class="Burstable",
                                                     placement=C.Kind.SHARED, cpus="0", **common)
    engine.start()  # the pool worker applies the pool grown back
    t = threading.Thread(target=relay.events_loop, daemon=True)
    t.start()
    assert impl.updated.wait(10), "no pool update after the stop event"
    deadline = time.time() + 10
    while relay.state().shared_pool != "0-1" or engine.container("shared1").cpus != "0-1":
        assert time.time() < deadline, relay.state()
        time.sleep(0.01)
    assert impl.updates == [("shared1", "0-1")]
    st = relay.state()
    assert st.exclusive == {} and st.shared_pool == "0-1"
    assert {c.id: (c.state, c.cpus) for c in st.containers} == {"exclusive1": ("exited", "1"),
                                                                 "shared1": ("running", "0-1")}
    engine.stop()
