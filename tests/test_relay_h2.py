"""The relay's HTTP/2 proxy driven by independent HTTP/2 peers (the ``h2`` library) on both sides, in process:
flow-control windows around held requests, padding, RST_STREAM during a held request, rewrites that change the
message size, connection credit held back for the client until the answer, and the limits (a CONTINUATION flood, a
held message over its limit) that end a stream or a connection while the relay goes on serving.
"""

from __future__ import annotations

import asyncio
import hashlib
import select
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import cast

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import hpack
import pytest

from cri_resmgr.relay.h2proxy import (
    IN_WORKER,
    MAX_HEADER_BLOCK,
    MAX_HELD_MESSAGE,
    WINDOW_HOLD_SECONDS,
    Exchange,
    Hooks,
    InWorker,
    Mode,
    Proxy,
    RewriteTiming,
)

REWRITE, OBSERVE, PASS = "/t.S/Rewrite", "/t.S/Observe", "/t.S/Pass"
HUNG = "/t.S/Hung"  # passed through; the runtime never answers it
HEADER_LIMIT, HELD_LIMIT = 256 << 10, 512 << 10


def grpc_frame(message: bytes) -> bytes:
    return b"\x00" + len(message).to_bytes(4, "big") + message


def digest(message: bytes) -> bytes:
    return hashlib.sha256(message).digest() + len(message).to_bytes(4, "big")


class TestHooks(Hooks):
    __test__ = False

    def __init__(self) -> None:
        self.completed: list[tuple[str, int, bytes]] = []
        self.grow = 1000  # the rewrite appends this many bytes (negative: cuts)
        self.inline = False  # rewrite on the event loop (rewrite_inline) instead of in a worker
        self.timed: list[RewriteTiming] = []
        self.complete_seconds = 0.0  # a slow completion (the books' work) on the event loop

    def mode(self, method: str) -> Mode:
        return {REWRITE: Mode.REWRITE, OBSERVE: Mode.OBSERVE}.get(method, Mode.PASS)

    def rewrite(self, ex: Exchange) -> bytes | None:
        time.sleep(0.01)  # a worker takes a moment: frames keep arriving meanwhile
        return ex.request + b"R" * self.grow if self.grow >= 0 else ex.request[: self.grow]

    def rewrite_inline(self, ex: Exchange) -> bytes | None | InWorker:
        if not self.inline:
            return IN_WORKER
        return ex.request + b"R" * self.grow if self.grow >= 0 else ex.request[: self.grow]

    def rewrite_timed(self, ex: Exchange) -> None:
        assert ex.timing is not None
        self.timed.append(ex.timing)

    def complete(self, ex: Exchange) -> None:
        time.sleep(self.complete_seconds)
        self.completed.append((ex.method, ex.code if ex.code is not None else -1, ex.request))


@dataclass
class Upstream:
    received: list[tuple[str, bytes]] = field(default_factory=list)
    resets: list[int] = field(default_factory=list)
    errors: list[Exception] = field(default_factory=list)
    ping_each_request: bool = False  # as grpc-go's BDP probe: a PING as each request's data arrives
    pings: list[bytes] = field(default_factory=list)  # PINGs that reached it
    ping_acks: list[bytes] = field(default_factory=list)  # acknowledgements of its own PINGs
    # As grpc-go: the connection window granted back for each DATA frame at once, a stream's once a quarter of its
    # window is pending (even after END_STREAM). Else h2's own policy: granted once half a window is consumed.
    grpc_go_windows: bool = False
    answer_delay_seconds: float = 0.0  # the runtime works this long on each call before it answers
    preface_delay_seconds: float = 0.0  # its SETTINGS (and all else) reach the proxy this late
    initial_window_grant: int = 0  # a connection WINDOW_UPDATE right after its SETTINGS, as grpc C-core's server
    conns: list[UpstreamProtocol] = field(default_factory=list)


