"""Optional JSON-lines dump of CRI messages through the relay (``relay.dump_file``; off by default).

One line per message: time, method, direction (request/response), stream id, gRPC status (responses), and
the message in protobuf's JSON mapping (google.protobuf.json_format). Only the first message of a
streaming call is dumped. Writing happens on the forwarding path, so it is for debugging, not for production.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

import grpc
from cri_api.v1 import api_pb2 as pb
from google.protobuf import json_format, message_factory

from .h2proxy import Exchange, code_name

log = logging.getLogger(__name__)


def _message_types() -> dict[str, tuple[Any, Any]]:
    out = {}
    for svc in pb.DESCRIPTOR.services_by_name.values():
        for m in svc.methods:
            out[f"/{svc.full_name}/{m.name}"] = (message_factory.GetMessageClass(m.input_type),
                                                 message_factory.GetMessageClass(m.output_type))
    return out


class Dumper:
    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # 0600, not the umask's: CreateContainer carries env values, i.e. resolved Secrets (issue 12). A file
        # left wider by an older version is narrowed; a symlink planted at the path is refused.
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        os.fchmod(fd, 0o600)
        self.f = open(fd, "a", buffering=1)  # noqa: SIM115 (open for the dumper's lifetime)
        self.types = _message_types()
        self.lock = threading.Lock()

    def write(self, direction: str, ex: Exchange, message: bytes) -> None:
        types = self.types.get(ex.method)
        rec = {"time": time.time(), "method": ex.method, "direction": direction, "stream": ex.stream_id}
        if direction == "response":
            rec["code"] = code_name(ex.code) if ex.code is not None else grpc.StatusCode.UNKNOWN.name
            if ex.message:
                rec["error"] = ex.message
        if direction == "request" and ex.rewritten:
            rec["rewritten"] = True
        if types is None or (direction == "response" and not message and ex.code):
            rec["bytes"] = len(message)
        else:
            try:
                cls = types[0] if direction == "request" else types[1]
                rec["message"] = json_format.MessageToDict(cls.FromString(message), preserving_proto_field_name=True)
            except Exception as e:  # noqa: BLE001 (the dump must never break forwarding)
                rec["undecodable"] = f"{type(e).__name__}: {e}"
        line = json.dumps(rec, sort_keys=True)
        with self.lock:
            try:
                self.f.write(line + "\n")
            except (OSError, ValueError) as e:
                log.warning("message dump to %s failed: %s", self.path, e)

    def close(self) -> None:
        with self.lock:
            self.f.close()
