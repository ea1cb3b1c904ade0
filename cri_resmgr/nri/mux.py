"""NRI's socket multiplexing: several logical connections over one unix socket.

Wire format (containerd/nri ``pkg/net/multiplex/mux.go``): each frame is a 4-byte big-endian connection id, a
4-byte big-endian payload length and the payload. Connection 1 carries the plugin's service (the runtime is
the ttrpc client), connection 2 the runtime's service (the plugin is the client); id 0 is reserved.

Each connection is a byte stream: a ttrpc message may span frames and one frame may hold several messages, so
receivers reassemble (:class:`FrameDecoder` hands out payloads; :mod:`.ttrpc` parses the stream). On send, the
Go side hands each frame's payload to ttrpc's reader as one ``Read`` into a 4 KiB buffer and fails with ENOMEM
on a larger one, so :func:`encode_frames` never writes a frame longer than :data:`MAX_FRAME_BYTES`.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import struct
import threading
from collections.abc import Callable
from enum import IntEnum

FRAME_HEADER = struct.Struct(">II")  # connection id, payload length
log = logging.getLogger(__name__)

MAX_FRAME_BYTES = 4096  # header included: stays inside the Go side's 4 KiB read buffer
MAX_FRAME_PAYLOAD = MAX_FRAME_BYTES - FRAME_HEADER.size
# The Go side refuses payloads over a ttrpc message (10-byte header + 4 MiB); a peer sending more is broken.
MAX_RECEIVE_PAYLOAD = 10 + (4 << 20)


class ConnId(IntEnum):
    RESERVED = 0
    PLUGIN_SERVICE = 1  # the runtime calls the plugin (Configure, Synchronize, CreateContainer, ...)
    RUNTIME_SERVICE = 2  # the plugin calls the runtime (RegisterPlugin, UpdateContainers)


class FramingError(Exception):
    """The peer sent something that is not a valid frame; the trunk must be closed."""


def encode_frames(conn_id: int, data: bytes, max_frame: int = MAX_FRAME_BYTES) -> bytes:
    """``data`` for ``conn_id`` as frames of at most ``max_frame`` bytes, header included."""
    if conn_id == ConnId.RESERVED:
        raise ValueError("connection id 0 is reserved")
    step = max_frame - FRAME_HEADER.size
    if step <= 0:
        raise ValueError(f"max_frame {max_frame} leaves no room for a payload")
    out = bytearray()
    for i in range(0, len(data), step):
        chunk = data[i:i + step]
        out += FRAME_HEADER.pack(conn_id, len(chunk))
        out += chunk
    return bytes(out)


class FrameDecoder:
    """Incremental: ``feed`` bytes as they arrive (any split), get whole frames' ``(conn_id, payload)``."""

    def __init__(self, max_payload: int = MAX_RECEIVE_PAYLOAD):
        self.max_payload = max_payload
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[tuple[int, bytes]]:
        self._buf += data
        out: list[tuple[int, bytes]] = []
        pos = 0
        buf = self._buf
        while len(buf) - pos >= FRAME_HEADER.size:
            cid, n = FRAME_HEADER.unpack_from(buf, pos)
            if n > self.max_payload:
                raise FramingError(f"frame of {n} bytes on connection {cid} exceeds {self.max_payload}")
            if len(buf) - pos - FRAME_HEADER.size < n:
                break
            start = pos + FRAME_HEADER.size
            out.append((cid, bytes(buf[start:start + n])))
            pos = start + n
        del buf[:pos]
        return out

    @property
    def pending(self) -> int:
        """Bytes held back waiting for the rest of a frame."""
        return len(self._buf)


class Mux:
    """One trunk socket: ``send`` writes framed data under a lock; ``run`` (a thread of its own) reads and hands
    each connection's payloads to its receiver until the peer closes, then calls ``on_close`` once."""

    def __init__(self, sock: socket.socket, receivers: dict[int, Callable[[bytes], None]],
                 on_close: Callable[[Exception | None], None]):
        self.sock = sock
        self.receivers = receivers
        self.on_close = on_close
        self._send_lock = threading.Lock()
        self._closed = threading.Event()

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def send(self, conn_id: int, data: bytes) -> None:
        frames = encode_frames(conn_id, data)
        with self._send_lock:
            if self._closed.is_set():
                raise ConnectionError("NRI socket closed")
            self.sock.sendall(frames)

    def run(self) -> None:
        dec = FrameDecoder()
        err: Exception | None = None
        try:
            while not self._closed.is_set():
                data = self.sock.recv(65536)
                if not data:
                    break
                for cid, payload in dec.feed(data):
                    rx = self.receivers.get(cid)
                    if rx is not None:  # like the Go side: frames for connections nobody opened are dropped
                        rx(payload)
        except (OSError, FramingError) as e:
            err = e
        except Exception as e:  # a receiver that fails (a protocol error above us) closes the trunk too
            log.exception("closing the NRI socket: %s", e)
            err = e
        finally:
            self.close()
            self.on_close(err)

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
