"""A gRPC-aware HTTP/2 proxy that forwards frames as they are and looks only at what it must.

Why not a gRPC server and a gRPC client back to back: in Python that costs a request decode and encode,
two thread hand-offs and a second call per request (measured ~0.6 ms added at p50 here). Instead every
client connection is paired with its own connection to the runtime and frames are copied through
unchanged (RFC 9113), so metadata, deadlines (``grpc-timeout``), status codes, unknown protobuf fields and
server-streaming calls pass exactly as the runtime sends them.

What the proxy does look at:

- header blocks in both directions are decoded (HPACK, RFC 7541) to learn each stream's ``:path`` and its
  ``grpc-status``. Blocks are forwarded byte for byte and in order, so both ends' HPACK dynamic tables
  stay in step; the proxy's own header blocks (the responses it answers itself) use only "literal never
  indexed" fields (RFC 7541 §6.2.3), which leave every dynamic table untouched;
- for methods the relay owns, the request message is held until it is complete, handed to a hook (on the
  event loop when the hook says it can answer there at once, else in a worker thread) which may rewrite or
  refuse it; the response message is copied as it passes;
- flow control (RFC 9113 §6.9) stays exact around held requests: the proxy credits the client for the
  bytes it holds (so a request larger than the window cannot stall), takes the bytes it later sends to the
  runtime out of the runtime's next connection WINDOW_UPDATEs to the client, and tracks the runtime's
  connection and stream windows itself, queueing DATA that does not fit until the runtime opens them;
- connection-level credit for the client (the runtime's WINDOW_UPDATEs on stream 0, less what the proxy already
  gave; the proxy's own for DATA it holds or drops) is not written as it comes: grpc-go grants a request's bytes
  back as soon as they arrive, while it works on the call, and passed on that grant woke the client for nothing
  once a call. The proxy tracks the client's connection send window (65,535 at the start, SETTINGS do not change
  it; less each DATA payload the client sends, padding included; more each connection WINDOW_UPDATE the proxy
  writes to it) and sends the credit owed with the next bytes it writes to the client (normally the answer:
  one WINDOW_UPDATE frame in the answer's write); at once, after the read that brought it, when holding it would
  leave the client less than half the initial window (``CLIENT_WINDOW_FLOOR``: two frames of the default maximum
  size, so a client can always send) or less than the credit held; at the latest after ``window_hold_seconds``
  (0.1 s; a backstop, cancelled when the credit goes). A client with a request larger than its window gets the
  credit as soon as its first bytes are read, never after the timer, and calls that hang hold up nobody's DATA;
- stream-level WINDOW_UPDATEs for a stream the client has ended (END_STREAM sent) are dropped, the runtime's and
  the proxy's own for held DATA alike (at most one a stream and read, sent once the read is parsed): the client
  sends no more DATA on it. A stream still open (a streaming call, a request still coming) gets them at once;
- nothing the proxy makes itself (PING acknowledgements, credit, refusals) reaches the client before the runtime's
  SETTINGS, its connection preface (RFC 9113 §3.4): until then it waits, and goes right after them;
- PING (RFC 9113 §6.7) is answered by the proxy itself on each connection, hop by hop, and not passed on: the
  runtime's flow-control probes (grpc-go sends one as a request's DATA arrives) and the client's otherwise cost
  a round trip through the proxy each, two more wake-ups of the proxy, the client and the runtime while the
  runtime works on the call (measured: about one per CRI call, both ways). Both ends then time the hop to
  the proxy; a peer that pings without reading the answers stops being read (below);
- the end of a call is sent to the client first; the completion hook (the books' work), metrics and timing
  run right after, in the same event-loop callback (so before anything else the client sends is read).

A held request is timed point by point (:class:`RewriteTiming`; the control socket's ``Timings`` call), so that
a benchmark can tell where its added time goes.

What the proxy bounds (so that no peer can make it hold memory without limit):

- what it writes to the client (answers, its own PING acknowledgements, window updates): while more than the
  transport's high-water mark waits for the client to read it, the proxy reads nothing more from the client
  (nor from the runtime for it), so a client that sends without reading stalls only itself;

- a header block (HEADERS + CONTINUATION frames, RFC 9113 §6.10) is at most ``max_header_block`` bytes
  (default 16 MiB, grpc-go's default header list limit, which containerd keeps). A block cannot be cut short
  without breaking the HPACK state of both ends, so beyond the limit the connection ends: GOAWAY
  ENHANCE_YOUR_CALM (RFC 9113 §7) to the client, which reconnects; the relay goes on;
- a held request message is at most ``max_held_message`` bytes (default 16 MiB, the runtime's own receive
  limit): beyond it the client gets RESOURCE_EXHAUSTED and RST_STREAM, the runtime RST_STREAM CANCEL, and
  the rest of that stream's DATA is dropped (its window credited back).

The gRPC wire format (length-prefixed messages; status in trailers) is in grpc/doc/PROTOCOL-HTTP2.md.
"""

from __future__ import annotations

import asyncio
import logging
import struct
import time
import urllib.parse
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field
from enum import Enum
from typing import cast

import grpc
import hpack
from hpack.table import HeaderTable

log = logging.getLogger(__name__)

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)
F_END_STREAM, F_ACK, F_END_HEADERS, F_PADDED, F_PRIORITY = 0x1, 0x1, 0x4, 0x8, 0x20
SETTINGS_HEADER_TABLE_SIZE, SETTINGS_INITIAL_WINDOW_SIZE = 0x1, 0x4
DEFAULT_WINDOW = 65535  # initial connection and stream window (RFC 9113 §6.9.2)
MAX_FRAME_PAYLOAD = 16384  # SETTINGS_MAX_FRAME_SIZE's initial value: every peer accepts it (RFC 9113 §6.5.2)
# HTTP/2 error codes (RFC 9113 §7)
H2_NO_ERROR, H2_CANCEL, H2_ENHANCE_YOUR_CALM = 0x0, 0x8, 0xB
MAX_HEADER_BLOCK = 16 << 20  # grpc-go's default max header list size (containerd keeps it)
MAX_HELD_MESSAGE = (16 << 20) + 5  # containerd's default max receive message size, plus the gRPC prefix
# Connection credit owed to the client is held back only while the client keeps at least this much connection window
# (and at least as much as is held): two frames of the default maximum size (RFC 9113 §6.5.2), so a client can always
# send and never waits on held credit; a request larger than its window has the credit sent as its first bytes are read.
CLIENT_WINDOW_FLOOR = DEFAULT_WINDOW // 2
# ... and at the latest this long. A backstop only (the floor already keeps the client sending): a wake-up of the
# client costs ~0.05 ms, 0.05 % of a call as long as this, while CRI calls of a pod lifecycle take ~5-50 ms, whose
# credit this lets ride on the answer (a timer of a few ms would fire during most of them and save nothing).
WINDOW_HOLD_SECONDS = 0.1


