"""The CRI front end of the placement engine: intercepted CRI calls become engine calls.

One handler per CRI method the relay owns (:data:`HANDLERS`); each says how the proxy treats the call
(:class:`~.h2proxy.Mode`), may rewrite the held request (on the event loop when that is short and waits on
nothing, else in a worker thread), and turns the call's outcome into engine calls on the event loop (short: the
engine only updates its books there). What a rewrite hands to the completion is a :class:`CallContext`.

- CreateContainer: reserve CPUs (``Engine.place``), put them into the request (:mod:`.wire`: the pod's
  annotations are neither decoded nor encoded again); commit when the runtime created the container, roll back
  to what it really got when the rewrite failed, abort otherwise.
- UpdateContainerResources (kubelet's in-place resize): keep the engine's cpuset; a changed whole-CPU
  request reserves like a create.
- StartContainer: held until the container's CPUs are its own (``Engine.wait_startable``, bounded; then fail
  open), so an exclusive CPU is never shared with a running container, not even for a moment.
- Stop/Remove, RunPodSandbox/StopPodSandbox/RemovePodSandbox: the engine's books follow.
- ListContainers (kubelet relists every second): exited containers release their CPUs.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
from cri_api.v1 import api_pb2 as pb
from google.protobuf.message import DecodeError

from ..config import RelayConfig
from ..placement.allocator import InsufficientCpus
from ..placement.api import ContainerView, RelayState
from ..placement.control import EngineControl
from ..placement.engine import ContainerRequest, Engine, Reservation
from ..placement.runtime import PodRecord, RuntimeCallError
from . import wire
from .h2proxy import IN_WORKER, Exchange, Hooks, InWorker, Mode, Reject, code_name, status
from .runtime import RuntimeClient, resources_of, untested_runtime
from .stats import RelayStats

log = logging.getLogger(__name__)

RT = "/runtime.v1.RuntimeService/"
LIST_OBSERVE_SECONDS = 0.5
# After an exclusive create, the shared containers' updates and the save wait this long (the updates: or until the
# start, which needs them, arrives): each update is a runtime process (runc update), and started together at the
# create's answer they took the CPUs from kubelet as it took that answer (bench/relay_bench.py phase 4: ~1 ms of
# the create's time on 2 CPUs). kubelet's StartContainer follows its CreateContainer within about a millisecond.
POOL_GRACE_SECONDS = 0.005
OK, NOT_FOUND = status(grpc.StatusCode.OK), status(grpc.StatusCode.NOT_FOUND)


@dataclass
class CallContext:
    """What a rewrite hands to its call's completion (``Exchange.context``)."""

    reservation: Reservation
    original_cpus: str  # the request's cpuset before the rewrite: what the runtime has if the rewrite failed
    resources_blob: str  # the resources as rewritten (hex of LinuxContainerResources)


class Handler:
    """How the relay treats one CRI method. Subclasses override what they need."""

    mode = Mode.OBSERVE

    def __init__(self, fe: CriFrontEnd):
        self.fe = fe
        self.engine = fe.engine

    def rewrite(self, ex: Exchange) -> bytes | Reject | None:
        """Worker thread: the new request message, a Reject, or None to forward it unchanged."""
        return None

    def rewrite_inline(self, ex: Exchange) -> bytes | Reject | None | InWorker:
        """Event loop: as :meth:`rewrite` when that is short and waits on nothing slow, else IN_WORKER."""
        return IN_WORKER

    def complete(self, ex: Exchange) -> None:
        """Event loop: the call ended (``ex.code``)."""

    def settle(self, ex: Exchange, container_id: str = "") -> None:
        """A held create or resize ended: its reservation is aborted (the call failed), committed (the runtime
        got the rewritten request) or committed as what the runtime really got (it got the original)."""
        ctx = self.fe.take_context(ex)
        if ctx is None:
            return
        if ex.code != OK:
            self.engine.abort(ctx.reservation)
        elif ex.rewritten:
            self.engine.commit(ctx.reservation, container_id, ctx.resources_blob, later=self.fe.pool_soon)
        else:
            self.engine.commit_unplaced(ctx.reservation, container_id, ctx.original_cpus)


