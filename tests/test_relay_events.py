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
from cri_resmgr.relay import cache as C
from cri_resmgr.relay.core import Relay
from cri_resmgr.relay.runtime import RuntimeClient
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
    relay = Relay(RelayConfig(runtime_socket=sock), topo, tmp_path / "state", RuntimeClient(sock, 5),
                  ThreadPoolExecutor(2))
    common = dict(pod_id="p", namespace="ns", pod_name="pod", pod_uid="u", cgroup_parent="/kubepods/podu",
                  state=C.RUNNING, mems="0")
    relay.cache.containers["exclusive1"] = C.Container("exclusive1", name="a", qos_class="Guaranteed",
                                                       placement=C.EXCLUSIVE, cpus="1", **common)
    relay.cache.containers["shared1"] = C.Container("shared1", name="b", qos_class="Burstable",
                                                    placement=C.SHARED, cpus="0", **common)
    t = threading.Thread(target=relay._events_loop, daemon=True)
    t.start()
    assert impl.updated.wait(10), "no pool update after the stop event"
    deadline = time.time() + 10
    while relay.state().shared_pool != "0-1" or relay.cache.containers["shared1"].cpus != "0-1":
        assert time.time() < deadline, relay.state()
        time.sleep(0.01)
    assert impl.updates == [("shared1", "0-1")]
    st = relay.state()
    assert st.exclusive == {} and st.shared_pool == "0-1"
    assert {c.id: (c.state, c.cpus) for c in st.containers} == {"exclusive1": ("exited", "1"),
                                                                 "shared1": ("running", "0-1")}
    relay._stop.set()
