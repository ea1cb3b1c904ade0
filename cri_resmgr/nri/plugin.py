"""The NRI plugin's logic: runtime events in NRI's terms turned into placement-engine calls, and the engine's
decisions turned into NRI adjustments and container updates.

No placement rule lives here: :class:`cri_resmgr.placement.engine.Engine` decides (the CRI relay uses the same
engine). What this module adds is NRI's shape of things:

- the runtime's view (:class:`RuntimeView`) is what NRI has told the plugin — Synchronize, then every event —
  because NRI, unlike CRI, has no call to list containers; it is the engine's ``snapshot()``;
- CreateContainer answers with the cpuset as an adjustment and, when the new container takes CPUs exclusively,
  updates for the shared containers still on them, so the runtime applies both before the container starts;
- CPUs a stopped container frees go back to the shared containers through ``UpdateContainers`` (the engine's
  pool worker, after the stop is answered), off the stop's path;
- everything else the engine wants changed later (pool changes, moves, repairs) goes through
  ``Runtime.UpdateContainers`` (:class:`NriPort`).

Every handler is bounded by the server's deadline and fails open (:mod:`.ttrpc`): a late or failing hook lets
the runtime's call through unchanged, and a late decision is undone (``Call.commit``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from ..placement.allocator import InsufficientCpus
from ..placement.engine import ContainerRequest, Engine
from ..placement.model import Kind, State
from ..placement.runtime import RuntimeCallError, RuntimeSnapshot
from ..sysfs import parse_cpulist
from . import convert
from .connection import Connection
from .proto import nri_pb2 as api
from .ttrpc import Call, Code, Handler, Method, RpcError

log = logging.getLogger(__name__)

# Events the plugin subscribes to (ConfigureResponse.events). containerd 1.7 (NRI 0.6) calls CreateContainer,
# UpdateContainer and StopContainer directly and relays the others through StateChange.
SUBSCRIBED = (api.RUN_POD_SANDBOX, api.STOP_POD_SANDBOX, api.REMOVE_POD_SANDBOX, api.CREATE_CONTAINER,
              api.START_CONTAINER, api.UPDATE_CONTAINER, api.STOP_CONTAINER, api.REMOVE_CONTAINER)
EMPTY = b""  # every response message of ours is empty when nothing is to change: the fail-open answer


class RuntimeView:
    """Pods and containers as NRI has reported them (Synchronize, then events): the engine's runtime snapshot."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.pods: dict[str, api.PodSandbox] = {}
        self.containers: dict[str, api.Container] = {}
        self.states: dict[str, State] = {}
        self.synced = False

    def reset(self, pods: list[api.PodSandbox], containers: list[api.Container]) -> None:
        with self._lock:
            self.pods = {p.id: p for p in pods}
            self.containers = {c.id: c for c in containers}
            self.states = {c.id: convert.STATES.get(c.state, State.UNKNOWN) for c in containers}
            self.synced = True

    def pod(self, pod: api.PodSandbox) -> None:
        with self._lock:
            self.pods[pod.id] = pod

    def container(self, ctr: api.Container, state: State, pod: api.PodSandbox | None = None) -> None:
        with self._lock:
            if pod is not None and pod.id:
                self.pods[pod.id] = pod
            self.containers[ctr.id] = ctr
            self.states[ctr.id] = state

    def set_state(self, cid: str, state: State) -> None:
        with self._lock:
            if cid in self.containers:
                self.states[cid] = state

    def set_resources(self, cid: str, res: api.LinuxResources) -> None:
        with self._lock:
            c = self.containers.get(cid)
            if c is not None:
                c.linux.resources.CopyFrom(res)

    def blob(self, cid: str) -> str:
        with self._lock:
            c = self.containers.get(cid)
            return convert.blob_of(c.linux.resources) if c is not None else ""

    def drop_container(self, cid: str) -> None:
        with self._lock:
            self.containers.pop(cid, None)
            self.states.pop(cid, None)

    def drop_pod(self, pod_id: str) -> None:
        with self._lock:
            self.pods.pop(pod_id, None)
            for cid in [c.id for c in self.containers.values() if c.pod_sandbox_id == pod_id]:
                self.containers.pop(cid, None)
                self.states.pop(cid, None)

    def snapshot(self) -> RuntimeSnapshot:
        with self._lock:
            pods = [convert.pod_record(p) for p in self.pods.values()]
            ctrs = [convert.container_record(c, self.pods.get(c.pod_sandbox_id), self.states.get(c.id))
                    for c in self.containers.values()]
        return RuntimeSnapshot(pods, ctrs)