class CreateContainer(Handler):
    """Placed on the event loop (~0.2 ms of books work, no runtime call): the request goes on without two
    thread hand-offs. Only a create the books cannot place goes to a worker, which asks the runtime for exits
    (a crashed container may still hold CPUs in the books) before refusing it."""

    mode = Mode.REWRITE

    def rewrite_inline(self, ex: Exchange) -> bytes | Reject | None | InWorker:
        return self._rewrite(ex, inline=True)

    def rewrite(self, ex: Exchange) -> bytes | Reject | None:
        out = self._rewrite(ex, inline=False)
        assert not isinstance(out, InWorker)
        return out

    def _rewrite(self, ex: Exchange, inline: bool) -> bytes | Reject | None | InWorker:
        # The pod's annotations (thousands, at times) are not decoded unless the engine reads them: it does
        # only for a pod it has not seen created. See wire.py.
        req = wire.parse_create(ex.request)
        cfg = req.config
        res = cfg.linux.resources
        # A pod the books know (from its RunPodSandbox, or adopted) is not read again from the request: its
        # sandbox config (~45 kB with 1,000 annotations) stays unparsed. Its identity and cgroup parent are the
        # sandbox's own, fixed when it was created.
        known = self.engine.pod_identity(req.pod_sandbox_id)
        if known is not None and all(known):
            namespace, pod_name, pod_uid, parent = known
        else:
            meta = req.sandbox_metadata
            namespace, pod_name, pod_uid = meta.namespace, meta.name, meta.uid
            parent = req.sandbox_linux.cgroup_parent
        creq = ContainerRequest(
            pod_id=req.pod_sandbox_id, name=cfg.metadata.name, namespace=namespace, pod_name=pod_name,
            pod_uid=pod_uid, cgroup_parent=parent, pod_annotations=req.pod_annotations,
            annotations=dict(cfg.annotations), resources=resources_of(res))
        with self.fe.exchange_lock:
            if ex.code is not None:
                return None  # the call ended (client gone) while waiting for a worker
            try:
                with self.engine.deferring() as run:  # the log line (and wake-ups) once the request is sent
                    try:
                        r = self.engine.place(creq, refresh_exits=not inline)
                    finally:
                        self.fe.after_forward(run)
            except InsufficientCpus as e:
                if inline:
                    return IN_WORKER  # nothing reserved: the worker places it again, asking the runtime first
                return Reject(status(grpc.StatusCode.RESOURCE_EXHAUSTED),
                              f"cri-resmgr: container {creq.namespace}/{creq.pod_name}/{creq.name}: {e}")
            ctx = CallContext(r, res.cpuset_cpus, "")
            ex.context = ctx  # from here on the completion settles the reservation, whatever happens below
        message, resources = wire.set_cpuset(req, r.cpus, r.mems)
        ctx.resources_blob = resources.hex()
        return message

    def complete(self, ex: Exchange) -> None:
        cid = pb.CreateContainerResponse.FromString(ex.response).container_id if ex.code == OK else ""
        self.settle(ex, cid)


class UpdateContainerResources(Handler):
    mode = Mode.REWRITE

    def rewrite(self, ex: Exchange) -> bytes | Reject | None:
        req = pb.UpdateContainerResourcesRequest.FromString(ex.request)
        if not req.HasField("linux"):
            return None
        with self.fe.exchange_lock:
            if ex.code is not None:
                return None
            r = self.engine.resize(req.container_id, resources_of(req.linux))
            if r is None:
                return None
            ctx = CallContext(r, req.linux.cpuset_cpus, "")
            ex.context = ctx
        req.linux.cpuset_cpus, req.linux.cpuset_mems = r.cpus, r.mems
        ctx.resources_blob = req.linux.SerializeToString().hex()
        # A resize that takes new CPUs waits (bounded) until shared containers have left them.
        self.engine.wait_vacated(r, self.engine.settings.start_hold_seconds)
        return req.SerializeToString()

    def complete(self, ex: Exchange) -> None:
        self.settle(ex)


class StartContainer(Handler):
    """Held, never changed: a start waits (bounded) until the container's CPUs are its own. The usual start (a
    shared container, nothing to wait for) is let through on the event loop; only one that may have to wait
    goes to a worker (two thread hand-offs: measured ~1 ms of a start's time on 2 busy CPUs)."""

    mode = Mode.REWRITE

    def rewrite_inline(self, ex: Exchange) -> bytes | Reject | None | InWorker:
        cid = pb.StartContainerRequest.FromString(ex.request).container_id
        return None if self.engine.start_now(cid) else IN_WORKER

    def rewrite(self, ex: Exchange) -> bytes | Reject | None:
        cid = pb.StartContainerRequest.FromString(ex.request).container_id
        if not self.engine.wait_startable(cid):
            log.warning("start of %s let through before its CPUs were vacated (waited %.1fs)", cid[:12],
                        self.engine.settings.start_hold_seconds)
        return None

    def complete(self, ex: Exchange) -> None:
        if ex.code == OK:
            self.engine.started(pb.StartContainerRequest.FromString(ex.request).container_id)