def status(code: grpc.StatusCode) -> int:
    """The wire number of a gRPC status code (grpc/doc/statuscodes.md)."""
    return int(code.value[0])


_CODE_NAMES = {status(c): c.name for c in grpc.StatusCode}
S = grpc.StatusCode
# RST_STREAM error codes as gRPC clients map them (PROTOCOL-HTTP2.md, "Errors")
_RST_TO_GRPC = {0x0: S.INTERNAL, 0x1: S.INTERNAL, 0x2: S.INTERNAL, 0x3: S.INTERNAL, 0x7: S.UNAVAILABLE,
                0x8: S.CANCELLED, 0xB: S.RESOURCE_EXHAUSTED, 0xC: S.PERMISSION_DENIED}


def code_name(code: int) -> str:
    return _CODE_NAMES.get(code, str(code))


class Mode(Enum):
    PASS = 0  # forward, count
    OBSERVE = 1  # forward, copy request and response messages for the completion hook
    REWRITE = 2  # hold the request until the rewrite hook has answered


@dataclass
class Reject:
    """A rewrite hook's refusal: the client gets this status; the runtime never sees the request."""

    code: int
    message: str


@dataclass
class Exchange:
    """One call as the hooks see it."""

    method: str
    stream_id: int
    started: float  # perf_counter
    request: bytes = b""  # the first request message (gRPC framing removed), once complete
    response: bytes = b""  # the first response message
    code: int | None = None
    message: str = ""
    context: object = None  # set by the rewrite hook, handed back to the completion hook
    rewritten: bool = False
    timing: RewriteTiming | None = None  # a held or observed request: where its time in the relay went


@dataclass
class RewriteTiming:
    """Where a held request's time in the relay goes: ``time.perf_counter()`` instants (CLOCK_MONOTONIC on
    Linux, so a benchmark in another process can set them against its own), 0.0 for a point not reached.

    The socket read that brought the client's request HEADERS began (``arrived``); those HEADERS parsed
    (``headers``, HPACK-decoded), the request's first DATA frame (``first_data``); the message
    complete and handed to the hook (``held``); the hook starts (in a worker: when one takes it; on the event
    loop: at once) and returns; the result's last bytes handed to the runtime's socket (``forwarded``; what the
    socket did not take at once and asyncio buffered: ``upstream_buffered`` bytes); the runtime's response
    HEADERS and its trailers parsed; the completion hook returned; the call's end handed to the client's socket
    (``answered``). ``reads``: socket reads (``data_received``) from the client's HEADERS to the message's end.
    An observed request (no hook) has ``held`` when its last DATA frame was parsed, no ``started``/``returned``,
    and ``forwarded`` when that frame was handed to the runtime's socket."""

    arrived: float = 0.0
    headers: float = 0.0
    first_data: float = 0.0
    held: float = 0.0
    started: float = 0.0
    returned: float = 0.0
    forwarded: float = 0.0
    upstream_buffered: int = 0
    response: float = 0.0
    response_end: float = 0.0
    completed: float = 0.0
    answered: float = 0.0
    reads: int = 0


class InWorker:
    """:meth:`Hooks.rewrite_inline`'s answer: this one takes :meth:`Hooks.rewrite` in a worker thread."""

    def __repr__(self) -> str:
        return "IN_WORKER"


IN_WORKER = InWorker()


class Hooks:
    """What the relay plugs into the proxy. The default forwards everything and records nothing."""

    def mode(self, method: str) -> Mode:
        return Mode.PASS

    def rewrite(self, ex: Exchange) -> bytes | Reject | None:
        """Worker thread. Return the new request message, a Reject, or None to forward unchanged."""
        return None

    def rewrite_inline(self, ex: Exchange) -> bytes | Reject | None | InWorker:
        """Event loop, first: a rewrite that is short and cannot wait on anything slow (no runtime call, no
        waiting for other calls) answers here, which spares it two thread hand-offs (to a worker and back:
        each a wake-up and a GIL hand-over); anything else returns IN_WORKER and :meth:`rewrite` runs in a
        worker thread."""
        return IN_WORKER

    def complete(self, ex: Exchange) -> None:
        """Event-loop thread, once the call's end has been handed to the client's socket. Keep it short."""

    def finished(self, method: str, code: int, seconds: float) -> None:
        """Every call, for metrics."""

    def rewrite_timed(self, ex: Exchange) -> None:
        """A held or observed request's call ended and its end was handed to the client's socket: ``ex.timing``
        holds what it passed through."""

    def dump(self, direction: str, ex: Exchange, message: bytes) -> None:
        """Only called when ``dumping`` is true."""

    dumping: bool = False


