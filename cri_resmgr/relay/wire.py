"""CreateContainerRequest read and rewritten without touching the pod's annotations.

A CreateContainerRequest carries the pod's whole ``PodSandboxConfig``; a pod with 1,000 annotations makes it
~45 kB, and protobuf (upb) spends most of a rewrite that changes two short strings in ``config.linux.resources``
decoding and encoding the pod's map. Measured here (45 kB request, protobuf 6.33 with the upb backend, CPU time
per rewrite, median of 7 x 300, on a shared 2-CPU VM):

================================================== ==========
full parse, read, set cpuset, full serialise        263-270 µs
:func:`parse_create`, read, :func:`set_cpuset`       72-78 µs
================================================== ==========

- Reading: :data:`CreateRequestView` is CreateContainerRequest with a ``sandbox_config`` that declares only
  ``metadata`` (1) and ``linux`` (8). protobuf parses it with exactly its own rules (repeated fields merged,
  last value wins, ...), and keeps the pod's annotations, labels and every other field as unknown-field bytes,
  which upb copies without decoding. The annotations are decoded (by protobuf, the whole request) only when
  read (:class:`PodAnnotations`: the engine reads them for a pod it has not seen created).
- Writing: only the ``config`` field (the container's ``ContainerConfig``, small) is serialised again, by
  protobuf, and spliced into the request's wire bytes in place of the old one
  (https://protobuf.dev/programming-guides/encoding/: a length-delimited field is tag, length, payload);
  the pod sandbox id and the ``sandbox_config`` bytes are copied as they came.

For a request encoded canonically (fields in number order, unknown fields last, maps sorted: protobuf's
deterministic serialisation) the result is byte for byte what protobuf writes (deterministically) after
parsing the whole request and setting the two fields; ``tests/test_relay_wire.py`` holds it to that, with
protobuf as the reference, unknown fields included. A request whose ``config`` field is repeated (protobuf
would merge the occurrences) or that is not well-formed raises :class:`WireError`; the caller then takes the
protobuf path.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from cri_api.v1 import api_pb2 as pb
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

# Wire types (encoding guide, "Message Structure")
VARINT, I64, LEN, SGROUP, EGROUP, I32 = 0, 1, 2, 3, 4, 5
CREATE_CONFIG = 2  # CreateContainerRequest.config (cri-api pkg/apis/runtime/v1/api.proto)


class WireError(ValueError):
    """Not a message this module handles exactly as protobuf would: use protobuf."""


def _view_class() -> type:
    """CreateContainerRequest as the relay reads it (field numbers and types of cri-api's api.proto)."""
    F = descriptor_pb2.FieldDescriptorProto
    fd = descriptor_pb2.FileDescriptorProto(name="cri_resmgr/relay/create_view.proto", package="cri_resmgr.relay.view",
                                            syntax="proto3", dependency=[pb.DESCRIPTOR.name])
    sb = fd.message_type.add(name="PodSandboxConfigView")
    sb.field.add(name="metadata", number=1, type=F.TYPE_MESSAGE, type_name=".runtime.v1.PodSandboxMetadata",
                 label=F.LABEL_OPTIONAL)
    sb.field.add(name="linux", number=8, type=F.TYPE_MESSAGE, type_name=".runtime.v1.LinuxPodSandboxConfig",
                 label=F.LABEL_OPTIONAL)
    req = fd.message_type.add(name="CreateContainerRequestView")
    req.field.add(name="pod_sandbox_id", number=1, type=F.TYPE_STRING, label=F.LABEL_OPTIONAL)
    req.field.add(name="config", number=2, type=F.TYPE_MESSAGE, type_name=".runtime.v1.ContainerConfig",
                  label=F.LABEL_OPTIONAL)
    req.field.add(name="sandbox_config", number=3, type=F.TYPE_MESSAGE,
                  type_name=".cri_resmgr.relay.view.PodSandboxConfigView", label=F.LABEL_OPTIONAL)
    pool = descriptor_pool.Default()
    pool.Add(fd)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName(
        "cri_resmgr.relay.view.CreateContainerRequestView"))


