"""Everything the relay does not own must behave through it exactly as it does directly.

Against the real containerd: unary calls compared field by field with the direct answer (minus fields
that change between two calls, like timestamps and counters), error codes and messages included.
Against a gRPC server of the test's own (containerd 1.6 has no GetContainerEvents): a server-streaming
call, metadata both ways, trailers, deadlines, and an unknown protobuf field, all end to end.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
import httpx
import pytest
from cri_api.v1 import api_pb2 as pb
from cri_api.v1 import api_pb2_grpc as pbg
from google.protobuf import json_format

from ..containerd import IMAGE
from ..cri import CriClient, PodSpec, container_config
from ..helpers import free_port
from .harness import RelayProcess

pytestmark = pytest.mark.integration


@pytest.fixture
def relay(containerd, tmp_path):
    r = RelayProcess(tmp_path / "relay", containerd.socket).start()
    yield r
    r.stop()


def scrub(msg, drop=("timestamp", "created_at", "started_at", "usage_core_nano_seconds", "usage_nano_cores",
                     "working_set_bytes", "usage_bytes", "used_bytes", "inodes_used", "available_bytes",
                     "rss_bytes", "page_faults", "major_page_faults")) -> dict:
    def walk(v):
        if isinstance(v, dict):
            return {k: walk(x) for k, x in v.items() if k not in drop}
        if isinstance(v, list):
            # containerd lists images in Go map order, which differs between any two calls, direct or not
            return sorted((walk(x) for x in v), key=lambda x: json.dumps(x, sort_keys=True))
        return v

    return walk(json_format.MessageToDict(msg, preserving_proto_field_name=True))


def outcome(fn, *args, **kw):
    try:
        return ("ok", scrub(fn(*args, timeout=10, **kw)))
    except grpc.RpcError as e:
        return (e.code(), e.details())


def test_unary_calls_and_errors_are_the_same_through_the_relay(relay, kubelets, containerd):
    k = kubelets(relay.socket)
    p = k.run_pod(PodSpec("passthrough"))
    cid = k.run_container(p, container_config("app", cpu_milli_request=100))
    direct = CriClient(containerd.socket)
    via = k.c
    calls = [
        ("Version", lambda c: c.runtime.Version, pb.VersionRequest(version="v1")),
        ("Status", lambda c: c.runtime.Status, pb.StatusRequest()),
        ("ListImages", lambda c: c.image.ListImages, pb.ListImagesRequest()),
        ("ImageStatus", lambda c: c.image.ImageStatus, pb.ImageStatusRequest(image=pb.ImageSpec(image=IMAGE))),
        ("ImageStatus missing", lambda c: c.image.ImageStatus,
         pb.ImageStatusRequest(image=pb.ImageSpec(image="localhost/none:0"))),
        ("ImageFsInfo", lambda c: c.image.ImageFsInfo, pb.ImageFsInfoRequest()),
        ("ListPodSandbox", lambda c: c.runtime.ListPodSandbox, pb.ListPodSandboxRequest(
            filter=pb.PodSandboxFilter(id=p.sandbox_id))),
        ("PodSandboxStatus", lambda c: c.runtime.PodSandboxStatus,
         pb.PodSandboxStatusRequest(pod_sandbox_id=p.sandbox_id)),
        ("ListContainers", lambda c: c.runtime.ListContainers, pb.ListContainersRequest(
            filter=pb.ContainerFilter(pod_sandbox_id=p.sandbox_id))),
        ("ContainerStatus", lambda c: c.runtime.ContainerStatus, pb.ContainerStatusRequest(container_id=cid)),
        ("ContainerStats", lambda c: c.runtime.ContainerStats, pb.ContainerStatsRequest(container_id=cid)),
        ("ExecSync", lambda c: c.runtime.ExecSync, pb.ExecSyncRequest(
            container_id=cid, cmd=["sh", "-c", "echo out; echo err >&2; exit 3"], timeout=10)),
        ("ContainerStatus unknown", lambda c: c.runtime.ContainerStatus,
         pb.ContainerStatusRequest(container_id="nope")),
        ("StopContainer unknown", lambda c: c.runtime.StopContainer, pb.StopContainerRequest(container_id="nope")),
        ("PullImage unreachable", lambda c: c.image.PullImage, pb.PullImageRequest(
            image=pb.ImageSpec(image="127.0.0.1:1/none:0"))),
        ("GetContainerEvents", None, None),
    ]
    for name, stub, req in calls:
        if stub is None:
            def events(c):
                try:
                    return ("ok", [scrub(e) for e in c.runtime.GetContainerEvents(pb.GetEventsRequest(), timeout=2)])
                except grpc.RpcError as e:
                    return (e.code(), e.details())
            a, b = events(direct), events(via)
        else:
            a, b = outcome(stub(direct), req), outcome(stub(via), req)
        assert a == b, f"{name}: direct {a!r} != relay {b!r}"
        if name == "ExecSync":
            assert a[1]["exit_code"] == 3 and a[1]["stdout"] and a[1]["stderr"]
        if name.endswith("unknown"):
            assert a[0] == grpc.StatusCode.NOT_FOUND
    direct.close()


class _StreamingRuntime(pbg.RuntimeServiceServicer):
    """A runtime of the test's own: answers Version, streams events, reports what it received."""

    def __init__(self):
        self.seen: dict[str, object] = {}

    def Version(self, request, context):
        md = dict(context.invocation_metadata())
        # The relay also calls Version itself (start-up guard, reconnects): only the test's call, the one
        # carrying x-test, is recorded, so the relay's own call cannot overwrite it between call and assert.
        if "x-test" in md:
            self.seen["metadata"] = md["x-test"]
            self.seen["time_remaining"] = context.time_remaining()
        context.set_trailing_metadata((("x-trailer", "t1"),))
        return pb.VersionResponse(version="0.1.0", runtime_name="stream-test", runtime_version="1")

    def GetContainerEvents(self, request, context):
        context.send_initial_metadata((("x-initial", "i1"),))
        for i in range(3):
            yield pb.ContainerEventResponse(container_id=f"c{i}", container_event_type=i, created_at=i)
            time.sleep(0.05)
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "events: done after 3")

    def ContainerStatus(self, request, context):
        # echo the unknown field back: it only arrives if the relay forwarded the raw bytes
        self.seen["raw_len"] = len(request.SerializeToString())
        return pb.ContainerStatusResponse(info={"echo": request.container_id})