class UpstreamProtocol(asyncio.Protocol):
    """A gRPC-shaped HTTP/2 server: answers each request with the SHA-256 and length of the message it got."""

    def __init__(self, up: Upstream):
        self.up = up
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False, header_encoding="utf-8"))
        self.bodies: dict[int, bytearray] = {}
        self.paths: dict[int, str] = {}
        self.stream_pending: dict[int, int] = {}  # grpc_go_windows: bytes read on a stream, not yet granted back
        self.deferred: list[bytes] | None = None  # written once the preface delay is over
        up.conns.append(self)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.t = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass asyncio's
        self.conn.initiate_connection()
        if self.up.initial_window_grant:
            self.conn.increment_flow_control_window(self.up.initial_window_grant)
        if self.up.preface_delay_seconds:
            self.deferred = []
            asyncio.get_running_loop().call_later(self.up.preface_delay_seconds, self.end_delay)
        self.write(self.conn.data_to_send())

    def write(self, data: bytes) -> None:
        if self.deferred is not None:
            self.deferred.append(data)
        else:
            self.t.write(data)

    def end_delay(self) -> None:
        deferred, self.deferred = self.deferred or [], None
        self.t.write(b"".join(deferred))

    def data_received(self, data: bytes) -> None:
        try:
            events = self.conn.receive_data(data)
        except h2.exceptions.ProtocolError as e:
            self.up.errors.append(e)
            self.t.close()
            return
        for ev in events:
            if isinstance(ev, h2.events.RequestReceived):
                self.bodies[ev.stream_id] = bytearray()
                self.paths[ev.stream_id] = dict(ev.headers)[":path"]
            elif isinstance(ev, h2.events.DataReceived):
                self.bodies[ev.stream_id] += ev.data
                n = ev.flow_controlled_length
                if not self.up.grpc_go_windows:
                    self.conn.acknowledge_received_data(n, ev.stream_id)
                elif n:
                    self.conn.increment_flow_control_window(n)
                    pending = self.stream_pending.get(ev.stream_id, 0) + n
                    if pending >= 65535 // 4:
                        self.conn.increment_flow_control_window(pending, ev.stream_id)
                        pending = 0
                    self.stream_pending[ev.stream_id] = pending
            elif isinstance(ev, h2.events.PingReceived):
                self.up.pings.append(ev.ping_data)
            elif isinstance(ev, h2.events.PingAckReceived):
                self.up.ping_acks.append(ev.ping_data)
            elif isinstance(ev, h2.events.StreamEnded):
                if self.up.ping_each_request:
                    self.conn.ping(ev.stream_id.to_bytes(8, "big"))
                body = bytes(self.bodies.pop(ev.stream_id))
                msg = body[5:5 + int.from_bytes(body[1:5], "big")]
                self.up.received.append((self.paths[ev.stream_id], msg))
                if self.paths[ev.stream_id] == HUNG:
                    continue
                if self.up.answer_delay_seconds:
                    asyncio.get_running_loop().call_later(self.up.answer_delay_seconds, self.answer_later,
                                                          ev.stream_id, msg)
                else:
                    self.answer(ev.stream_id, msg)
            elif isinstance(ev, h2.events.StreamReset):
                self.up.resets.append(ev.stream_id)
                self.bodies.pop(ev.stream_id, None)
        self.write(self.conn.data_to_send())

    def answer(self, sid: int, msg: bytes) -> None:
        self.conn.send_headers(sid, [(":status", "200"), ("content-type", "application/grpc")])
        self.conn.send_data(sid, grpc_frame(digest(msg)))
        self.conn.send_headers(sid, [("grpc-status", "0")], end_stream=True)

    def answer_later(self, sid: int, msg: bytes) -> None:
        self.answer(sid, msg)
        self.write(self.conn.data_to_send())


@dataclass
class Result:
    status: int | None = None
    message: bytes = b""
    reset: int | None = None  # RST_STREAM error code received


