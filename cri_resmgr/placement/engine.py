"""The placement engine: container cache, CPU reservations, the shared pool, reconcile, invariants, moves.

Front ends (the CRI relay, the NRI plugin) turn runtime events into calls of :class:`Engine`; the engine
turns its decisions into :class:`~.runtime.RuntimePort` calls. It knows nothing of HTTP/2 or ttrpc.

Locks: ``_lock`` guards the books (cache, reservations) and is never held across a runtime call;
``_apply_lock`` serialises changes of cpusets in the runtime (pool worker, moves, repairs);
``_reconcile_lock`` makes reconciles run one at a time. Order: reconcile -> apply -> books.

Threads (supervised: restarted on error, counted, visible in :meth:`Engine.status`): ``pool`` applies
the shared pool to containers off every caller's path; ``reconcile`` checks the books against the runtime
and the kernel; ``persist`` saves the cache; ``controllers`` runs the resource controllers' hooks.

Why exclusive CPUs are never shared, not even for a moment: a container takes its cpuset when it starts,
so :meth:`Engine.wait_startable` holds a start until no shared container has the starting container's
exclusive CPUs — in the books and in the kernel's cpuset files — and a shared container's start until its
cpuset holds no exclusive CPU (reserved ones included). A shared container created while an exclusive
reservation was pending is brought to the new pool right after it is committed. The runtime may apply an
update of a container that is starting to its spec only (containerd does for a container not yet running),
so a started shared container's kernel cpuset is compared with the books and re-pinned when they differ.
"""

from __future__ import annotations

import dataclasses
import errno
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import metrics as M
from ..sysfs import format_cpulist, parse_cpulist
from ..topology import Topology
from . import annotations as A
from .allocator import CpuAllocator, Hints, InsufficientCpus, Placement, Taken
from .api import ContainerView, InvariantView, MoveRecord, RelayState, ThreadView, ViolationView
from .context import ContainerContext, Controller
from .estimate import Resources, estimate_resources, qos_from_cgroup_parent
from .invariants import InvariantReport, KernelCpusets, Rule, check
from .model import Cache, Container, Kind, Pod, State, cpu_set_of, moves_on
from .persist import load_cache, write_whole
from .runtime import ContainerRecord, PodRecord, RuntimeCallError, RuntimePort, RuntimeSnapshot

log = logging.getLogger(__name__)

MOVES_FILE = "relay-moves.jsonl"
POOL_UPDATE_WORKERS = 8  # concurrent pool updates: a runtime call that hangs holds one, not the others
PERSIST_COALESCE_SECONDS = 0.2
LAZY_SAVE_SECONDS = 1.0  # a change the runtime can tell again is saved this long after it (with the ones after it)

# Counters (metric names defined in cri_resmgr/metrics.py)
INVARIANT_VIOLATIONS = M.RELAY_INVARIANT_VIOLATIONS.name
INVARIANT_REPAIRS = M.RELAY_INVARIANT_REPAIRS.name
REWRITE_ROLLBACKS = M.RELAY_REWRITE_ROLLBACKS.name
CACHE_SAVE_FAILURES = M.RELAY_CACHE_SAVE_FAILURES.name
CACHE_CORRUPT = M.RELAY_CACHE_CORRUPT.name
THREAD_RESTARTS = M.RELAY_THREAD_RESTARTS.name
START_HOLD_TIMEOUTS = M.RELAY_START_HOLD_TIMEOUTS.name
POOL_UPDATE_FAILURES = M.RELAY_POOL_UPDATE_FAILURES.name
CONTROLLER_ERRORS = M.RELAY_CONTROLLER_ERRORS.name
MOVES = M.RELAY_MOVES.name
COUNTERS = (INVARIANT_VIOLATIONS, INVARIANT_REPAIRS, REWRITE_ROLLBACKS, CACHE_SAVE_FAILURES, CACHE_CORRUPT,
            THREAD_RESTARTS, START_HOLD_TIMEOUTS, POOL_UPDATE_FAILURES, CONTROLLER_ERRORS, MOVES)


class Refused(Exception):
    pass


@dataclass(frozen=True)
class EngineSettings:
    reserved_cpus: str = ""
    reserved_namespaces: tuple[str, ...] = ("kube-system",)
    min_shared_cpus: int = 1
    allow_move_exclusive: bool = False
    runtime_timeout_seconds: float = 10.0
    reconcile_interval_seconds: float = 5.0
    start_hold_seconds: float = 5.0  # longest a start waits for the pool to vacate its CPUs (then fails open)

    @classmethod
    def from_relay_config(cls, cfg: Any) -> EngineSettings:
        """From :class:`cri_resmgr.config.RelayConfig` (or anything with the same attributes)."""
        return cls(reserved_cpus=cfg.reserved_cpus, reserved_namespaces=tuple(cfg.reserved_namespaces),
                   min_shared_cpus=cfg.min_shared_cpus, allow_move_exclusive=cfg.allow_move_exclusive,
                   runtime_timeout_seconds=cfg.runtime_timeout_seconds,
                   reconcile_interval_seconds=cfg.reconcile_interval_seconds,
                   start_hold_seconds=min(5.0, cfg.runtime_timeout_seconds))


@dataclass(frozen=True)
class ContainerRequest:
    """A container about to be created, as the front end learnt it from the runtime call."""

    pod_id: str
    name: str
    namespace: str
    pod_name: str
    pod_uid: str
    cgroup_parent: str
    pod_annotations: Mapping[str, str]  # read only when the engine does not know the pod yet
    annotations: Mapping[str, str]
    resources: Resources


@dataclass
class Reservation:
    """CPUs set aside for a create or a resize until the runtime has answered (commit or abort)."""

    token: int
    kind: Kind
    cpus: str
    mems: str
    reason: str
    container: Container  # the record as it will be committed
    resize_of: str = ""  # container id for a resize, "" for a create


@dataclass
class ReconcileSummary:
    pods_added: int = 0
    pods_removed: int = 0
    containers_added: int = 0
    containers_removed: int = 0
    exited: int = 0
    violations: int = 0
    repaired: int = 0

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


@dataclass
class _Supervised:
    name: str
    body: Callable[[], None]
    restarts: int = 0
    last_error: str = ""
    thread: threading.Thread | None = None


@dataclass
class _ControllerCall:
    what: str  # started, adopted, stopped, reload
    contexts: list[ContainerContext] = field(default_factory=list)