class StopContainer(Handler):
    def complete(self, ex: Exchange) -> None:
        if ex.code in (OK, NOT_FOUND):
            self.engine.stopped(pb.StopContainerRequest.FromString(ex.request).container_id, "stopped")


class RemoveContainer(Handler):
    def complete(self, ex: Exchange) -> None:
        if ex.code in (OK, NOT_FOUND):
            self.engine.removed(pb.RemoveContainerRequest.FromString(ex.request).container_id)


class RunPodSandbox(Handler):
    def complete(self, ex: Exchange) -> None:
        if ex.code != OK:
            return
        cfg = pb.RunPodSandboxRequest.FromString(ex.request).config
        pid = pb.RunPodSandboxResponse.FromString(ex.response).pod_sandbox_id
        self.engine.pod_added(PodRecord(id=pid, name=cfg.metadata.name, namespace=cfg.metadata.namespace,
                                        uid=cfg.metadata.uid, cgroup_parent=cfg.linux.cgroup_parent,
                                        annotations=dict(cfg.annotations), labels=dict(cfg.labels)))


class StopPodSandbox(Handler):
    def complete(self, ex: Exchange) -> None:
        if ex.code in (OK, NOT_FOUND):
            self.engine.pod_stopped(pb.StopPodSandboxRequest.FromString(ex.request).pod_sandbox_id)


class RemovePodSandbox(Handler):
    def complete(self, ex: Exchange) -> None:
        if ex.code in (OK, NOT_FOUND):
            self.engine.pod_removed(pb.RemovePodSandboxRequest.FromString(ex.request).pod_sandbox_id)


class ListContainers(Handler):
    """kubelet relists containers every second (PLEG): a free look at which ones have exited (a crash, an
    OOM kill). Parsed off the event loop."""

    def complete(self, ex: Exchange) -> None:
        if ex.code == OK:
            self.fe.executor_submit(self._observe, ex.response)

    def _observe(self, response: bytes) -> None:
        try:
            items = pb.ListContainersResponse.FromString(response).containers
        except DecodeError:  # a malformed response is the runtime's business; kubelet will see it too
            return
        self.engine.exited_seen([it.id for it in items if it.state == pb.CONTAINER_EXITED],
                                "seen exited in ListContainers")


HANDLERS: dict[str, type[Handler]] = {RT + h.__name__: h for h in (
    CreateContainer, UpdateContainerResources, StartContainer, StopContainer, RemoveContainer, RunPodSandbox,
    StopPodSandbox, RemovePodSandbox, ListContainers)}
LIST = RT + "ListContainers"