class Client:
    """A gRPC-shaped HTTP/2 client over a blocking unix socket."""

    def __init__(self, path: str):
        self.s = socket.socket(socket.AF_UNIX)
        self.s.settimeout(10)
        self.s.connect(path)
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
        self.conn.initiate_connection()
        self.results: dict[int, Result] = {}
        self.done: set[int] = set()
        self.bodies: dict[int, bytearray] = {}
        self.terminated: h2.events.ConnectionTerminated | None = None
        self.pings: list[bytes] = []  # PINGs that reached the client
        self.ping_acks: list[bytes] = []
        self.reads: list[list[h2.events.Event]] = []  # the events of each socket read
        self._flush()

    def _flush(self) -> None:
        out = self.conn.data_to_send()
        if out:
            self.s.sendall(out)

    def pump(self) -> None:
        data = self.s.recv(1 << 16)
        if not data:
            raise EOFError("proxy closed the connection")
        events = self.conn.receive_data(data)
        self.reads.append(events)
        for ev in events:
            sid = getattr(ev, "stream_id", 0)
            r = self.results.setdefault(sid, Result()) if sid else None
            if isinstance(ev, (h2.events.ResponseReceived, h2.events.TrailersReceived)):
                st = dict(ev.headers).get("grpc-status")
                if st is not None:
                    r.status = int(st)
            elif isinstance(ev, h2.events.DataReceived):
                self.bodies.setdefault(sid, bytearray()).extend(ev.data)
                self.conn.acknowledge_received_data(ev.flow_controlled_length, sid)
            elif isinstance(ev, h2.events.StreamEnded):
                body = bytes(self.bodies.pop(sid, b""))
                r.message = body[5:]
                self.done.add(sid)
            elif isinstance(ev, h2.events.StreamReset):
                r.reset = ev.error_code
                self.done.add(sid)
            elif isinstance(ev, h2.events.ConnectionTerminated):
                self.terminated = ev
            elif isinstance(ev, h2.events.PingReceived):
                self.pings.append(ev.ping_data)
            elif isinstance(ev, h2.events.PingAckReceived):
                self.ping_acks.append(ev.ping_data)
        self._flush()

    def start(self, path: str) -> int:
        sid = self.conn.get_next_available_stream_id()
        self.conn.send_headers(sid, [(":method", "POST"), (":scheme", "http"), (":path", path), (":authority", "rt"),
                                     ("content-type", "application/grpc"), ("te", "trailers")])
        self._flush()
        return sid

    def send(self, sid: int, body: bytes, end: bool, pad: int = 0, flush_each: bool = True) -> None:
        """Send respecting the windows (padding counts against them: RFC 9113 §6.1); frame by frame, or (not
        ``flush_each``) in one write as far as the windows allow, as grpc-go's writer does."""
        while body or end:
            if sid in self.done:
                return
            room = min(self.conn.local_flow_control_window(sid), self.conn.max_outbound_frame_size) - \
                (pad + 1 if pad else 0)
            if room <= 0:
                self._flush()
                self.pump()
                continue
            chunk, body = body[:room], body[room:]
            last = end and not body
            try:
                self.conn.send_data(sid, chunk, end_stream=last, pad_length=pad or None)
            except h2.exceptions.StreamClosedError:
                return
            if flush_each or last:
                self._flush()
            if last:
                return

    def wait(self, sid: int, timeout: float = 10) -> Result:
        deadline = time.monotonic() + timeout
        while sid not in self.done:
            assert time.monotonic() < deadline, f"stream {sid} never ended"
            self.pump()
        return self.results[sid]

    def call(self, path: str, message: bytes, pad: int = 0) -> Result:
        sid = self.start(path)
        self.send(sid, grpc_frame(message), True, pad)
        return self.wait(sid)

    def drain(self, seconds: float) -> None:
        """Read whatever arrives within ``seconds``."""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            if select.select([self.s], [], [], left)[0]:
                self.pump()

    def readable_within(self, seconds: float) -> bool:
        return bool(select.select([self.s], [], [], seconds)[0])

    def close(self) -> None:
        self.s.close()


def wait_for(cond, timeout: float = 5) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition never held"
        time.sleep(0.005)


@pytest.fixture
def window_hold_seconds() -> float:
    """The proxy's timer for held connection credit; a test overrides it with ``pytest.mark.parametrize``."""
    return WINDOW_HOLD_SECONDS


@pytest.fixture(params=["asyncio", "uvloop"])
def proxy(request, tmp_path, window_hold_seconds):
    # Each test on asyncio's loop and on uvloop's, the one the relay process runs on (server.event_loop_factory).
    if request.param == "uvloop":
        uvloop = pytest.importorskip("uvloop")
        loop = uvloop.new_event_loop()
    else:
        loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    up, hooks, resets = Upstream(), TestHooks(), []
    up_path, px_path = str(tmp_path / "up.sock"), str(tmp_path / "px.sock")
    executor = ThreadPoolExecutor(2)

    async def setup() -> tuple[asyncio.AbstractServer, Proxy]:
        server = await loop.create_unix_server(lambda: UpstreamProtocol(up), up_path)
        p = Proxy(up_path, hooks, executor, max_header_block=HEADER_LIMIT, max_held_message=HELD_LIMIT,
                  on_reset=resets.append, window_hold_seconds=window_hold_seconds)
        await p.start(px_path)
        return server, p

    server, p = asyncio.run_coroutine_threadsafe(setup(), loop).result(5)
    clients: list[Client] = []

    def connect() -> Client:
        c = Client(px_path)
        clients.append(c)
        return c

    yield connect, up, hooks, resets
    for c in clients:
        c.close()
    asyncio.run_coroutine_threadsafe(p.close(), loop).result(5)

    async def close_upstream() -> None:
        # asyncio servers are not thread-safe: close on the loop's own thread.
        server.close()
        await server.wait_closed()

    asyncio.run_coroutine_threadsafe(close_upstream(), loop).result(5)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)
    executor.shutdown()


