"""``cri-resmgr nri``: the NRI plugin as a process of its own (docs/nri.md).

SIGHUP re-reads the configuration file for the resource controllers (``controls.*``), as the relay does.

Start-up: single-instance lock (``run_dir/cri-resmgr-nri.lock``, flock(2): the kernel drops it when the holder
dies), topology, the placement engine with its saved cache (``state_dir/nri-cache.json``), the control socket
(the relay's interface: moves, state, metrics, reconcile), then the runtime's NRI socket: connect, register,
answer Configure and Synchronize. When the runtime goes away (restart, crash) the plugin connects again with
back-off (0.1 s doubling to ``nri.reconnect_max_seconds``) and registers anew; containerd then synchronises it
again, and the engine adopts what it finds without booking anything twice.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import FrameType
from typing import Any

from ..config import Config, ConfigError
from ..placement.api import ContainerView, RelayState
from ..placement.control import EngineControl
from ..placement.controllers.manager import ControlManager
from ..placement.engine import Engine, EngineSettings
from ..runfiles import SocketInUse, StartupError, claim_run_dirs, claim_socket
from ..topology import discover
from .connection import Connection
from .plugin import NriPort, Plugin, RuntimeView
from .stats import NriStats
from .trace import GcPauses, HookTracer
from .ttrpc import RpcError

log = logging.getLogger("cri_resmgr.nri")

LOCK_NAME = "cri-resmgr-nri.lock"
CONTROL_NAME = "relay-control.sock"  # the front end's control socket: the rebalancer and the agent look here
CACHE_NAME = "nri-cache.json"
SWITCH_INTERVAL_SECONDS = 0.0005
FIRST_BACKOFF_SECONDS = 0.1


class NriControl(EngineControl):
    """What the control socket (:mod:`cri_resmgr.relay.control`) serves, from the engine: the same methods as
    the relay's front end, so the rebalancer and the agent need not know which front end runs."""

    def __init__(self, engine: Engine, port: NriPort, decorate: Callable[[ContainerView], None] | None = None):
        self.engine = engine
        self.port = port
        self.decorate = decorate

    def state(self) -> RelayState:
        return self._decorated(self.engine.state(self.port.describe()))


