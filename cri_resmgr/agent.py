"""The agent: owns the lifecycle, runtime directories, the single-instance lock, the store, the
collector threads and configuration reloads. HTTP lives in :mod:`cri_resmgr.web.app` and only reads."""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from . import metrics as M
from .clock import SteadyClock
from .collectors.avx512 import Avx512Collector
from .collectors.base import Collector, CollectorUnavailable
from .collectors.cgroup import CgroupCollector, runtime_names
from .collectors.cpu import CpuCollector
from .collectors.perf import PerfCollector
from .collectors.rdt import RdtCollector
from .collectors.series import Cardinality, SeriesFilter
from .collectors.sst import SstCollector
from .config import Config, ConfigError, load_config
from .export.exposition import DirectSample
from .export.remote_write import RemoteWriter
from .heap import fix_mmap_threshold, limit_arenas, release_free_heap
from .runfiles import acquire_lock
from .store import Columns, Store, checkpoint
from .supervise import LoopStatus, start_supervised
from .topology import Topology, discover

if TYPE_CHECKING:
    from .rebalancer.service import RebalancerService

log = logging.getLogger("cri_resmgr")

LOCK_NAME = "cri-resmgr.lock"
# Options that are bound at start (sockets, directories, filesystem roots, store layout):
# a reload that changes them is accepted for the rest and reports them as pending a restart.
RESTART_KEYS = ("listen", "run_dir", "state_dir", "paths", "node_name", "store")


class InstanceLock:
    """``flock`` on ``run_dir/cri-resmgr.lock``, held for the process lifetime (see :func:`runfiles.acquire_lock`:
    a lock file left by a killed process never blocks a restart)."""

    def __init__(self, path: Path):
        self.path = path
        self.fd: int | None = None

    def acquire(self) -> None:
        self.fd = acquire_lock(self.path, "cri-resmgr")

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


@dataclass
class CollectorHealth:
    name: str
    enabled: bool = True
    up: bool = False
    reason: str = "not run yet"
    interval_seconds: float = 0.0
    last_run: float | None = None
    last_duration_seconds: float = 0.0
    errors_total: int = 0
    runs_total: int = 0
    last_error: str | None = None


@dataclass
class ConfigState:
    active: Config
    source: str | None
    last_error: str | None = None
    last_error_time: float | None = None
    last_reload_time: float | None = None
    reloads_total: int = 0
    reload_errors_total: int = 0
    pending_restart: list[str] = field(default_factory=list)


def _writable_dir(path: Path, mode: int) -> Path:
    path.mkdir(parents=True, exist_ok=True, mode=mode)
    if not os.access(path, os.W_OK | os.X_OK):
        raise PermissionError(errno.EACCES, "not writable", str(path))
    return path