def test_the_default_limits_are_at_least_the_runtimes_own():
    assert MAX_HEADER_BLOCK >= 16 << 20 and MAX_HELD_MESSAGE >= (16 << 20) + 5


def test_held_requests_larger_than_the_window_pass_rewritten_and_the_windows_stay_exact(proxy):
    connect, up, hooks, _ = proxy
    c = connect()
    for size, grow in ((200_000, 1000), (150_000, -40_000), (100, 70_000)):  # grows, shrinks, crosses frames
        hooks.grow = grow
        msg = bytes(range(256)) * (size // 256) + b"x" * (size % 256)
        r = c.call(REWRITE, msg)
        want = msg + b"R" * grow if grow >= 0 else msg[:grow]
        assert r.status == 0 and r.message == digest(want)
        assert up.received[-1] == (REWRITE, want)
    big = b"p" * 300_000  # forwarded as it comes, on the same connection
    assert c.call(PASS, big).message == digest(big)
    assert c.call(OBSERVE, big).message == digest(big)
    # The proxy never credits the client more than the runtime's window: the client's view of the
    # connection window never exceeds what the runtime granted (65535 at start, all acknowledged since).
    assert 0 < c.conn.outbound_flow_control_window <= 65535
    wait_for(lambda: len(hooks.completed) == 4)  # completions run once the client has been sent the call's end
    assert [m for m, code, _ in hooks.completed] == [REWRITE, REWRITE, REWRITE, OBSERVE]
    assert all(code == 0 for _m, code, _r in hooks.completed) and not up.errors


def test_a_rewrite_answered_on_the_event_loop_is_forwarded_in_order_with_exact_windows(proxy):
    connect, up, hooks, _ = proxy
    c = connect()
    hooks.inline = True
    for size, grow in ((200_000, 1000), (150_000, -40_000), (100, 70_000)):
        hooks.grow = grow
        msg = bytes(range(256)) * (size // 256) + b"y" * (size % 256)
        r = c.call(REWRITE, msg)
        want = msg + b"R" * grow if grow >= 0 else msg[:grow]
        assert r.status == 0 and r.message == digest(want)
        assert up.received[-1] == (REWRITE, want)
    big = b"q" * 300_000
    assert c.call(PASS, big).message == digest(big)
    assert 0 < c.conn.outbound_flow_control_window <= 65535
    wait_for(lambda: len(hooks.timed) == 3)  # timed once the answer went to the client's socket
    assert all(t.started == t.held <= t.returned <= t.forwarded for t in hooks.timed)
    hooks.inline = False  # and the worker path on the same connection, timed as such
    assert c.call(REWRITE, b"z" * 1000).status == 0
    wait_for(lambda: len(hooks.timed) == 4)
    t = hooks.timed[-1]
    assert t.held < t.started <= t.returned <= t.forwarded and not up.errors


def test_padded_data_is_unpadded_for_rewrite_and_forwarded_as_is_otherwise(proxy):
    connect, up, hooks, _ = proxy
    c = connect()
    hooks.grow = 3
    msg = b"m" * 40_000
    r = c.call(REWRITE, msg, pad=200)
    assert r.status == 0 and up.received[-1] == (REWRITE, msg + b"RRR")
    r = c.call(PASS, msg, pad=255)
    assert r.status == 0 and up.received[-1] == (PASS, msg)
    assert c.call(REWRITE, b"after").status == 0  # windows still right after padding was credited
    assert not up.errors


def test_rst_stream_during_a_held_request_cancels_it_and_the_connection_goes_on(proxy):
    connect, up, hooks, _ = proxy
    c = connect()
    sid = c.start(REWRITE)
    c.send(sid, grpc_frame(b"h" * 100_000)[:60_000], end=False)  # held: the message is not complete
    c.conn.reset_stream(sid, error_code=0x8)
    c._flush()
    deadline = time.monotonic() + 5
    while not any(m == REWRITE and code == 1 for m, code, _ in hooks.completed):  # CANCELLED
        assert time.monotonic() < deadline, hooks.completed
        time.sleep(0.01)
    while sid not in up.resets:
        assert time.monotonic() < deadline, "the runtime never saw the reset"
        time.sleep(0.01)
    assert all(m != REWRITE for m, _msg in up.received)  # the half message never reached the runtime
    r = c.call(REWRITE, b"n" * 100_000)
    assert r.status == 0 and up.received[-1][0] == REWRITE


def test_a_held_message_over_the_limit_resets_the_stream_and_the_relay_goes_on(proxy):
    connect, up, hooks, resets = proxy
    c = connect()
    sid = c.start(REWRITE)
    c.send(sid, grpc_frame(b"b" * (HELD_LIMIT + 100_000)), end=True)
    r = c.wait(sid)
    assert r.status == 8  # RESOURCE_EXHAUSTED
    deadline = time.monotonic() + 5
    while (REWRITE, 8) not in [(m, code) for m, code, _ in hooks.completed]:  # the hook runs on the proxy's loop
        assert time.monotonic() < deadline, hooks.completed
        time.sleep(0.01)
    assert resets == ["held_message"]
    while sid not in up.resets:
        assert time.monotonic() < deadline, "the runtime never saw the reset"
        time.sleep(0.01)
    assert c.call(REWRITE, b"small").status == 0  # same connection, windows intact
    assert c.call(PASS, b"z" * 200_000).status == 0


def raw_frame(ftype: int, flags: int, sid: int, payload: bytes) -> bytes:
    return len(payload).to_bytes(3, "big") + bytes((ftype, flags)) + sid.to_bytes(4, "big") + payload


def test_pings_are_answered_by_the_proxy_on_each_side_and_not_passed_on(proxy):
    """grpc-go's flow-control probe (a PING as a request's data arrives) and the client's own pings cost a
    round trip through the proxy each if passed on; answered hop by hop, each side still gets its answer."""
    connect, up, _hooks, _ = proxy
    up.ping_each_request = True
    c = connect()
    for i in range(3):
        assert c.call(OBSERVE if i % 2 else PASS, b"x" * 100).status == 0
    wait_for(lambda: len(up.ping_acks) == 3)
    assert up.ping_acks == [sid.to_bytes(8, "big") for sid in (1, 3, 5)]  # each acknowledged with its payload
    c.conn.ping(b"client-1")
    c._flush()
    deadline = time.monotonic() + 5
    while not c.ping_acks:
        assert time.monotonic() < deadline, "the client's PING was never answered"
        c.pump()
    assert c.ping_acks == [b"client-1"]
    assert c.call(PASS, b"after").status == 0  # the connection goes on
    assert c.pings == [] and up.pings == []  # neither side's PINGs reached the other
    assert not up.errors and c.terminated is None


def test_a_client_that_pings_without_reading_stalls_only_itself(proxy, tmp_path):
    """Each PING the proxy answers is 17 bytes it writes to the client: a client that never reads must not make
    it buffer without limit. It stops reading that client until the client reads; the others are served."""
    connect, _up, _hooks, _ = proxy
    s = socket.socket(socket.AF_UNIX)
    s.connect(str(tmp_path / "px.sock"))
    s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + raw_frame(4, 0, 0, b""))
    batch = b"".join(raw_frame(6, 0, 0, i.to_bytes(8, "big")) for i in range(4096))  # 68 kB of PINGs
    s.setblocking(False)
    sent, deadline = 0, time.monotonic() + 3
    rest = memoryview(b"")  # a partial send's remainder goes first: the byte stream stays whole frames
    while sent < 64 << 20 and time.monotonic() < deadline:  # try 64 MB (3.7 million PINGs)
        if not rest:
            rest = memoryview(batch)
        try:
            n = s.send(rest)
        except BlockingIOError:
            time.sleep(0.01)
            continue
        sent += n
        rest = rest[n:]
    assert sent < 8 << 20, sent  # the proxy stopped reading: only the sockets' and transports' buffers took it
    c = connect()
    assert c.call(PASS, b"others are served").status == 0
    sent += len(rest)  # the last PING is completed below, as the proxy reads again
    acks, buf = 0, b""
    want = sent // 17  # every PING that went out is answered once the client reads
    deadline = time.monotonic() + 20
    while acks < want:
        assert time.monotonic() < deadline, f"{acks} of {want} PING acknowledgements in 20 s"
        readable, writable, _ = select.select([s], [s] if rest else [], [], 1.0)
        if writable:
            rest = rest[s.send(rest):]
        if not readable:
            continue
        got = s.recv(1 << 16)
        assert got, f"the proxy closed the connection after {acks} of {want} PING acknowledgements"
        buf += got
        pos = 0
        while len(buf) - pos >= 9:
            n = int.from_bytes(buf[pos:pos + 3], "big")
            if len(buf) - pos < 9 + n:
                break
            if buf[pos + 3] == 6 and buf[pos + 4] & 1:
                acks += 1
            pos += 9 + n
        buf = buf[pos:]
    s.close()
    assert acks == want


def test_a_continuation_flood_ends_that_connection_only(proxy, tmp_path):
    connect, up, hooks, resets = proxy
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(10)
    s.connect(str(tmp_path / "px.sock"))
    block = hpack.Encoder().encode([(":method", "POST"), (":scheme", "http"), (":path", PASS),
                                    (":authority", "rt"), ("x-pad", "a" * 4000)])
    s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + raw_frame(4, 0, 0, b"") + raw_frame(1, 0, 1, block))
    sent, goaway = 0, None
    buf = b""
    try:
        while sent < 4 * HEADER_LIMIT:  # CONTINUATION frames, never END_HEADERS
            s.sendall(raw_frame(9, 0, 1, b"\x00" * 16000))
            sent += 16000
    except (BrokenPipeError, ConnectionResetError):
        pass
    try:
        while True:
            data = s.recv(1 << 16)
            if not data:
                break
            buf += data
    except (ConnectionResetError, TimeoutError):
        pass
    pos = 0
    while pos + 9 <= len(buf):
        n = int.from_bytes(buf[pos:pos + 3], "big")
        if buf[pos + 3] == 7:  # GOAWAY
            goaway = int.from_bytes(buf[pos + 13:pos + 17], "big")
        pos += 9 + n
    s.close()
    assert goaway == 0xB  # ENHANCE_YOUR_CALM
    assert resets == ["header_block"]
    assert not any(p == PASS for p, _ in up.received)
    c = connect()  # the relay goes on
    assert c.call(PASS, b"still here").status == 0


