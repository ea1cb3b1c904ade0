"""The relay's control socket: moves for the rebalancer, the cache, metrics, a reconcile trigger.

gRPC over a unix socket (``relay.control_socket``, mode 0600) with JSON payloads: the methods carry the
Pydantic models of :mod:`cri_resmgr.relay.api`, so a caller in another process (the agent's rebalancer)
gets typed records without a second schema. Service ``cri_resmgr.relay.v1.Control``:

=========== =============================== ====================================
method      request                         response
=========== =============================== ====================================
Move        MoveRequest                     MoveRecord
State       {}                              RelayState
Moves       {}                              {"moves": [MoveRecord, ...]}
Metrics     {}                              {"text": Prometheus text exposition}
Reconcile   {}                              {"summary": {...}}
=========== =============================== ====================================
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from concurrent import futures
from pathlib import Path

import grpc

from .api import MoveRecord, MoveRequest, RelayState

SERVICE = "cri_resmgr.relay.v1.Control"


class _Handler(grpc.GenericRpcHandler):
    def __init__(self, methods: dict[str, Callable[[dict], dict]]):
        self.methods = methods

    def service(self, details):
        name = details.method.rsplit("/", 1)[-1]
        if not details.method.startswith(f"/{SERVICE}/") or name not in self.methods:
            return None
        fn = self.methods[name]

        def handle(raw: bytes, ctx):
            try:
                body = json.loads(raw or b"{}")
                return json.dumps(fn(body)).encode()
            except (ValueError, TypeError) as e:
                ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

        return grpc.unary_unary_rpc_method_handler(handle)


def serve(relay, path: Path, metrics_text: Callable[[], str]) -> grpc.Server:
    def move(body: dict) -> dict:
        req = MoveRequest.model_validate(body)
        return relay.move(req.container_id, req.cpus, req.mems, req.who, req.why).model_dump()

    methods = {
        "Move": move,
        "State": lambda body: relay.state().model_dump(),
        "Moves": lambda body: {"moves": [m.model_dump() for m in relay.moves]},
        "Metrics": lambda body: {"text": metrics_text()},
        "Reconcile": lambda body: {"summary": relay.reconcile()},
    }
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="relay-control"))
    server.add_generic_rpc_handlers([_Handler(methods)])
    path = Path(path)
    if path.is_socket():
        path.unlink()
    server.add_insecure_port(f"unix:{path}")
    server.start()
    os.chmod(path, 0o600)
    return server


class ControlClient:
    """For other processes (the rebalancer, tests, ``cri-resmgr relay`` tooling)."""

    def __init__(self, path: Path | str, timeout: float = 30):
        self.channel = grpc.insecure_channel(f"unix://{path}")
        self.timeout = timeout

    def _call(self, method: str, body: dict | None = None) -> dict:
        fn = self.channel.unary_unary(f"/{SERVICE}/{method}")
        return json.loads(fn(json.dumps(body or {}).encode(), timeout=self.timeout))

    def move(self, container_id: str, cpus: str, mems: str | None = None, who: str = "unknown",
             why: str = "") -> MoveRecord:
        req = MoveRequest(container_id=container_id, cpus=cpus, mems=mems, who=who, why=why)
        return MoveRecord.model_validate(self._call("Move", req.model_dump()))

    def state(self) -> RelayState:
        return RelayState.model_validate(self._call("State"))

    def moves(self) -> list[MoveRecord]:
        return [MoveRecord.model_validate(m) for m in self._call("Moves")["moves"]]

    def metrics(self) -> str:
        return self._call("Metrics")["text"]

    def reconcile(self) -> dict[str, int]:
        return self._call("Reconcile")["summary"]

    def close(self) -> None:
        self.channel.close()
