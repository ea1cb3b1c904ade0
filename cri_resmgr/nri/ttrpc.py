"""ttrpc, the RPC protocol NRI speaks on each multiplexed connection (containerd/ttrpc ``channel.go``,
``request.go``, ``client.go``, ``server.go``).

A message is a 10-byte header — payload length (u32 BE), stream id (u32 BE), type (u8), flags (u8) — and the
payload. A unary call is one ``Request`` message (type 1) on a new stream, odd ids increasing from 1 on the
client side, answered by one ``Response`` (type 2) on the same stream. ``Request``/``Response`` are protobuf
(:mod:`.proto.ttrpc_pb2`); a response without a status is OK, a status carries a gRPC code and message.
"""

from __future__ import annotations

import heapq
import logging
import math
import struct
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from enum import IntEnum

from google.protobuf.message import DecodeError

from .proto import ttrpc_pb2
from .trace import HookTrace, HookTracer, TraceStart, phase_durations

log = logging.getLogger(__name__)

MESSAGE_HEADER = struct.Struct(">IIBB")  # length, stream id, type, flags
MAX_MESSAGE_BYTES = 4 << 20  # ttrpc's messageLengthMax


class MessageType(IntEnum):
    REQUEST = 1
    RESPONSE = 2
    DATA = 3


class Code(IntEnum):
    """gRPC status codes (google.rpc.Code), as ttrpc carries them."""

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16


class ProtocolError(Exception):
    """The peer broke the protocol; the connection must be closed."""


class RpcError(Exception):
    def __init__(self, code: Code, message: str):
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


@dataclass(frozen=True)
class Message:
    stream_id: int
    type: MessageType
    payload: bytes
    flags: int = 0

    def encode(self) -> bytes:
        if len(self.payload) > MAX_MESSAGE_BYTES:
            raise ValueError(f"ttrpc message of {len(self.payload)} bytes exceeds {MAX_MESSAGE_BYTES}")
        return MESSAGE_HEADER.pack(len(self.payload), self.stream_id, self.type, self.flags) + self.payload