def test_a_held_request_is_timed_point_by_point_in_the_order_it_passed(proxy):
    connect, up, hooks, _ = proxy
    c = connect()
    hooks.inline = True
    t0 = time.perf_counter()
    assert c.call(REWRITE, b"t" * 45_000).status == 0
    wait_for(lambda: len(hooks.timed) == 1)
    t = hooks.timed[0]
    points = [t0, t.arrived, t.headers, t.first_data, t.held, t.started, t.returned, t.forwarded, t.response,
              t.response_end, t.answered, t.completed]
    assert all(points[i] <= points[i + 1] for i in range(len(points) - 1)), points
    assert t.reads >= 1 and t.upstream_buffered == 0
    hooks.inline = False  # a worker: it starts after the request is held
    assert c.call(REWRITE, b"w" * 1000).status == 0
    wait_for(lambda: len(hooks.timed) == 2)
    t = hooks.timed[1]
    assert t.held < t.started <= t.returned <= t.forwarded <= t.response <= t.answered <= t.completed
    assert not up.errors


def test_an_observed_request_is_timed_too_and_a_passed_one_is_not(proxy):
    """The answer leg of every call the relay completes (pod lifecycles are mostly observed calls) can be
    set against the client's clock; calls passed through untouched cost nothing extra."""
    connect, up, hooks, _ = proxy
    c = connect()
    assert c.call(PASS, b"p" * 100).status == 0
    t0 = time.perf_counter()
    assert c.call(OBSERVE, b"o" * 45_000).status == 0
    wait_for(lambda: len(hooks.timed) == 1)
    t = hooks.timed[0]
    assert t.started == t.returned == 0.0  # no hook before the forward
    points = [t0, t.arrived, t.headers, t.held, t.forwarded, t.response, t.response_end, t.answered, t.completed]
    assert all(points[i] <= points[i + 1] for i in range(len(points) - 1)), points
    assert [m for m, _c, _r in hooks.completed] == [OBSERVE] and not up.errors


