"""``cri-resmgr relay``: the relay as a process of its own.

Kept apart from the agent on purpose: the relay is on kubelet's critical path, and in one process the
collectors' and the HTTP server's Python work would compete with forwarding for the interpreter. The
relay imports neither the store nor the collectors; the agent (and its rebalancer) reach it over the
control socket.

Start-up order: single-instance lock (``run_dir/cri-resmgr-relay.lock``), topology, the runtime's
``Version`` (must name containerd or CRI-O unless ``relay.allow_untested_runtimes``), the cache from
``state_dir`` reconciled with the runtime, then the sockets. A relay socket left by a dead relay is
removed only when nothing accepts connections on it. A cache file that cannot be used never stops the
relay: it is moved aside and the state rebuilt from the runtime.

SIGHUP re-reads the configuration file and hands it to the resource controllers (``controls.*``); a
configuration they refuse is logged and the running one kept.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import stat
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import grpc

from .. import metrics as M
from ..config import Config, ConfigError, parse_listen
from ..export.exposition import CONTENT_TYPE
from ..placement.controllers.manager import ControlManager
from ..placement.engine import Engine, EngineSettings
from ..runfiles import SocketInUse, StartupError, claim_run_dirs, claim_socket
from ..topology import discover
from . import control
from .core import CriFrontEnd
from .dump import Dumper
from .h2proxy import Hooks, Proxy
from .runtime import CriRuntime, RuntimeClient, cri_methods, untested_runtime
from .scheduling import Priority, prioritise
from .stats import RelayStats

log = logging.getLogger("cri_resmgr.relay")

LOCK_NAME = "cri-resmgr-relay.lock"
# The event-loop thread's scheduler slice (EEVDF): about one wake-up's work (scheduling.py).
EVENT_LOOP_SLICE_NS = 200_000
CONTROL_NAME = "relay-control.sock"


def _claim(path: Path) -> None:
    try:
        claim_socket(path)
    except SocketInUse as e:
        raise StartupError(f"{e} (another relay?)") from None


def follow_runtime_socket(path: Path, runtime: Path) -> None:
    """Owner and mode of the relay socket follow the runtime's: whoever may talk to the runtime may talk
    to the relay, and nobody else. Without a runtime socket: root, 0660."""
    try:
        st = os.stat(runtime)
        mode, uid, gid = stat.S_IMODE(st.st_mode) & 0o770 or 0o660, st.st_uid, st.st_gid
    except OSError:
        mode, uid, gid = 0o660, None, None
    os.chmod(path, mode)
    if uid is not None and gid is not None and os.geteuid() == 0:
        os.chown(path, uid, gid)


class _MetricsHandler(BaseHTTPRequestHandler):
    text_fn = staticmethod(lambda: "")
    timeout = 5  # seconds a connection may stay idle or slow: no thread is held by a silent client

    def do_GET(self):
        if self.path.split("?")[0] != "/metrics":
            self.send_error(404)
            return
        body = self.text_fn().encode()
        self.send_response(200)
        self.send_header("Content-Type", CONTENT_TYPE)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


class RelayProcess:
    def __init__(self, cfg: Config, reload_config: Callable[[], Config] | None = None):
        self.cfg = cfg
        self.reload_config = reload_config
        self.rc = cfg.relay
        self.run_dir = Path(cfg.run_dir)
        self.state_dir = Path(cfg.state_dir)
        self.control_path = Path(self.rc.control_socket or self.run_dir / CONTROL_NAME)
        self.lock_fd: int | None = None
        self.stats = RelayStats(cri_methods())
        # Rewrites and held starts (a start may wait up to relay.runtime_timeout_seconds, at most 5 s, for
        # its CPUs to be vacated) and ListContainers parsing; pool updates have a thread of their own.
        self.executor = ThreadPoolExecutor(max_workers=8, thread_name_prefix="relay-worker")
        self.engine: Engine | None = None
        self.relay: CriFrontEnd | None = None
        self.controls: ControlManager | None = None
        self.dumper: Dumper | None = None
        self.sockets: list[Path] = []
        self.control_server: grpc.Server | None = None
        self.http: ThreadingHTTPServer | None = None
        self.event_loop_priority: Priority | None = None  # what the kernel granted the event-loop thread

    def metrics_text(self) -> str:
        if self.relay is not None:
            gauges = self.relay.gauges()
            if self.event_loop_priority is not None:
                gauges[M.RELAY_EVENT_LOOP_NICE.name] = float(self.event_loop_priority.nice)
            self.stats.gauges = gauges
        text = self.stats.render()
        if self.controls is not None:
            text += self.controls.metrics_text()
        return text

    def prepare(self) -> None:
        # hpack logs every header it decodes at DEBUG: never wanted, and costly on the forwarding path.
        logging.getLogger("hpack").setLevel(logging.WARNING)
        self.lock_fd = claim_run_dirs(self.run_dir, self.state_dir, LOCK_NAME, "a relay")
        topo = discover(self.cfg.paths.sysfs)
        if not topo.cpus:
            raise StartupError(f"no CPUs found under {self.cfg.paths.sysfs}/devices/system/cpu")
        runtime = RuntimeClient(self.rc.runtime_socket, self.rc.runtime_timeout_seconds)
        try:
            v = runtime.version(timeout=min(5.0, self.rc.runtime_timeout_seconds))
            problem = untested_runtime(v)
            if problem and not self.rc.allow_untested_runtimes:
                raise StartupError(f"refusing to start: {problem}", code=2)
            log.info("runtime %s %s (CRI %s) at %s", v.runtime_name, v.runtime_version, v.runtime_api_version,
                     self.rc.runtime_socket)
        except grpc.RpcError as e:
            log.warning("runtime %s not reachable yet (%s); calls get UNAVAILABLE until it is",
                        self.rc.runtime_socket, e.code().name)
        if self.rc.dump_file:
            self.dumper = Dumper(self.rc.dump_file)
        port = CriRuntime(runtime)
        try:
            self.engine = Engine(EngineSettings.from_relay_config(self.rc), topo, self.state_dir, port,
                                 cgroup_root=Path(self.cfg.paths.cgroup))
        except ValueError as e:
            raise StartupError(f"relay: {e}", code=2) from None
        self.relay = CriFrontEnd(self.rc, self.engine, runtime, self.executor.submit, self.stats, self.dumper)
        port.before_snapshot = self.relay.check_version
        self._add_controls()
        summary = self.relay.resync()
        if summary is not None:
            pods, ctrs = self.engine.counts()
            log.info("resync: %s; %d pods, %d containers cached", summary, pods, ctrs)
        _claim(Path(self.rc.socket))
        if self.rc.image_socket and self.rc.image_relay_socket:
            _claim(Path(self.rc.image_relay_socket))
        _claim(self.control_path)

    def _add_controls(self) -> None:
        """The resource controllers (RDT, block I/O, RT: docs/resource-control.md) as an engine controller."""
        try:
            self.controls = ControlManager.from_config(self.cfg)
        except ConfigError as e:
            raise StartupError(e.render(), code=2) from None
        assert self.engine is not None and self.relay is not None
        self.engine.add_controller(self.controls)
        self.relay.decorate = self.controls.decorate

    def reload(self) -> None:
        """SIGHUP: re-read the configuration; the resource controllers re-enforce with the new one."""
        if self.reload_config is None or self.controls is None or self.engine is None:
            log.info("SIGHUP: nothing to reload")
            return
        self.controls.reload_from(self.reload_config, self.engine.reload_controllers)

    async def serve(self, ready: threading.Event | None = None) -> None:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        loop.add_signal_handler(signal.SIGHUP, lambda: loop.run_in_executor(None, self.reload))
        relay = self.relay
        engine = self.engine
        assert relay is not None and engine is not None, "prepare() first"
        proxy = Proxy(str(self.rc.runtime_socket), relay, self.executor, refusal=relay.refusal,
                      on_upstream=relay.on_upstream, on_reset=self.stats.reset,
                      # A restarted runtime is found within half a second, and kubelet's connection sent GOAWAY.
                      backoff_max=0.5)
        await proxy.start(str(self.rc.socket))
        follow_runtime_socket(Path(self.rc.socket), Path(self.rc.runtime_socket))
        self.sockets.append(Path(self.rc.socket))
        proxies = [proxy]
        if self.rc.image_socket and self.rc.image_relay_socket:
            img = Proxy(str(self.rc.image_socket), _PassThrough(relay), self.executor, on_reset=self.stats.reset)
            await img.start(str(self.rc.image_relay_socket))
            follow_runtime_socket(Path(self.rc.image_relay_socket), Path(self.rc.image_socket))
            self.sockets.append(Path(self.rc.image_relay_socket))
            proxies.append(img)
        self.control_server = control.serve(relay, self.control_path, self.metrics_text,
                                            timings=lambda: {"rewrites": self.stats.rewrite_samples()})
        self.sockets.append(self.control_path)
        if self.rc.metrics_listen:
            host, port = parse_listen(self.rc.metrics_listen)
            handler = type("H", (_MetricsHandler,), {"text_fn": staticmethod(self.metrics_text)})
            self.http = ThreadingHTTPServer((host, port), handler)
            threading.Thread(target=self.http.serve_forever, name="relay-metrics", daemon=True).start()
        engine.start()
        engine.spawn("events", relay.events_loop)
        gc.freeze()  # objects from start-up never need collecting: keeps GC pauses off the forwarding path
        # The engine's threads (pool, persist, controllers) wake on every create and hold the GIL in turns: the
        # event loop, back from a socket write, waited up to a whole turn (default 5 ms) for it. Shorter turns
        # keep forwarding ahead of that bookkeeping (bench/relay_bench.py phase 4).
        sys.setswitchinterval(0.001)
        # The event loop runs ahead of ordinary work: woken by a call, it preempts the task it finds on its CPU
        # instead of queueing behind it (scheduling.py). Only this thread: the engine's threads keep their nice.
        got = prioritise(self.rc.event_loop_nice, EVENT_LOOP_SLICE_NS)
        self.event_loop_priority = got
        (log.warning if got.error else log.info)("event loop scheduling: %s", got.describe())
        log.info("relay listening on %s -> %s (control %s)", self.rc.socket, self.rc.runtime_socket,
                 self.control_path)
        if ready is not None:
            ready.set()
        await stop.wait()
        log.info("relay stopping")
        for p in proxies:
            await p.close()

    def shutdown(self) -> None:
        if self.control_server is not None:
            self.control_server.stop(grace=1)
        if self.http is not None:
            self.http.shutdown()
        if self.engine is not None:
            self.engine.stop()
        for p in self.sockets:
            p.unlink(missing_ok=True)
        if self.dumper is not None:
            self.dumper.close()
        self.executor.shutdown(wait=False, cancel_futures=True)
        if self.lock_fd is not None:
            os.close(self.lock_fd)


class _PassThrough(Hooks):
    """Hooks for the image-service socket: forward everything, count it in the relay's metrics."""

    def __init__(self, relay: CriFrontEnd):
        self.relay = relay

    def finished(self, method: str, code: int, seconds: float) -> None:
        self.relay.finished(method, code, seconds)


def event_loop_factory() -> tuple[Callable[[], asyncio.AbstractEventLoop], str]:
    """The relay's event loop: uvloop's (libuv, in C) when it is installed, else asyncio's own.

    Every forwarded call wakes the loop twice (the request, the answer); asyncio's selector loop spends its
    wake-ups in Python. With uvloop the relay's CPU per pass-through Version call went from ~190 to ~140 µs
    of user time here (bench/relay_bench.py, docs/relay.md). Probed at start, not at import: the proxy runs
    on either (tests drive it on asyncio's)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop, "asyncio"
    return uvloop.new_event_loop, f"uvloop {uvloop.__version__}"


def run(cfg: Config, reload_config: Callable[[], Config] | None = None) -> int:
    proc = RelayProcess(cfg, reload_config)
    try:
        proc.prepare()
        factory, name = event_loop_factory()
        log.info("event loop: %s", name)
        with asyncio.Runner(loop_factory=factory) as runner:
            runner.run(proc.serve())
        return 0
    except StartupError as e:
        print(f"cri-resmgr relay: {e}", file=sys.stderr, flush=True)
        return e.code
    finally:
        proc.shutdown()