class MessageDecoder:
    """Incremental: ``feed`` a connection's bytes in any split, get whole messages."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[Message]:
        self._buf += data
        buf = self._buf
        out: list[Message] = []
        pos = 0
        while len(buf) - pos >= MESSAGE_HEADER.size:
            length, sid, typ, flags = MESSAGE_HEADER.unpack_from(buf, pos)
            if length > MAX_MESSAGE_BYTES:
                raise ProtocolError(f"message of {length} bytes exceeds {MAX_MESSAGE_BYTES}")
            if len(buf) - pos - MESSAGE_HEADER.size < length:
                break
            start = pos + MESSAGE_HEADER.size
            try:
                mtype = MessageType(typ)
            except ValueError:
                raise ProtocolError(f"unknown message type {typ} on stream {sid}") from None
            out.append(Message(sid, mtype, bytes(buf[start:start + length]), flags))
            pos = start + length
        del buf[:pos]
        return out


def encode_request(service: str, method: str, payload: bytes, timeout_seconds: float | None) -> bytes:
    req = ttrpc_pb2.Request(service=service, method=method, payload=payload)
    if timeout_seconds:
        req.timeout_nano = int(timeout_seconds * 1e9)
    return req.SerializeToString()


def encode_response(payload: bytes = b"", code: Code = Code.OK, message: str = "") -> bytes:
    resp = ttrpc_pb2.Response(payload=payload)
    if code != Code.OK:
        resp.status.code, resp.status.message = int(code), message
    return resp.SerializeToString()


class Client:
    """Unary calls over one connection. ``send`` writes bytes to the connection; feed received bytes to
    :meth:`receive`. Thread-safe; calls wait for their own response only."""

    def __init__(self, send: Callable[[bytes], None]):
        self._send = send
        self._decoder = MessageDecoder()
        self._lock = threading.Lock()
        self._next_id = 1
        self._pending: dict[int, Future[bytes]] = {}
        self._closed: Exception | None = None

    def call(self, service: str, method: str, payload: bytes, timeout_seconds: float) -> bytes:
        fut: Future[bytes] = Future()
        with self._lock:
            if self._closed is not None:
                raise RpcError(Code.UNAVAILABLE, f"connection closed: {self._closed}")
            sid = self._next_id
            self._next_id += 2
            self._pending[sid] = fut
        try:
            self._send(Message(sid, MessageType.REQUEST,
                               encode_request(service, method, payload, timeout_seconds)).encode())
            try:
                return fut.result(timeout_seconds)
            except FutureTimeout:
                raise RpcError(Code.DEADLINE_EXCEEDED, f"{service}/{method}: no answer in {timeout_seconds}s") \
                    from None
        except OSError as e:
            raise RpcError(Code.UNAVAILABLE, f"{service}/{method}: {e}") from e
        finally:
            with self._lock:
                self._pending.pop(sid, None)

    def receive(self, data: bytes) -> None:
        for m in self._decoder.feed(data):
            if m.type != MessageType.RESPONSE:
                raise ProtocolError(f"client got a {m.type.name} message on stream {m.stream_id}")
            with self._lock:
                fut = self._pending.pop(m.stream_id, None)
            if fut is None:
                continue  # the caller gave up (timeout)
            try:
                resp = ttrpc_pb2.Response.FromString(m.payload)
            except DecodeError as e:
                fut.set_exception(RpcError(Code.INTERNAL, f"undecodable response: {e}"))
                continue
            if resp.HasField("status") and resp.status.code != Code.OK:
                try:
                    code = Code(resp.status.code)
                except ValueError:
                    code = Code.UNKNOWN
                fut.set_exception(RpcError(code, resp.status.message))
            else:
                fut.set_result(resp.payload)

    def close(self, why: Exception | None = None) -> None:
        with self._lock:
            self._closed = why or ConnectionError("closed")
            pending, self._pending = self._pending, {}
        for fut in pending.values():
            fut.set_exception(RpcError(Code.UNAVAILABLE, f"connection closed: {self._closed}"))


class Call:
    """What a handler knows about the call it serves, and who answers it.

    A fail-open handler calls :meth:`commit` just before it changes state it would have to undo: True means its
    answer will be sent; False means the deadline passed and the runtime already got the fail-open answer, so
    the handler must leave everything as it was."""

    def __init__(self, method: str, deadline: float):
        self.method = method
        self.event = method  # what metrics call it; a handler may name it more precisely (StateChange's event)
        self.deadline = deadline  # time.monotonic() by which the answer must be sent
        self._lock = threading.Lock()
        self._owner = ""  # "", "handler" or "timeout"
        self._after: list[Callable[[], None]] = []
        self.marks: list[tuple[str, float]] = []  # (phase, time.monotonic() it ended): a slow hook's log line

    def mark(self, phase: str) -> None:
        """``phase`` of the handler ends now (see :mod:`.trace`)."""
        self.marks.append((phase, time.monotonic()))

    def after(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` once the answer is sent (or the handler is done, when the watchdog answered): work the caller
        need not wait for, such as waking threads that would otherwise compete with the answer for the interpreter."""
        self._after.append(fn)

    def run_after(self) -> None:
        while self._after:
            try:
                self._after.pop(0)()
            except Exception:  # the answer is out: nothing to fail open to
                log.exception("after %s", self.method)

    @property
    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def _claim(self, who: str) -> bool:
        with self._lock:
            if not self._owner:
                self._owner = who
            return self._owner == who

    def commit(self) -> bool:
        return self._claim("handler")

    @property
    def committed(self) -> bool:
        return self._owner == "handler"  # once set, never changes

    def expire(self) -> bool:
        """The deadline passed: True when the fail-open answer is to be sent (the handler had not committed)."""
        return self._claim("timeout")


Handler = Callable[[bytes, Call], bytes]