def frame(ftype: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    head = len(payload).to_bytes(3, "big") + bytes((ftype, flags)) + (stream_id & 0x7FFFFFFF).to_bytes(4, "big")
    return head + payload


def _hpack_int(value: int, prefix_bits: int, first: int) -> bytes:
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes((first | value,))
    out = bytearray((first | limit,))
    value -= limit
    while value >= 128:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def encode_never_indexed(headers: list[tuple[bytes, bytes]]) -> bytes:
    """HPACK block of "literal header field never indexed, new name" fields (RFC 7541 §6.2.3):
    decodable by any peer and touching no dynamic table."""
    out = bytearray()
    for name, value in headers:
        out += b"\x10" + _hpack_int(len(name), 7, 0) + name + _hpack_int(len(value), 7, 0) + value
    return bytes(out)


def trailers_only(stream_id: int, code: int, message: str) -> bytes:
    """A complete gRPC error response on one stream (PROTOCOL-HTTP2.md "Trailers-Only")."""
    msg = urllib.parse.quote(message, safe=" !\"#$&'()*+,-./:;<=>?@[\\]^_`{|}~").encode()
    block = encode_never_indexed([(b":status", b"200"), (b"content-type", b"application/grpc"),
                                  (b"grpc-status", str(code).encode()), (b"grpc-message", msg)])
    return frame(HEADERS, F_END_HEADERS | F_END_STREAM, stream_id, block)


def grpc_message(payload: bytes) -> bytes | None:
    """The first length-prefixed message in ``payload``, or None when it is incomplete or compressed."""
    if len(payload) < 5 or payload[0] != 0:
        return None
    n = int.from_bytes(payload[1:5], "big")
    if len(payload) < 5 + n:
        return None
    return payload[5:5 + n]


def data_frames(stream_id: int, message: bytes) -> tuple[bytes, int]:
    """``message`` as gRPC-framed DATA frames ending the stream; returns (bytes, flow-controlled payload size)."""
    body = b"\x00" + len(message).to_bytes(4, "big") + message
    out = []
    for i in range(0, max(len(body), 1), MAX_FRAME_PAYLOAD):
        chunk = body[i:i + MAX_FRAME_PAYLOAD]
        last = i + MAX_FRAME_PAYLOAD >= len(body)
        out.append(frame(DATA, F_END_STREAM if last else 0, stream_id, chunk))
    return b"".join(out), len(body)


def _fragment(ftype: int, flags: int, payload: bytes) -> bytes:
    """The header block fragment of a HEADERS/CONTINUATION payload, without padding and priority."""
    if ftype == CONTINUATION:
        return payload
    start, end = 0, len(payload)
    if flags & F_PADDED:
        start, end = 1, len(payload) - payload[0]
    if flags & F_PRIORITY:
        start += 5
    return payload[start:end]


def _data_body(flags: int, payload: bytes) -> bytes:
    if flags & F_PADDED:
        return payload[1:len(payload) - payload[0]]
    return payload


_STATIC = HeaderTable.STATIC_TABLE  # RFC 7541 Appendix A: index 1 is _STATIC[0]
_STATIC_ENTRIES = len(_STATIC)


def decode_block(decoder: hpack.Decoder, block: bytes) -> list[tuple[bytes, bytes]]:
    """Decode a header block. Fast path: when every byte is a one-byte "indexed header field"
    (RFC 7541 §6.1: high bit set, index 1-126), the block only reads the tables and changes nothing, so
    plain lookups give the same result as the full decoder. Repeated gRPC calls send exactly such blocks
    once their headers are in the dynamic table."""
    if block and min(block) > 0x80 and max(block) < 0xFF:
        dynamic = decoder.header_table.dynamic_entries
        if max(block) & 0x7F <= _STATIC_ENTRIES + len(dynamic):  # else the decoder names the bad index
            return [_STATIC[i] if i < _STATIC_ENTRIES else dynamic[i - _STATIC_ENTRIES]
                    for i in [(b & 0x7F) - 1 for b in block]]
    return [(bytes(k), bytes(v)) for k, v in decoder.decode(block, raw=True)]


# A frame's 9-byte header (RFC 9113 §4.1): 24-bit length (as 16 + 8 bits), type, flags, R bit + 31-bit stream id.
_frame_head = struct.Struct(">HBBBI").unpack_from


def _setting(payload: bytes, wanted: int) -> int | None:
    value = None
    for i in range(0, len(payload) - 5, 6):
        ident, v = struct.unpack_from(">HI", payload, i)
        if ident == wanted:
            value = v
    return value


@dataclass
class _Stream:
    ex: Exchange
    mode: Mode
    req: bytearray = field(default_factory=bytearray)
    resp: bytearray = field(default_factory=bytearray)
    held: list[bytes] = field(default_factory=list)  # REWRITE: DATA payloads waiting for the hook
    held_size: int = 0
    req_done: bool = False
    closed: bool = False
    seen_response_headers: bool = False
    client_ended: bool = False  # the client sent END_STREAM: a window update for this stream is of no use to it


class _Direction:
    """Frame parser for one direction; keeps the HPACK decoder for the blocks flowing that way."""

    def __init__(self, expect_preface: bool):
        self.buf = bytearray()
        self.preface_left = len(PREFACE) if expect_preface else 0
        self.decoder = hpack.Decoder()
        self.decoder.max_header_list_size = 1 << 24
        self.block: list[bytes] = []  # frames of a header block still waiting for END_HEADERS
        self.block_fragments: list[bytes] = []
        self.block_stream = 0
        self.block_end_stream = False
        self.block_size = 0


class Pair:
    """One client connection and its runtime connection."""

    def __init__(self, proxy: Proxy, client: asyncio.Transport):
        self.proxy = proxy
        self.hooks = proxy.hooks
        self.client = client
        self.upstream: asyncio.Transport | None = None
        self.c2s = _Direction(expect_preface=True)
        self.s2c = _Direction(expect_preface=False)
        self.streams: dict[int, _Stream] = {}
        self.debt = 0  # bytes to take out of the runtime's next connection WINDOW_UPDATEs
        # The runtime's receive windows as the proxy has used them (what it may still send upstream).
        self.up_conn = DEFAULT_WINDOW
        self.up_initial = DEFAULT_WINDOW
        self.up_streams: dict[int, int] = {}
        self.blocked: deque[tuple[int, bytes, int]] = deque()  # (stream, DATA frame, payload size)
        self.closed = False
        self.dropped: set[int] = set()  # streams reset by the proxy: the client's further DATA is dropped
        # While a direction's input is being parsed, bytes for that direction's peer are appended here so
        # that they keep their place after frames already parsed (a stream's DATA never before its HEADERS).
        self._c2s_out: list[bytes] | None = None
        self._s2c_out: list[bytes] | None = None
        # While the client's input is parsed, what goes back to the client waits here: it is written once, after
        # the runtime's bytes, which are on the critical path (one write instead of one per frame, each waking the
        # client).
        self._c2s_back: list[bytes] | None = None
        # The client's connection send window as the proxy has it (RFC 9113 §6.9: 65,535 at the start, whatever
        # SETTINGS_INITIAL_WINDOW_SIZE says; less every DATA payload the client sends, padding included; more every
        # connection WINDOW_UPDATE written to it), and the connection credit owed to it and not yet written: the
        # runtime's grants (less the debt) and the proxy's own for DATA it holds or drops. The credit goes with the
        # next bytes written to the client, at once when its window runs low, at the latest when the timer fires.
        self.client_window = DEFAULT_WINDOW
        self._client_credit = 0
        # Stream credit for held DATA, per stream, while the client's input is parsed: one WINDOW_UPDATE a stream
        # and read, none for a stream the client ended meanwhile (it sends nothing more on it).
        self._stream_credit: dict[int, int] = {}
        self._credit_timer: asyncio.TimerHandle | None = None
        # The runtime's connection preface (its SETTINGS, RFC 9113 §3.4) must be the first frame the client gets:
        # what the proxy makes itself before that (PING acknowledgements, credit, refusals) waits in _early.
        self._preface_out = False
        self._early: list[bytes] = []
        # Calls that ended while the runtime's input was parsed: their completion (hooks, metrics) runs once the
        # client has been sent what was parsed, so that the books' work is not on the answer's path.
        self._ended: list[_Stream] = []
        # Timed held requests whose bytes wait in the lists above: stamped once the lists went to the sockets.
        self._forward_stamps: list[RewriteTiming] = []
        self._client_holds: set[str] = set()  # why the client is not read from: "client" or "runtime" not reading
        self.reads = 0  # data_received calls from the client (RewriteTiming.reads)
        self.read_at = 0.0  # when the latest began (RewriteTiming.arrived)

    def hold_client(self, why: str, held: bool) -> None:
        """Stop reading the client while any reason holds (each side's write buffer over its high-water mark)."""
        before = bool(self._client_holds)
        if held:
            self._client_holds.add(why)
        else:
            self._client_holds.discard(why)
        if before != bool(self._client_holds) and not self.closed:
            (self.client.pause_reading if self._client_holds else self.client.resume_reading)()

    # -- client -> runtime --------------------------------------------------------------------------
    def from_client(self, data: bytes) -> None:
        self.reads += 1
        self.read_at = time.perf_counter()
        d = self.c2s
        d.buf += data
        out: list[bytes] = []
        self._c2s_out = out
        back: list[bytes] = []
        self._c2s_back = back
        buf = d.buf
        pos = 0
        # Frames forwarded as they are stay in ``buf`` and go out as one slice, buf[run:pos]; a frame handled
        # otherwise first puts the run before it into ``out`` (order kept), and the run starts after it.
        run = 0
        if d.preface_left:
            take = min(d.preface_left, len(buf))
            d.preface_left -= take
            pos = take
        n = len(buf)
        while n - pos >= 9:
            hi, lo, ftype, flags, sid = _frame_head(buf, pos)
            length = hi << 8 | lo
            end = pos + 9 + length
            if end > n:
                break
            sid &= 0x7FFFFFFF
            if ftype == DATA:
                self.client_window -= length
                st = self.streams.get(sid)
                if st is not None and flags & F_END_STREAM:
                    st.client_ended = True
                if st is None and sid in self.dropped:
                    if pos > run:
                        out.append(bytes(buf[run:pos]))
                    run = end
                    self._client_credit += length  # never forwarded: the client's window gets the bytes back
                    if flags & F_END_STREAM:
                        self.dropped.discard(sid)
                elif st is not None and st.mode is Mode.REWRITE and not st.req_done:
                    if pos > run:
                        out.append(bytes(buf[run:pos]))
                    run = end
                    # Held bytes never reach the runtime as such: the proxy gives the client its window back.
                    self._client_credit += length
                    st.held_size += length
                    if st.held_size > self.proxy.max_held_message:
                        self._reset_held(st, flags & F_END_STREAM == 0)
                        pos = end
                        continue
                    st.held.append(_data_body(flags, bytes(buf[pos + 9:end])))
                    if st.ex.timing is not None and not st.ex.timing.first_data:
                        st.ex.timing.first_data = time.perf_counter()
                    if length and not flags & F_END_STREAM:  # and the stream's: sent once this read is parsed
                        self._stream_credit[sid] = self._stream_credit.get(sid, 0) + length
                    if flags & F_END_STREAM:
                        st.req_done = True
                        self._submit_rewrite(st)
                else:
                    if st is not None and (st.mode is not Mode.PASS or self.hooks.dumping):
                        st.req += _data_body(flags, bytes(buf[pos + 9:end]))
                        if flags & F_END_STREAM:
                            st.req_done = True
                            if st.ex.timing is not None:  # an observed request: forwarded with this read's frames
                                st.ex.timing.held = time.perf_counter()
                                self._forward_stamps.append(st.ex.timing)
                    w = self.up_streams.get(sid, self.up_initial)
                    if self.blocked or length > self.up_conn or length > w:  # may have to wait: _send_data
                        if pos > run:
                            out.append(bytes(buf[run:pos]))
                        run = end
                        self._send_data(sid, bytes(buf[pos:end]), length)
                    else:  # within the runtime's windows: it stays in the run (as _send_data would send it)
                        self.up_conn -= length
                        if sid in self.up_streams:
                            self.up_streams[sid] = w - length
            elif ftype == HEADERS and flags & F_END_HEADERS and sid not in self.streams and not d.block:
                # The usual case, a new call's whole header block in one frame: it stays in the run.
                self._request_headers(sid, decode_block(d.decoder, _fragment(ftype, flags, bytes(buf[pos + 9:end]))),
                                      bool(flags & F_END_STREAM))
            elif ftype in (HEADERS, CONTINUATION):
                if pos > run:
                    out.append(bytes(buf[run:pos]))
                run = end
                if not self._header_frame(d, ftype, flags, sid, bytes(buf[pos:end]), out, self._request_headers):
                    self._c2s_out, self._forward_stamps = None, []
                    self._flush_back()
                    self._goaway_client("request header block larger than "
                                        f"{self.proxy.max_header_block} bytes")
                    return
            elif ftype == PING and not flags & F_ACK and length == 8 and not sid:
                if pos > run:
                    out.append(bytes(buf[run:pos]))
                run = end
                back.append(frame(PING, F_ACK, 0, bytes(buf[pos + 9:end])))  # answered here (module doc)
            elif ftype == RST_STREAM:  # forwarded in the run; what it ends writes only to the client
                self._drop_blocked(sid)
                st = self.streams.get(sid)
                if st is not None:
                    st.held = []
                    self._finish(st, status(S.CANCELLED), "cancelled by the client")
            elif ftype == SETTINGS and not flags & F_ACK:
                size = _setting(bytes(buf[pos + 9:end]), SETTINGS_HEADER_TABLE_SIZE)
                if size is not None:
                    # The client's decoder limit bounds the runtime's encoder: our s2c decoder follows.
                    self.s2c.decoder.max_allowed_table_size = size
            pos = end
        if pos > run:
            out.append(bytes(buf[run:pos]))
        del buf[:pos]
        self._c2s_out = None
        if out:
            self._to_upstream(b"".join(out))
        if self._forward_stamps:
            self._stamp_forwarded()
        self._flush_back()

    def _flush_back(self) -> None:
        """Write what the client's input parsed so far owes the client (see ``_c2s_back``); connection credit goes
        with it, or waits (:meth:`_settle_credit`)."""
        back, self._c2s_back = self._c2s_back, None
        if back is None:
            return
        if self._stream_credit:
            for sid, n in self._stream_credit.items():
                st = self.streams.get(sid)
                if st is not None and not st.client_ended:
                    back.append(frame(WINDOW_UPDATE, 0, sid, n.to_bytes(4, "big")))
            self._stream_credit.clear()
        if back:
            self._to_client(b"".join(back))
        self._settle_credit()

    def _settle_credit(self) -> None:
        """After a read's frames went out: connection credit still owed to the client is written now if holding it
        would leave the client's window below ``CLIENT_WINDOW_FLOOR`` or below the credit itself, else it waits for
        the next bytes to the client (normally the answer: one write and one wake-up of the client fewer per call,
        the runtime's grant for the request riding on it), at the latest ``window_hold_seconds``."""
        owed = self._client_credit
        if not owed or self.closed or not self._preface_out:  # else it goes after the preface (from_upstream)
            return
        if self.client_window < max(CLIENT_WINDOW_FLOOR, owed):
            self.client.write(self._credit_frame())
        elif self._credit_timer is None:
            self._credit_timer = self.proxy.loop.call_later(self.proxy.window_hold_seconds, self._credit_due)

    def _credit_due(self) -> None:
        self._credit_timer = None
        if self._client_credit and not self.closed:
            self.client.write(self._credit_frame())

    def _credit_frame(self) -> bytes:
        """The connection WINDOW_UPDATE for all credit owed to the client, now counted as written."""
        owed, self._client_credit = self._client_credit, 0
        self.client_window += owed
        self._cancel_credit_timer()
        return frame(WINDOW_UPDATE, 0, 0, owed.to_bytes(4, "big"))

    def _cancel_credit_timer(self) -> None:
        if self._credit_timer is not None:
            self._credit_timer.cancel()
            self._credit_timer = None

    def _header_frame(self, d: _Direction, ftype: int, flags: int, sid: int, raw: bytes, out: list[bytes],
                      on_headers) -> bool:
        """Collect a header block (HEADERS + CONTINUATIONs), decode it once complete, hand it to
        ``on_headers(sid, headers, end_stream)`` and forward its frames unchanged. False when the block
        grew beyond ``max_header_block`` (the caller ends the connection)."""
        if ftype == HEADERS:
            if flags & F_END_HEADERS:  # the usual case: the whole block in one frame
                on_headers(sid, decode_block(d.decoder, _fragment(ftype, flags, raw[9:])), bool(flags & F_END_STREAM))
                out.append(raw)
                return True
            d.block, d.block_fragments, d.block_size = [], [], 0
            d.block_stream, d.block_end_stream = sid, bool(flags & F_END_STREAM)
        d.block_size += len(raw)
        if d.block_size > self.proxy.max_header_block:
            d.block, d.block_fragments, d.block_size = [], [], 0
            return False
        d.block.append(raw)
        d.block_fragments.append(_fragment(ftype, flags, raw[9:]))
        if not flags & F_END_HEADERS:
            return True
        frames, block = d.block, b"".join(d.block_fragments)
        d.block, d.block_fragments, d.block_size = [], [], 0
        on_headers(d.block_stream, decode_block(d.decoder, block), d.block_end_stream)
        out.extend(frames)
        return True

    def _goaway_client(self, why: str) -> None:
        """End the connection (both sides): a header block cannot be cut short without breaking HPACK."""
        log.warning("closing a client connection: %s", why)
        self.proxy.count_reset("header_block")
        if not self.closed:
            last = max(self.streams, default=0)
            self.client.write(frame(GOAWAY, 0, 0, last.to_bytes(4, "big") + H2_ENHANCE_YOUR_CALM.to_bytes(4, "big")))
        self.close(why)

    def _reset_held(self, st: _Stream, more_coming: bool) -> None:
        """A held request grew beyond ``max_held_message``: the stream ends here, the relay goes on."""
        sid = st.ex.stream_id
        log.warning("%s: request message larger than %d bytes: stream reset", st.ex.method,
                    self.proxy.max_held_message)
        self.proxy.count_reset("held_message")
        st.held, st.held_size = [], 0
        self._to_upstream(frame(RST_STREAM, 0, sid, H2_CANCEL.to_bytes(4, "big")))
        msg = f"cri-resmgr relay: request message larger than {self.proxy.max_held_message} bytes"
        # The held bytes, the last frame's included, were credited to the client as they came (from_client).
        self._to_client(trailers_only(sid, status(S.RESOURCE_EXHAUSTED), msg)
                        + frame(RST_STREAM, 0, sid, H2_NO_ERROR.to_bytes(4, "big")))
        if more_coming:
            if len(self.dropped) > 1000:
                self.dropped.clear()
            self.dropped.add(sid)
        self._finish(st, status(S.RESOURCE_EXHAUSTED), msg)

    def _request_headers(self, sid: int, headers: list[tuple[bytes, bytes]], end_stream: bool) -> None:
        st = self.streams.get(sid)
        if st is not None:
            st.client_ended = st.client_ended or end_stream
            # Request trailers (gRPC clients send none): a held request can no longer wait for a rewrite,
            # since the trailers' header block must not overtake it.
            if st.mode is Mode.REWRITE and not st.req_done:
                st.req_done = True
                self._release_held(st)
            return
        method = ""
        for k, v in headers:
            if k == b":path":
                method = v.decode("ascii", "replace")
                break
        ex = Exchange(method, sid, time.perf_counter())
        mode = self.hooks.mode(method)
        if mode is not Mode.PASS:  # held or observed: timed (observed calls have no hook before the forward)
            ex.timing = RewriteTiming(arrived=self.read_at, headers=ex.started, reads=self.reads)
        self.streams[sid] = _Stream(ex, mode, client_ended=end_stream)
        self.up_streams[sid] = self.up_initial

    # -- runtime -> client --------------------------------------------------------------------------
    def from_upstream(self, data: bytes) -> None:
        d = self.s2c
        d.buf += data
        out: list[bytes] = []
        self._s2c_out = out
        buf = d.buf
        pos = 0
        run = 0  # as in from_client: frames forwarded as they are go out as one slice, buf[run:pos]
        acks: list[bytes] = []  # the runtime's PINGs, answered here (module doc)
        n = len(buf)
        while n - pos >= 9:
            hi, lo, ftype, flags, sid = _frame_head(buf, pos)
            length = hi << 8 | lo
            end = pos + 9 + length
            if end > n:
                break
            sid &= 0x7FFFFFFF
            if ftype == DATA:
                st = self.streams.get(sid)
                if st is not None and (st.mode is not Mode.PASS or self.hooks.dumping):
                    st.resp += _data_body(flags, bytes(buf[pos + 9:end]))
            elif ftype == HEADERS and flags & F_END_HEADERS and not d.block:
                # The usual case, a whole header block in one frame: it stays in the run.
                self._response_headers(sid, decode_block(d.decoder, _fragment(ftype, flags, bytes(buf[pos + 9:end]))),
                                       bool(flags & F_END_STREAM))
            elif ftype in (HEADERS, CONTINUATION):
                if pos > run:
                    out.append(bytes(buf[run:pos]))
                run = end
                if not self._header_frame(d, ftype, flags, sid, bytes(buf[pos:end]), out, self._response_headers):
                    self._s2c_out = None
                    self._report_ended()
                    self._goaway_client(f"runtime header block larger than {self.proxy.max_header_block} bytes")
                    return
            elif ftype == WINDOW_UPDATE:
                inc = int.from_bytes(buf[pos + 9:pos + 13], "big") & 0x7FFFFFFF
                if sid == 0:
                    # Owed to the client, less the part the proxy already gave it (debt); written with the next
                    # bytes to the client, normally the answer (_settle_credit), not as it comes.
                    if pos > run:
                        out.append(bytes(buf[run:pos]))
                    run = end
                    self.up_conn += inc
                    take = min(inc, self.debt)
                    self.debt -= take
                    self._client_credit += inc - take
                elif sid in self.up_streams:
                    self.up_streams[sid] += inc
                    st = self.streams.get(sid)
                    if st is not None and st.client_ended:  # it sends no more DATA on this stream: dropped
                        if pos > run:
                            out.append(bytes(buf[run:pos]))
                        run = end
                if self.blocked:
                    self._flush_blocked()  # writes to the runtime, not into ``out``
            elif ftype == PING and not flags & F_ACK and length == 8 and not sid:
                if pos > run:
                    out.append(bytes(buf[run:pos]))
                run = end
                acks.append(frame(PING, F_ACK, 0, bytes(buf[pos + 9:end])))
            elif ftype == RST_STREAM:
                st = self.streams.get(sid)
                if st is not None:
                    err = int.from_bytes(buf[pos + 9:pos + 13], "big")
                    self._finish(st, status(_RST_TO_GRPC.get(err, S.INTERNAL)),
                                 f"stream reset by the runtime (HTTP/2 error {err})")
            elif ftype == SETTINGS and not flags & F_ACK:
                payload = bytes(buf[pos + 9:end])
                size = _setting(payload, SETTINGS_HEADER_TABLE_SIZE)
                if size is not None:
                    self.c2s.decoder.max_allowed_table_size = size
                window = _setting(payload, SETTINGS_INITIAL_WINDOW_SIZE)
                if window is not None:
                    # A new initial window changes every open stream's window by the difference (§6.9.2).
                    delta, self.up_initial = window - self.up_initial, window
                    for k in self.up_streams:
                        self.up_streams[k] += delta
                    if self.blocked:
                        self._flush_blocked()
            pos = end
        if pos > run:
            out.append(bytes(buf[run:pos]))
        del buf[:pos]
        self._s2c_out = None
        if out:
            if not self._preface_out:  # the runtime's first frames (SETTINGS first) are out: the proxy's may follow
                self._preface_out = True
                out += self._early
                self._early = []
            self._to_client(b"".join(out))
        self._settle_credit()
        if acks:
            self._to_upstream(b"".join(acks))
        if self._ended:
            self._report_ended()

    def _report_ended(self) -> None:
        ended, self._ended = self._ended, []
        now = time.perf_counter()
        for st in ended:
            if st.ex.timing is not None:
                st.ex.timing.answered = now
        for st in ended:
            self._report(st)

    def _response_headers(self, sid: int, headers: list[tuple[bytes, bytes]], end_stream: bool) -> None:
        st = self.streams.get(sid)
        if st is None:
            return
        st.seen_response_headers = True
        t = st.ex.timing
        if t is not None:
            if end_stream:
                t.response_end = time.perf_counter()
            if not t.response:
                t.response = t.response_end or time.perf_counter()
        if not end_stream:
            return
        code, message = status(S.UNKNOWN), ""
        for k, v in headers:
            if k == b"grpc-status":
                try:
                    code = int(v)
                except ValueError:
                    code = status(S.UNKNOWN)
            elif k == b"grpc-message":
                message = urllib.parse.unquote(v.decode("utf-8", "replace"))
        if st.mode is Mode.REWRITE and not st.req_done:
            st.held = []  # the runtime answered before the request was complete: nothing is left to rewrite
        self._finish(st, code, message)

    # -- hooks --------------------------------------------------------------------------------------
    def _submit_rewrite(self, st: _Stream) -> None:
        body = b"".join(st.held)
        msg = grpc_message(body)
        if msg is None or len(body) != 5 + len(msg):
            # Compressed, or not exactly one message: not ours to rewrite.
            self._release_held(st)
            return
        st.ex.request = msg
        loop = self.proxy.loop
        timing = st.ex.timing
        if timing is None:  # a hook that switched a stream to REWRITE by hand (tests)
            timing = st.ex.timing = RewriteTiming(headers=st.ex.started, reads=self.reads)
        timing.held = time.perf_counter()
        timing.reads = self.reads - timing.reads + 1
        try:
            inline = self.hooks.rewrite_inline(st.ex)
        except Exception:  # as a failing worker hook: the request goes as the client sent it
            log.exception("inline rewrite hook for %s failed; forwarding unchanged", st.ex.method)
            inline = None
        if not isinstance(inline, InWorker):
            timing.started, timing.returned = timing.held, time.perf_counter()
            # Inside from_client: what this sends joins the frames being forwarded, after this stream's own.
            self._rewritten(st, inline)
            return

        def work() -> None:
            result: bytes | Reject | None
            timing.started = time.perf_counter()
            try:
                result = self.hooks.rewrite(st.ex)
            except Exception:  # a failing hook must not lose the request: it goes as the client sent it
                log.exception("rewrite hook for %s failed; forwarding unchanged", st.ex.method)
                result = None
            timing.returned = time.perf_counter()
            loop.call_soon_threadsafe(self._rewritten, st, result)

        self.proxy.executor.submit(work)

    def _rewritten(self, st: _Stream, result: bytes | Reject | None) -> None:
        if st.closed or self.closed:
            return
        self._forward_rewritten(st, result)
        t = st.ex.timing
        if t is not None and not t.forwarded:
            if self._c2s_out is not None:  # inside from_client: the bytes go with the frames being parsed
                self._forward_stamps.append(t)
            else:
                self._stamp_forwarded(t)

    def _stamp_forwarded(self, t: RewriteTiming | None = None) -> None:
        now = time.perf_counter()
        buffered = self.upstream.get_write_buffer_size() if self.upstream is not None else 0
        stamps, self._forward_stamps = ([t] if t is not None else self._forward_stamps), []
        for s in stamps:
            s.forwarded, s.upstream_buffered = now, buffered

    def _forward_rewritten(self, st: _Stream, result: bytes | Reject | None) -> None:
        if isinstance(result, Reject):
            if st.ex.timing is not None:  # the refusal is this request's "forward": nothing reaches the runtime
                st.ex.timing.forwarded = time.perf_counter()
            st.held = []
            self._to_upstream(frame(RST_STREAM, 0, st.ex.stream_id, H2_CANCEL.to_bytes(4, "big")))
            self._to_client(trailers_only(st.ex.stream_id, result.code, result.message))
            self._finish(st, result.code, result.message)
            return
        if isinstance(result, bytes):
            st.ex.rewritten = True
            st.ex.request = result
            st.held = []
            self._send_body(st.ex.stream_id, b"\x00" + len(result).to_bytes(4, "big") + result, True)
            return
        self._release_held(st)

    def _release_held(self, st: _Stream) -> None:
        """Forward held DATA unchanged (as the client framed it, minus padding)."""
        body = b"".join(st.held)
        st.held = []
        st.req += body
        self._send_body(st.ex.stream_id, body, st.req_done)

    def _send_body(self, sid: int, body: bytes, end_stream: bool) -> None:
        """DATA frames of the proxy's own making; the runtime will grant their size back to the client,
        which the proxy already credited when it held the request: that grant is owed back (debt)."""
        for i in range(0, max(len(body), 1), MAX_FRAME_PAYLOAD):
            chunk = body[i:i + MAX_FRAME_PAYLOAD]
            last = i + MAX_FRAME_PAYLOAD >= len(body)
            self._send_data(sid, frame(DATA, F_END_STREAM if last and end_stream else 0, sid, chunk), len(chunk))
        self.debt += len(body)

    def _send_data(self, sid: int, raw: bytes, n: int) -> None:
        """Send one DATA frame upstream if the runtime's windows allow it, else queue it (order per stream kept)."""
        w = self.up_streams.get(sid, self.up_initial)
        if n and (n > self.up_conn or n > w or (self.blocked and any(b[0] == sid for b in self.blocked))):
            self.blocked.append((sid, raw, n))
            return
        self.up_conn -= n
        if sid in self.up_streams:
            self.up_streams[sid] = w - n
        self._to_upstream(raw)

    def _flush_blocked(self) -> None:
        keep: deque[tuple[int, bytes, int]] = deque()
        stuck: set[int] = set()
        out = []
        for sid, raw, n in self.blocked:
            w = self.up_streams.get(sid, self.up_initial)
            if sid in stuck or n > self.up_conn or n > w:
                stuck.add(sid)
                keep.append((sid, raw, n))
                continue
            self.up_conn -= n
            if sid in self.up_streams:
                self.up_streams[sid] = w - n
            out.append(raw)
        self.blocked = keep
        if out:
            self._to_upstream(b"".join(out))

    def _drop_blocked(self, sid: int) -> None:
        """A reset stream's queued DATA is never sent: the client's window gets those bytes back."""
        if not self.blocked:
            return
        dropped = sum(n for s, _r, n in self.blocked if s == sid)
        self.blocked = deque(b for b in self.blocked if b[0] != sid)
        self._client_credit += dropped  # called while the client's input is parsed: settled after it

    def _finish(self, st: _Stream, code: int, message: str) -> None:
        """The call ended: it is forgotten at once; its completion runs now, or (inside from_upstream) once the
        client has been sent its end."""
        if st.closed:
            return
        st.closed = True
        ex = st.ex
        ex.code, ex.message = code, message
        self.streams.pop(ex.stream_id, None)
        self.up_streams.pop(ex.stream_id, None)
        if self._s2c_out is not None:
            self._ended.append(st)
            return
        if ex.timing is not None:  # what the client gets for it (if anything) is on its way
            ex.timing.answered = time.perf_counter()
        self._report(st)

    def _report(self, st: _Stream) -> None:
        """A call's completion: the hooks (the books), metrics, the dump, the timing."""
        ex = st.ex
        code = ex.code if ex.code is not None else status(S.UNKNOWN)
        if st.mode is not Mode.PASS or self.hooks.dumping:
            if not ex.rewritten:
                ex.request = grpc_message(bytes(st.req)) or b""
            ex.response = grpc_message(bytes(st.resp)) or b""
            if self.hooks.dumping:
                self.hooks.dump("request", ex, ex.request)
                self.hooks.dump("response", ex, ex.response)
            if st.mode is not Mode.PASS:
                try:
                    self.hooks.complete(ex)
                except Exception:
                    log.exception("completion hook for %s failed", ex.method)
        self.hooks.finished(ex.method, code, time.perf_counter() - ex.started)
        if ex.timing is not None:
            ex.timing.completed = time.perf_counter()
            try:
                self.hooks.rewrite_timed(ex)
            except Exception:
                log.exception("timing hook for %s failed", ex.method)

    # -- transports ---------------------------------------------------------------------------------
    def _to_upstream(self, data: bytes) -> None:
        if self._c2s_out is not None:
            self._c2s_out.append(data)
        elif not self.closed and self.upstream is not None:
            self.upstream.write(data)

    def _to_client(self, data: bytes) -> None:
        if not data:
            return
        if self._s2c_out is not None:
            self._s2c_out.append(data)
        elif self._c2s_back is not None:
            self._c2s_back.append(data)
        elif not self._preface_out:
            self._early.append(data)
        elif not self.closed:
            if self._client_credit:  # held connection credit rides on the bytes that go anyway (_settle_credit)
                data += self._credit_frame()  # after them: never before the runtime's SETTINGS
            self.client.write(data)

    def close(self, reason: str) -> None:
        if self.closed:
            return
        self._cancel_credit_timer()
        for st in list(self.streams.values()):
            self._finish(st, status(S.UNAVAILABLE), reason)
        self.closed = True
        self.client.close()
        if self.upstream is not None:
            self.upstream.close()


class _ClientProtocol(asyncio.Protocol):
    def __init__(self, proxy: Proxy):
        self.proxy = proxy
        self.pair: Pair | None = None
        self.fallback: _ErrorResponder | None = None
        self.early: list[bytes] = []  # client bytes received before the runtime connection settled

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport: asyncio's, or uvloop's (which implements the interface without subclassing it).
        self.transport = transport = cast(asyncio.Transport, transport)
        self.pair = Pair(self.proxy, transport)
        self.proxy.loop.create_task(self._connect())

    async def _connect(self) -> None:
        pair = self.pair
        assert pair is not None
        problem = self.proxy.refusal()
        if problem is None:
            try:
                await self.proxy.loop.create_unix_connection(lambda: _UpstreamProtocol(pair, self),
                                                             self.proxy.upstream_path)
                return
            except OSError as e:
                problem = (status(S.UNAVAILABLE),
                           f"cri-resmgr relay: runtime {self.proxy.upstream_path} unreachable: {e.strerror or e}")
                self.proxy.upstream_down(problem[1])
        # Answer every call on this connection with the error until the runtime is back, then GOAWAY.
        pair.closed = True
        self.pair = None
        if self.transport.is_closing():
            return
        self.fallback = _ErrorResponder(self.proxy, self.transport, *problem)
        early, self.early = b"".join(self.early), []
        if early:
            self.fallback.feed(early)

    def upstream_ready(self) -> None:
        early, self.early = b"".join(self.early), []
        if early and self.pair is not None:
            self.pair.from_client(early)

    def data_received(self, data: bytes) -> None:
        if self.fallback is not None:
            self.fallback.feed(data)
        elif self.pair is not None:
            if self.pair.upstream is None:
                self.early.append(data)
            else:
                self.pair.from_client(data)

    def connection_lost(self, exc) -> None:
        if self.fallback is not None:
            self.fallback.lost()
        if self.pair is not None:
            self.pair.close("client went away")

    def pause_writing(self) -> None:
        # The client is not reading what the proxy writes it: nothing more is read for it, from either side.
        if self.pair:
            if self.pair.upstream:
                self.pair.upstream.pause_reading()
            self.pair.hold_client("client", True)

    def resume_writing(self) -> None:
        if self.pair:
            if self.pair.upstream:
                self.pair.upstream.resume_reading()
            self.pair.hold_client("client", False)


class _UpstreamProtocol(asyncio.Protocol):
    def __init__(self, pair: Pair, client: _ClientProtocol):
        self.pair = pair
        self.client = client

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, transport)  # see _ClientProtocol.connection_made
        self.pair.upstream = transport
        self.pair.proxy.upstream_up()
        if self.pair.closed:
            transport.close()
            return
        self.client.upstream_ready()

    def data_received(self, data: bytes) -> None:
        self.pair.from_upstream(data)

    def connection_lost(self, exc) -> None:
        # The runtime went away (restart): end the client connection too; gRPC clients reconnect.
        self.pair.close("runtime connection lost")

    def pause_writing(self) -> None:
        self.pair.hold_client("runtime", True)

    def resume_writing(self) -> None:
        self.pair.hold_client("runtime", False)


