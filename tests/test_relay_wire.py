"""CreateContainerRequest read and rewritten in its wire bytes (cri_resmgr/relay/wire.py), with protobuf as the
reference: the rewrite must give the bytes protobuf gives after a full parse, set and serialise."""

from __future__ import annotations

import random

import pytest
from cri_api.v1 import api_pb2 as pb
from google.protobuf.message import DecodeError

from cri_resmgr.relay import wire
from cri_resmgr.relay.core import RT

from . import protowire as pw
from .test_placement_engine import node  # noqa: F401 (fixture)
from .test_relay_handlers import OK, exchange, fe, finish, run_pod  # noqa: F401 (fixture)


def unknown(rng: random.Random) -> bytes:
    """A few fields with numbers no version of these messages uses, of every wire type but groups."""
    out = b""
    for _ in range(rng.randint(1, 3)):
        n = rng.randint(1000, 5000)
        kind = rng.choice(("varint", "len", "i32", "i64"))
        if kind == "varint":
            out += pw.varint(n << 3 | pw.VARINT) + pw.varint(rng.randint(0, 1 << 40))
        elif kind == "len":
            data = rng.randbytes(rng.randint(0, 40))
            out += pw.varint(n << 3 | pw.LEN) + pw.varint(len(data)) + data
        elif kind == "i32":
            out += pw.varint(n << 3 | pw.I32) + rng.randbytes(4)
        else:
            out += pw.varint(n << 3 | pw.I64) + rng.randbytes(8)
    return out


def with_unknown(msg, rng: random.Random, p: float):
    """``msg`` with unknown fields (kept by protobuf and written after the known ones), with probability p."""
    if rng.random() >= p:
        return msg
    return type(msg).FromString(msg.SerializeToString(deterministic=True) + unknown(rng))


def random_request(rng: random.Random, p_unknown: float = 0.5) -> pb.CreateContainerRequest:
    n_ann = rng.choice((0, 1, 10, 1000))
    ann = {f"example.com/key-{i}": f"value-{rng.random()}" for i in range(n_ann)}
    if rng.random() < 0.5:
        ann["cri-resmgr.io/affinity"] = ",".join(f"crowd/c{i}" for i in range(rng.randint(1, 50)))
    sandbox = pb.PodSandboxConfig(
        metadata=with_unknown(pb.PodSandboxMetadata(name=f"pod{rng.randint(0, 9)}", uid="u", namespace="ns",
                                                    attempt=rng.randint(0, 3)), rng, p_unknown),
        hostname=rng.choice(("", "h")), log_directory="/var/log/pods/x", annotations=ann,
        labels={"io.kubernetes.pod.name": "p"},
        linux=with_unknown(pb.LinuxPodSandboxConfig(cgroup_parent=rng.choice(("", "/kubepods/podu"))), rng,
                           p_unknown))
    res = pb.LinuxContainerResources(
        cpu_shares=rng.choice((0, 2, 1024)), cpu_quota=rng.choice((0, 100000)), cpu_period=rng.choice((0, 100000)),
        memory_limit_in_bytes=rng.choice((0, 64 << 20)), oom_score_adj=rng.choice((0, -997, 1000)),
        cpuset_cpus=rng.choice(("", "0-3", "1")), cpuset_mems=rng.choice(("", "0")),
        unified={"memory.high": "1"} if rng.random() < 0.3 else {},
        memory_swap_limit_in_bytes=rng.choice((0, 1 << 30)))
    config = pb.ContainerConfig(
        metadata=pb.ContainerMetadata(name=f"c{rng.randint(0, 9)}"), image=pb.ImageSpec(image="busybox"),
        command=["sh", "-c", "sleep 1"], labels={"io.kubernetes.container.name": "c"},
        annotations={f"a{i}": str(i) for i in range(rng.randint(0, 5))},
        envs=[pb.KeyValue(key="K", value="V")], log_path="c.log", stop_signal=rng.choice((0, 15)))
    shape = rng.random()
    if shape < 0.8:
        config.linux.CopyFrom(with_unknown(pb.LinuxContainerConfig(resources=with_unknown(res, rng, p_unknown)),
                                           rng, p_unknown))
    elif shape < 0.9:
        config.linux.CopyFrom(pb.LinuxContainerConfig(security_context=pb.LinuxContainerSecurityContext(
            privileged=True)))  # linux, no resources
    req = pb.CreateContainerRequest(pod_sandbox_id=f"{rng.getrandbits(128):032x}",
                                    sandbox_config=with_unknown(sandbox, rng, p_unknown))
    if rng.random() < 0.95:
        req.config.CopyFrom(with_unknown(config, rng, p_unknown))
    return with_unknown(req, rng, p_unknown)


def reference(raw: bytes, cpus: str, mems: str) -> tuple[bytes, bytes]:
    full = pb.CreateContainerRequest.FromString(raw)
    res = full.config.linux.resources
    res.cpuset_cpus, res.cpuset_mems = cpus, mems
    return full.SerializeToString(deterministic=True), res.SerializeToString(deterministic=True)


