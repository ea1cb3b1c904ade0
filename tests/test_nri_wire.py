"""NRI's wire layers without a runtime: the multiplexed socket framing, ttrpc messages, the NRI messages'
encoding against bytes worked out by hand from the public field numbers, and a ttrpc client and server talking
over a real socketpair through the multiplexer."""

from __future__ import annotations

import math
import socket
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from cri_resmgr.nri import convert
from cri_resmgr.nri.mux import MAX_FRAME_BYTES, ConnId, FrameDecoder, FramingError, Mux, encode_frames
from cri_resmgr.nri.proto import nri_pb2 as api
from cri_resmgr.nri.proto import ttrpc_pb2
from cri_resmgr.nri.ttrpc import (
    Call,
    Client,
    Code,
    Message,
    MessageDecoder,
    MessageType,
    Method,
    ProtocolError,
    RpcError,
    Server,
)

# -- multiplexer framing ------------------------------------------------------------------------------


def test_frame_is_conn_id_and_length_big_endian_then_payload():
    assert encode_frames(2, b"abc") == b"\x00\x00\x00\x02\x00\x00\x00\x03abc"


def test_payload_over_4k_is_split_into_frames_of_at_most_4096_bytes():
    data = bytes(range(256)) * 40  # 10240 bytes
    wire = encode_frames(ConnId.RUNTIME_SERVICE, data)
    frames = FrameDecoder().feed(wire)
    assert [len(p) for _, p in frames] == [MAX_FRAME_BYTES - 8, MAX_FRAME_BYTES - 8, 10240 - 2 * (MAX_FRAME_BYTES - 8)]
    assert all(cid == 2 for cid, _ in frames)
    assert b"".join(p for _, p in frames) == data
    # and on the wire every frame, header included, is within 4096 bytes
    pos, sizes = 0, []
    while pos < len(wire):
        _, n = struct.unpack_from(">II", wire, pos)
        sizes.append(8 + n)
        pos += 8 + n
    assert max(sizes) == MAX_FRAME_BYTES


def test_frames_split_anywhere_are_reassembled():
    wire = encode_frames(1, b"hello") + encode_frames(2, b"world!")
    for cut in range(len(wire) + 1):
        dec = FrameDecoder()
        out = dec.feed(wire[:cut]) + dec.feed(wire[cut:])
        assert out == [(1, b"hello"), (2, b"world!")], cut
        assert dec.pending == 0


def test_byte_at_a_time_and_coalesced_frames_decode_the_same():
    wire = b"".join(encode_frames(1 + i % 2, bytes([i]) * i) for i in range(1, 20))
    whole = FrameDecoder().feed(wire)
    dec = FrameDecoder()
    trickled = [f for b in wire for f in dec.feed(bytes([b]))]
    assert whole == trickled and len(whole) == 19


def test_oversized_frame_is_a_framing_error():
    with pytest.raises(FramingError):
        FrameDecoder(max_payload=100).feed(struct.pack(">II", 1, 101))


def test_connection_zero_is_reserved():
    with pytest.raises(ValueError):
        encode_frames(0, b"x")


# -- ttrpc messages -----------------------------------------------------------------------------------


def test_ttrpc_header_is_length_stream_type_flags():
    assert Message(3, MessageType.REQUEST, b"xy").encode() == b"\x00\x00\x00\x02\x00\x00\x00\x03\x01\x00xy"


def test_ttrpc_messages_split_across_frames_are_reassembled():
    a, b = Message(1, MessageType.RESPONSE, b"A" * 5000), Message(3, MessageType.RESPONSE, b"")
    wire = encode_frames(2, a.encode() + b.encode())
    frames = FrameDecoder().feed(wire)
    assert len(frames) == 2  # 5020 bytes need two frames
    dec = MessageDecoder()
    msgs = [m for _, p in frames for m in dec.feed(p)]
    assert msgs == [a, b]


def test_unknown_message_type_is_a_protocol_error():
    with pytest.raises(ProtocolError):
        MessageDecoder().feed(b"\x00\x00\x00\x00\x00\x00\x00\x01\x09\x00")


def test_ttrpc_request_encoding_known_bytes():
    req = ttrpc_pb2.Request(service="s", method="m", payload=b"\x01", timeout_nano=2)
    # 1:"s" 2:"m" 3:b"\x01" 4:varint 2
    assert req.SerializeToString() == b"\x0a\x01s\x12\x01m\x1a\x01\x01\x20\x02"