@pytest.fixture
def streaming_runtime(tmp_path):
    impl = _StreamingRuntime()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    pbg.add_RuntimeServiceServicer_to_server(impl, server)
    sock = tmp_path / "fake-runtime.sock"
    server.add_insecure_port(f"unix:{sock}")
    server.start()
    yield sock, impl
    server.stop(0)


def test_untested_runtime_is_refused_at_start(streaming_runtime, tmp_path):
    sock, _impl = streaming_runtime
    r = RelayProcess(tmp_path / "refuse", sock).start(wait=False)
    assert r.proc.wait(20) == 2
    assert "'stream-test' 1 is not containerd or CRI-O" in r.log()


def test_streaming_metadata_deadlines_and_unknown_fields_pass_through(streaming_runtime, tmp_path):
    sock, impl = streaming_runtime
    port = free_port()
    dump = tmp_path / "dump.jsonl"
    r = RelayProcess(tmp_path / "stream", sock, {"relay": {"allow_untested_runtimes": True, "dump_file": str(dump),
                                                            "metrics_listen": f"127.0.0.1:{port}"}}).start()
    try:
        ch = grpc.insecure_channel(f"unix://{r.socket}")
        rt = pbg.RuntimeServiceStub(ch)
        resp, call = rt.Version.with_call(pb.VersionRequest(), timeout=7.5, metadata=(("x-test", "m1"),))
        assert resp.runtime_name == "stream-test"
        assert impl.seen["metadata"] == "m1"
        # The client's deadline, not a new one. (grpc's time_remaining is the deadline less time.time(): a wall clock
        # stepped back during the call, as seen on these VMs, reads a few ms past 7.5; a new deadline would not.)
        assert 6.5 < impl.seen["time_remaining"] <= 7.5 + 0.25
        assert ("x-trailer", "t1") in call.trailing_metadata()

        stream = rt.GetContainerEvents(pb.GetEventsRequest(), timeout=10)
        got = []
        with pytest.raises(grpc.RpcError) as e:
            for ev in stream:
                got.append((ev.container_id, ev.container_event_type))
        assert got == [("c0", 0), ("c1", 1), ("c2", 2)]
        assert ("x-initial", "i1") in stream.initial_metadata()
        assert (e.value.code(), e.value.details()) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "events: done after 3")

        # field 99 is unknown to ContainerStatusRequest: raw bytes must reach the runtime unchanged
        raw = pb.ContainerStatusRequest(container_id="x").SerializeToString() + b"\x9a\x06\x03abc"
        fn = ch.unary_unary("/runtime.v1.RuntimeService/ContainerStatus")
        out = pb.ContainerStatusResponse.FromString(fn(raw, timeout=5))
        assert out.info["echo"] == "x" and impl.seen["raw_len"] == len(raw)

        # a deadline shorter than the runtime's answer: DEADLINE_EXCEEDED, as directly
        with pytest.raises(grpc.RpcError) as e:
            for _ in rt.GetContainerEvents(pb.GetEventsRequest(), timeout=0.08):
                pass
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
        assert 'method="GetContainerEvents",code="RESOURCE_EXHAUSTED"} 1' in text
        assert 'method="Version",code="OK"} 1' in text
        counters = [x for x in text.splitlines() if x.startswith("cri_resmgr_relay_requests_total{")]
        assert counters == [x for x in r.client().metrics().splitlines() if x in counters]
        if shutil.which("promtool"):
            check = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
            assert check.returncode == 0, check.stdout + check.stderr
        ch.close()
        lines = [json.loads(x) for x in dump.read_text().splitlines()]
        version = [x for x in lines if x["method"].endswith("/Version")]
        assert [x["direction"] for x in version] == ["request", "response"]
        assert version[1]["message"]["runtime_name"] == "stream-test" and version[1]["code"] == "OK"
        status = next(x for x in lines if x["method"].endswith("/ContainerStatus") and x["direction"] == "request")
        assert status["message"]["container_id"] == "x"
    finally:
        r.stop()