@dataclass(frozen=True)
class Method:
    handler: Handler
    fail_open: bytes | None = None  # sent (status OK) when the handler fails or is late; None: send the error
    # Run on the connection's reader thread (one thread hop less per call). Only for handlers that never wait
    # for anything the reader itself must deliver (a response on another connection of the same socket).
    inline: bool = False


class _Watchdog:
    """One thread for all calls of a server: at a call's deadline, unless its handler has committed, the
    fail-open answer goes out (``on_expire``). Handlers run on the executor, never on this thread.

    Kept off the hook path: a new call wakes the thread only when its deadline comes before the thread's next
    wake-up anyway, and each wake-up drops every committed call at the head of the queue at once. With nothing to
    watch, the thread still wakes every ``period`` (no longer than any call's budget) for ``linger`` seconds
    after the last call, so that the next call's deadline is already covered and needs no wake-up: a thread woken
    during a hook takes the interpreter from it (issue 15). After that it sleeps until a call comes."""

    def __init__(self, on_expire: Callable[[Call, int, float], None], period: float, linger: float = 10.0):
        self.on_expire = on_expire
        self.period = period
        self.linger = linger
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, int, Call, float]] = []  # deadline, seq (ties), stream, call, start
        self._seq = 0
        self._closed = False
        self._thread: threading.Thread | None = None
        self._wake_at = -math.inf  # the thread's next wake-up while it sleeps (inf: when notified only)
        self._last_watch = -math.inf
        self.notified = 0  # wake-ups a new call caused (tests)

    def watch(self, call: Call, sid: int, t0: float) -> None:
        with self._cond:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="ttrpc-watchdog", daemon=True)
                self._thread.start()
            self._seq += 1
            heapq.heappush(self._heap, (call.deadline, self._seq, sid, call, t0))
            self._last_watch = t0
            if call.deadline < self._wake_at:  # the thread sleeps past this deadline: wake it
                self.notified += 1
                self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while True:
                    while self._heap and self._heap[0][3].committed:  # answered: nothing to watch
                        heapq.heappop(self._heap)
                    now = time.monotonic()
                    if self._closed or (self._heap and self._heap[0][0] <= now):
                        break
                    if self._heap:
                        timeout: float | None = self._heap[0][0] - now
                    else:
                        timeout = self.period if now - self._last_watch < self.linger else None
                    self._wake_at = math.inf if timeout is None else now + timeout
                    self._cond.wait(timeout)
                    self._wake_at = -math.inf  # awake: it looks at the queue before it sleeps again
                if self._closed:
                    return
                _, _, sid, call, t0 = heapq.heappop(self._heap)
            if call.expire():
                self.on_expire(call, sid, t0)