def test_the_answer_is_sent_before_the_completion_runs(proxy):
    connect, up, hooks, _ = proxy
    c = connect()
    hooks.complete_seconds = 0.5  # the books' work after a call; the client must not wait for it
    t0 = time.monotonic()
    r = c.call(OBSERVE, b"o" * 1000)
    answered = time.monotonic() - t0
    assert r.status == 0 and answered < 0.4, answered
    assert not hooks.completed  # still running, after the client had its answer
    wait_for(lambda: len(hooks.completed) == 1)
    hooks.complete_seconds = 0.0
    assert c.call(REWRITE, b"after").status == 0  # the connection goes on, in order
    wait_for(lambda: [m for m, _c, _r in hooks.completed] == [OBSERVE, REWRITE])


def conn_updates(events: list[h2.events.Event]) -> list[int]:
    return [ev.delta for ev in events if isinstance(ev, h2.events.WindowUpdated) and ev.stream_id == 0]


@pytest.mark.parametrize("window_hold_seconds", [30.0])  # the answer, not the timer, must carry the credit
@pytest.mark.parametrize("path", [PASS, OBSERVE, REWRITE])
def test_the_runtimes_window_update_rides_on_the_answer_and_wakes_the_client_once(proxy, path):
    """grpc-go grants a request's bytes back (and probes with a PING) as soon as they arrive, while it works on the
    call: passed on at once, that grant woke the client for nothing. It now goes in the answer's write."""
    connect, up, hooks, _ = proxy
    up.grpc_go_windows = up.ping_each_request = True
    c = connect()
    assert c.call(PASS, b"warm").status == 0  # the settings exchange is over
    c.drain(0.1)
    up.answer_delay_seconds = 0.3
    # 20 kB: two frames, in one write as grpc-go's client sends them, and over grpc-go's threshold (a quarter
    # window) for a stream update, of no use to a client that has ended its stream.
    for size in (100, 20_000):
        sid = c.start(path)
        c.send(sid, grpc_frame(b"w" * size), True, flush_each=False)
        reads = len(c.reads)
        assert not c.readable_within(0.2), "a frame reached the client while the runtime worked on the call"
        r = c.wait(sid)
        assert r.status == 0 and up.received[-1][0] == path
        answer = c.reads[reads]  # the first read after the request
        assert any(isinstance(ev, h2.events.ResponseReceived) for ev in answer)
        assert conn_updates(answer) == [5 + size]  # what the runtime granted (or the proxy, for the held request)
        assert not [ev for read in c.reads[reads:] for ev in read
                    if isinstance(ev, h2.events.WindowUpdated) and ev.stream_id == sid]
        assert c.conn.outbound_flow_control_window == up.conns[0].conn.inbound_flow_control_window == 65535
    assert len(up.ping_acks) == 3 and not up.errors and not c.pings