# -- NRI messages -------------------------------------------------------------------------------------


def test_register_plugin_request_known_bytes():
    assert api.RegisterPluginRequest(plugin_name="cri-resmgr", plugin_idx="90").SerializeToString() == \
        b"\x0a\x0acri-resmgr\x12\x0290"


def test_create_container_cpuset_adjustment_known_bytes():
    # adjust(1) -> linux(6) -> resources(2) -> cpu(2) -> cpus(6) = "1"
    r = api.CreateContainerResponse()
    r.adjust.linux.resources.cpu.cpus = "1"
    assert r.SerializeToString() == b"\x0a\x09\x32\x07\x12\x05\x12\x03\x32\x011"


def test_configure_response_events_bitmask():
    # bit (event - 1): CREATE_CONTAINER=4 -> 0x8, STOP_CONTAINER=10 -> 0x200
    mask = convert.events_mask([api.CREATE_CONTAINER, api.STOP_CONTAINER])
    assert mask == 0x208
    assert api.ConfigureResponse(events=mask).SerializeToString() == b"\x10\x88\x04"


def test_container_update_keeps_other_resources_and_sets_cpuset():
    res = api.LinuxResources()
    res.cpu.shares.value, res.cpu.quota.value, res.memory.limit.value = 1024, 100000, 64 << 20
    u = convert.cpuset_update("abc", "0-1", "0", convert.blob_of(res))
    assert u.container_id == "abc"
    r = u.linux.resources
    assert (r.cpu.cpus, r.cpu.mems, r.cpu.shares.value, r.cpu.quota.value, r.memory.limit.value) == \
        ("0-1", "0", 1024, 100000, 64 << 20)


def test_unknown_fields_from_newer_runtimes_survive_a_round_trip():
    # a field number we do not declare (Container.rlimits = 13) is kept, not dropped
    raw = api.Container(id="x").SerializeToString() + b"\x6a\x03abc"
    c = api.Container.FromString(raw)
    assert c.id == "x" and c.SerializeToString() == raw


def test_resources_estimate_inputs_from_nri():
    res = api.LinuxResources()
    res.cpu.shares.value, res.cpu.quota.value, res.cpu.period.value = 2048, 200000, 100000
    res.cpu.cpus = "0-1"
    r = convert.resources_of(res)
    assert (r.cpu_shares, r.cpu_quota, r.cpu_period, r.cpuset_cpus) == (2048, 200000, 100000, "0-1")


# -- client and server over a real socket pair --------------------------------------------------------


class _Pair:
    """Two multiplexers on the ends of a socketpair: 'runtime' serves conn 2 and calls conn 1, 'plugin' the reverse."""

    def __init__(self, plugin_methods: dict[str, Method], budget: float = 1.0):
        a, b = socket.socketpair()
        self.pool = ThreadPoolExecutor(4)
        self.observed: list[tuple[str, str]] = []
        self.plugin_server = Server(lambda d: self.plugin_mux.send(1, d), plugin_methods, self.pool, budget,
                                    lambda m, r, s: self.observed.append((m, r)))
        self.runtime_client = Client(lambda d: self.runtime_mux.send(1, d))
        self.plugin_mux = Mux(a, {1: self.plugin_server.receive}, lambda e: None)
        self.runtime_mux = Mux(b, {1: self.runtime_client.receive}, lambda e: self.runtime_client.close(e))
        for m in (self.plugin_mux, self.runtime_mux):
            threading.Thread(target=m.run, daemon=True).start()

    def close(self) -> None:
        self.plugin_server.close()
        self.plugin_mux.close()
        self.runtime_mux.close()
        self.pool.shutdown(wait=False)


def test_unary_call_round_trip_with_large_payload():
    def echo(raw: bytes, call: Call) -> bytes:
        return raw[::-1]

    p = _Pair({"svc/Echo": Method(echo)})
    try:
        big = bytes(range(256)) * 100  # 25.6 kB: many frames each way
        assert p.runtime_client.call("svc", "Echo", big, 5) == big[::-1]
        with pytest.raises(RpcError) as e:
            p.runtime_client.call("svc", "Nope", b"", 5)
        assert e.value.code == Code.UNIMPLEMENTED
    finally:
        p.close()