def prepare_dirs(cfg: Config) -> tuple[Path, Path, list[str]]:
    """Create run_dir (0750) and state_dir (0700). Without root, the *default* locations fall back
    to per-user ones (XDG), so the agent still starts; explicitly configured ones must work."""
    notes = []
    defaults = Config()
    out = []
    for key, mode, fallback in (
        ("run_dir", 0o750, Path(os.environ.get("XDG_RUNTIME_DIR") or f"/tmp/cri-resmgr-{os.getuid()}") / "cri-resmgr"),
        ("state_dir", 0o700, Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local/state") / "cri-resmgr"),
    ):
        path = getattr(cfg, key)
        try:
            out.append(_writable_dir(path, mode))
        except PermissionError:
            if path != getattr(defaults, key):
                raise
            notes.append(f"{key} {path} is not writable (not root?); using {fallback}")
            out.append(_writable_dir(fallback, mode))
    return out[0], out[1], notes


class Agent:
    def __init__(self, cfg: Config, config_path: Path | None = None, flags: dict | None = None,
                 env: dict | None = None, clock: SteadyClock | None = None):
        # The running configuration is self.cfg; this is it plus where it came from and how reloads went.
        self.config_state = ConfigState(cfg, str(config_path) if config_path else None)
        self.config_path = config_path
        self.flags = flags or {}
        self.env = env
        self.started = time.time()
        self.topology: Topology = Topology()
        self.store = Store(cfg.store.retention_seconds, cfg.store.max_series)
        # Each block a wide table seals is merged into the one growing before it (every ~40 s at 1,000 containers):
        # what the merge freed goes back to the OS then, not at the next checkpoint.
        self.store.after_merge = release_free_heap
        # series.disable / series.drop_labels, applied to every collector's samples before the store
        self.series_filter = SeriesFilter(lambda: self.cfg.series)
        self.cardinality = Cardinality(self.store, self.series_filter)
        self.collectors: dict[str, Collector] = {}
        self.health: dict[str, CollectorHealth] = {}
        self.restore_note: str | None = None
        self.remote_write: RemoteWriter | None = None
        self.rebalancer: RebalancerService | None = None  # from start()
        self._threads: dict[str, threading.Thread] = {}
        self._stop = threading.Event()
        self._wake: dict[str, threading.Event] = {}
        self._lock: InstanceLock | None = None
        self._logged_errors: dict[str, str] = {}
        self.run_dir: Path = cfg.run_dir
        self.state_dir: Path = cfg.state_dir
        # Sample timestamps: wall-clock seconds that never step back (clock.py); tests inject the wall clock.
        self.clock = clock or SteadyClock()
        self.loops: dict[str, LoopStatus] = {}  # supervised background loops, /api/v1/loops
        self.checkpoint_errors_total = 0
        # Remembers what is on disk: each checkpoint writes the blocks sealed since the last one (store/checkpoint.py)
        self.checkpointer = checkpoint.Checkpointer()
        self._reload_lock = threading.Lock()  # SIGHUP and POST /api/v1/config/reload, one at a time

    def now(self) -> float:
        return self.clock()

    @property
    def cfg(self) -> Config:
        return self.config_state.active

    # -- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> None:
        fix_mmap_threshold()  # MB-sized temporaries go back to the OS when freed (heap.py)
        limit_arenas()  # before the collector threads: they share the malloc arenas (heap.py)
        self.run_dir, self.state_dir, notes = prepare_dirs(self.cfg)
        for n in notes:
            log.warning(n)
        self._lock = InstanceLock(self.run_dir / LOCK_NAME)
        self._lock.acquire()
        self.topology = discover(self.cfg.paths.sysfs)
        if not self.topology.cpus:
            log.warning("no CPUs found under %s; per-CPU labels will be incomplete", self.cfg.paths.sysfs)
        self._build_collectors()
        if self.cfg.store.checkpoint:
            res = self.checkpointer.restore(self.store, self.state_dir, self._interval_of, now=self.now())
            if res.error or res.note:
                self.restore_note = res.error or res.note
            elif res.restored:
                log.info("restored %d series from %s", res.series, self.state_dir / checkpoint.FILENAME)
        for name in self.collectors:
            self._start_thread(name)
        if self.cfg.store.checkpoint:
            self._supervise("checkpoint", self._checkpoint_loop)
        # Reads export.remote_write on every cycle, so a reload can turn it on, change it or turn it off.
        self.remote_write = RemoteWriter(lambda: self.cfg.export.remote_write, self.store, self.self_metrics,
                                         self.cfg.node_name, clock=self.now)
        self.remote_write.start()
        self.loops["remote_write"] = self.remote_write.loop_status
        # Rounds every rebalancer.interval_seconds; mode advise by default (docs/rebalancer.md).
        from .rebalancer.service import RebalancerService

        rebalancer = self.rebalancer = RebalancerService(self)
        self._supervise("rebalancer", lambda: rebalancer._loop(self._stop))

    def _supervise(self, name: str, target) -> None:
        """Run a background loop that is restarted after an error, counted, and shown in /api/v1/loops."""
        self.loops[name] = LoopStatus(name)
        self._threads[name] = start_supervised(self.loops[name], target, self._stop)

    def stop(self) -> None:
        self._stop.set()
        for ev in self._wake.values():
            ev.set()
        for t in self._threads.values():
            t.join(timeout=10)
        if self.remote_write is not None:
            self.remote_write.stop()  # after the collectors: their last rows are flushed too
        if self.cfg.store.checkpoint:
            try:
                self.checkpointer.save(self.store, self.state_dir)
            except OSError as e:
                log.error("final checkpoint failed: %s", e)
        for c in self.collectors.values():
            c.close()
        if self._lock:
            self._lock.release()

    def _interval_of(self, table: str) -> float:
        cc = getattr(self.cfg.collectors, table, None)
        return getattr(cc, "interval_seconds", 1.0)

    def _build_collectors(self) -> None:
        c = self.cfg.collectors
        cgroup = CgroupCollector(self.cfg.paths.cgroup, c.cgroup, names=runtime_names(c.cgroup))
        self.collectors = {"cgroup": cgroup, "cpu": CpuCollector(self.cfg.paths.proc, self.topology)}
        # Hardware collectors attribute to the containers the cgroup collector discovers (one discovery).
        self.collectors["perf"] = PerfCollector(self.cfg.paths.cgroup, c.perf, cgroup, self.topology)
        self.collectors["rdt"] = RdtCollector(self.cfg.paths.resctrl, self.cfg.paths.cgroup, c.rdt, cgroup)
        self.collectors["sst"] = SstCollector(self.cfg.paths.sysfs, c.sst, self.topology)
        self.collectors["avx512"] = Avx512Collector(c.avx512, self.cfg.paths, self.topology, cgroup.identities)
        for name in self.collectors:
            cc = getattr(c, name)
            self.health[name] = CollectorHealth(name, enabled=cc.enabled, interval_seconds=cc.interval_seconds,
                                                reason="not run yet" if cc.enabled else "disabled in config")

    def _start_thread(self, name: str) -> None:
        self._wake[name] = threading.Event()
        t = threading.Thread(target=self._collector_loop, args=(name,), name=f"collector-{name}", daemon=True)
        t.start()
        self._threads[name] = t

    # -- collection --------------------------------------------------------------------------------
    def run_collector_once(self, name: str) -> None:
        col = self.collectors[name]
        h = self.health[name]
        cc = getattr(self.cfg.collectors, name)
        h.enabled, h.interval_seconds = cc.enabled, cc.interval_seconds
        if not cc.enabled:
            h.up, h.reason = False, "disabled in config"
            return
        t0 = time.monotonic()
        now = self.now()
        try:
            probe = col.probe()
            if not probe.ok:
                raise CollectorUnavailable(probe.reason)
            row = col.collect_row(now)
            if isinstance(row, Columns) and not self.series_filter.active():
                self.store.append_columns(name, now, row, cc.interval_seconds)
            else:
                samples = row.samples() if isinstance(row, Columns) else row
                self.store.append(name, now, self.series_filter.apply(samples), cc.interval_seconds)
            h.up, h.reason, h.last_error = True, col.status() or probe.reason or "ok", None
            self._logged_errors.pop(name, None)
        except CollectorUnavailable as e:
            h.up, h.reason = False, str(e)
            self._log_once(name, f"collector {name} is down: {e}")
        except Exception as e:  # noqa: BLE001 - a broken collector must not take the agent down (logged below)
            h.up, h.reason = False, f"error: {type(e).__name__}: {e}"
            h.errors_total += 1
            h.last_error = h.reason
            self._log_once(name, f"collector {name} failed: {type(e).__name__}: {e}", exc=True)
        finally:
            h.runs_total += 1
            h.last_run = now
            h.last_duration_seconds = time.monotonic() - t0

    def _log_once(self, name: str, msg: str, exc: bool = False) -> None:
        if self._logged_errors.get(name) != msg:
            self._logged_errors[name] = msg
            log.error(msg, exc_info=exc) if exc else log.warning(msg)

    def _collector_loop(self, name: str) -> None:
        wake = self._wake[name]
        while not self._stop.is_set():
            start = time.monotonic()
            self.run_collector_once(name)
            interval = getattr(self.cfg.collectors, name).interval_seconds
            wake.wait(max(0.0, interval - (time.monotonic() - start)))
            wake.clear()

    def _checkpoint_loop(self) -> None:
        while not self._stop.wait(self.cfg.store.checkpoint_interval_seconds):
            try:
                self.checkpointer.save(self.store, self.state_dir)
                self._logged_errors.pop("checkpoint", None)
                release_free_heap()  # the checkpoint's transient arrays (the rebalancer trims after its rounds)
            except OSError as e:  # a full or read-only disk: counted, retried next interval
                self.checkpoint_errors_total += 1
                self.loops["checkpoint"].last_error = f"checkpoint to {self.state_dir} failed: {e}"
                self._log_once("checkpoint", f"checkpoint to {self.state_dir} failed: {e}")

    def ready(self) -> bool:
        return all(h.runs_total > 0 or not h.enabled for h in self.health.values())

    # -- configuration -----------------------------------------------------------------------------
    def reload(self) -> bool:
        """Re-read the config file. A bad file is rejected and the running config stays. Serialised: SIGHUP
        and the API may ask at the same time."""
        with self._reload_lock:
            return self._reload()

    def _reload(self) -> bool:
        st = self.config_state
        try:
            new = load_config(self.config_path, env=self.env, flags=self.flags)
        except ConfigError as e:
            st.reload_errors_total += 1
            st.last_error = e.render()
            st.last_error_time = time.time()
            log.error("configuration reload rejected, keeping the running one:\n%s", st.last_error)
            return False
        old = st.active
        pending = [k for k in RESTART_KEYS if getattr(new, k) != getattr(old, k)]
        keep = {k: getattr(old, k) for k in pending}
        st.active = new.model_copy(update=keep)
        st.pending_restart = pending
        for name in self.collectors:
            # A table's rows cover the retention at its collector's interval: a new interval re-sizes it.
            interval = getattr(st.active.collectors, name).interval_seconds
            if interval != getattr(old.collectors, name).interval_seconds:
                self.store.resize(name, interval)
        st.reloads_total += 1
        st.last_reload_time = time.time()
        st.last_error = None
        logging.getLogger().setLevel(st.active.log_level.upper())
        for name, col in self.collectors.items():
            col.reconfigure(getattr(st.active.collectors, name))
            self._wake.get(name, threading.Event()).set()
        log.info("configuration reloaded%s", f"; restart needed for: {', '.join(pending)}" if pending else "")
        return True

    # -- self-metrics ------------------------------------------------------------------------------
    def self_metrics(self) -> list[DirectSample]:
        out = []
        for h in self.health.values():
            lab = {"collector": h.name}
            out.append(DirectSample(M.COLLECTOR_UP, lab, 1.0 if h.up else 0.0))
            out.append(DirectSample(M.COLLECTOR_DURATION, lab, h.last_duration_seconds))
            out.append(DirectSample(M.COLLECTOR_ERRORS, lab, float(h.errors_total)))
        out.append(DirectSample(M.CONFIG_RELOAD_ERRORS, {}, float(self.config_state.reload_errors_total)))
        out.append(DirectSample(M.CONFIG_RELOADS, {}, float(self.config_state.reloads_total)))
        out.append(DirectSample(M.STORE_SERIES, {}, float(self.store.series_count)))
        out.append(DirectSample(M.STORE_DROPPED, {}, float(self.store.dropped_series)))
        out.append(DirectSample(M.STORE_CHECKPOINT_ERRORS, {}, float(self.checkpoint_errors_total)))
        out.append(DirectSample(M.STORE_ROWS_OUT_OF_ORDER, {}, float(self.store.rows_out_of_order)))
        out.append(DirectSample(M.CLOCK_AHEAD, {}, float(self.clock.ahead_seconds)))
        for loop in self.loops.values():
            out.append(DirectSample(M.LOOP_RESTARTS, {"loop": loop.name}, float(loop.restarts_total)))
        if self.rebalancer is not None:
            gate = self.rebalancer.gate
            out += [DirectSample(M.REBALANCER_ROUNDS, {"result": "planned"}, float(gate.planned_total)),
                    DirectSample(M.REBALANCER_ROUNDS, {"result": "skipped"}, float(gate.skipped_total))]
        out += self.cardinality.self_metrics()
        out += [DirectSample(M.SERIES_DISABLED_SAMPLES, {"family": f}, float(n))
                for f, n in sorted(self.series_filter.dropped_samples.items())]
        if self.remote_write is not None and self.cfg.export.remote_write is not None:
            out += self.remote_write.self_metrics()
        return out
