"""The CRI front end's per-method handlers, each driven with an Exchange as the proxy hands it over (no HTTP/2),
against the real engine on the runtime emulator of tests/test_placement_engine.py."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from cri_api.v1 import api_pb2 as pb

from cri_resmgr import metrics as M
from cri_resmgr.config import RelayConfig
from cri_resmgr.placement.model import Kind, State
from cri_resmgr.relay.core import RT, CallContext, CriFrontEnd
from cri_resmgr.relay.h2proxy import IN_WORKER, Exchange, Mode, Reject, status
from cri_resmgr.sysfs import parse_cpulist

from .test_placement_engine import node  # noqa: F401 (fixture)

OK = status(grpc.StatusCode.OK)


@pytest.fixture
def fe(node):  # noqa: F811
    rt, make = node
    e = make()
    pool = ThreadPoolExecutor(1)
    front = CriFrontEnd(RelayConfig(), e, runtime=None, submit=pool.submit)  # type: ignore[arg-type]
    yield front, rt
    pool.shutdown()


def exchange(method: str, request) -> Exchange:
    return Exchange(RT + method, 1, time.perf_counter(), request=request.SerializeToString())


def run_pod(front: CriFrontEnd, rt, name: str, qos: str) -> pb.PodSandboxConfig:
    rec = rt.run_pod(name, qos)
    cfg = pb.PodSandboxConfig(metadata=pb.PodSandboxMetadata(name=name, uid=rec.uid, namespace="default"),
                              linux=pb.LinuxPodSandboxConfig(cgroup_parent=rec.cgroup_parent))
    ex = exchange("RunPodSandbox", pb.RunPodSandboxRequest(config=cfg))
    ex.code, ex.response = OK, pb.RunPodSandboxResponse(pod_sandbox_id=rec.id).SerializeToString()
    front.complete(ex)
    return cfg


def create_request(pod: pb.PodSandboxConfig, name: str, milli: int) -> pb.CreateContainerRequest:
    res = pb.LinuxContainerResources(cpu_shares=max(2, milli * 1024 // 1000), cpu_period=100000,
                                     cpu_quota=milli * 100, memory_limit_in_bytes=64 << 20)
    return pb.CreateContainerRequest(
        pod_sandbox_id=f"pod-{pod.metadata.name}", sandbox_config=pod,
        config=pb.ContainerConfig(metadata=pb.ContainerMetadata(name=name),
                                  linux=pb.LinuxContainerConfig(resources=res)))


def finish(front: CriFrontEnd, ex: Exchange, code: int = OK, response=None, rewritten: bool = True) -> None:
    ex.code, ex.rewritten = code, rewritten
    ex.response = response.SerializeToString() if response is not None else b""
    front.complete(ex)


def test_every_intercepted_method_has_a_handler_and_a_mode(fe):
    front, _rt = fe
    assert front.mode(RT + "CreateContainer") is Mode.REWRITE
    assert front.mode(RT + "StartContainer") is Mode.REWRITE  # held until its CPUs are its own
    assert front.mode(RT + "StopContainer") is Mode.OBSERVE
    assert front.mode(RT + "Version") is Mode.PASS
    assert front.mode(RT + "ListContainers") is Mode.OBSERVE
    assert front.mode(RT + "ListContainers") is Mode.PASS  # at most one relist in LIST_OBSERVE_SECONDS


def test_create_places_commits_and_a_failed_rewrite_rolls_back(fe):
    front, rt = fe
    pod = run_pod(front, rt, "g", "Guaranteed")
    ex = exchange("CreateContainer", create_request(pod, "app", 1000))
    out = front.rewrite(ex)
    assert isinstance(out, bytes) and isinstance(ex.context, CallContext)
    cpus = pb.CreateContainerRequest.FromString(out).config.linux.resources.cpuset_cpus
    assert len(parse_cpulist(cpus)) == 1
    finish(front, ex, response=pb.CreateContainerResponse(container_id="c1"))
    assert front.engine.state().exclusive == {"c1": cpus}

    # the proxy forwarded the original request (the rewrite did not reach the runtime): roll back, count
    ex2 = exchange("CreateContainer", create_request(pod, "two", 1000))
    front.engine.removed("c1")
    assert isinstance(front.rewrite(ex2), bytes)
    finish(front, ex2, response=pb.CreateContainerResponse(container_id="c2"), rewritten=False)
    c2 = front.engine.container("c2")
    assert c2.placement == Kind.SHARED and "rewrite failed" in c2.reason
    assert front.engine.counters()[M.RELAY_REWRITE_ROLLBACKS.name] == 1 and front.engine.state().exclusive == {}


def test_create_refused_by_name_and_a_call_that_ended_first_reserves_nothing(fe):
    front, rt = fe
    pod = run_pod(front, rt, "g", "Guaranteed")
    ex = exchange("CreateContainer", create_request(pod, "big", 4000))  # 4 CPUs: the pool must keep one
    out = front.rewrite(ex)
    assert isinstance(out, Reject) and out.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    assert "default/g/big" in out.message and "insufficient CPUs" in out.message
    late = exchange("CreateContainer", create_request(pod, "late", 1000))
    late.code = status(grpc.StatusCode.CANCELLED)  # the client went away before a worker took it
    assert front.rewrite(late) is None and front.engine.state().pending == 0
    ex = exchange("CreateContainer", create_request(pod, "app", 1000))
    front.rewrite(ex)
    finish(front, ex, code=status(grpc.StatusCode.DEADLINE_EXCEEDED))  # the runtime failed it: CPUs return
    assert front.engine.state().pending == 0 and front.engine.state().exclusive == {}


def test_resize_keeps_the_cpuset_and_list_observation_releases_exits(fe):
    front, rt = fe
    pod = run_pod(front, rt, "g", "Guaranteed")
    ex = exchange("CreateContainer", create_request(pod, "app", 1000))
    cpus = pb.CreateContainerRequest.FromString(front.rewrite(ex)).config.linux.resources.cpuset_cpus
    finish(front, ex, response=pb.CreateContainerResponse(container_id="c1"))
    up = exchange("UpdateContainerResources", pb.UpdateContainerResourcesRequest(
        container_id="c1", linux=pb.LinuxContainerResources(cpu_shares=1024, cpu_period=100000, cpu_quota=100000,
                                                            memory_limit_in_bytes=128 << 20)))
    out = pb.UpdateContainerResourcesRequest.FromString(front.rewrite(up))
    assert out.linux.cpuset_cpus == cpus and out.linux.memory_limit_in_bytes == 128 << 20
    finish(front, up)
    assert front.engine.container("c1").memory_limit_bytes == 128 << 20
    front._last_list = 0.0
    lst = exchange("ListContainers", pb.ListContainersRequest())
    finish(front, lst, response=pb.ListContainersResponse(containers=[
        pb.Container(id="c1", state=pb.CONTAINER_EXITED)]))
    deadline = time.monotonic() + 5
    while front.engine.container("c1").state != State.EXITED:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert front.engine.state().exclusive == {}


def test_create_is_placed_on_the_event_loop_unless_it_must_ask_the_runtime(fe):
    front, rt = fe
    pod = run_pod(front, rt, "g", "Guaranteed")
    ex = exchange("CreateContainer", create_request(pod, "app", 1000))
    out = front.rewrite_inline(ex)  # the event loop's first try: placed there
    assert isinstance(out, bytes) and isinstance(ex.context, CallContext)
    cpus = pb.CreateContainerRequest.FromString(out).config.linux.resources.cpuset_cpus
    cid = rt.create(rt.pods["pod-g"], "app", cpus)  # the runtime has it (asked about exits, it says created)
    finish(front, ex, response=pb.CreateContainerResponse(container_id=cid))
    assert front.engine.state().exclusive == {cid: cpus}
    # 3 more CPUs do not fit (the pool keeps one): the loop must not wait for the runtime's answer about exits,
    # so the create goes to a worker, with nothing reserved meanwhile; there it is refused by name
    big = exchange("CreateContainer", create_request(pod, "big", 3000))
    assert front.rewrite_inline(big) is IN_WORKER
    assert big.context is None and front.engine.state().pending == 0
    out = front.rewrite(big)
    assert isinstance(out, Reject) and "insufficient CPUs" in out.message
    # methods that wait (a start held until its CPUs are free) always go to a worker
    assert front.rewrite_inline(exchange("StartContainer", pb.StartContainerRequest(container_id=cid))) is IN_WORKER


def test_create_reads_a_known_pod_from_the_books_and_an_unknown_one_from_the_request(fe):
    front, rt = fe
    pod = run_pod(front, rt, "g", "Guaranteed")
    known = create_request(pod, "app", 1000)
    known.pod_sandbox_id = "pod-g"
    known.sandbox_config.metadata.namespace = "not-read"  # the sandbox is not read again for a pod the books know
    ex = exchange("CreateContainer", known)
    assert isinstance(front.rewrite_inline(ex), bytes)
    finish(front, ex, response=pb.CreateContainerResponse(container_id="c1"))
    c1 = front.engine.container("c1")
    assert (c1.namespace, c1.pod_name, c1.cgroup_parent) == ("default", "g", rt.pods["pod-g"].cgroup_parent)
    assert c1.qos_class == "Guaranteed"  # from the books' cgroup parent

    # a pod the relay never saw created (RunPodSandbox before it started): read from the request
    stranger = create_request(pb.PodSandboxConfig(
        metadata=pb.PodSandboxMetadata(name="s", uid="u-s", namespace="other"),
        linux=pb.LinuxPodSandboxConfig(cgroup_parent="/kubepods/burstable/podu-s"),
        annotations={"cri-resmgr.io/exclusive-cpus": "false"}), "app", 1000)
    stranger.pod_sandbox_id = "pod-unknown"
    ex = exchange("CreateContainer", stranger)
    out = front.rewrite_inline(ex)
    assert isinstance(out, bytes)
    finish(front, ex, response=pb.CreateContainerResponse(container_id="c2"))
    c2 = front.engine.container("c2")
    assert (c2.namespace, c2.pod_name, c2.pod_uid, c2.cgroup_parent) == (
        "other", "s", "u-s", "/kubepods/burstable/podu-s")
    assert c2.placement == Kind.SHARED  # the pod's annotation was read from the request too


def test_an_exclusive_create_wakes_the_pool_and_the_save_through_later_and_a_start_at_once(fe):
    front, rt = fe
    e = front.engine
    pod = run_pod(front, rt, "g", "Guaranteed")
    ex = exchange("CreateContainer", create_request(pod, "app", 1000))
    out = front.rewrite(ex)
    assert isinstance(out, bytes)
    cpus = pb.CreateContainerRequest.FromString(out).config.linux.resources.cpuset_cpus
    cid = rt.create(rt.pods["pod-g"], "app", cpus)
    ctx = front.take_context(ex)
    assert ctx is not None
    e._pool_wake.clear()
    e._dirty.clear()
    held: list = []
    e.commit(ctx.reservation, cid, ctx.resources_blob, later=held.append)
    assert e.state().exclusive == {cid: cpus}  # the books at once
    assert len(held) == 1 and not e._pool_wake.is_set() and not e._dirty.is_set()  # the threads later
    held[0]()
    assert e._pool_wake.is_set() and e._dirty.is_set()