class Engine:
    def __init__(self, settings: EngineSettings, topology: Topology, state_dir: Path, runtime: RuntimePort,
                 cgroup_root: Path = Path("/sys/fs/cgroup"), cache_name: str = "relay-cache.json",
                 clock: Callable[[], float] = time.time):
        self.settings = settings
        self.alloc = CpuAllocator(topology, parse_cpulist(settings.reserved_cpus), settings.min_shared_cpus)
        self.state_dir = Path(state_dir)
        self.cache_path = self.state_dir / cache_name
        self.runtime = runtime
        self.kernel = KernelCpusets(cgroup_root)
        self.clock = clock
        self._lock = threading.RLock()
        self._apply_lock = threading.Lock()
        self._reconcile_lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # books or applied cpusets changed
        self._counters: dict[str, float] = dict.fromkeys(COUNTERS, 0.0)
        loaded = load_cache(self.cache_path, clock())
        if loaded.note:
            log.warning("%s", loaded.note)
        if loaded.moved_to is not None:
            self._counters[CACHE_CORRUPT] += 1
        self.cache: Cache = loaded.cache
        self._pending: dict[int, Reservation] = {}
        self._force: set[str] = set()  # containers the pool worker updates whatever the books say
        self._pod_prefixed: dict[str, dict[str, str]] = {}  # pod id -> its cri-resmgr.io/* annotations
        self._starting: set[str] = set()  # starts let through whose answer has not come back: treated as running
        # Every cpuset the books gave a starting container since its start was let through: the runtime builds
        # its cgroup from the spec as it is then, and applies later updates to the spec only (containerd 1.6
        # UpdateContainerResources on a container not yet running), so it may come up with any of them.
        self._start_cpus: dict[str, frozenset[int]] = {}
        self._tokens = itertools.count(1)
        self._moves: deque[MoveRecord] = deque(maxlen=1000)
        self._controllers: list[Controller] = []
        self._ctl_queue: deque[_ControllerCall] = deque()
        self._ctl_cond = threading.Condition()
        self._ctl_queued = 0
        self._ctl_done = 0
        self._ctl_released: set[str] = set()  # ids whose controllers.stopped ran
        # While a reconcile's snapshot is being taken and adopted: the pods and containers removed meanwhile
        # (the runtime's lists may have been taken before, and must not bring them back). None otherwise.
        self._removed_meanwhile: set[str] | None = None
        self._pool_wake = threading.Event()
        self._dirty = threading.Event()  # a change to save now
        self._lazy_dirty = False  # a change the runtime can tell again: saved at the persist thread's next tick
        self._persist_wake = threading.Event()  # either of those: an idle persist thread sleeps until then
        self._deferring = threading.local()  # .wakes: wake-ups a front end runs once its answer is sent
        # wake-ups the engine's threads got, by cause (pool: apply_pool runs; persist: saves on demand, persist_tick:
        # lazy saves; controllers: controller calls queued), for tests and benchmarks
        self._wakeups: dict[str, int] = dict.fromkeys(("pool", "persist", "persist_tick", "controllers"), 0)
        self._stop = threading.Event()
        self._reconcile_now = threading.Event()
        self._threads: dict[str, _Supervised] = {}
        self._last_save_error: int | None = None
        self._last_report = InvariantReport()
        self._last_report_time = 0.0
        self.runtime_up = False

    # -- counters -----------------------------------------------------------------------------------
    def _count(self, name: str, n: float = 1) -> None:
        with self._lock:
            self._counters[name] = self._counters.get(name, 0.0) + n

    def counters(self) -> dict[str, float]:
        with self._lock:
            return dict(self._counters)

    def wakeups(self) -> dict[str, int]:
        """How often each of the engine's threads was asked to run (see ``_wakeups``)."""
        with self._lock:
            return dict(self._wakeups)

    # -- waking the engine's threads ----------------------------------------------------------------
    # Every wake-up costs the interpreter a thread switch (and the woken thread then competes with the caller for
    # it), so threads are woken only when they have something to do, and a front end may run the wake-ups of a
    # runtime hook once its answer is on its way (:meth:`deferring`).
    def _wake(self, kind: str, fn: Callable[[], None]) -> None:
        with self._lock:
            self._wakeups[kind] += 1
        self._later(fn)

    def _later(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` now, or once the front end's answer is sent when it defers this thread's wake-ups."""
        pending: list[Callable[[], None]] | None = getattr(self._deferring, "wakes", None)
        if pending is None:
            fn()
        else:
            pending.append(fn)

    def _wake_pool(self) -> None:
        """The shared pool (or what a container should have of it) changed: the pool worker applies it."""
        self._wake("pool", self._pool_wake.set)

    def _save_soon(self) -> None:
        """A change worth saving at once (exclusive CPUs taken, a resize, a move, a repair)."""
        self._wake("persist", self._save_now)

    def _save_now(self) -> None:
        self._dirty.set()
        self._persist_wake.set()

    def _note_changed(self) -> None:
        """A change the runtime can tell the engine again after a restart (pods, container states, released
        CPUs, the pool's cpusets): saved at the persist thread's next tick, LAZY_SAVE_SECONDS after the first
        such change. Only that first change wakes the thread (an idle engine's persist thread never wakes)."""
        if not self._lazy_dirty:
            self._lazy_dirty = True
            self._wake("persist_tick", self._persist_wake.set)

    @contextmanager
    def deferring(self) -> Iterator[Callable[[], None]]:
        """Collect the wake-ups that engine calls on this thread cause, in order; the context's value runs them.
        The caller must run it, also when the calls fail: once the runtime's answer is sent, or at once."""
        wakes: list[Callable[[], None]] = []
        self._deferring.wakes = wakes

        def run() -> None:
            while wakes:
                wakes.pop(0)()

        try:
            yield run
        finally:
            self._deferring.wakes = None

    # -- the books ----------------------------------------------------------------------------------
    def _taken(self, skip: str | None = None) -> Taken:
        avx: set[int] = set()
        other: set[int] = set()
        for c in itertools.chain(self.cache.containers.exclusive(), (r.container for r in self._pending.values())):
            if c.placement == Kind.EXCLUSIVE and c.live and (skip is None or c.id != skip):
                (avx if c.avx512 else other).update(c.cpu_set)
        return Taken(frozenset(avx), frozenset(other))

    def _pool(self) -> frozenset[int]:
        return self.alloc.shared_pool(self._taken().all)

    def _desired(self, c: Container, pool: frozenset[int]) -> frozenset[int]:
        if c.placement == Kind.RESERVED:
            return self.alloc.reserved or pool
        if c.placement == Kind.PINNED:
            return (parse_cpulist(c.pinned_cpus) & pool) or pool
        return pool

    def _cpus_of(self, namespace: str, pod_id: str, spec: str | None) -> frozenset[int]:
        """CPUs of the containers an (anti-)affinity annotation names: ``name`` (same pod) or ``pod/name``.
        From the table's name index (no walk over every container), remembered until one of them changes."""
        if not spec:
            return frozenset()
        texts = self.cache.containers.cpus_named(namespace, pod_id, A.container_refs(spec))
        return frozenset().union(*(cpu_set_of(t) for t in texts if t))

    def _choose(self, c: Container, whole: int) -> tuple[Placement, Kind]:
        taken = self._taken()
        if c.namespace in self.settings.reserved_namespaces and self.alloc.reserved:
            return self.alloc.reserved_placement(taken.all), Kind.RESERVED
        excl = c.annotations.get(A.EXCLUSIVE)
        if whole and not (excl is not None and not A.truthy(excl)):
            hints = Hints(latency_critical=A.truthy(c.annotations.get(A.LATENCY_CRITICAL)), avx512=c.avx512,
                          near=self._cpus_of(c.namespace, c.pod_id, c.annotations.get(A.AFFINITY)),
                          away=self._cpus_of(c.namespace, c.pod_id, c.annotations.get(A.ANTI_AFFINITY)))
            return self.alloc.allocate(whole, taken, hints), Kind.EXCLUSIVE
        return self.alloc.shared_placement(taken.all), Kind.SHARED

    # -- create -------------------------------------------------------------------------------------
    def place(self, req: ContainerRequest, refresh_exits: bool = True) -> Reservation:
        """Choose CPUs for a container about to be created and reserve them. Raises InsufficientCpus (with
        ``refresh_exits`` only after asking the runtime whether exclusive holders have exited meanwhile;
        without it, the caller never waits on the runtime). Its log line is deferred with the wake-ups
        (:meth:`deferring`): a log record costs ~0.2 ms when the interpreter's caches are cold."""
        with self._lock:
            pod = self.cache.pods.get(req.pod_id)
            parent = req.cgroup_parent or (pod.cgroup_parent if pod else "")
            est = estimate_resources(req.resources, parent)
            ann = A.effective_annotations(self._pod_keys(pod) if pod else A.prefixed(req.pod_annotations),
                                          req.annotations, req.name)
            raw = dict(req.annotations)
            c = Container(
                id="", pod_id=req.pod_id, name=req.name, namespace=req.namespace, pod_name=req.pod_name,
                pod_uid=req.pod_uid, qos_class=est.qos_class, cgroup_parent=parent, annotations=ann,
                raw_annotations=raw, cpu_request_milli=est.cpu_request_milli, cpu_limit_milli=est.cpu_limit_milli,
                memory_limit_bytes=est.memory_limit_bytes, avx512=A.truthy(ann.get(A.AVX512)), created=self.clock())
            refused: InsufficientCpus | None = None
            try:
                p, kind = self._choose(c, est.whole_cpus)
            except InsufficientCpus as e:
                refused = e
        # A container that has just crashed or been OOM-killed may still hold CPUs in the books (kubelet
        # re-creates it as soon as it sees the exit): ask the runtime once (outside the lock), then retry.
        if refused is not None and (not refresh_exits or not self._refresh_exits()):
            raise refused
        with self._lock:
            if refused is not None:
                p, kind = self._choose(c, est.whole_cpus)
            c.placement, c.cpus, c.mems, c.reason = kind, p.cpus_text, p.mems_text, p.reason
            r = Reservation(next(self._tokens), kind, c.cpus, c.mems, p.reason, c)
            self._pending[r.token] = r
        args = (c.namespace, c.pod_name, c.name, c.qos_class or "no QoS", c.cpu_request_milli, kind, c.cpus, c.mems,
                p.reason)
        # A container joining the shared pool is every create's routine (debug); CPUs of its own are news (info).
        level = logging.DEBUG if kind == Kind.SHARED else logging.INFO
        self._later(lambda: log.log(level, "place %s/%s/%s (%s, %dm): %s cpus %s mems %s (%s)", *args))
        return r

    def _refresh_exits(self, timeout: float = 1.0) -> bool:
        """Mark the exclusive containers the runtime reports exited (or no longer has); True if any were.
        The runtime call (bounded: a create is waiting) is made without the books' lock."""
        with self._lock:
            holders = {c.id for c in self.cache.containers.values() if c.placement == Kind.EXCLUSIVE and c.live}
            known = frozenset(self.cache.pods) | frozenset(self.cache.containers)
        if not holders:
            return False
        try:
            snap = self.runtime.snapshot(min(timeout, self.settings.runtime_timeout_seconds), known)
        except RuntimeCallError:
            return False
        states = {rec.id: rec.state for rec in snap.containers}
        released = []
        with self._lock:
            for cid in holders:
                c = self.cache.containers.get(cid)
                if c is not None and c.live and states.get(cid, State.EXITED) == State.EXITED:
                    c.state = State.EXITED
                    released.append(c)
        if released:
            log.info("exclusive containers %s found exited while placing", ", ".join(c.id[:12] for c in released))
            self._released(released, "exited (found while placing)")
        return bool(released)

    def commit(self, r: Reservation, container_id: str = "", resources_blob: str = "",
               later: Callable[[Callable[[], None]], None] | None = None) -> None:
        """The runtime did what the reservation says (created the container, or applied the resize).

        The books change at once, and the engine's threads are woken (the relay commits once the runtime's
        answer is on its way to kubelet; NRI defers them with :meth:`deferring`). Waking the pool worker and
        the persist thread goes through ``later`` when given: the relay wakes them a few ms later, so that the
        shared containers' updates (a runtime process each) and the save (~1 ms of JSON, two fsyncs) do not
        compete with kubelet for the CPUs while it takes the answer, and a burst of creates shares one round of
        them. A start that needs the pool does not wait for that: it wakes the
        worker at once (``_wait``)."""
        created: ContainerContext | None = None
        with self._lock:
            if self._pending.pop(r.token, None) is None:
                return
            pool_changed = True  # a resize or an exclusive create: shared containers leave the CPUs taken
            if r.resize_of:
                c = self.cache.containers.get(r.resize_of)
                if c is None:
                    return
                n = r.container
                c.cpu_request_milli, c.cpu_limit_milli = n.cpu_request_milli, n.cpu_limit_milli
                c.memory_limit_bytes = n.memory_limit_bytes
                c.placement, c.cpus, c.mems, c.reason = n.placement, n.cpus, n.mems, n.reason
                if resources_blob:
                    c.resources = resources_blob
            else:
                c = r.container
                c.id, c.state, c.resources = container_id, State.CREATED, resources_blob
                self.cache.containers[c.id] = c
                created = self._context(c)
                if c.placement != Kind.EXCLUSIVE:
                    # The pool is unchanged, unless an exclusive reservation came or went since place().
                    pool_changed = self._desired(c, self._pool()) != c.cpu_set
            self._changed.notify_all()
        self._committed(created, pool_changed, later)

    def _committed(self, created: ContainerContext | None, pool_changed: bool = True,
                   later: Callable[[Callable[[], None]], None] | None = None) -> None:
        if pool_changed:
            # The shared containers leave newly taken exclusive CPUs (not at place(): moving them during the
            # create slowed the runtime's create, and a failed create moved them for nothing; the start waits
            # for them), and a shared create that raced an exclusive one gets the new pool.
            def wake() -> None:
                self._save_soon()
                self._wake_pool()

            if later is None:
                wake()
            else:
                later(wake)
        else:
            self._note_changed()  # a shared create: Synchronize or a reconcile finds it again after a crash
        if created is not None:
            self._controller_call("created", [created])

    def commit_unplaced(self, r: Reservation, container_id: str = "", cpus_applied: str = "",
                        resources_blob: str = "") -> None:
        """The rewrite failed and the runtime got the original request: record what it really has
        (``cpus_applied``, "" for all CPUs) and bring it into the pool."""
        self._count(REWRITE_ROLLBACKS)
        with self._lock:
            if self._pending.pop(r.token, None) is None:
                return
            if r.resize_of:
                c = self.cache.containers.get(r.resize_of)
                if c is not None and cpus_applied:
                    c.cpus = cpus_applied
                    c.reason = "resize rewrite failed: runtime kept the request's cpuset"
            else:
                c = r.container
                c.id, c.state, c.resources = container_id, State.CREATED, resources_blob
                c.placement = Kind.SHARED
                c.cpus = cpus_applied or format_cpulist(frozenset(self.alloc.topology.cpus))
                c.mems = format_cpulist(self.alloc.mems_of(c.cpu_set))
                c.reason = "rewrite failed: runtime got the original request; joins the shared pool"
                self.cache.containers[c.id] = c
            self._changed.notify_all()
        log.warning("rewrite of %s failed: cache rolled back to what the runtime applied (%s)",
                    container_id or r.resize_of, cpus_applied or "all CPUs")
        self._save_soon()
        self._wake_pool()

    def abort(self, r: Reservation) -> None:
        """The create or resize did not happen: the reserved CPUs return."""
        with self._lock:
            gone = self._pending.pop(r.token, None)
            self._changed.notify_all()
        if gone is not None and r.kind == Kind.EXCLUSIVE:
            self._wake_pool()

    # -- resize -------------------------------------------------------------------------------------
    def resize(self, container_id: str, res: Resources) -> Reservation | None:
        """An in-place resize keeps the engine's cpuset; a changed whole-CPU request reserves like a create."""
        with self._lock:
            c = self.cache.containers.get(container_id)
            if c is None:
                return None
            est = estimate_resources(res, c.cgroup_parent)
            n = dataclasses.replace(c, cpu_request_milli=est.cpu_request_milli, cpu_limit_milli=est.cpu_limit_milli,
                                    memory_limit_bytes=est.memory_limit_bytes)
            if c.placement == Kind.EXCLUSIVE and est.whole_cpus and est.whole_cpus != len(c.cpu_set):
                try:
                    p = self.alloc.allocate(est.whole_cpus, self._taken(skip=c.id),
                                            Hints(avx512=c.avx512, prefer=c.cpu_set))
                    n.cpus, n.mems, n.reason = p.cpus_text, p.mems_text, f"resized: {p.reason}"
                except InsufficientCpus as e:
                    log.warning("resize of %s to %d CPUs keeps %s: %s", c.id[:12], est.whole_cpus, c.cpus, e)
            elif c.placement == Kind.EXCLUSIVE and not est.whole_cpus:
                p = self.alloc.shared_placement(self._taken(skip=c.id).all)
                n.placement, n.reason = Kind.SHARED, "resized to a non-whole request: shared pool"
                n.cpus, n.mems = p.cpus_text, p.mems_text
            r = Reservation(next(self._tokens), n.placement, n.cpus, n.mems, n.reason, n, resize_of=c.id)
            self._pending[r.token] = r
        if r.kind == Kind.EXCLUSIVE and n.cpu_set != c.cpu_set:
            self._pool_wake.set()
        return r

    def wait_vacated(self, r: Reservation, timeout: float) -> bool:
        """Until no running shared container holds CPUs of exclusive reservation ``r`` (a resize that grows)."""
        if r.kind != Kind.EXCLUSIVE:
            return True
        return self._wait(lambda: not self._conflicts(r.container.cpu_set, r.resize_of), timeout)

    # -- lifecycle events ---------------------------------------------------------------------------
    def _held(self, c: Container) -> frozenset[int]:
        held = c.cpu_set or self.alloc.online  # no cpuset: every CPU
        if c.state == State.CREATED and c.id in self._starting:
            held |= self._start_cpus.get(c.id, frozenset())
        return held

    def _runs(self, c: Container) -> bool:
        """Running, or may be: its start has been let through."""
        return c.state in (State.RUNNING, State.UNKNOWN) or (c.state == State.CREATED and c.id in self._starting)

    def _conflicts(self, cpus: frozenset[int], me: str) -> bool:
        """A running non-exclusive container other than ``me`` has some of ``cpus`` (a created one cannot start
        with them: its own start is held until it is off every exclusive CPU)."""
        return any(c.placement != Kind.EXCLUSIVE and self._runs(c) and c.id != me and self._held(c) & cpus
                   for c in self.cache.containers.values())

    def _kernel_conflicts(self, cpus: frozenset[int], me: str) -> bool:
        """A running non-exclusive container's cgroup (as the kernel has it) holds some of ``cpus``: it is
        re-pinned by the pool worker."""
        found = False
        for c in self.cache.containers.values():
            if c.placement == Kind.EXCLUSIVE or c.id == me or not self._runs(c):
                continue
            got = self.kernel.read(c.cgroup_path)
            if got is not None and got & cpus:
                self._force.add(c.id)
                found = True
        if found:
            self._pool_wake.set()
        return found

    def _startable(self, cid: str) -> bool:
        c = self.cache.containers.get(cid)
        if c is None:
            return True
        if c.placement == Kind.EXCLUSIVE:
            return not self._conflicts(c.cpu_set, cid) and not self._kernel_conflicts(c.cpu_set, cid)
        if self._held(c) & self._taken(skip=cid).all:  # pending exclusive reservations included
            self._force.add(cid)  # created containers are updated when they are about to start
            self._pool_wake.set()
            return False
        return True

    def _wait(self, ready: Callable[[], bool], timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self._changed:
            while not ready():
                left = deadline - time.monotonic()
                if left <= 0:
                    self._counters[START_HOLD_TIMEOUTS] += 1
                    return False
                self._pool_wake.set()
                self._changed.wait(min(left, 0.5))
        return True

    def start_now(self, container_id: str) -> bool:
        """For a front end's event loop: True when the start may go on at once, marked as starting as after
        :meth:`wait_startable` (a shared container whose CPUs no exclusive one holds or has reserved, or one the
        books do not know); False when it has to wait, with nothing marked: the caller then calls
        :meth:`wait_startable` off its event loop. Reads only the books (an exclusive container's check reads the
        kernel's cgroup files, so it always waits there)."""
        with self._lock:
            c = self.cache.containers.get(container_id)
            if c is None:
                return True
            if c.placement == Kind.EXCLUSIVE or not self._startable(container_id):
                return False
            self._mark_starting(c)
        return True

    def _mark_starting(self, c: Container) -> None:
        self._starting.add(c.id)  # from here on it may run, whatever the books say
        self._start_cpus[c.id] = self._held(c)

    def wait_startable(self, container_id: str, timeout: float | None = None) -> bool:
        """Hold a start until the container's CPUs are its own (exclusive) or its cpuset is the current pool
        (shared). False when ``timeout`` passed first (the caller lets the start through: fail open)."""
        t = self.settings.start_hold_seconds if timeout is None else timeout
        ok = self._wait(lambda: self._startable(container_id), t)
        with self._lock:
            if container_id in self.cache.containers:
                self._mark_starting(self.cache.containers[container_id])
        return ok

    def started(self, container_id: str) -> None:
        with self._lock:
            c = self.cache.containers.get(container_id)
            self._starting.discard(container_id)
            self._start_cpus.pop(container_id, None)  # from here on its cgroup is read (_kernel_conflicts)
            if c is None or c.state == State.RUNNING:
                return
            c.state = State.RUNNING
            ctx = self._context(c)
            check = c.placement != Kind.EXCLUSIVE and bool(c.cpu_set)
        if check:  # the kernel's file is read without the books' lock (a hook may be waiting for it)
            got = self.kernel.read(ctx.cgroup_path)
            with self._lock:
                if got is not None and got != c.cpu_set and c.live and c.placement != Kind.EXCLUSIVE:
                    # an update raced the start and reached only the spec: apply the books again
                    self._force.add(c.id)
                    self._wake_pool()
        self._note_changed()
        self._controller_call("started", [ctx])

    def stopped(self, container_id: str, why: str = "stopped") -> None:
        self.exited_seen([container_id], why)

    def exited_seen(self, ids: Iterable[str], why: str) -> None:
        """Containers known to have exited (stop, crash, OOM kill): their CPUs are released."""
        released = []
        with self._lock:
            for cid in ids:
                c = self.cache.containers.get(cid)
                if c is not None and c.state != State.EXITED:
                    c.state = State.EXITED
                    self._starting.discard(cid)
                    released.append(c)
        self._released(released, why)

    def removed(self, container_id: str) -> None:
        with self._lock:
            c = self.cache.containers.pop(container_id, None)
            if self._removed_meanwhile is not None:
                self._removed_meanwhile.add(container_id)
            self._starting.discard(container_id)
            self._start_cpus.pop(container_id, None)
        if c is not None:
            self._released([c], "removed", was_live=c.live)
            with self._lock:
                self._ctl_released.discard(container_id)

    def _released(self, ctrs: Sequence[Container], why: str, was_live: bool = True) -> None:
        if not ctrs:
            return
        contexts = []
        with self._lock:
            for c in ctrs:
                if was_live:
                    # Exclusive CPUs given back are news (info); a shared container leaving the pool is every
                    # stop's routine, on the event loop right after the answer: debug.
                    level = logging.INFO if c.placement == Kind.EXCLUSIVE else logging.DEBUG
                    log.log(level, "container %s (%s/%s) %s: releasing %s CPUs %s", c.id[:12], c.pod_name, c.name,
                            why, c.placement, c.cpus)
                if c.id not in self._ctl_released:
                    self._ctl_released.add(c.id)
                    contexts.append(self._context(c))
            self._changed.notify_all()
        self._note_changed()
        if any(c.placement == Kind.EXCLUSIVE for c in ctrs):
            self._wake_pool()
        if contexts:
            self._controller_call("stopped", contexts)

    def pod_added(self, p: PodRecord) -> None:
        with self._lock:
            self.cache.pods[p.id] = self._pod(p)
            self._pod_prefixed.pop(p.id, None)
        self._note_changed()

    def pod_stopped(self, pod_id: str) -> None:
        with self._lock:
            pod = self.cache.pods.get(pod_id)
            if pod is not None:
                pod.state = "notready"
            ids = [c.id for c in self.cache.containers.values() if c.pod_id == pod_id]
        self.exited_seen(ids, "pod stopped")  # the runtime stops every container of a stopped sandbox
        self._note_changed()

    def pod_removed(self, pod_id: str) -> None:
        with self._lock:
            ids = [c.id for c in self.cache.containers.values() if c.pod_id == pod_id]
        for cid in ids:
            self.removed(cid)
        with self._lock:
            self.cache.pods.pop(pod_id, None)
            if self._removed_meanwhile is not None:
                self._removed_meanwhile.add(pod_id)
        self._note_changed()

    def _pod_keys(self, pod: Pod) -> dict[str, str]:
        """A pod's cri-resmgr.io/* annotations, computed once per pod (a pod may carry thousands of others)."""
        keys = self._pod_prefixed.get(pod.id)
        if keys is None:
            if len(self._pod_prefixed) > 4 * len(self.cache.pods) + 64:
                self._pod_prefixed.clear()  # entries of removed pods
            keys = self._pod_prefixed[pod.id] = A.prefixed(pod.annotations)
        return keys

    def _pod(self, p: PodRecord) -> Pod:
        return Pod(id=p.id, name=p.name, namespace=p.namespace, uid=p.uid,
                   qos_class=qos_from_cgroup_parent(p.cgroup_parent), cgroup_parent=p.cgroup_parent,
                   annotations=dict(p.annotations), labels=dict(p.labels), state="ready" if p.ready else "notready",
                   created=p.created or self.clock())

    def _context(self, c: Container) -> ContainerContext:
        return ContainerContext.of(c, self.cache.pods.get(c.pod_id))

    # -- the shared pool (its own thread) -----------------------------------------------------------
    def apply_pool(self, concurrent: bool = False) -> int:
        """Bring every live non-exclusive container's cpuset in line with the pool. Returns updates made.
        ``concurrent``: the updates in worker threads, so that one the runtime hangs (each has the runtime
        deadline) does not hold the others; not from inside a front end's hook (NRI collects the updates of
        its hook's thread into the hook's answer). Raises the first failure after all were tried."""
        done = 0
        failed: list[tuple[Container, frozenset[int], RuntimeCallError]] = []
        with self._apply_lock:
            with self._lock:
                pool = self._pool()
                # Created (not yet started) containers are updated when they are about to start (or forced):
                # a node with hundreds of created containers does not pay an update each per pool change.
                todo = [(c, self._desired(c, pool)) for c in self.cache.containers.values()
                        if c.placement != Kind.EXCLUSIVE and c.live
                        and (c.state != State.CREATED or c.id in self._force or c.id in self._starting)]
                todo = [(c, want) for c, want in todo if want and (want != c.cpu_set or c.id in self._force)]
                self._force.clear()

            def update(item: tuple[Container, frozenset[int]]) -> bool:
                c, want = item
                try:
                    self._update_cpuset(c, want, self.alloc.mems_of(want), self.settings.runtime_timeout_seconds)
                    return True
                except RuntimeCallError as e:
                    failed.append((c, want, e))
                    return False

            if concurrent and len(todo) > 1:
                with ThreadPoolExecutor(min(POOL_UPDATE_WORKERS, len(todo)), "engine-pool-update") as ex:
                    done = sum(ex.map(update, todo))
            else:
                done = sum(map(update, todo))
            error: RuntimeCallError | None = None
            for c, want, e in failed:
                if e.not_found:
                    self.exited_seen([c.id], "gone from the runtime")
                else:
                    with self._lock:
                        self._force.add(c.id)
                    self._count(POOL_UPDATE_FAILURES)
                    log.warning("pool update of %s to %s failed: %s", c.id[:12], format_cpulist(want), e)
                    error = error or e
        if done:
            self._note_changed()
        if error is not None:
            raise error
        return done

    def pool_targets(self, changed_only: bool = True) -> list[tuple[str, str, str, str]]:
        """(container id, cpus, mems, resources blob) for every live non-exclusive container whose cpuset is not
        what the pool says now (every one with ``changed_only=False``: a front end whose answers run ahead of the
        books). Books only: no runtime call (a front end may answer a runtime hook with them)."""
        with self._lock:
            pool = self._pool()
            out = []
            for c in self.cache.containers.values():
                if not c.live or c.placement == Kind.EXCLUSIVE:
                    continue
                want = self._desired(c, pool)
                if want and (want != c.cpu_set or not changed_only):
                    out.append((c.id, format_cpulist(want), format_cpulist(self.alloc.mems_of(want)), c.resources))
            return out

    def pool_delivered(self, done: Iterable[tuple[str, str, str, str]]) -> None:
        """A front end gave the runtime these cpusets (container id, cpus, mems, resources blob) with a hook's
        answer, which the runtime applies before it goes on: the books take them, so that the pool worker does not
        send them again. A container the runtime then failed to update is found by the invariants check."""
        with self._lock:
            for cid, cpus, mems, blob in done:
                c = self.cache.containers.get(cid)
                if c is not None and c.placement != Kind.EXCLUSIVE and c.live:
                    c.cpus, c.mems = cpus, mems
                    if blob:
                        c.resources = blob
            self._changed.notify_all()

    def _update_cpuset(self, c: Container, cpus: frozenset[int], mems: frozenset[int], timeout: float) -> None:
        cpus_text, mems_text = format_cpulist(cpus), format_cpulist(mems)
        blob = self.runtime.update_cpuset(c.id, cpus_text, mems_text, c.resources, timeout)
        with self._lock:
            c.cpus, c.mems, c.resources = cpus_text, mems_text, blob
            if c.id in self._start_cpus:
                self._start_cpus[c.id] |= cpus
            self._changed.notify_all()

    def _pool_loop(self) -> None:
        while not self._stop.is_set():
            self._pool_wake.wait()  # no timeout: woken with work (or to stop), never idly (see _persist_loop)
            self._pool_wake.clear()
            if self._stop.is_set():
                return
            try:
                self.apply_pool(concurrent=True)
            except RuntimeCallError:
                self._stop.wait(0.2)  # retry soon: a create or start may be waiting for this
                self._pool_wake.set()

    # -- moves --------------------------------------------------------------------------------------
    def move(self, container_id: str, cpus: str, mems: str | None = None, who: str = "unknown", why: str = "",
             deadline: float | None = None, gain_by_term: dict[str, float] | None = None,
             separates: list[dict[str, str | float]] | None = None) -> MoveRecord:
        """Apply a new cpuset (and mems) to a running container; the record says what happened.
        ``deadline`` (time.monotonic()): the caller's; past it nothing is changed."""

        def left() -> float:
            return self.settings.runtime_timeout_seconds if deadline is None else deadline - time.monotonic()

        with self._lock:
            c = self.cache.containers.get(container_id)
            rec = MoveRecord(time=self.clock(), container_id=container_id, who=who, why=why,
                             from_cpus=c.cpus if c else "", to_cpus=cpus, from_mems=c.mems if c else "",
                             to_mems=mems or "", result="refused", gain_by_term=dict(gain_by_term or {}),
                             separates=list(separates or []))
            if c is not None:
                rec.container, rec.pod, rec.namespace = c.name, c.pod_name, c.namespace
        if left() <= 0 or not self._apply_lock.acquire(timeout=max(left(), 0)):
            rec.error = "deadline passed before the move could start"
            return self._record(rec)
        try:
            with self._lock:
                try:
                    target, target_mems = self._check_move(c, cpus, mems)
                    rec.to_cpus, rec.to_mems = format_cpulist(target), format_cpulist(target_mems)
                except (Refused, ValueError) as e:
                    rec.error = str(e)
                    return self._record(rec)
            assert c is not None
            budget = min(left(), self.settings.runtime_timeout_seconds)
            if budget <= 0:
                rec.error = "deadline passed before the move could start"
                return self._record(rec)
            try:
                self._update_cpuset(c, target, target_mems, budget)
            except RuntimeCallError as e:
                rec.result, rec.error = "failed", str(e)
                return self._record(rec)
            with self._lock:
                if c.placement != Kind.EXCLUSIVE:
                    c.placement, c.pinned_cpus = Kind.PINNED, rec.to_cpus
                c.reason = f"moved by {who}: {why}" if why else f"moved by {who}"
                rec.result = "applied"
                self._counters[MOVES] += 1
        finally:
            self._apply_lock.release()
        self._save_soon()  # a pinning is what the runtime cannot tell again
        if c.placement == Kind.EXCLUSIVE:
            self._wake_pool()
        return self._record(rec)

    def _check_move(self, c: Container | None, cpus: str, mems: str | None) -> tuple[frozenset[int], frozenset[int]]:
        if c is None:
            raise Refused("unknown container")
        if not c.live:
            raise Refused(f"container is {c.state}")
        target = parse_cpulist(cpus)
        if not target:
            raise Refused("empty cpuset")
        online = frozenset(self.alloc.topology.cpus)
        if target - online:
            raise Refused(f"CPUs {format_cpulist(target - online)} are not online")
        taken = self._taken(skip=c.id)
        if c.placement == Kind.EXCLUSIVE:
            if not self.settings.allow_move_exclusive:
                raise Refused("exclusive container (relay.allow_move_exclusive is off)")
            if target & taken.all:
                raise Refused(f"CPUs {format_cpulist(target & taken.all)} are exclusive to other containers")
            if target & self.alloc.reserved:
                raise Refused(f"CPUs {format_cpulist(target & self.alloc.reserved)} are reserved")
            if len(self.alloc.shared_base - taken.all - target) < self.alloc.min_shared_cpus:
                raise Refused("the shared pool would become too small")
            if self._conflicts(target, c.id):
                raise Refused("shared containers still run on those CPUs")
        else:
            pool = self.alloc.shared_pool(taken.all)
            allowed = pool | (self.alloc.reserved if c.placement == Kind.RESERVED else frozenset())
            if target - allowed:
                raise Refused(f"CPUs {format_cpulist(target - allowed)} are outside the shared pool "
                              f"{format_cpulist(pool)}")
        nodes = frozenset(self.alloc.topology.numa_nodes)
        target_mems = parse_cpulist(mems) if mems else self.alloc.mems_of(target)
        if nodes and target_mems - nodes:
            raise Refused(f"NUMA nodes {format_cpulist(target_mems - nodes)} do not exist")
        return target, target_mems

    def _record(self, rec: MoveRecord) -> MoveRecord:
        with self._lock:
            self._moves.append(rec)
        log.info("move %s %s -> %s by %s: %s%s", rec.container_id[:12], rec.from_cpus, rec.to_cpus, rec.who,
                 rec.result, f" ({rec.error})" if rec.error else "")
        try:
            with open(self.state_dir / MOVES_FILE, "a") as f:
                f.write(rec.model_dump_json() + "\n")
        except OSError as e:
            log.warning("cannot append to %s: %s", self.state_dir / MOVES_FILE, e)
        return rec

    def moves(self) -> list[MoveRecord]:
        with self._lock:
            return list(self._moves)

    # -- reconcile / adopt --------------------------------------------------------------------------
    def reconcile(self) -> ReconcileSummary:
        """Make the books agree with the runtime (one reconcile at a time), apply the pool, then check the
        invariants against the kernel and repair them. Raises RuntimeCallError when the runtime does not answer."""
        with self._reconcile_lock:
            with self._lock:
                known = frozenset(self.cache.pods) | frozenset(self.cache.containers)
                self._removed_meanwhile = set()
            try:
                snap = self.runtime.snapshot(self.settings.runtime_timeout_seconds, known)
                self.runtime_up = True
                return self._adopt(snap, concurrent=True, known=known)
            finally:
                with self._lock:
                    self._removed_meanwhile = None

    def adopt(self, snap: RuntimeSnapshot) -> ReconcileSummary:
        """Like :meth:`reconcile` with the runtime's view given (NRI Synchronize: the runtime's whole view,
        delivered before its other events)."""
        with self._reconcile_lock:
            return self._adopt(snap)

    def _adopt(self, snap: RuntimeSnapshot, concurrent: bool = False,
               known: frozenset[str] | None = None) -> ReconcileSummary:
        """Make the books agree with ``snap``. With ``known`` (the ids in the books when the snapshot was asked
        for), the snapshot is older than the books: the front end kept creating, starting, stopping and removing
        meanwhile. Then only what was known may be found gone (a container committed after the runtime's list was
        taken is not in it: releasing its exclusive CPUs gave them to the shared pool while it ran on them), what
        was removed meanwhile is not adopted again, and a state never moves back (a start or an exit the books
        saw after the list stays)."""
        s = ReconcileSummary()
        pods = {p.id: p for p in snap.pods}
        records = {c.id: c for c in snap.containers}
        released: list[Container] = []
        gone: list[Container] = []
        adopted: list[ContainerContext] = []
        started: list[ContainerContext] = []
        with self._lock:
            judged = known if known is not None else frozenset(self.cache.pods) | frozenset(self.cache.containers)
            removed: set[str] | frozenset[str] = self._removed_meanwhile or frozenset()
            # creates in flight: the runtime may list the container before the front end commits it (adopted
            # now, it would join the pool: the reservation holds its CPUs, and the pool worker would move it)
            creating = {(r.container.pod_id, r.container.name) for r in self._pending.values() if not r.resize_of}
            for pid in [p for p in self.cache.pods if p not in pods and p in judged]:
                del self.cache.pods[pid]
                s.pods_removed += 1
            for cid in [c for c in self.cache.containers if c not in records and c in judged]:
                gone.append(self.cache.containers.pop(cid))
                s.containers_removed += 1
            for pid, p in pods.items():
                if pid in self.cache.pods:
                    self.cache.pods[pid].state = "ready" if p.ready else "notready"
                elif pid not in removed:
                    self.cache.pods[pid] = self._pod(p)
                    s.pods_added += 1
            for cid, rec in records.items():
                c = self.cache.containers.get(cid)
                if c is None:
                    if cid in removed or (rec.pod_id, rec.name) in creating:
                        continue
                    c = self._adopt_container(rec)
                    self.cache.containers[cid] = c
                    s.containers_added += 1
                    if c.state == State.RUNNING:
                        adopted.append(self._context(c))
                    continue
                if not moves_on(c.state, rec.state):
                    continue
                if rec.state == State.EXITED and c.live:
                    released.append(c)
                    s.exited += 1
                elif rec.state == State.RUNNING and c.state == State.CREATED:
                    started.append(self._context(c))
                # UNKNOWN is not EXITED: the container keeps its CPUs until the runtime says it exited.
                c.state = rec.state
                if rec.state != State.CREATED:
                    self._starting.discard(cid)
            self._changed.notify_all()
        self._released(released, "exited (seen at reconcile)")
        self._released(gone, "gone from the runtime")
        with self._lock:
            for c in gone:
                self._ctl_released.discard(c.id)
        if adopted:
            self._controller_call("adopted", adopted)
        if started:
            self._controller_call("started", started)
        if any((s.pods_added, s.pods_removed, s.containers_added, s.containers_removed, s.exited)):
            # rare once the books follow the events; after a restart or a lost cache, the rebuilt books are
            # saved at once
            self._save_soon()
        try:
            self.apply_pool(concurrent)
        except RuntimeCallError as e:
            log.warning("pool update at reconcile failed: %s", e)
        report = self.check_and_repair()
        s.violations, s.repaired = len(report.violations), report.repaired
        return s

    def _adopt_container(self, rec: ContainerRecord) -> Container:
        """A container created while the engine was not looking: it keeps an exclusive cpuset it already has
        when its request says exclusive and nobody else holds those CPUs; otherwise it joins the pool."""
        pod = self.cache.pods.get(rec.pod_id)
        parent = rec.cgroup_parent or (pod.cgroup_parent if pod else "")
        res = rec.resources or Resources()
        est = estimate_resources(res, parent)
        pod_ann = dict(pod.annotations) if pod else {}
        ann = A.effective_annotations(pod_ann, rec.annotations, rec.name)
        c = Container(
            id=rec.id, pod_id=rec.pod_id, name=rec.name, namespace=pod.namespace if pod else "",
            pod_name=pod.name if pod else "", pod_uid=pod.uid if pod else "", qos_class=est.qos_class,
            cgroup_parent=parent, annotations=ann, raw_annotations=dict(rec.annotations),
            cpu_request_milli=est.cpu_request_milli, cpu_limit_milli=est.cpu_limit_milli,
            memory_limit_bytes=est.memory_limit_bytes, avx512=A.truthy(ann.get(A.AVX512)), state=rec.state,
            cpus=res.cpuset_cpus, mems=res.cpuset_mems, resources=rec.resources_blob,
            created=rec.created or self.clock(), reason="adopted at resync")
        held = c.cpu_set
        taken = self._taken().all
        excl = ann.get(A.EXCLUSIVE)
        if (est.whole_cpus and len(held) == est.whole_cpus and held <= self.alloc.allocatable
                and not held & taken and c.live and not (excl is not None and not A.truthy(excl))):
            c.placement = Kind.EXCLUSIVE
        elif c.namespace in self.settings.reserved_namespaces and self.alloc.reserved:
            c.placement = Kind.RESERVED
        else:
            c.placement = Kind.SHARED
        return c

    # -- invariants ---------------------------------------------------------------------------------
    def check_invariants(self) -> InvariantReport:
        """The invariants as the kernel's cpuset files show them (no repair). Counted. A container whose resize
        the runtime is applying right now is left out (the kernel may already have what the books have not)."""
        with self._lock:
            resizing = {r.resize_of for r in self._pending.values() if r.resize_of}
            ctrs = [dataclasses.replace(c) for c in self.cache.containers.values() if c.id not in resizing]
        report, _seen = check(ctrs, self.kernel)
        if report.violations:
            self._count(INVARIANT_VIOLATIONS, len(report.violations))
            for v in report.violations:
                log.warning("invariant %s violated by %s: %s%s", v.rule, v.container_id[:12], v.detail,
                            f" (with {v.other_id[:12]})" if v.other_id else "")
        with self._lock:
            self._last_report, self._last_report_time = report, self.clock()
        return report

    def check_and_repair(self) -> InvariantReport:
        """Check, then re-pin every container a violation names to what the books say it should have. Holds the
        apply lock throughout, so that no pool update or move is between its runtime call and its books."""
        with self._apply_lock:
            return self._check_and_repair()

    def _check_and_repair(self) -> InvariantReport:
        report = self.check_invariants()
        if report.ok:
            return report
        with self._lock:
            for v in report.violations:
                if v.rule == Rule.BOOKS_OVERLAP:
                    c = self.cache.containers.get(v.container_id)
                    if c is not None:
                        c.placement, c.reason = Kind.SHARED, f"exclusive CPUs also held by {v.other_id[:12]}: shared"
            pool = self._pool()
            targets: dict[str, tuple[Container, frozenset[int]]] = {}
            for v in report.violations:
                for cid in (v.container_id, v.other_id):
                    c = self.cache.containers.get(cid)
                    if c is None or not c.live or cid in targets:
                        continue
                    want = c.cpu_set if c.placement == Kind.EXCLUSIVE else self._desired(c, pool)
                    if want:
                        targets[cid] = (c, want)
        for c, want in targets.values():
            try:
                self._update_cpuset(c, want, self.alloc.mems_of(want), self.settings.runtime_timeout_seconds)
                report.repaired += 1
            except RuntimeCallError as e:
                log.warning("repair of %s failed: %s", c.id[:12], e)
        self._count(INVARIANT_REPAIRS, report.repaired)
        self._save_soon()
        with self._lock:
            self._last_report = report
        return report

    # -- persistence --------------------------------------------------------------------------------
    def persist(self) -> bool:
        """Save the cache whole or not at all. False (counted, previous file kept) when it could not be."""
        with self._lock:
            data = self.cache.to_json()
        try:
            write_whole(self.cache_path, data)
        except OSError as e:
            self._count(CACHE_SAVE_FAILURES)
            if e.errno != self._last_save_error:
                log.error("cannot save %s (%s); the previous file is kept", self.cache_path,
                          errno.errorcode.get(e.errno or 0, str(e)))
            self._last_save_error = e.errno
            return False
        if self._last_save_error is not None:
            log.info("saved %s again", self.cache_path)
        self._last_save_error = None
        return True

    def _persist_loop(self) -> None:
        while not self._stop.is_set():
            # No timeout: every wake-up of an engine thread may land in a front end's hook and take the interpreter
            # from it (issue 15), so an engine with nothing to save sleeps until there is something.
            self._persist_wake.wait()
            self._persist_wake.clear()
            if self._stop.is_set():
                return
            if not self._dirty.is_set() and not self._lazy_dirty:
                continue  # a wake-up whose change the last save already took
            if not self._dirty.is_set():
                self._dirty.wait(LAZY_SAVE_SECONDS)  # a lazy change: saved at the tick, or with a save-now
            self._dirty.clear()
            self._lazy_dirty = False  # before saving: a change made during the save is saved next time
            if self._stop.is_set():
                return
            if not self.persist():
                self._stop.wait(1.0)  # retry: the disk may have room again
                self._save_now()
            # Coalesce: the first change after a quiet spell is saved at once, then at most one save (two
            # fsyncs, which compete with the runtime's own) per PERSIST_COALESCE_SECONDS while events keep
            # coming. What a crash loses meanwhile the next reconcile finds in the runtime: exclusive cpusets
            # are re-adopted, shared containers rejoin the pool (a move's pinning is what can be lost).
            self._stop.wait(PERSIST_COALESCE_SECONDS)

    # -- reconcile loop -----------------------------------------------------------------------------
    def request_reconcile(self) -> None:
        self._reconcile_now.set()

    def _reconcile_loop(self) -> None:
        while not self._stop.is_set():
            self._reconcile_now.wait(self.settings.reconcile_interval_seconds)
            self._reconcile_now.clear()
            if self._stop.is_set():
                return
            try:
                self.reconcile()
            except RuntimeCallError as e:
                self.runtime_up = not e.unavailable
                log.debug("reconcile: %s", e)

    # -- controllers --------------------------------------------------------------------------------
    def add_controller(self, c: Controller) -> None:
        self._controllers.append(c)

    def _controller_call(self, what: str, contexts: list[ContainerContext]) -> None:
        if not self._controllers:
            return
        if what != "reload":  # containers no controller ``wants`` (nothing to enforce or release) wake nobody
            contexts = [x for x in contexts if self._wanted(x)]
            if not contexts:
                return

        def queue() -> None:
            with self._ctl_cond:
                self._ctl_queue.append(_ControllerCall(what, contexts))
                self._ctl_queued += 1
                self._ctl_cond.notify_all()

        self._wake("controllers", queue)

    def _wanted(self, ctx: ContainerContext) -> bool:
        for c in self._controllers:
            wants: Callable[[ContainerContext], bool] | None = getattr(c, "wants", None)
            if wants is None or wants(ctx):
                return True
        return False

    def reload_controllers(self) -> None:
        with self._lock:
            running = [self._context(c) for c in self.cache.containers.values() if c.state == State.RUNNING]
        self._controller_call("reload", running)

    def flush_controllers(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self._ctl_cond:
            target = self._ctl_queued
            while self._ctl_done < target:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._ctl_cond.wait(left)
        return True

    def _controllers_loop(self) -> None:
        while not self._stop.is_set():
            with self._ctl_cond:
                if not self._ctl_queue:
                    if not self._stop.is_set():  # stop() notifies under this lock: checked here, never missed
                        self._ctl_cond.wait()  # no timeout (see _persist_loop)
                    continue
                call = self._ctl_queue.popleft()
            try:
                for ctl in self._controllers:
                    try:
                        if call.what == "reload":
                            ctl.reload(call.contexts)
                        else:
                            fn: Callable[[ContainerContext], None] | None = getattr(ctl, call.what, None)
                            if fn is None:  # "created" is optional
                                continue
                            for ctx in call.contexts:
                                fn(ctx)
                    except Exception:  # a controller never breaks placement
                        log.exception("controller %s failed at %s", getattr(ctl, "name", ctl), call.what)
                        self._count(CONTROLLER_ERRORS)
            finally:
                with self._ctl_cond:
                    self._ctl_done += 1
                    self._ctl_cond.notify_all()

    # -- threads ------------------------------------------------------------------------------------
    def spawn(self, name: str, body: Callable[[], None]) -> None:
        """Run ``body`` on a supervised thread: restarted (with back-off) when it raises, counted."""
        sup = _Supervised(name, body)
        self._threads[name] = sup

        def run() -> None:
            delay = 0.2
            while not self._stop.is_set():
                try:
                    sup.body()
                    return
                except Exception as e:  # supervised: log, count, restart
                    sup.restarts += 1
                    sup.last_error = f"{type(e).__name__}: {e}"
                    self._count(THREAD_RESTARTS)
                    log.exception("thread %s failed; restarting in %.1fs", name, delay)
                    self._stop.wait(delay)
                    delay = min(delay * 2, 5.0)

        sup.thread = threading.Thread(target=run, name=f"engine-{name}", daemon=True)
        sup.thread.start()

    def start(self) -> None:
        for name, body in (("pool", self._pool_loop), ("reconcile", self._reconcile_loop),
                           ("persist", self._persist_loop), ("controllers", self._controllers_loop)):
            self.spawn(name, body)
        # Containers loaded from the saved cache are neither started nor adopted now: the controllers keep no
        # state of their own, so they enforce every running container once at start.
        self.reload_controllers()

    def stop(self) -> None:
        self._stop.set()
        self._pool_wake.set()
        self._reconcile_now.set()
        self._save_now()
        with self._ctl_cond:
            self._ctl_cond.notify_all()
        for sup in self._threads.values():
            if sup.thread is not None and sup.thread is not threading.current_thread():
                sup.thread.join(timeout=2)
        self.persist()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    # -- views --------------------------------------------------------------------------------------
    def threads(self) -> list[ThreadView]:
        return [ThreadView(name=s.name, alive=bool(s.thread and s.thread.is_alive()), restarts=s.restarts,
                           last_error=s.last_error) for s in self._threads.values()]

    def invariant_view(self) -> InvariantView:
        with self._lock:
            r, t = self._last_report, self._last_report_time
            total, repairs = self._counters[INVARIANT_VIOLATIONS], self._counters[INVARIANT_REPAIRS]
        return InvariantView(time=t, checked=r.checked, repaired=r.repaired, violations_total=int(total),
                             repairs_total=int(repairs),
                             violations=[ViolationView(rule=str(v.rule), container_id=v.container_id, detail=v.detail,
                                                       other_id=v.other_id) for v in r.violations])

    def state(self, runtime: str = "", problem: str | None = None) -> RelayState:
        with self._lock:
            taken = self._taken()
            views = [ContainerView(
                id=c.id, pod_id=c.pod_id, name=c.name, pod=c.pod_name, namespace=c.namespace, pod_uid=c.pod_uid,
                qos_class=c.qos_class, state=str(c.state), placement=str(c.placement), cpus=c.cpus, mems=c.mems,
                cpu_request_milli=c.cpu_request_milli, cpu_limit_milli=c.cpu_limit_milli,
                memory_limit_bytes=c.memory_limit_bytes, annotations=c.annotations, cgroup_path=c.cgroup_path,
                reason=c.reason) for c in self.cache.containers.values()]
            return RelayState(
                runtime_up=self.runtime_up, runtime=runtime, problem=problem,
                shared_pool=format_cpulist(self.alloc.shared_pool(taken.all)),
                reserved=format_cpulist(self.alloc.reserved),
                exclusive={c.id: c.cpus for c in self.cache.containers.values()
                           if c.placement == Kind.EXCLUSIVE and c.live},
                containers=views, pods=len(self.cache.pods), pending=len(self._pending),
                threads=self.threads(), invariants=self.invariant_view(),
                counters={k: v for k, v in self._counters.items()})

    def gauges(self) -> dict[str, float]:
        with self._lock:
            taken = self._taken().all
            out = {M.RELAY_RUNTIME_UP.name: float(self.runtime_up), M.RELAY_EXCLUSIVE_CPUS.name: float(len(taken)),
                   M.RELAY_SHARED_POOL_CPUS.name: float(len(self.alloc.shared_pool(taken)))}
            out.update(self._counters)
        return out

    def container(self, container_id: str) -> Container | None:
        """A copy of one container's record."""
        with self._lock:
            c = self.cache.containers.get(container_id)
            return dataclasses.replace(c) if c is not None else None

    def container_ids(self) -> list[str]:
        with self._lock:
            return list(self.cache.containers)

    def pod(self, pod_id: str) -> Pod | None:
        with self._lock:
            p = self.cache.pods.get(pod_id)
            return dataclasses.replace(p) if p is not None else None

    def pod_identity(self, pod_id: str) -> tuple[str, str, str, str] | None:
        """(namespace, name, uid, cgroup parent) of a pod the books know: a front end's create need not read
        them from the request again (cheaper than :meth:`pod`, which copies the record)."""
        with self._lock:
            p = self.cache.pods.get(pod_id)
            return (p.namespace, p.name, p.uid, p.cgroup_parent) if p is not None else None

    def counts(self) -> tuple[int, int]:
        with self._lock:
            return len(self.cache.pods), len(self.cache.containers)