class _ErrorResponder:
    """A minimal HTTP/2 server side for one connection while the runtime cannot be reached: settings are
    acknowledged, pings answered, and every call gets ``code`` at once. When the runtime is reachable
    again the connection is sent GOAWAY so that the client reconnects through the proxy."""

    def __init__(self, proxy: Proxy, transport: asyncio.Transport, code: int, message: str):
        self.proxy = proxy
        self.transport = transport
        self.code, self.message = code, message
        self.d = _Direction(expect_preface=True)
        self.last_stream = 0
        self.alive = True
        transport.write(frame(SETTINGS, 0, 0))
        self.task = proxy.loop.create_task(self._watch())

    def feed(self, data: bytes) -> None:
        d = self.d
        d.buf += data
        buf = d.buf
        pos = 0
        if d.preface_left:
            take = min(d.preface_left, len(buf))
            d.preface_left -= take
            pos = take
        out = []
        n = len(buf)
        while n - pos >= 9:
            hi, lo, ftype, flags, sid = _frame_head(buf, pos)
            length = hi << 8 | lo
            end = pos + 9 + length
            if end > n:
                break
            sid &= 0x7FFFFFFF
            payload = bytes(buf[pos + 9:end])
            if ftype == SETTINGS and not flags & F_ACK:
                out.append(frame(SETTINGS, F_ACK, 0))
            elif ftype == PING and not flags & F_ACK:
                out.append(frame(PING, F_ACK, 0, payload))
            elif ftype == DATA and length:
                out.append(frame(WINDOW_UPDATE, 0, 0, length.to_bytes(4, "big")))
            elif ftype in (HEADERS, CONTINUATION):
                if ftype == HEADERS:
                    d.block_fragments, d.block_stream, d.block_size = [], sid, 0
                d.block_size += length
                if d.block_size > self.proxy.max_header_block:
                    self.proxy.count_reset("header_block")
                    self.transport.write(frame(GOAWAY, 0, 0, self.last_stream.to_bytes(4, "big")
                                               + H2_ENHANCE_YOUR_CALM.to_bytes(4, "big")))
                    self.transport.close()
                    self.lost()
                    return
                d.block_fragments.append(_fragment(ftype, flags, payload))
                if flags & F_END_HEADERS:
                    headers = decode_block(d.decoder, b"".join(d.block_fragments))
                    d.block_fragments = []
                    if d.block_stream > self.last_stream:
                        self.last_stream = d.block_stream
                        method = next((v.decode("ascii", "replace") for k, v in headers if k == b":path"), "")
                        t0 = time.perf_counter()
                        out.append(trailers_only(d.block_stream, self.code, self.message))
                        self.proxy.hooks.finished(method, self.code, time.perf_counter() - t0)
            pos = end
        del buf[:pos]
        if out and self.alive:
            self.transport.write(b"".join(out))

    async def _watch(self) -> None:
        delay = self.proxy.backoff_initial
        while self.alive:
            await asyncio.sleep(delay)
            delay = min(delay * 2, self.proxy.backoff_max)
            if self.proxy.refusal() is not None:
                continue
            if await self.proxy.probe_upstream():
                if self.alive:
                    self.transport.write(frame(GOAWAY, 0, 0, self.last_stream.to_bytes(4, "big") + b"\0\0\0\0"))
                    self.proxy.loop.call_later(0.5, self.transport.close)
                return

    def lost(self) -> None:
        self.alive = False
        self.task.cancel()