@pytest.mark.parametrize("window_hold_seconds", [30.0])  # a stall would last the whole test
def test_held_credit_is_sent_at_once_when_the_clients_window_runs_low(proxy):
    """Calls the runtime never answers, many at once and larger than the window, and a held request larger than
    the window: every byte reaches the runtime although no answer comes to carry the credit."""
    connect, up, hooks, _ = proxy
    up.grpc_go_windows = True
    c = connect()
    sids = [c.start(HUNG) for _ in range(40)]
    for i, sid in enumerate(sids):  # 40 x 5 kB: three times the connection window
        c.send(sid, grpc_frame(bytes([i]) * 5000), True)
    big = c.start(HUNG)
    c.send(big, grpc_frame(b"b" * 300_000), True)
    wait_for(lambda: len(up.received) == 41)
    assert sorted(msg for _p, msg in up.received) == sorted([bytes([i]) * 5000 for i in range(40)] + [b"b" * 300_000])
    r = c.call(REWRITE, b"r" * 200_000)  # held, the hung calls still open
    assert r.status == 0 and up.received[-1] == (REWRITE, b"r" * 200_000 + b"R" * 1000)
    c.drain(0.05)
    # Whatever the proxy still holds leaves the client at least half the initial window.
    assert c.conn.outbound_flow_control_window >= 65535 // 2 and not up.errors


@pytest.mark.parametrize("window_hold_seconds", [0.05])
def test_held_credit_goes_out_when_the_timer_fires_if_no_answer_comes(proxy):
    connect, up, _hooks, _ = proxy
    up.grpc_go_windows = True
    c = connect()
    assert c.call(PASS, b"warm").status == 0
    c.drain(0.1)
    sid = c.start(HUNG)
    t0 = time.monotonic()
    c.send(sid, grpc_frame(b"h" * 1000), True)
    reads = len(c.reads)
    while not [d for read in c.reads[reads:] for d in conn_updates(read)]:
        assert time.monotonic() - t0 < 5, "the held credit never reached the client"
        c.pump()
    waited = time.monotonic() - t0
    assert waited >= 0.04, waited  # held, not passed on as it came
    assert conn_updates(c.reads[-1]) == [1005] and sid not in c.done  # the call still hangs
    assert c.conn.outbound_flow_control_window == up.conns[0].conn.inbound_flow_control_window == 65535
    assert c.call(PASS, b"others go on").status == 0


