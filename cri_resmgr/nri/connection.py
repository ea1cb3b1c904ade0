"""One NRI socket: the plugin's service served on connection 1, the runtime's service called on connection 2.

containerd may call Configure (connection 1) before it answers RegisterPlugin (connection 2), so both are
live at once: a reader thread demultiplexes frames, requests run in the server's executor, and calls on
connection 2 wait for their own response only.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable
from concurrent.futures import Executor
from pathlib import Path

from .mux import ConnId, Mux
from .proto import nri_pb2 as api
from .trace import HookTrace, HookTracer
from .ttrpc import Client, Method, Server

log = logging.getLogger(__name__)

API_PACKAGE = "nri.pkg.api.v1alpha1"
RUNTIME_SERVICE = f"{API_PACKAGE}.Runtime"
PLUGIN_SERVICE = f"{API_PACKAGE}.Plugin"


class Connection:
    def __init__(self, path: Path, methods: dict[str, Method], executor: Executor, budget_seconds: float,
                 observe: Callable[[str, str, float], None] | None = None, connect_timeout: float = 5.0,
                 tracer: HookTracer | None = None, on_trace: Callable[[HookTrace], None] | None = None,
                 on_closed: Callable[[], None] | None = None):
        self.path = Path(path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(connect_timeout)
        try:
            sock.connect(str(self.path))
        except OSError:
            sock.close()
            raise
        sock.settimeout(None)
        self.closed = threading.Event()
        self.on_closed = on_closed or (lambda: None)  # after ``closed`` is set: a waiter needs no polling
        self.close_reason: Exception | None = None
        self.client = Client(lambda data: self.mux.send(ConnId.RUNTIME_SERVICE, data))
        served = {f"{PLUGIN_SERVICE}/{name}": m for name, m in methods.items()}
        self.server = Server(lambda data: self.mux.send(ConnId.PLUGIN_SERVICE, data), served, executor,
                             budget_seconds, observe, tracer=tracer, on_trace=on_trace)
        self.mux = Mux(sock, {ConnId.PLUGIN_SERVICE: self.server.receive, ConnId.RUNTIME_SERVICE: self.client.receive},
                       self._on_close)
        self._reader = threading.Thread(target=self.mux.run, name="nri-mux", daemon=True)
        self._reader.start()

    def _on_close(self, err: Exception | None) -> None:
        self.close_reason = err
        self.client.close(err)
        self.server.close()
        self.closed.set()
        self.on_closed()

    def register(self, name: str, index: str, timeout_seconds: float) -> None:
        req = api.RegisterPluginRequest(plugin_name=name, plugin_idx=index)
        self.client.call(RUNTIME_SERVICE, "RegisterPlugin", req.SerializeToString(), timeout_seconds)

    def update_containers(self, updates: list[api.ContainerUpdate], timeout_seconds: float) -> list[str]:
        """Unsolicited updates (moves, pool changes); returns the ids of containers the runtime failed to update."""
        req = api.UpdateContainersRequest(update=updates)
        raw = self.client.call(RUNTIME_SERVICE, "UpdateContainers", req.SerializeToString(), timeout_seconds)
        return [u.container_id for u in api.UpdateContainersResponse.FromString(raw).failed]

    def close(self) -> None:
        self.mux.close()
        self._reader.join(timeout=5)