class Proxy:
    """Listens on a unix socket; pairs each client connection with one to ``upstream_path``."""

    def __init__(self, upstream_path: str, hooks: Hooks, executor: Executor,
                 refusal: Callable[[], tuple[int, str] | None] = lambda: None,
                 on_upstream: Callable[[bool, str], None] = lambda up, why: None,
                 backoff_initial: float = 0.1, backoff_max: float = 2.0,
                 max_header_block: int = MAX_HEADER_BLOCK, max_held_message: int = MAX_HELD_MESSAGE,
                 on_reset: Callable[[str], None] = lambda reason: None,
                 window_hold_seconds: float = WINDOW_HOLD_SECONDS):
        self.upstream_path = upstream_path
        self.hooks = hooks
        self.executor = executor
        self.refusal = refusal  # () -> (code, message) while calls must be refused (e.g. untested runtime)
        self.on_upstream = on_upstream
        self.backoff_initial, self.backoff_max = backoff_initial, backoff_max
        self.max_header_block, self.max_held_message = max_header_block, max_held_message
        self.count_reset = on_reset  # (reason) for every stream or connection the proxy ends itself
        self.window_hold_seconds = window_hold_seconds  # connection credit held for the client at most this long
        self._loop: asyncio.AbstractEventLoop | None = None
        self.server: asyncio.AbstractServer | None = None
        self._up: bool | None = None

    async def start(self, path: str) -> None:
        self._loop = asyncio.get_running_loop()
        self.server = await self.loop.create_unix_server(lambda: _ClientProtocol(self), path)

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        assert self._loop is not None, "Proxy.start() first"
        return self._loop

    def upstream_up(self) -> None:
        if self._up is not True:
            self._up = True
            self.on_upstream(True, "")

    def upstream_down(self, why: str) -> None:
        if self._up is not False:
            self._up = False
            self.on_upstream(False, why)

    async def probe_upstream(self) -> bool:
        try:
            _r, w = await asyncio.open_unix_connection(self.upstream_path)
        except OSError:
            return False
        w.close()
        self.upstream_up()
        return True

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