class NriPort:
    """The engine's :class:`~cri_resmgr.placement.runtime.RuntimePort` over NRI: updates through
    ``Runtime.UpdateContainers`` on the current connection, the snapshot from :class:`RuntimeView`.

    While a hook runs on this thread (:meth:`collecting`), updates the engine makes go into that hook's answer
    instead: the runtime is waiting for the answer and applies its updates with it, whereas an
    UpdateContainers call from inside a hook would wait for the hook to end."""

    def __init__(self, view: RuntimeView, connection: Callable[[], Connection | None]):
        self.view = view
        self.connection = connection
        self.runtime = ""
        self._local = threading.local()

    @contextmanager
    def collecting(self) -> Iterator[list[api.ContainerUpdate]]:
        out: list[api.ContainerUpdate] = []
        self._local.updates = out
        try:
            yield out
        finally:
            self._local.updates = None

    def update_cpuset(self, container_id: str, cpus: str, mems: str, resources: str, timeout: float) -> str:
        upd = convert.cpuset_update(container_id, cpus, mems, resources or self.view.blob(container_id))
        pending: list[api.ContainerUpdate] | None = getattr(self._local, "updates", None)
        if pending is not None:
            pending.append(upd)
            self.view.set_resources(container_id, upd.linux.resources)
            return convert.blob_of(upd.linux.resources)
        conn = self.connection()
        if conn is None or conn.closed.is_set():
            raise RuntimeCallError("not connected to the runtime's NRI socket", unavailable=True)
        try:
            failed = conn.update_containers([upd], timeout)
        except RpcError as e:
            raise RuntimeCallError(f"UpdateContainers: {e}", not_found=e.code == Code.NOT_FOUND,
                                   unavailable=e.code in (Code.UNAVAILABLE, Code.DEADLINE_EXCEEDED)) from e
        if container_id in failed:
            gone = container_id not in self.view.containers
            raise RuntimeCallError(f"runtime failed to update {container_id[:12]}", not_found=gone)
        self.view.set_resources(container_id, upd.linux.resources)
        return convert.blob_of(upd.linux.resources)

    def snapshot(self, timeout: float, known: frozenset[str] = frozenset()) -> RuntimeSnapshot:
        if not self.view.synced:
            raise RuntimeCallError("not synchronised with the runtime yet", unavailable=True)
        return self.view.snapshot()

    def describe(self) -> str:
        return f"{self.runtime or 'runtime'} over NRI"


