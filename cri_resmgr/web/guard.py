"""What every request passes before a handler runs: the Host check (DNS rebinding), the read token, and the
limit on heavy requests served at once, so that /healthz and /metrics keep answering whatever the queries do.

A pure ASGI middleware (no response buffering); the decisions are small functions tested on their own.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import os
import posixpath
import threading
from collections.abc import Awaitable, Callable, MutableMapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from pydantic import BaseModel, SecretStr

from ..config import is_loopback_host

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

# Probes answer without a token: kubelet does not send one, and they say nothing about the node.
UNAUTHENTICATED_PATHS = frozenset({"/healthz", "/readyz"})
# The web UI's own files are the package's static files, the same on every node: served without a token, so the
# page can load and ask for one (it then sends it as a bearer header on every API call).
UI_PATHS = frozenset({"/", "/ui"})
UI_PREFIX = "/ui/"
# Requests whose work grows with the store (series × steps): at most api.max_concurrent_queries at once.
HEAVY_PATHS = frozenset({"/api/v1/query_range", "/api/v1/series"})
HEAVY_PREFIXES = ("/api/v1/heatmap",)
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


class ErrorModel(BaseModel):
    """Every 4xx the agent answers itself: ``detail`` names the parameter (or header) that is wrong."""

    detail: str


def _err(description: str) -> dict[str, Any]:
    return {"model": ErrorModel, "description": description}


# Documented on every operation (FastAPI(responses=...)); 422 (a parameter of the wrong type) FastAPI adds.
COMMON_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: _err("bad parameter: detail names it"),
    401: _err("missing or wrong bearer token (api.read_token, or api.token)"),
    421: _err("Host header not accepted on a loopback listen address (DNS rebinding guard; api.allowed_hosts)"),
    429: _err("too many heavy requests at once (api.max_concurrent_queries); retry after Retry-After seconds"),
}
TOKEN_RESPONSES: dict[int | str, dict[str, Any]] = {
    403: _err("mutating endpoints are disabled: api.token is not set"),
}


def parse_bearer(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header (RFC 6750 section 2.1: the scheme is
    case-insensitive, one or more spaces follow it, the token is b64token characters). None for a missing or
    malformed header, a bare token or another scheme."""
    if not authorization:
        return None
    scheme, sep, rest = authorization.partition(" ")
    if not sep or scheme.lower() != "bearer":
        return None
    token = rest.strip(" ")
    if not token or any(not (c.isascii() and (c.isalnum() or c in "-._~+/=")) for c in token):
        return None
    if "=" in token.rstrip("="):  # b64token: '=' only as trailing padding
        return None
    return token


def token_matches(given: str | None, *expected: SecretStr | None) -> bool:
    """Constant-time comparison against each configured token."""
    if given is None:
        return False
    ok = False
    for e in expected:
        if e is not None:
            ok |= hmac.compare_digest(given.encode(), e.get_secret_value().encode())
    return ok


def host_allowed(host_header: str | None, listen_host: str, allowed: list[str]) -> bool:
    """On a loopback listen address, only loopback names (and api.allowed_hosts) may be in Host: a page of
    another origin that rebinds its DNS name to 127.0.0.1 sends its own name and is refused."""
    if not is_loopback_host(listen_host):
        return True
    if not host_header:
        return False
    h = host_header.strip().lower()
    if h.startswith("["):  # [::1]:8891
        name = h[1:].partition("]")[0]
    elif h.count(":") == 1:  # name:port
        name = h.rpartition(":")[0]
    else:
        name = h
    return name in LOOPBACK_NAMES or name == listen_host.lower() or name in {a.lower() for a in allowed}


def needs_no_token(path: str) -> bool:
    """Probes and the UI's static files. A UI path must stay under /ui/ once dot segments are resolved (the
    ASGI path is percent-decoded but not normalised)."""
    if path in UNAUTHENTICATED_PATHS or path in UI_PATHS:
        return True
    return path.startswith(UI_PREFIX) and (posixpath.normpath(path) + "/").startswith(UI_PREFIX)


def is_heavy(path: str) -> bool:
    return path in HEAVY_PATHS or path.startswith(HEAVY_PREFIXES)


async def _send_error(send: Send, status: int, detail: str, headers: dict[str, str] | None = None) -> None:
    body = json.dumps({"detail": detail}).encode()
    hdrs = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    hdrs += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": hdrs})
    await send({"type": "http.response.body", "body": body})


T = TypeVar("T")
HEAVY_NICE = 10


def _lower_priority(nice: int) -> None:
    # setpriority(2) with a thread id sets that thread's nice value on Linux (NOTES of the man page).
    tid = threading.get_native_id()
    with contextlib.suppress(OSError):  # not permitted: the query runs at the process' priority
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))


class HeavyPool:
    """Threads at nice +10 for the heavy part of a request (reading the store, building the answer): when the
    CPUs are busy, the scheduler runs the event loop that answers /healthz and /metrics first. Concurrency is
    bounded by :class:`RequestGuard`; this only lowers their priority."""

    def __init__(self, workers: int = 64, nice: int = HEAVY_NICE):  # started as needed, up to the 429 limit
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="heavy-query", initializer=_lower_priority,
                                        initargs=(nice,))

    def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        return self._pool.submit(fn, *args, **kwargs).result()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False)


class RequestGuard:
    """ASGI middleware. ``agent.cfg`` is read per request, so a reload changes tokens and limits at once.
    ``check_host`` is on when the agent serves (cli); in-process test clients send Host: testserver."""

    def __init__(self, app: ASGIApp, agent: Any, check_host: bool = True):
        self.app = app
        self.agent = agent
        self.check_host = check_host
        self.heavy_inflight = 0
        self.rejected_total = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        cfg = self.agent.cfg
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        path = scope.get("path", "")
        if self.check_host:
            listen_host, _ = cfg.listen_address()
            if not host_allowed(headers.get("host"), listen_host, cfg.api.allowed_hosts):
                self.rejected_total += 1
                await _send_error(send, 421, "Host: not accepted on a loopback listen address; use localhost or "
                                             "127.0.0.1, or add the name to api.allowed_hosts")
                return
        if (cfg.api.read_token is not None and not needs_no_token(path)
                and not token_matches(parse_bearer(headers.get("authorization")), cfg.api.read_token, cfg.api.token)):
            self.rejected_total += 1
            await _send_error(send, 401, "Authorization: missing or wrong bearer token (api.read_token)",
                              {"WWW-Authenticate": "Bearer"})
            return
        if not is_heavy(path):
            await self.app(scope, receive, send)
            return
        limit = cfg.api.max_concurrent_queries
        if self.heavy_inflight >= limit:
            self.rejected_total += 1
            await _send_error(send, 429, f"{limit} heavy requests are being served (api.max_concurrent_queries); "
                                         f"retry later", {"Retry-After": "1"})
            return
        self.heavy_inflight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.heavy_inflight -= 1