def test_late_hook_fails_open_within_the_deadline_and_is_told_to_undo():
    committed: list[bool] = []

    def slow(raw: bytes, call: Call) -> bytes:
        time.sleep(0.6)
        committed.append(call.commit())
        return b"decided"

    p = _Pair({"svc/Slow": Method(slow, fail_open=b"")}, budget=0.2)
    try:
        t0 = time.monotonic()
        assert p.runtime_client.call("svc", "Slow", b"", 5) == b""  # the fail-open answer: the hook had not decided
        assert time.monotonic() - t0 < 2.0
        time.sleep(0.6)
        assert committed == [False]
        assert ("Slow", "timeout") in p.observed
    finally:
        p.close()


def test_failing_hook_fails_open_but_a_refusal_is_answered_as_an_error():
    def boom(raw: bytes, call: Call) -> bytes:
        raise KeyError("bug")

    def refuse(raw: bytes, call: Call) -> bytes:
        raise RpcError(Code.RESOURCE_EXHAUSTED, "no CPUs")

    p = _Pair({"svc/Boom": Method(boom, fail_open=b"unchanged"), "svc/Refuse": Method(refuse, fail_open=b"")})
    try:
        assert p.runtime_client.call("svc", "Boom", b"", 5) == b"unchanged"
        with pytest.raises(RpcError) as e:
            p.runtime_client.call("svc", "Refuse", b"", 5)
        assert e.value.code == Code.RESOURCE_EXHAUSTED and "no CPUs" in e.value.message
        assert ("Boom", "error") in p.observed and ("Refuse", "error") in p.observed
    finally:
        p.close()


def test_caller_timeout_shortens_the_budget():
    gate = threading.Event()

    def slow(raw: bytes, call: Call) -> bytes:
        gate.wait(10)
        return b"late"

    p = _Pair({"svc/Slow": Method(slow, fail_open=b"")}, budget=30.0)
    try:
        t0 = time.monotonic()
        # timeout_nano 2 s -> budget 1.5 s (75 %), long before the server's own 30 s and the hook's end
        assert p.runtime_client.call("svc", "Slow", b"", 2.0) == b""
        assert 1.4 < time.monotonic() - t0 < 2.0
    finally:
        gate.set()
        p.close()


def test_watchdog_wakes_for_an_earlier_deadline_and_skips_answered_calls():
    """The watchdog is woken only by a call whose deadline is the earliest, and drops answered calls without
    expiring them: a short-deadline call behind a long answered one, and a long one behind a short answered one,
    both still fail open on time, and no answered call is reported as timed out."""
    gate = threading.Event()

    def fast(raw: bytes, call: Call) -> bytes:
        return b"fast"

    def slow(raw: bytes, call: Call) -> bytes:
        gate.wait(10)
        return b"late"

    p = _Pair({"svc/Fast": Method(fast, fail_open=b""), "svc/Slow": Method(slow, fail_open=b"")}, budget=30.0)
    try:
        assert p.runtime_client.call("svc", "Fast", b"", 20.0) == b"fast"  # deadline in 15 s, answered
        t0 = time.monotonic()
        assert p.runtime_client.call("svc", "Slow", b"", 0.4) == b""  # deadline in 0.3 s: now the earliest
        assert time.monotonic() - t0 < 1.0
        assert p.runtime_client.call("svc", "Fast", b"", 0.4) == b"fast"  # deadline in 0.3 s, answered
        t0 = time.monotonic()
        assert p.runtime_client.call("svc", "Slow", b"", 2.0) == b""  # deadline in 1.5 s, behind it
        assert 1.4 < time.monotonic() - t0 < 2.0
        assert p.observed.count(("Slow", "timeout")) == 2
        assert ("Fast", "timeout") not in p.observed
    finally:
        gate.set()
        p.close()


def test_pending_calls_fail_unavailable_when_the_peer_goes_away():
    gate = threading.Event()

    def hang(raw: bytes, call: Call) -> bytes:
        gate.wait(5)
        return b""

    p = _Pair({"svc/Hang": Method(hang)})
    errors: list[RpcError] = []

    def caller() -> None:
        try:
            p.runtime_client.call("svc", "Hang", b"", 5)
        except RpcError as e:
            errors.append(e)

    t = threading.Thread(target=caller)
    t.start()
    time.sleep(0.2)
    p.plugin_mux.close()
    t.join(3)
    gate.set()
    p.close()
    assert errors and errors[0].code == Code.UNAVAILABLE