class CriFrontEnd(Hooks, EngineControl):
    """The proxy's hooks: classification, per-method handlers, metrics, the message dump."""

    def __init__(self, cfg: RelayConfig, engine: Engine, runtime: RuntimeClient,
                 submit: Callable[..., Any], stats: RelayStats | None = None, dumper: Any = None):
        self.cfg = cfg
        self.engine = engine
        self.runtime = runtime
        self.executor_submit = submit
        self.stats = stats or RelayStats()
        self.dumper = dumper
        self.dumping = dumper is not None
        self.exchange_lock = threading.Lock()  # a rewrite's reservation and its call's end never race
        self.handlers = {m: h(self) for m, h in HANDLERS.items()}
        self.runtime_version = ""
        self.problem: tuple[int, str] | None = None
        self.decorate: Callable[[ContainerView], None] | None = None  # e.g. resource controllers' classes
        self._last_list = 0.0

    # -- hooks --------------------------------------------------------------------------------------
    def mode(self, method: str) -> Mode:
        h = self.handlers.get(method)
        if h is None:
            return Mode.PASS
        if method == LIST:
            # kubelet relists every second; looking at one answer in LIST_OBSERVE_SECONDS is plenty, and the
            # others then cost nothing beyond forwarding.
            now = time.monotonic()
            if now - self._last_list < LIST_OBSERVE_SECONDS:
                return Mode.PASS
            self._last_list = now
        return h.mode

    def rewrite(self, ex: Exchange) -> bytes | Reject | None:
        h = self.handlers.get(ex.method)
        return h.rewrite(ex) if h is not None else None

    def rewrite_inline(self, ex: Exchange) -> bytes | Reject | None | InWorker:
        h = self.handlers.get(ex.method)
        return h.rewrite_inline(ex) if h is not None else IN_WORKER

    def complete(self, ex: Exchange) -> None:
        h = self.handlers.get(ex.method)
        if h is not None:
            h.complete(ex)

    @staticmethod
    def _on_loop(fn: Callable[[], None], delay: float = 0.0) -> None:
        """Run ``fn`` on the event loop once the current callback is done (``delay`` seconds later); elsewhere
        (a worker thread, a handler called directly) at once."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            fn()
            return
        if delay:
            loop.call_later(delay, fn)
        else:
            loop.call_soon(fn)

    def after_forward(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` once the request being rewritten has been handed to the runtime's socket: a rewrite on the
        event loop runs while the proxy holds the request, and the loop runs ``fn`` right after it is sent."""
        self._on_loop(fn)

    def pool_soon(self, fn: Callable[[], None]) -> None:
        """Wake the pool worker and the persist thread after a create ``POOL_GRACE_SECONDS`` later (see
        ``Engine.commit``'s ``later``)."""
        self._on_loop(fn, POOL_GRACE_SECONDS)

    def take_context(self, ex: Exchange) -> CallContext | None:
        with self.exchange_lock:
            ctx, ex.context = ex.context, None
        return ctx if isinstance(ctx, CallContext) else None

    def finished(self, method: str, code: int, seconds: float) -> None:
        self.stats.record(method, code_name(code), seconds)

    def rewrite_timed(self, ex: Exchange) -> None:
        t = ex.timing
        if t is not None and t.forwarded:  # held or observed, and the request reached the runtime (not cut short)
            self.stats.record_rewrite(ex.method, t)

    def dump(self, direction: str, ex: Exchange, message: bytes) -> None:
        self.dumper.write(direction, ex, message)

    def refusal(self) -> tuple[int, str] | None:
        return self.problem

    def on_upstream(self, up: bool, why: str) -> None:
        self.engine.runtime_up = up
        if up:
            log.info("runtime %s reachable", self.runtime.path)
            self.engine.request_reconcile()  # the runtime may have restarted
        else:
            log.warning("runtime unreachable: %s", why)

    # -- the runtime --------------------------------------------------------------------------------
    def check_version(self, timeout: float | None = None) -> pb.VersionResponse:
        v = self.runtime.version(timeout)
        self.runtime_version = f"{v.runtime_name} {v.runtime_version}"
        problem = untested_runtime(v)
        if problem and not self.cfg.allow_untested_runtimes:
            if self.problem is None:
                log.error("refusing to relay: %s", problem)
            self.problem = (status(grpc.StatusCode.FAILED_PRECONDITION), f"cri-resmgr relay: {problem}")
        else:
            self.problem = None
        return v

    def resync(self) -> dict[str, int] | None:
        try:
            return self.engine.reconcile().as_dict()
        except RuntimeCallError as e:
            log.warning("resync with %s failed (%s); the cache stays as saved until the runtime answers",
                        self.runtime.path, e)
            return None

    def events_loop(self) -> None:
        """GetContainerEvents (containerd >= 1.7, CRI-O): exits release CPUs at once. A streaming call: it has
        no deadline, and ends when the runtime goes away (then it is opened again)."""
        delay = 0.5
        while not self.engine.stopping:
            try:
                for ev in self.runtime.events():
                    delay = 0.5
                    self._on_event(ev)
                    if self.engine.stopping:
                        return
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                    log.info("runtime has no GetContainerEvents; exits are found by reconcile every %gs",
                             self.cfg.reconcile_interval_seconds)
                    return
            time.sleep(delay)
            delay = min(delay * 2, 10)

    def _on_event(self, ev: pb.ContainerEventResponse) -> None:
        if ev.container_event_type == pb.CONTAINER_DELETED_EVENT:
            self.engine.removed(ev.container_id)
        elif ev.container_event_type == pb.CONTAINER_STOPPED_EVENT:
            self.engine.stopped(ev.container_id, "stopped (runtime event)")

    # -- control socket -----------------------------------------------------------------------------
    def state(self) -> RelayState:
        return self._decorated(self.engine.state(self.runtime_version, self.problem[1] if self.problem else None))

    def gauges(self) -> dict[str, float]:
        return self.engine.gauges()
