"""The relay's metrics in the agent's ``/metrics``, so one scrape target per node carries everything.

The relay is its own process (kubelet's critical path stays apart from the metrics side); it renders its
own exposition text on its control socket (``Metrics`` call). The agent appends that text when the socket
exists, with a short timeout, so a slow or absent relay never delays a scrape by more than
``timeout_seconds``. Families never collide: the relay's are ``cri_resmgr_relay_*`` and, from the resource
controllers, ``cri_resmgr_container_{rdt,blockio,rt}_class`` and ``cri_resmgr_control_*``, none of which the agent
itself writes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..relay.control import ControlClient

log = logging.getLogger(__name__)


class RelayMetrics:
    def __init__(self, control_path: Callable[[], Path], timeout_seconds: float = 0.5):
        self.control_path = control_path
        self.timeout_seconds = timeout_seconds
        self.error: str | None = None
        self._client: ControlClient | None = None
        self._path: Path | None = None

    def text(self) -> bytes:
        path = self.control_path()
        try:
            if not path.exists():
                return b""
        except OSError:
            return b""
        import grpc

        from ..relay.control import ControlClient

        if self._client is None or self._path != path:
            self._client, self._path = ControlClient(path, timeout=self.timeout_seconds), path
        try:
            out = self._client.metrics()
        except grpc.RpcError as e:
            msg = f"relay metrics from {path}: {e.code().name}"
            if msg != self.error:
                log.warning("%s; /metrics goes on without them", msg)
            self.error = msg
            return b""
        self.error = None
        return out.encode() if out.endswith("\n") else (out + "\n").encode()