def test_generated_modules_match_the_proto_files(tmp_path):
    pytest.importorskip("grpc_tools", reason="grpcio-tools (test extra) compiles the .proto files")
    from pathlib import Path

    from cri_resmgr.nri.proto import generate

    generate.compile_protos(tmp_path)
    for name, module in (("nri_pb2", api), ("ttrpc_pb2", ttrpc_pb2)):
        # The serialized file descriptor inside the module is what protoc made of the .proto: compare those
        # (the rest of the generated text varies with the protoc version).
        assert _descriptor_of(tmp_path / f"{name}.py") == module.DESCRIPTOR.serialized_pb, \
            f"{name}.py is stale: run python -m cri_resmgr.nri.proto.generate"
        checked_in = Path(module.__file__).with_suffix(".pyi")
        assert (tmp_path / f"{name}.pyi").read_text() == checked_in.read_text(), f"{name}.pyi is stale"


def _descriptor_of(path) -> bytes:
    import ast

    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "AddSerializedFile":
            return node.args[0].value
    raise AssertionError(f"no AddSerializedFile in {path}")


def test_a_protocol_error_closes_the_trunk_and_fails_pending_calls():
    p = _Pair({})
    closed: list[Exception | None] = []
    p.plugin_mux.on_close = closed.append
    try:
        p.runtime_mux.send(1, Message(1, MessageType.RESPONSE, b"").encode())  # a response sent to a server
        deadline = time.monotonic() + 5
        while not closed and time.monotonic() < deadline:
            time.sleep(0.01)
        assert closed and isinstance(closed[0], ProtocolError) and p.plugin_mux.closed
        with pytest.raises(RpcError) as e:
            p.runtime_client.call("svc", "Any", b"", 5)
        assert e.value.code == Code.UNAVAILABLE
    finally:
        p.close()


def test_calls_in_a_steady_stream_never_wake_the_watchdog_yet_a_hung_one_still_fails_open_on_time():
    """A thread woken while a hook runs takes the interpreter from it (issue 15): once the watchdog has seen a call,
    it wakes on its own at least once per budget for a while, so the calls after it need no wake-up, and a hook
    that hangs among them is still answered (fail-open) within its deadline."""
    gate = threading.Event()

    def fast(raw: bytes, call: Call) -> bytes:
        return b"fast"

    def hung(raw: bytes, call: Call) -> bytes:
        gate.wait(10)
        return b"late"

    p = _Pair({"svc/Fast": Method(fast, fail_open=b"", inline=True),
               "svc/Hung": Method(hung, fail_open=b"", inline=True)}, budget=0.3)
    try:
        for _ in range(8):  # 0.8 s: the first call's deadline and several idle periods pass meanwhile
            assert p.runtime_client.call("svc", "Fast", b"", 5) == b"fast"
            time.sleep(0.1)
        watchdog = p.plugin_server._watchdog
        assert watchdog.notified == 0  # the first call started the thread; none had to wake it
        t0 = time.monotonic()
        assert p.runtime_client.call("svc", "Hung", b"", 5) == b""
        assert time.monotonic() - t0 < 0.3 + 0.2
        assert watchdog.notified == 0
        assert ("Hung", "timeout") in p.observed
    finally:
        gate.set()
        p.close()


def test_an_idle_watchdog_sleeps_without_a_timeout_after_lingering_and_a_new_call_wakes_it():
    from cri_resmgr.nri.ttrpc import _Watchdog

    expired: list[str] = []
    w = _Watchdog(lambda call, sid, t0: expired.append(call.method), period=0.1, linger=0.3)
    try:
        c = Call("A", time.monotonic() + 0.1)
        assert c.commit()
        w.watch(c, 1, time.monotonic())
        deadline = time.monotonic() + 5
        while w._wake_at != math.inf and time.monotonic() < deadline:  # lingers for 0.3 s, then sleeps for good
            time.sleep(0.05)
        assert w._wake_at == math.inf
        late = Call("B", time.monotonic() + 0.1)
        w.watch(late, 3, time.monotonic())
        assert w.notified == 1  # this one (the first started the thread)
        deadline = time.monotonic() + 5
        while not expired and time.monotonic() < deadline:
            time.sleep(0.01)
        assert expired == ["B"]  # the committed call is dropped, not expired
    finally:
        w.close()