CreateRequestView: Any = _view_class()
_SELF_CHECK = {f.name: (f.number, f.type) for f in pb.CreateContainerRequest.DESCRIPTOR.fields}
assert all(_SELF_CHECK[f.name] == (f.number, f.type) for f in CreateRequestView.DESCRIPTOR.fields)
assert all(pb.PodSandboxConfig.DESCRIPTOR.fields_by_name[f.name].number == f.number
           for f in CreateRequestView.DESCRIPTOR.fields_by_name["sandbox_config"].message_type.fields)


def read_varint(buf: bytes, pos: int, end: int) -> tuple[int, int]:
    result = shift = 0
    while pos < end and shift < 64:
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, pos
        shift += 7
    raise WireError("truncated or overlong varint")


def varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


@dataclass(frozen=True)
class Field:
    number: int
    wire_type: int
    start: int  # the tag's first byte
    value_start: int  # LEN: the payload's first byte (after the length)
    end: int


def fields(buf: bytes) -> Iterator[Field]:
    """The top-level fields of message ``buf``, in wire order."""
    pos, end = 0, len(buf)
    while pos < end:
        tag, vpos = read_varint(buf, pos, end)
        number, wt = tag >> 3, tag & 7
        if number == 0:
            raise WireError("field number 0")
        if wt == VARINT:
            _, nxt = read_varint(buf, vpos, end)
        elif wt == LEN:
            n, vpos = read_varint(buf, vpos, end)
            nxt = vpos + n
        elif wt == I64:
            nxt = vpos + 8
        elif wt == I32:
            nxt = vpos + 4
        else:
            raise WireError(f"wire type {wt} (groups) not handled")
        if nxt > end:
            raise WireError(f"field {number} runs past the message")
        yield Field(number, wt, pos, vpos, nxt)
        pos = nxt


class PodAnnotations(Mapping[str, str]):
    """The pod's annotations, decoded (by protobuf) when first read."""

    def __init__(self, raw: bytes):
        self._raw = raw
        self._map: dict[str, str] | None = None

    def _decoded(self) -> dict[str, str]:
        if self._map is None:
            self._map = dict(pb.CreateContainerRequest.FromString(self._raw).sandbox_config.annotations)
            self._raw = b""
        return self._map

    def __getitem__(self, key: str) -> str:
        return self._decoded()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._decoded())

    def __len__(self) -> int:
        return len(self._decoded())


@dataclass(frozen=True)
class CreateRequest:
    """What the relay reads from a CreateContainerRequest (the message parts are protobuf messages)."""

    raw: bytes
    pod_sandbox_id: str
    config: pb.ContainerConfig
    sandbox_metadata: pb.PodSandboxMetadata
    sandbox_linux: pb.LinuxPodSandboxConfig
    pod_annotations: PodAnnotations


def parse_create(raw: bytes) -> CreateRequest:
    """Read a CreateContainerRequest; its pod's annotations stay undecoded until read. DecodeError as protobuf's."""
    v = CreateRequestView.FromString(raw)
    sb = v.sandbox_config
    return CreateRequest(raw, v.pod_sandbox_id, v.config, sb.metadata, sb.linux, PodAnnotations(raw))


def set_cpuset(req: CreateRequest, cpus: str, mems: str) -> tuple[bytes, bytes]:
    """The request with ``config.linux.resources.cpuset_cpus``/``cpuset_mems`` set, and the new
    LinuxContainerResources. Changes ``req.config``. WireError: use protobuf."""
    spans = [f for f in fields(req.raw) if f.number == CREATE_CONFIG]
    if len(spans) > 1 or (spans and spans[0].wire_type != LEN):
        raise WireError("config repeated (protobuf merges the occurrences) or not length-delimited")
    res = req.config.linux.resources
    res.cpuset_cpus, res.cpuset_mems = cpus, mems
    config = req.config.SerializeToString(deterministic=True)
    field = varint(CREATE_CONFIG << 3 | LEN) + varint(len(config)) + config
    raw = req.raw
    if spans:
        f = spans[0]
        out = b"".join((raw[:f.start], field, raw[f.end:]))
    else:  # no config at all: it goes where protobuf writes field 2 (after field 1)
        at = next((f.start for f in fields(raw) if f.number > CREATE_CONFIG), len(raw))
        out = b"".join((raw[:at], field, raw[at:]))
    return out, res.SerializeToString(deterministic=True)