@pytest.mark.parametrize("seed", range(300))
def test_rewrite_is_byte_exact_with_a_full_reencode_unknown_fields_included(seed):
    rng = random.Random(seed)
    raw = random_request(rng).SerializeToString(deterministic=True)  # canonical, as protobuf writes
    cpus, mems = rng.choice(("", "2", "0-1,3", "5-63")), rng.choice(("", "0", "0-1"))
    req = wire.parse_create(raw)
    assert wire.set_cpuset(req, cpus, mems) == reference(raw, cpus, mems)


@pytest.mark.parametrize("seed", range(100))
def test_what_is_read_equals_what_protobuf_reads(seed):
    rng = random.Random(seed)
    msg = random_request(rng)
    raw = msg.SerializeToString()  # maps in upb's own order: not canonical
    full = pb.CreateContainerRequest.FromString(raw)
    req = wire.parse_create(raw)
    assert (req.pod_sandbox_id, req.config, req.sandbox_metadata, req.sandbox_linux) == (
        full.pod_sandbox_id, full.config, full.sandbox_config.metadata, full.sandbox_config.linux)
    assert dict(req.pod_annotations) == dict(full.sandbox_config.annotations)
    out, res = wire.set_cpuset(req, "1", "0")
    want, want_res = reference(raw, "1", "0")
    assert pb.CreateContainerRequest.FromString(out) == pb.CreateContainerRequest.FromString(want)
    assert pb.LinuxContainerResources.FromString(res) == pb.LinuxContainerResources.FromString(want_res)


def test_fields_out_of_order_read_and_rewrite_as_protobuf_does():
    rng = random.Random(7)
    msg = random_request(rng, p_unknown=1.0)
    parts = {f.number: msg.SerializeToString(deterministic=True)[f.start:f.end]
             for f in pw.fields(msg.SerializeToString(deterministic=True)) if f.number <= 3}
    raw = parts[3] + parts.get(2, b"") + parts[1]  # sandbox_config, config, pod id: valid, not canonical
    out, _res = wire.set_cpuset(wire.parse_create(raw), "3", "0")
    want = reference(raw, "3", "0")[0]
    assert pb.CreateContainerRequest.FromString(out) == pb.CreateContainerRequest.FromString(want)


def test_a_repeated_config_is_merged_and_written_once_as_protobuf_does():
    a = pb.CreateContainerRequest(config=pb.ContainerConfig(metadata=pb.ContainerMetadata(name="a"),
                                                            linux=pb.LinuxContainerConfig(
                                                                resources=pb.LinuxContainerResources(cpu_shares=2))))
    b = pb.CreateContainerRequest(config=pb.ContainerConfig(image=pb.ImageSpec(image="busybox")))
    raw = a.SerializeToString() + b.SerializeToString()  # two occurrences of field 2: merged by protobuf
    req = wire.parse_create(raw)
    assert req.config.metadata.name == "a" and req.config.image.image == "busybox"  # read as protobuf does
    assert wire.set_cpuset(req, "1", "0") == reference(raw, "1", "0")


@pytest.mark.parametrize("raw", [b"\x12\x05ab", b"\x12", b"\x0b\x00", b"\x12\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff"])
def test_malformed_bytes_are_refused_like_protobuf_refuses_them(raw):
    with pytest.raises(DecodeError):
        pb.CreateContainerRequest.FromString(raw)
    with pytest.raises(DecodeError):  # the proxy then forwards the request unchanged
        wire.parse_create(raw)


def test_the_create_handler_forwards_the_rewrite_and_merges_a_repeated_config_as_protobuf_does(fe):  # noqa: F811
    front, rt = fe
    pod = run_pod(front, rt, "g", "Guaranteed")
    pod.annotations.update({f"k{i}": "v" for i in range(1000)})
    res = pb.LinuxContainerResources(cpu_shares=1024, cpu_period=100000, cpu_quota=100000,
                                     memory_limit_in_bytes=64 << 20)
    req = pb.CreateContainerRequest(pod_sandbox_id="pod-g", sandbox_config=pod, config=pb.ContainerConfig(
        metadata=pb.ContainerMetadata(name="app"), linux=pb.LinuxContainerConfig(resources=res)))
    raw = req.SerializeToString(deterministic=True)
    ex = exchange("CreateContainer", req)
    ex.request = raw
    out = front.rewrite(ex)
    assert isinstance(out, bytes)
    cpus = pb.CreateContainerRequest.FromString(out).config.linux.resources.cpuset_cpus
    assert cpus and out == reference(raw, cpus, "0")[0]
    finish(front, ex, response=pb.CreateContainerResponse(container_id="c1"))
    assert front.engine.state().exclusive == {"c1": cpus}
    assert pb.LinuxContainerResources.FromString(bytes.fromhex(front.engine.container("c1").resources)) == \
        pb.CreateContainerRequest.FromString(out).config.linux.resources

    # config repeated: protobuf merges it, and so does the rewrite
    two = pb.CreateContainerRequest(config=pb.ContainerConfig(metadata=pb.ContainerMetadata(name="two")))
    ex2 = exchange("CreateContainer", req)
    ex2.request = raw + two.SerializeToString()
    out2 = front.rewrite(ex2)
    assert isinstance(out2, bytes)
    got = pb.CreateContainerRequest.FromString(out2)
    assert got.config.metadata.name == "two" and got.config.linux.resources.cpuset_cpus not in ("", cpus)
    assert front.engine.state().pending == 1 and ex2.method == RT + "CreateContainer"