class Plugin:
    """The handlers of NRI's Plugin service (:meth:`methods`), each a thin translation to engine calls."""

    def __init__(self, engine: Engine, view: RuntimeView, port: NriPort):
        self.engine = engine
        self.view = view
        self.port = port
        self.configured = threading.Event()
        self.synchronized = threading.Event()
        self.shutdown_requested = threading.Event()
        self._sync_pods: list[api.PodSandbox] = []
        self._sync_containers: list[api.Container] = []
        self._events: dict[int, Callable[[api.PodSandbox, api.Container], None]] = {
            api.RUN_POD_SANDBOX: self._run_pod, api.STOP_POD_SANDBOX: self._stop_pod,
            api.REMOVE_POD_SANDBOX: self._remove_pod, api.START_CONTAINER: self._start,
            api.REMOVE_CONTAINER: self._remove_container,
        }

    def methods(self) -> dict[str, Method]:
        # Synchronize runs off the reader thread: adopting may wait for the engine's pool worker, which may be
        # waiting for an UpdateContainers answer that only the reader can deliver. The others touch the engine's
        # books only (its lock is never held across a runtime call) and run inline.
        return {
            "Configure": Method(self.configure, inline=True),  # an error here is answered: registration fails
            "Synchronize": Method(self.synchronize, EMPTY),
            "Shutdown": Method(self.shutdown, EMPTY, inline=True),
            "CreateContainer": Method(self._deferred(self.create_container), EMPTY, inline=True),
            "UpdateContainer": Method(self._deferred(self.update_container), EMPTY, inline=True),
            "StopContainer": Method(self._deferred(self.stop_container), EMPTY, inline=True),
            "StateChange": Method(self._deferred(self.state_change), EMPTY, inline=True),
            "RunPodSandbox": self._event(api.RunPodSandboxRequest, self._run_pod),
            "StopPodSandbox": self._event(api.StopPodSandboxRequest, self._stop_pod),
            "RemovePodSandbox": self._event(api.RemovePodSandboxRequest, self._remove_pod),
            "StartContainer": self._event(api.StartContainerRequest, self._start),
            "RemoveContainer": self._event(api.RemoveContainerRequest, self._remove_container),
        }

    # -- registration -------------------------------------------------------------------------------
    def configure(self, raw: bytes, call: Call) -> bytes:
        req = api.ConfigureRequest.FromString(raw)
        self.port.runtime = f"{req.runtime_name} {req.runtime_version}".strip()
        log.info("configured by %s; subscribing to %s", self.port.runtime or "the runtime",
                 ", ".join(api.Event.Name(e) for e in SUBSCRIBED))
        self.configured.set()
        return api.ConfigureResponse(events=convert.events_mask(list(SUBSCRIBED))).SerializeToString()

    def synchronize(self, raw: bytes, call: Call) -> bytes:
        """Adopt what exists: the engine keeps exclusive cpusets containers already hold (from its saved cache or
        their cgroups) when nobody else holds those CPUs, so a restarted plugin books nothing twice."""
        req = api.SynchronizeRequest.FromString(raw)
        if req.more:
            # NRI >= 0.8 splits a large state into several requests: collect until the last (more = false).
            self._sync_pods.extend(req.pods)
            self._sync_containers.extend(req.containers)
            return api.SynchronizeResponse(more=True).SerializeToString()
        pods, ctrs = [*self._sync_pods, *req.pods], [*self._sync_containers, *req.containers]
        self._sync_pods, self._sync_containers = [], []
        actual = {c.id: c.linux.resources.cpu.cpus for c in ctrs}
        self.view.reset(pods, ctrs)
        if not call.commit():
            return EMPTY
        with self.port.collecting() as updates:
            summary = self.engine.adopt(self.view.snapshot())
        log.info("synchronised: %d pods, %d containers (%s)", len(pods), len(ctrs), summary.as_dict())
        # What the books say and the runtime does not have yet (e.g. a cache from before a restart).
        for v in self.engine.state().containers:
            if v.id in actual and v.cpus and v.state in _HOLDING and _differs(actual[v.id], v.cpus):
                updates.append(convert.cpuset_update(v.id, v.cpus, v.mems, self.view.blob(v.id)))
        self.synchronized.set()
        return api.SynchronizeResponse(update=_last_per_container(updates)).SerializeToString()

    def shutdown(self, raw: bytes, call: Call) -> bytes:
        log.info("the runtime is shutting down")
        self.shutdown_requested.set()
        return api.Empty().SerializeToString()

    # -- container lifecycle ------------------------------------------------------------------------
    def create_container(self, raw: bytes, call: Call) -> bytes:
        req = api.CreateContainerRequest.FromString(raw)
        pod, ctr = req.pod, req.container
        creq = ContainerRequest(
            pod_id=pod.id, name=ctr.name, namespace=pod.namespace, pod_name=pod.name, pod_uid=pod.uid,
            cgroup_parent=pod.linux.cgroup_parent, pod_annotations=dict(pod.annotations),
            annotations=dict(ctr.annotations), resources=convert.resources_of(ctr.linux.resources))
        call.mark("decode")
        try:
            res = self.engine.place(creq)  # its log line runs with the deferred wake-ups
        except InsufficientCpus as e:
            raise RpcError(Code.RESOURCE_EXHAUSTED,
                           f"cri-resmgr: container {pod.namespace}/{pod.name}/{ctr.name}: {e}") from e
        call.mark("place")
        if not call.commit():
            self.engine.abort(res)
            return EMPTY
        resp = api.CreateContainerResponse()
        cpu = resp.adjust.linux.resources.cpu
        cpu.cpus, cpu.mems = res.cpus, res.mems
        ctr.linux.resources.cpu.cpus, ctr.linux.resources.cpu.mems = res.cpus, res.mems
        self.view.container(ctr, State.CREATED, pod)
        self.engine.commit(res, ctr.id, convert.blob_of(ctr.linux.resources))
        call.mark("commit")
        if res.kind == Kind.EXCLUSIVE:
            # The shared containers leave the new container's CPUs in the same step (before it can start).
            resp.update.extend(self._pool_updates(exclude=ctr.id))
        return resp.SerializeToString()

    def update_container(self, raw: bytes, call: Call) -> bytes:
        """kubelet's resize (UpdateContainerResources): the engine re-decides the cpuset for the new request."""
        req = api.UpdateContainerRequest.FromString(raw)
        cid = req.container.id
        before = self.engine.container(cid)
        res = self.engine.resize(cid, convert.resources_of(req.linux_resources))
        if res is None or before is None:
            return EMPTY
        if not call.commit():
            self.engine.abort(res)
            return EMPTY
        new = api.LinuxResources()
        new.CopyFrom(req.linux_resources)
        new.cpu.cpus, new.cpu.mems = res.cpus, res.mems
        self.view.set_resources(cid, new)
        self.engine.commit(res, cid, convert.blob_of(new))
        resp = api.UpdateContainerResponse()
        u = resp.update.add(container_id=cid)
        u.linux.resources.CopyFrom(new)
        if Kind.EXCLUSIVE in (before.placement, res.kind) and res.cpus != before.cpus:
            resp.update.extend(self._pool_updates(exclude=cid))
        log.info("resize %s: %s cpus %s (%s)", cid[:12], res.kind, res.cpus, res.reason)
        return resp.SerializeToString()

    def stop_container(self, raw: bytes, call: Call) -> bytes:
        req = api.StopContainerRequest.FromString(raw)
        cid = req.container.id
        if not call.commit():
            return EMPTY
        self.view.set_state(cid, State.EXITED)
        # CPUs it held exclusively go back to the shared containers through the engine's pool worker
        # (UpdateContainers, once this answer is sent), not in this answer: the runtime applies an answer's
        # updates (a runc update each) before the stop returns, and nothing needs to wait for a pool to grow.
        self.engine.stopped(cid, "stopped (NRI StopContainer)")
        return EMPTY

    def state_change(self, raw: bytes, call: Call) -> bytes:
        """NRI 0.6 (containerd 1.7) relays the events without an answer of their own through StateChange."""
        ev = api.StateChangeEvent.FromString(raw)
        call.event = _EVENT_NAMES.get(ev.event, "Unknown")
        handler = self._events.get(ev.event)
        if handler is not None and call.commit():
            handler(ev.pod, ev.container)
        return EMPTY

    def _event(self, msg: type[_PodEvent], fn: Callable[[api.PodSandbox, api.Container], None]) -> Method:
        """A handler for the same event called directly (NRI >= 0.7), its request carrying pod and container."""

        def handle(raw: bytes, call: Call) -> bytes:
            req = msg.FromString(raw)
            if call.commit():
                fn(req.pod, req.container if isinstance(req, _CONTAINER_EVENTS) else api.Container())
            return EMPTY

        return Method(self._deferred(handle), EMPTY, inline=True)

    def _deferred(self, handler: Handler) -> Handler:
        """The engine's thread wake-ups that a hook causes (save, pool worker, controllers) run once its answer
        is sent: woken earlier, those threads compete with the hook for the interpreter."""

        def run(raw: bytes, call: Call) -> bytes:
            with self.engine.deferring() as wake:
                try:
                    return handler(raw, call)
                finally:
                    call.after(wake)

        return run

    def _run_pod(self, pod: api.PodSandbox, _ctr: api.Container) -> None:
        self.view.pod(pod)
        self.engine.pod_added(convert.pod_record(pod))

    def _stop_pod(self, pod: api.PodSandbox, _ctr: api.Container) -> None:
        for cid in [c.id for c in self.view.containers.values() if c.pod_sandbox_id == pod.id]:
            self.view.set_state(cid, State.EXITED)
        self.engine.pod_stopped(pod.id)

    def _remove_pod(self, pod: api.PodSandbox, _ctr: api.Container) -> None:
        self.view.drop_pod(pod.id)
        self.engine.pod_removed(pod.id)

    def _start(self, _pod: api.PodSandbox, ctr: api.Container) -> None:
        self.view.set_state(ctr.id, State.RUNNING)
        self.engine.started(ctr.id)

    def _remove_container(self, _pod: api.PodSandbox, ctr: api.Container) -> None:
        self.view.drop_container(ctr.id)
        self.engine.removed(ctr.id)

    # -- helpers ------------------------------------------------------------------------------------
    def _pool_updates(self, exclude: str) -> list[api.ContainerUpdate]:
        """Updates that put every created or running shared, pinned and reserved container where the engine's pool
        says: the runtime gets them with the answer it is waiting for and applies them before it goes on, and the
        engine's books take them (``pool_delivered``), so the pool worker does not send them again. Sent also where
        the books say a container is there already (they may be behind an update the pool worker is making)."""
        out = []
        delivered = []
        for cid, cpus, mems, _ in self.engine.pool_targets(changed_only=False):
            if cid == exclude or self.view.states.get(cid) not in _HOLDING:
                continue
            upd = convert.cpuset_update(cid, cpus, mems, self.view.blob(cid))
            self.view.set_resources(cid, upd.linux.resources)
            out.append(upd)
            delivered.append((cid, cpus, mems, convert.blob_of(upd.linux.resources)))
        self.engine.pool_delivered(delivered)
        return out


_PodEvent = (api.RunPodSandboxRequest | api.StopPodSandboxRequest | api.RemovePodSandboxRequest
             | api.StartContainerRequest | api.RemoveContainerRequest)
_CONTAINER_EVENTS = (api.StartContainerRequest, api.RemoveContainerRequest)
_HOLDING = (State.CREATED, State.RUNNING)
# RUN_POD_SANDBOX -> RunPodSandbox (metrics' event label), computed once rather than per StateChange
_EVENT_NAMES = {v: "".join(w.capitalize() for w in n.split("_")) for n, v in api.Event.items()}


def _last_per_container(updates: list[api.ContainerUpdate]) -> list[api.ContainerUpdate]:
    out: dict[str, api.ContainerUpdate] = {}
    for u in updates:
        out[u.container_id] = u
    return list(out.values())


def _differs(actual: str, wanted: str) -> bool:
    try:
        return parse_cpulist(actual) != parse_cpulist(wanted)
    except ValueError:
        return True

