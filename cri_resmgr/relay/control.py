"""The relay's control socket: moves for the rebalancer, the cache, metrics, a reconcile trigger.

gRPC over a unix socket (``relay.control_socket``, mode 0600) with JSON payloads: the methods carry the
Pydantic models of :mod:`cri_resmgr.placement.api`, so a caller in another process (the agent's rebalancer)
gets typed records without a second schema. Service ``cri_resmgr.relay.v1.Control``:

=========== =============================== ====================================
method      request                         response
=========== =============================== ====================================
Move        MoveRequest                     MoveRecord
State       {}                              RelayState
Moves       {}                              {"moves": [MoveRecord, ...]}
Metrics     {}                              {"text": Prometheus text exposition}
Reconcile   {}                              {"summary": {...}}
Invariants  {}                              InvariantView (checked now against the kernel, repaired)
Timings     {}                              {"rewrites": {method: [RewriteTiming fields, ...]}}
=========== =============================== ====================================

Timings (the CRI relay only; ``{}`` elsewhere): the last 1,000 held or observed requests per method, for
benchmarks — the instants each passed in the relay (:class:`cri_resmgr.relay.h2proxy.RewriteTiming`:
``time.perf_counter()``, which a caller on the same machine can set against its own clock).

Move honours the caller's deadline: a move whose client has given up is not applied.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from concurrent import futures
from pathlib import Path
from typing import Any, Protocol

import grpc

from ..placement.api import InvariantView, MoveRecord, MoveRequest, RelayState
from ..placement.runtime import RuntimeCallError
from .h2proxy import RewriteTiming

SERVICE = "cri_resmgr.relay.v1.Control"


class ControlTarget(Protocol):
    """What a front end (the CRI relay, the NRI plugin) offers on the control socket."""

    def move(self, container_id: str, cpus: str, mems: str | None, who: str, why: str, deadline: float | None,
             gain_by_term: dict[str, float] | None = None,
             separates: list[dict[str, str | float]] | None = None) -> MoveRecord: ...

    def moves(self) -> list[MoveRecord]: ...

    def state(self) -> RelayState: ...

    def reconcile(self) -> dict[str, int]: ...

    def invariants(self) -> InvariantView: ...


class _Handler(grpc.GenericRpcHandler):
    def __init__(self, methods: dict[str, Callable[[dict, Any], dict]]):
        self.methods = methods

    def service(self, details):
        name = details.method.rsplit("/", 1)[-1]
        if not details.method.startswith(f"/{SERVICE}/") or name not in self.methods:
            return None
        fn = self.methods[name]

        def handle(raw: bytes, ctx):
            try:
                body = json.loads(raw or b"{}")
                return json.dumps(fn(body, ctx)).encode()
            except (ValueError, TypeError) as e:
                ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            except RuntimeCallError as e:
                ctx.abort(grpc.StatusCode.UNAVAILABLE, str(e))

        return grpc.unary_unary_rpc_method_handler(handle)


def serve(relay: ControlTarget, path: Path, metrics_text: Callable[[], str],
          timings: Callable[[], dict] | None = None) -> grpc.Server:
    """``relay``: a front end (:class:`cri_resmgr.relay.core.CriFrontEnd`, or the NRI plugin's)."""

    def move(body: dict, ctx: Any) -> dict:
        req = MoveRequest.model_validate(body)
        remaining = ctx.time_remaining() if ctx is not None else None
        deadline = time.monotonic() + remaining if remaining is not None else None
        return relay.move(req.container_id, req.cpus, req.mems, req.who, req.why, deadline,
                          gain_by_term=req.gain_by_term, separates=req.separates).model_dump()

    methods: dict[str, Callable[[dict, Any], dict]] = {
        "Move": move,
        "State": lambda body, ctx: relay.state().model_dump(),
        "Moves": lambda body, ctx: {"moves": [m.model_dump() for m in relay.moves()]},
        "Metrics": lambda body, ctx: {"text": metrics_text()},
        "Reconcile": lambda body, ctx: {"summary": relay.reconcile()},
        "Invariants": lambda body, ctx: relay.invariants().model_dump(),
        "Timings": lambda body, ctx: timings() if timings is not None else {},
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
             why: str = "", gain_by_term: dict[str, float] | None = None,
             separates: list[dict[str, str | float]] | None = None) -> MoveRecord:
        req = MoveRequest(container_id=container_id, cpus=cpus, mems=mems, who=who, why=why,
                          gain_by_term=gain_by_term or {}, separates=separates or [])
        return MoveRecord.model_validate(self._call("Move", req.model_dump()))

    def state(self) -> RelayState:
        return RelayState.model_validate(self._call("State"))

    def moves(self) -> list[MoveRecord]:
        return [MoveRecord.model_validate(m) for m in self._call("Moves")["moves"]]

    def metrics(self) -> str:
        return self._call("Metrics")["text"]

    def reconcile(self) -> dict[str, int]:
        return self._call("Reconcile")["summary"]

    def invariants(self) -> InvariantView:
        """Check the placement invariants against the kernel now (and repair what is wrong)."""
        return InvariantView.model_validate(self._call("Invariants"))

    def rewrite_timings(self) -> dict[str, list[RewriteTiming]]:
        """method -> the last held or observed requests' timings, oldest first (see the module's doc)."""
        return {m: [RewriteTiming(**x) for x in xs] for m, xs in self._call("Timings").get("rewrites", {}).items()}

    def close(self) -> None:
        self.channel.close()