@pytest.mark.parametrize("window_hold_seconds", [0.02])
@pytest.mark.parametrize("grpc_go_windows", [True, False])
def test_the_clients_connection_window_stays_exact_over_many_calls(proxy, grpc_go_windows):
    """At rest, the client's view of its connection window is the runtime's view of the same window: the proxy's
    grants (its own for held and dropped bytes, the runtime's less what the proxy already gave) lose or add
    nothing, whether they went with an answer, on the timer or at once. The runtime grants every byte at once (as
    grpc-go) or once half its window is used (h2's policy, so the windows wander); the proxy's own bytes (rewrites
    that change the size) are only compared where the runtime grants them at once."""
    connect, up, hooks, _ = proxy
    up.grpc_go_windows = grpc_go_windows
    c = connect()
    runtime = None
    paths = [PASS, OBSERVE, REWRITE, HUNG] if grpc_go_windows else [PASS, OBSERVE, HUNG]
    for i in range(60):
        path = paths[i % len(paths)]
        size = (i * 7919) % 70_000
        hooks.grow = (-1) ** i * (i * 37 % 5000)
        sid = c.start(path)
        c.send(sid, grpc_frame(b"e" * size), True, pad=(i % 3) * 50)
        if path != HUNG:
            assert c.wait(sid).status == 0
        c.drain(0.03)
        runtime = up.conns[0].conn
        assert c.conn.outbound_flow_control_window == runtime.inbound_flow_control_window, i
    if grpc_go_windows:  # and a held message over the limit, reset by the proxy: its bytes come back exactly once
        sid = c.start(REWRITE)
        c.send(sid, grpc_frame(b"o" * (HELD_LIMIT + 50_000)), True)
        assert c.wait(sid).status == 8
        assert c.call(PASS, b"after").status == 0
        c.drain(0.03)
        assert c.conn.outbound_flow_control_window == 65535 == runtime.inbound_flow_control_window
    assert not up.errors


def read_frames(s: socket.socket, seconds: float) -> list[tuple[int, int, int, bytes]]:
    """Every frame (type, flags, stream, payload) a raw socket receives within ``seconds``."""
    buf, deadline = b"", time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        if select.select([s], [], [], left)[0]:
            got = s.recv(1 << 16)
            if not got:
                break
            buf += got
    frames, pos = [], 0
    while len(buf) - pos >= 9:
        n = int.from_bytes(buf[pos:pos + 3], "big")
        frames.append((buf[pos + 3], buf[pos + 4], int.from_bytes(buf[pos + 5:pos + 9], "big") & 0x7FFFFFFF,
                       buf[pos + 9:pos + 9 + n]))
        pos += 9 + n
    return frames


def test_the_runtimes_settings_reach_the_client_before_anything_the_proxy_makes(proxy, tmp_path):
    """RFC 9113 §3.4: the server's preface, a SETTINGS frame, comes first. A runtime that grants connection window
    right after it (grpc C-core's server does) and answers late: the grant, held, must not be written ahead of its
    SETTINGS, nor the proxy's PING acknowledgement or its credit for a held request sent before the runtime spoke."""
    _connect, up, _hooks, _ = proxy
    up.preface_delay_seconds, up.initial_window_grant = 0.2, 1 << 20
    s = socket.socket(socket.AF_UNIX)
    s.connect(str(tmp_path / "px.sock"))
    block = hpack.Encoder().encode([(":method", "POST"), (":scheme", "http"), (":path", REWRITE),
                                    (":authority", "rt"), ("content-type", "application/grpc")])
    body = grpc_frame(b"q" * 1000)
    s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + raw_frame(4, 0, 0, b"") + raw_frame(6, 0, 0, b"pingpong")
              + raw_frame(1, 0x4, 1, block) + raw_frame(0, 0x1, 1, body))
    frames = read_frames(s, 1.0)
    s.close()
    assert frames and frames[0][:3] == (4, 0, 0), frames[:3]  # SETTINGS, not an acknowledgement
    assert (6, 1, 0, b"pingpong") in frames  # and the rest after it
    credit = sum(int.from_bytes(p, "big") for t, _f, sid, p in frames if t == 8 and sid == 0)
    assert 65535 - len(body) + credit == up.conns[0].conn.inbound_flow_control_window  # exact, as elsewhere
    assert up.received == [(REWRITE, b"q" * 1000 + b"R" * 1000)] and not up.errors