class NriProcess:
    def __init__(self, cfg: Config, reload_config: Callable[[], Config] | None = None):
        self.cfg = cfg
        self.reload_config = reload_config
        self.controls: ControlManager | None = None
        self.nc = cfg.nri
        self.run_dir = Path(cfg.run_dir)
        self.state_dir = Path(cfg.state_dir)
        self.control_path = Path(self.nc.control_socket or self.run_dir / CONTROL_NAME)
        self.gc_pauses = GcPauses()
        self.tracer = HookTracer(Path(cfg.paths.proc), self.gc_pauses)
        self.stats = NriStats(self.gc_pauses)
        self.view = RuntimeView()
        self.conn: Connection | None = None
        self.port = NriPort(self.view, lambda: self.conn)
        self.executor = ThreadPoolExecutor(max_workers=4, thread_name_prefix="nri-worker")
        self.engine: Engine | None = None
        self.plugin: Plugin | None = None
        self.control_server: Any = None
        self.lock_fd: int | None = None
        self.stop = threading.Event()
        self._woken = threading.Event()  # a stop or the connection's close: the main thread never polls

    def observe(self, event: str, result: str, seconds: float) -> None:
        self.stats.record(event, result, seconds)  # ttrpc logs each at debug level (bench/nri_bench.py reads them)

    def metrics_text(self) -> str:
        text = self.stats.render()
        if self.engine is not None:
            from .. import metrics as M
            from ..export.exposition import format_family

            for name, v in sorted(self.engine.gauges().items()):
                spec = M.lookup(name)
                if spec is not None:
                    text += format_family(spec, [((), v)])
        if self.controls is not None:
            text += self.controls.metrics_text()
        return text

    def prepare(self) -> None:
        self.lock_fd = claim_run_dirs(self.run_dir, self.state_dir, LOCK_NAME, "an NRI plugin")
        topo = discover(self.cfg.paths.sysfs)
        if not topo.cpus:
            raise StartupError(f"no CPUs found under {self.cfg.paths.sysfs}/devices/system/cpu")
        try:
            self.engine = Engine(EngineSettings.from_relay_config(self.cfg.relay), topo, state_dir=self.state_dir,
                                 runtime=self.port, cgroup_root=Path(self.cfg.paths.cgroup), cache_name=CACHE_NAME)
        except ValueError as e:
            raise StartupError(f"placement: {e}", code=2) from None
        self.plugin = Plugin(self.engine, self.view, self.port)
        self._add_controls()
        try:
            claim_socket(self.control_path)
        except SocketInUse as e:  # a relay or another plugin serves it: two front ends would both place
            raise StartupError(f"{e} (a relay or another plugin?)", code=2) from None

    def _add_controls(self) -> None:
        """The resource controllers (RDT, block I/O, RT: docs/resource-control.md), as with the relay."""
        try:
            self.controls = ControlManager.from_config(self.cfg)
        except ConfigError as e:
            raise StartupError(e.render(), code=2) from None
        assert self.engine is not None
        self.engine.add_controller(self.controls)

    def _decorate(self, v: ContainerView) -> None:
        if self.controls is not None:
            self.controls.decorate(v)

    def reload(self) -> None:
        """SIGHUP: re-read the configuration; the resource controllers re-enforce with the new one."""
        if self.reload_config is None or self.controls is None or self.engine is None:
            log.info("SIGHUP: nothing to reload")
            return
        self.controls.reload_from(self.reload_config, self.engine.reload_controllers)

    def serve(self) -> None:
        from ..relay import control

        assert self.engine is not None and self.plugin is not None
        self.engine.start()
        target = NriControl(self.engine, self.port, self._decorate)
        self.control_server = control.serve(target, self.control_path, self.metrics_text)
        gc.freeze()  # objects from start-up never need collecting: keeps GC pauses out of the hooks
        self.gc_pauses.install()
        log.info("NRI plugin %s-%s started (control %s); runtime socket %s", self.nc.plugin_index,
                 self.nc.plugin_name, self.control_path, self.nc.socket)
        backoff = FIRST_BACKOFF_SECONDS
        warned = False
        while not self.stop.is_set():
            try:
                conn = Connection(self.nc.socket, self.plugin.methods(), self.executor,
                                  self.nc.request_timeout_seconds, self.observe, tracer=self.tracer,
                                  on_trace=self.stats.record_trace, on_closed=self._woken.set)
            except OSError as e:
                if not warned:
                    log.warning("cannot connect to %s (%s); retrying with back-off up to %gs", self.nc.socket,
                                e.strerror or e, self.nc.reconnect_max_seconds)
                    warned = True
                self.stop.wait(backoff)
                backoff = min(backoff * 2, self.nc.reconnect_max_seconds)
                continue
            self.conn = conn
            try:
                conn.register(self.nc.plugin_name, self.nc.plugin_index, timeout_seconds=10)
            except RpcError as e:
                log.warning("registration with %s failed: %s", self.nc.socket, e)
                conn.close()
                self.stop.wait(backoff)
                backoff = min(backoff * 2, self.nc.reconnect_max_seconds)
                continue
            warned = False
            self.stats.connected = self.engine.runtime_up = True
            log.info("registered with the runtime at %s as %s-%s", self.nc.socket, self.nc.plugin_index,
                     self.nc.plugin_name)
            since = time.monotonic()
            while not self.stop.is_set() and not conn.closed.is_set():
                # No timeout: a thread waking while a hook runs takes the interpreter from it (issue 15).
                self._woken.wait()
                self._woken.clear()
            self.stats.connected = self.engine.runtime_up = False
            self.view.synced = False  # until the next Synchronize: reconcile waits instead of trusting a stale view
            self.plugin.synchronized.clear()
            self.conn = None
            if self.stop.is_set():
                conn.close()
                break
            # A connection the runtime drops at once (e.g. it refuses the registration) must not become a tight loop.
            backoff = FIRST_BACKOFF_SECONDS if time.monotonic() - since > 10 else \
                min(backoff * 2, self.nc.reconnect_max_seconds)
            log.warning("runtime closed the NRI connection (%s); reconnecting in %gs", conn.close_reason or "EOF",
                        backoff)
            self.stop.wait(backoff)

    def request_stop(self) -> None:
        self.stop.set()
        self._woken.set()

    def shutdown(self) -> None:
        self.stop.set()
        self.gc_pauses.uninstall()
        if self.conn is not None:
            self.conn.close()
        if self.control_server is not None:
            self.control_server.stop(grace=1)
            self.control_path.unlink(missing_ok=True)
        if self.engine is not None:
            self.engine.stop()
        self.executor.shutdown(wait=False, cancel_futures=True)
        if self.lock_fd is not None:
            os.close(self.lock_fd)


def run(cfg: Config, reload_config: Callable[[], Config] | None = None) -> int:
    # Hooks are answered on the connection's reader thread, which wakes from recv() needing the interpreter: when
    # one of the engine's threads is running Python code then, CPython makes it let go only after the switch
    # interval (5 ms by default). 0.5 ms bounds that wait (bench/nri_gil_bench.py, 400 hooks with a thread busy
    # saving the cache: p50 6.3 ms at 5 ms, 2.2 ms at 1 ms, 2.3 ms at 0.5 ms; no difference when idle).
    sys.setswitchinterval(SWITCH_INTERVAL_SECONDS)
    proc = NriProcess(cfg, reload_config)

    def on_term(_sig: int, _frm: FrameType | None) -> None:
        proc.request_stop()

    def on_hup(_sig: int, _frm: FrameType | None) -> None:
        threading.Thread(target=proc.reload, name="nri-reload", daemon=True).start()

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    signal.signal(signal.SIGHUP, on_hup)
    try:
        proc.prepare()
        proc.serve()
        log.info("NRI plugin stopping")
        return 0
    except StartupError as e:
        print(f"cri-resmgr nri: {e}", file=sys.stderr, flush=True)
        return e.code
    finally:
        proc.shutdown()