def test_many_concurrent_calls_share_one_connection(relay):
    """kubelet multiplexes its calls on one HTTP/2 connection: interleaved streams must not mix up."""
    ch = grpc.insecure_channel(f"unix://{relay.socket}")
    rt = pbg.RuntimeServiceStub(ch)
    errors = []

    def worker(i):
        try:
            for _ in range(30):
                if i % 2:
                    assert rt.Version(pb.VersionRequest(), timeout=10).runtime_name == "containerd"
                else:
                    with pytest.raises(grpc.RpcError) as e:
                        rt.ContainerStatus(pb.ContainerStatusRequest(container_id=f"missing-{i}"), timeout=10)
                    assert e.value.code() == grpc.StatusCode.NOT_FOUND and f"missing-{i}" in e.value.details()
        except BaseException as e:  # noqa: BLE001 - collected for the main thread, which re-raises it
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ch.close()
    assert not errors, errors[:3]


def _thread_nices(pid: int) -> dict[int, int]:
    """tid -> nice, from /proc/PID/task/TID/stat (field 19, after the parenthesised comm; proc(5))."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except FileNotFoundError:
            continue
        out[int(tid)] = int(stat.rsplit(")", 1)[1].split()[16])
    return out


def test_the_forwarding_thread_runs_at_the_configured_nice_and_no_other_thread_does(containerd, tmp_path):
    """The event loop (which forwards every call) is raised ahead of ordinary work; the engine's threads are not."""
    r = RelayProcess(tmp_path / "relay", containerd.socket, {"relay": {"event_loop_nice": -6}}).start()
    try:
        ch = grpc.insecure_channel(f"unix://{r.socket}")
        assert pbg.RuntimeServiceStub(ch).Version(pb.VersionRequest(), timeout=10).runtime_name == "containerd"
        ch.close()
        nices = _thread_nices(r.proc.pid)
        assert sorted(nices.values()).count(-6) == 1, nices  # the event loop alone
        assert all(n == 0 for n in nices.values() if n != -6), nices
        assert "cri_resmgr_relay_event_loop_nice -6" in r.client().metrics()
    finally:
        r.stop()


def test_separate_image_socket_gets_a_listener_of_its_own(containerd, tmp_path):
    img = tmp_path / "img.sock"
    r = RelayProcess(tmp_path / "img", containerd.socket,
                     {"relay": {"image_socket": str(containerd.socket), "image_relay_socket": str(img)}}).start()
    try:
        direct = CriClient(containerd.socket)
        via = CriClient(img)
        assert outcome(via.image.ListImages, pb.ListImagesRequest()) == outcome(direct.image.ListImages,
                                                                                  pb.ListImagesRequest())
        assert IMAGE in str(outcome(via.image.ListImages, pb.ListImagesRequest()))
        assert 'cri_resmgr_relay_requests_total{method="ListImages",code="OK"} 2' in r.client().metrics()
        direct.close()
        via.close()
    finally:
        r.stop()


def test_large_messages_pass_both_ways_including_held_requests(relay, kubelets, containerd):
    """A held (rewritten) CreateContainer larger than HTTP/2's initial windows must neither stall nor
    overrun the runtime's windows; a large response streams through unchanged."""
    k = kubelets(relay.socket)
    p = k.run_pod(PodSpec("large"))
    big = "x" * 300_000
    ids = []
    for i in range(3):  # more than the 64 KiB connection window in total, several times over
        cfg = container_config(f"app{i}", cpu_milli_request=100, annotations={"test/big": big})
        ids.append(k.run_container(p, cfg))
    for cid in ids:
        st = k.status(cid)
        assert st.status.annotations["test/big"] == big
        assert st.status.resources.linux.cpuset_cpus  # placed, so the request was rewritten
    direct = CriClient(containerd.socket)
    req = pb.ExecSyncRequest(container_id=ids[0], cmd=["head", "-c", "700000", "/dev/zero"], timeout=20)
    a, b = direct.runtime.ExecSync(req, timeout=30), k.c.runtime.ExecSync(req, timeout=30)
    assert len(a.stdout) == len(b.stdout) == 700_000 and a.exit_code == b.exit_code == 0
    # the connection is still healthy afterwards
    assert k.c.runtime.Version(pb.VersionRequest(), timeout=5).runtime_name == "containerd"
    direct.close()