class Server:
    """Serves one connection: each request's handler runs in ``executor`` and its answer is sent when the
    handler returns. For methods with ``fail_open``, a watchdog sends the fail-open answer at the deadline
    instead if the handler has not committed by then (``budget_seconds``, shortened to ``margin`` of the
    caller's own timeout when that is shorter); handler failures other than :class:`RpcError` are answered
    with the fail-open answer too.

    ``observe(method, result, seconds)`` is called once per request: result is ``ok``, ``error``,
    ``timeout`` or ``unimplemented``. With a ``tracer``, ``on_trace`` gets where each answered request's time
    went (:class:`~.trace.HookTrace`), once the answer is sent."""

    def __init__(self, send: Callable[[bytes], None], methods: dict[str, Method], executor: Executor,
                 budget_seconds: float, observe: Callable[[str, str, float], None] | None = None,
                 margin: float = 0.75, tracer: HookTracer | None = None,
                 on_trace: Callable[[HookTrace], None] | None = None):
        self._send = send
        self.methods = methods
        self.executor = executor
        self.budget_seconds = budget_seconds
        self.margin = margin
        self.observe = observe or (lambda m, r, s: None)
        self.tracer = tracer
        self.on_trace = on_trace or (lambda t: None)
        self._decoder = MessageDecoder()
        self._fail_open: dict[int, bytes] = {}  # id(call) -> the answer the watchdog sends
        self._watchdog = _Watchdog(self._expired, period=budget_seconds)

    def close(self) -> None:
        self._watchdog.close()

    def receive(self, data: bytes) -> None:
        for m in self._decoder.feed(data):
            if m.type != MessageType.REQUEST:
                raise ProtocolError(f"server got a {m.type.name} message on stream {m.stream_id}")
            t0 = time.monotonic()
            start = self.tracer.begin() if self.tracer is not None else None
            try:
                req = ttrpc_pb2.Request.FromString(m.payload)
            except DecodeError as e:
                self._reply(m.stream_id, encode_response(code=Code.INVALID_ARGUMENT, message=str(e)))
                continue
            name = f"{req.service}/{req.method}"
            method = self.methods.get(name)
            if method is None:
                self.observe(req.method, "unimplemented", time.monotonic() - t0)
                self._reply(m.stream_id, encode_response(code=Code.UNIMPLEMENTED, message=f"{name} not served"))
                continue
            budget = self.budget_seconds
            if req.timeout_nano > 0:
                budget = min(budget, req.timeout_nano / 1e9 * self.margin)
            call = Call(req.method, t0 + budget)
            call.mark("ttrpc")
            if method.fail_open is not None:
                self._fail_open[id(call)] = method.fail_open
                self._watchdog.watch(call, m.stream_id, t0)
            if method.inline:
                self._serve(m.stream_id, method, req.payload, call, t0, start)
            else:
                self.executor.submit(self._serve, m.stream_id, method, req.payload, call, t0)

    def _expired(self, call: Call, sid: int, t0: float) -> None:
        log.warning("NRI %s not done in %.3fs; letting it through unchanged", call.method, call.deadline - t0)
        seconds = time.monotonic() - t0
        self.observe(call.event, "timeout", seconds)
        self._reply(sid, encode_response(self._fail_open.pop(id(call), b"")))
        log.debug("request %s %s %.6fs", call.event, "timeout", seconds)

    def _serve(self, sid: int, method: Method, payload: bytes, call: Call, t0: float,
               start: TraceStart | None = None) -> None:
        if self.tracer is not None and start is None:  # on an executor thread: its own clocks from here
            call.mark("queued")
            start = self.tracer.begin()
        try:
            answer = method.handler(payload, call)
            call.mark("handler")
            out, result = encode_response(answer), "ok"
            call.mark("encode")
        except RpcError as e:  # a deliberate refusal (e.g. no CPUs left): answered as such
            out, result = encode_response(code=e.code, message=e.message), "error"
        except Exception as e:  # a failing handler: fail open where the method can, else an error status
            if method.fail_open is not None:
                log.exception("NRI %s failed; letting it through unchanged", call.method)
                out = encode_response(method.fail_open)
            else:
                log.exception("ttrpc handler %s failed", call.method)
                out = encode_response(code=Code.INTERNAL, message=str(e))
            result = "error"
        if method.fail_open is not None and not call.commit():
            call.run_after()
            return  # the watchdog answered at the deadline
        self._fail_open.pop(id(call), None)
        trace = None if start is None or self.tracer is None else \
            self.tracer.end(start, call.event, result, t0, time.monotonic(), phase_durations(t0, call.marks))
        seconds = time.monotonic() - t0  # the tracer's own cost included
        self.observe(call.event, result, seconds)  # recorded before the peer can see the answer
        self._reply(sid, out)
        log.debug("request %s %s %.6fs", call.event, result, seconds)  # after the answer (bench/nri_bench.py)
        if trace is not None:
            self.on_trace(trace)
        call.run_after()

    def _reply(self, sid: int, payload: bytes) -> None:
        try:
            self._send(Message(sid, MessageType.RESPONSE, payload).encode())
        except OSError as e:
            log.debug("cannot answer stream %d: %s", sid, e)
