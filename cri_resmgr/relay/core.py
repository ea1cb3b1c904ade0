"""The relay's logic: the hooks the proxy calls, the container cache, placement, reconcile and moves.

Threads: the proxy's event loop calls :meth:`Relay.complete` (short: cache updates only); rewrites, pool
updates and ListContainers parsing run in the worker pool; reconcile, events and persistence have a thread
each. ``lock`` guards the cache; ``apply_lock`` serialises changes of cpusets in the runtime so that pool
updates and moves never interleave.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor
from pathlib import Path

import grpc
from cri_api.v1 import api_pb2 as pb

from ..config import RelayConfig
from ..sysfs import format_cpulist, parse_cpulist
from ..topology import Topology
from . import cache as C
from .allocator import CpuAllocator, Hints, InsufficientCpus, Placement, Taken
from .api import ContainerView, MoveRecord, RelayState
from .estimate import estimate, qos_from_cgroup_parent
from .h2proxy import Exchange, Hooks, Mode, Reject, code_name
from .runtime import STATE_NAMES, RuntimeClient, untested_runtime
from .stats import RelayStats

log = logging.getLogger(__name__)

RT = "/runtime.v1.RuntimeService/"
CREATE, UPDATE, LIST = RT + "CreateContainer", RT + "UpdateContainerResources", RT + "ListContainers"
RUN_POD, STOP_POD, REMOVE_POD = RT + "RunPodSandbox", RT + "StopPodSandbox", RT + "RemovePodSandbox"
START, STOP, REMOVE = RT + "StartContainer", RT + "StopContainer", RT + "RemoveContainer"
MODES = {CREATE: Mode.REWRITE, UPDATE: Mode.REWRITE,
         **{m: Mode.OBSERVE for m in (LIST, RUN_POD, STOP_POD, REMOVE_POD, START, STOP, REMOVE)}}

PREFIX = "cri-resmgr.io/"
A_LATENCY_CRITICAL = PREFIX + "latency-critical"
A_AVX512 = PREFIX + "avx512"
A_AFFINITY = PREFIX + "affinity"
A_ANTI_AFFINITY = PREFIX + "anti-affinity"
A_EXCLUSIVE = PREFIX + "exclusive"
_TRUE = ("1", "true", "yes", "on")
OK, NOT_FOUND, RESOURCE_EXHAUSTED, FAILED_PRECONDITION = 0, 5, 8, 9
MOVES_FILE = "relay-moves.jsonl"
LIST_OBSERVE_SECONDS = 0.5


def effective_annotations(pod: dict[str, str], container: dict[str, str], name: str) -> dict[str, str]:
    """``cri-resmgr.io/*`` settings for one container: pod annotations, overridden by the container's own,
    overridden by pod annotations ``cri-resmgr.io/<key>.container.<name>``."""
    suffix = f".container.{name}"
    out = {k: v for k, v in pod.items() if k.startswith(PREFIX) and ".container." not in k}
    out.update({k: v for k, v in container.items() if k.startswith(PREFIX)})
    for k, v in pod.items():
        if k.startswith(PREFIX) and k.endswith(suffix):
            out[k[: -len(suffix)]] = v
    return out


def _truthy(v: str | None) -> bool:
    return (v or "").strip().lower() in _TRUE


class Refused(Exception):
    pass


class Relay(Hooks):
    def __init__(self, cfg: RelayConfig, topology: Topology, state_dir: Path, runtime: RuntimeClient,
                 executor: Executor, stats: RelayStats | None = None, dumper=None,
                 clock: Callable[[], float] = time.time):
        self.cfg = cfg
        self.alloc = CpuAllocator(topology, parse_cpulist(cfg.reserved_cpus), cfg.min_shared_cpus)
        self.state_dir = Path(state_dir)
        self.runtime = runtime
        self.executor = executor
        self.stats = stats or RelayStats()
        self.dumper = dumper
        self.dumping = dumper is not None
        self.clock = clock
        self.lock = threading.RLock()
        self.apply_lock = threading.Lock()
        self.cache, note = C.load(self.state_dir)
        if note:
            log.warning(note)
        self.pending: dict[int, C.Container] = {}  # id(Exchange) -> container being created
        self.moves: deque[MoveRecord] = deque(maxlen=1000)
        self.runtime_up = False
        self.runtime_version = ""
        self.problem: tuple[int, str] | None = None
        self._dirty = threading.Event()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._threads: list[threading.Thread] = []
        self.moves_total = 0
        self._last_list = 0.0

    # -- hooks: classification and metrics ----------------------------------------------------------
    def mode(self, method: str) -> Mode:
        if method == LIST:
            # kubelet relists every second; looking at one answer in LIST_OBSERVE_SECONDS is plenty, and the
            # others then cost nothing beyond forwarding.
            now = time.monotonic()
            if now - self._last_list < LIST_OBSERVE_SECONDS:
                return Mode.PASS
            self._last_list = now
        return MODES.get(method, Mode.PASS)

    def finished(self, method: str, code: int, seconds: float) -> None:
        self.stats.record(method, code_name(code), seconds)

    def dump(self, direction: str, ex: Exchange, message: bytes) -> None:
        self.dumper.write(direction, ex, message)

    def refusal(self) -> tuple[int, str] | None:
        return self.problem

    # -- hooks: rewrites (worker thread) ------------------------------------------------------------
    def rewrite(self, ex: Exchange) -> bytes | Reject | None:
        if ex.method == CREATE:
            return self._rewrite_create(ex)
        if ex.method == UPDATE:
            return self._rewrite_update(ex)
        return None

    def _rewrite_create(self, ex: Exchange) -> bytes | Reject | None:
        req = pb.CreateContainerRequest.FromString(ex.request)
        cfg, sb = req.config, req.sandbox_config
        pod = self.cache.pods.get(req.pod_sandbox_id)
        parent = sb.linux.cgroup_parent or (pod.cgroup_parent if pod else "")
        res = cfg.linux.resources
        est = estimate(res.cpu_shares, res.cpu_quota, res.cpu_period, res.memory_limit_in_bytes, parent)
        ann = effective_annotations(dict(sb.annotations), dict(cfg.annotations), cfg.metadata.name)
        ctr = C.Container(
            id="", pod_id=req.pod_sandbox_id, name=cfg.metadata.name, namespace=sb.metadata.namespace,
            pod_name=sb.metadata.name, pod_uid=sb.metadata.uid, qos_class=est.qos_class, cgroup_parent=parent,
            annotations=ann, cpu_request_milli=est.cpu_request_milli, cpu_limit_milli=est.cpu_limit_milli,
            memory_limit_bytes=est.memory_limit_bytes, avx512=_truthy(ann.get(A_AVX512)), created=self.clock(),
        )
        with self.lock:
            if ex.code is not None:
                return None  # the call ended (client gone) while waiting for a worker
            try:
                p, kind = self._place(ctr, est.whole_cpus, ann)
            except InsufficientCpus as e:
                return Reject(RESOURCE_EXHAUSTED, f"cri-resmgr: container {ctr.namespace}/{ctr.pod_name}/"
                                                  f"{ctr.name}: {e}")
            ctr.placement, ctr.cpus, ctr.mems, ctr.reason = kind, p.cpus_text, p.mems_text, p.reason
            self.pending[id(ex)] = ctr
        if kind == C.EXCLUSIVE:
            # Vacate the CPUs before the container exists: shared containers leave them now.
            self.apply_pool()
        res.cpuset_cpus, res.cpuset_mems = ctr.cpus, ctr.mems
        ctr.resources = res.SerializeToString().hex()
        log.info("place %s/%s/%s (%s, %dm): %s cpus %s mems %s (%s)", ctr.namespace, ctr.pod_name, ctr.name,
                 ctr.qos_class or "no QoS", ctr.cpu_request_milli, kind, ctr.cpus, ctr.mems, p.reason)
        return req.SerializeToString()

    def _place(self, ctr: C.Container, whole: int, ann: dict[str, str]) -> tuple[Placement, str]:
        taken = self._taken()
        if ctr.namespace in self.cfg.reserved_namespaces and self.alloc.reserved:
            return self.alloc.reserved_placement(taken.all), C.RESERVED
        excl = ann.get(A_EXCLUSIVE)
        if whole and not (excl is not None and not _truthy(excl)):
            hints = Hints(latency_critical=_truthy(ann.get(A_LATENCY_CRITICAL)), avx512=ctr.avx512,
                          near=self._cpus_of(ctr, ann.get(A_AFFINITY)), away=self._cpus_of(ctr, ann.get(A_ANTI_AFFINITY)))
            return self.alloc.allocate(whole, taken, hints), C.EXCLUSIVE
        return self.alloc.shared_placement(taken.all), C.SHARED

    def _cpus_of(self, ctr: C.Container, spec: str | None) -> frozenset[int]:
        """CPUs of the containers an (anti-)affinity annotation names: ``name`` (same pod) or ``pod/name``."""
        if not spec:
            return frozenset()
        out: set[int] = set()
        for item in (s.strip() for s in spec.split(",")):
            if not item:
                continue
            pod_name, _, name = item.rpartition("/")
            for c in self.cache.containers.values():
                if not c.live or c.name != name or c.namespace != ctr.namespace:
                    continue
                if (pod_name and c.pod_name == pod_name) or (not pod_name and c.pod_id == ctr.pod_id):
                    out |= c.cpu_set
        return frozenset(out)

    def _taken(self, skip: str | None = None) -> Taken:
        avx: set[int] = set()
        other: set[int] = set()
        ctrs = [c for c in self.cache.containers.values() if c.id != skip] + list(self.pending.values())
        for c in ctrs:
            if c.placement == C.EXCLUSIVE and c.live:
                (avx if c.avx512 else other).update(c.cpu_set)
        return Taken(frozenset(avx), frozenset(other))

    def _rewrite_update(self, ex: Exchange) -> bytes | None:
        """kubelet's UpdateContainerResources (in-place resize) keeps the relay's cpuset."""
        req = pb.UpdateContainerResourcesRequest.FromString(ex.request)
        with self.lock:
            c = self.cache.containers.get(req.container_id)
            if c is None or not req.HasField("linux"):
                return None
            res = req.linux
            est = estimate(res.cpu_shares, res.cpu_quota, res.cpu_period, res.memory_limit_in_bytes, c.cgroup_parent)
            cpus, mems, placement, reason = c.cpus, c.mems, c.placement, c.reason
            if c.placement == C.EXCLUSIVE and est.whole_cpus and est.whole_cpus != len(c.cpu_set):
                try:
                    p = self.alloc.allocate(est.whole_cpus, self._taken(skip=c.id),
                                            Hints(avx512=c.avx512, prefer=c.cpu_set))
                    cpus, mems, reason = p.cpus_text, p.mems_text, f"resized: {p.reason}"
                except InsufficientCpus as e:
                    log.warning("resize of %s to %d CPUs keeps %s: %s", c.id[:12], est.whole_cpus, c.cpus, e)
            elif c.placement == C.EXCLUSIVE and not est.whole_cpus:
                placement, reason = C.SHARED, "resized to a non-whole request: shared pool"
                p = self.alloc.shared_placement(self._taken(skip=c.id).all)
                cpus, mems = p.cpus_text, p.mems_text
            if cpus:
                res.cpuset_cpus = cpus
            if mems:
                res.cpuset_mems = mems
            ex.context = (est, cpus, mems, placement, reason, res.SerializeToString().hex())
        return req.SerializeToString()

    # -- hooks: completion (event loop) -------------------------------------------------------------
    def complete(self, ex: Exchange) -> None:
        m = ex.method
        ok = ex.code == OK
        gone = ex.code == NOT_FOUND
        changed = False
        pool_grew = False
        with self.lock:
            if m == CREATE:
                ctr = self.pending.pop(id(ex), None)
                if ctr is not None and ok:
                    ctr.id = pb.CreateContainerResponse.FromString(ex.response).container_id
                    ctr.state = C.CREATED
                    self.cache.containers[ctr.id] = ctr
                    changed = True
                elif ctr is not None:
                    pool_grew = ctr.placement == C.EXCLUSIVE
            elif m == START and ok:
                changed = self._set_state(pb.StartContainerRequest.FromString(ex.request).container_id, C.RUNNING)
            elif m == STOP and (ok or gone):
                cid = pb.StopContainerRequest.FromString(ex.request).container_id
                pool_grew = self._is_exclusive(cid)
                changed = self._set_state(cid, C.EXITED)
            elif m == REMOVE and (ok or gone):
                cid = pb.RemoveContainerRequest.FromString(ex.request).container_id
                pool_grew = self._is_exclusive(cid)
                changed = self.cache.containers.pop(cid, None) is not None
            elif m == RUN_POD and ok:
                cfg = pb.RunPodSandboxRequest.FromString(ex.request).config
                pid = pb.RunPodSandboxResponse.FromString(ex.response).pod_sandbox_id
                self.cache.pods[pid] = C.Pod(
                    id=pid, name=cfg.metadata.name, namespace=cfg.metadata.namespace, uid=cfg.metadata.uid,
                    qos_class=qos_from_cgroup_parent(cfg.linux.cgroup_parent), cgroup_parent=cfg.linux.cgroup_parent,
                    annotations=dict(cfg.annotations), labels=dict(cfg.labels), created=self.clock())
                changed = True
            elif m == STOP_POD and (ok or gone):
                pid = pb.StopPodSandboxRequest.FromString(ex.request).pod_sandbox_id
                pod = self.cache.pods.get(pid)
                if pod is not None:
                    pod.state = "notready"
                for c in self.cache.containers.values():
                    if c.pod_id == pid and c.live:
                        pool_grew |= c.placement == C.EXCLUSIVE
                        c.state = C.EXITED  # the runtime stops every container of a stopped sandbox
                changed = True
            elif m == REMOVE_POD and (ok or gone):
                pid = pb.RemovePodSandboxRequest.FromString(ex.request).pod_sandbox_id
                for cid in [c.id for c in self.cache.containers.values() if c.pod_id == pid]:
                    pool_grew |= self._is_exclusive(cid)
                    del self.cache.containers[cid]
                changed = self.cache.pods.pop(pid, None) is not None or changed
            elif m == UPDATE:
                cid = pb.UpdateContainerResourcesRequest.FromString(ex.request).container_id
                c = self.cache.containers.get(cid)
                if ok and c is not None and ex.context is not None:
                    est, cpus, mems, placement, reason, res = ex.context
                    pool_grew = c.placement == C.EXCLUSIVE and (placement != C.EXCLUSIVE or
                                                                len(parse_cpulist(cpus)) < len(c.cpu_set))
                    c.cpu_request_milli, c.cpu_limit_milli = est.cpu_request_milli, est.cpu_limit_milli
                    c.memory_limit_bytes = est.memory_limit_bytes
                    c.cpus, c.mems, c.placement, c.reason, c.resources = cpus, mems, placement, reason, res
                    changed = True
            elif m == LIST and ok:
                self.executor.submit(self._observe_list, ex.response)
        if changed:
            self._dirty.set()
        if pool_grew:
            self.executor.submit(self.apply_pool)

    def _is_exclusive(self, cid: str) -> bool:
        c = self.cache.containers.get(cid)
        return c is not None and c.placement == C.EXCLUSIVE and c.live

    def _set_state(self, cid: str, state: str) -> bool:
        c = self.cache.containers.get(cid)
        if c is None or c.state == state:
            return False
        c.state = state
        return True

    def _observe_list(self, response: bytes) -> None:
        """kubelet relists containers every second (PLEG): a free look at which ones have exited."""
        try:
            items = pb.ListContainersResponse.FromString(response).containers
        except Exception:  # a malformed response is the runtime's business; kubelet will see it too
            return
        exited = []
        with self.lock:
            for it in items:
                c = self.cache.containers.get(it.id)
                if c is not None and c.live and it.state == pb.CONTAINER_EXITED:
                    c.state = C.EXITED
                    exited.append(c)
        if exited:
            self._released(exited, "seen exited in ListContainers")

    def _released(self, ctrs: list[C.Container], why: str) -> None:
        for c in ctrs:
            log.info("container %s (%s/%s) %s: releasing %s CPUs %s", c.id[:12], c.pod_name, c.name, why,
                     c.placement, c.cpus)
        self._dirty.set()
        if any(c.placement == C.EXCLUSIVE for c in ctrs):
            self.apply_pool()

    # -- the shared pool ----------------------------------------------------------------------------
    def _desired(self, c: C.Container, taken: frozenset[int]) -> frozenset[int]:
        pool = self.alloc.shared_pool(taken)
        if c.placement == C.RESERVED:
            return self.alloc.reserved or pool
        if c.placement == C.PINNED:
            return (parse_cpulist(c.pinned_cpus) & pool) or pool
        return pool

    def apply_pool(self) -> int:
        """Bring every live non-exclusive container's cpuset in line with the pool. Returns updates made."""
        done = 0
        with self.apply_lock:
            with self.lock:
                taken = self._taken().all
                todo = []
                for c in self.cache.containers.values():
                    if not c.live or c.placement == C.EXCLUSIVE:
                        continue
                    want = self._desired(c, taken)
                    if want and want != c.cpu_set:
                        todo.append((c, want))
            for c, want in todo:
                mems = self.alloc.mems_of(want)
                try:
                    self._update_cpuset(c, want, mems)
                    done += 1
                except grpc.RpcError as e:
                    if e.code() == grpc.StatusCode.NOT_FOUND:
                        with self.lock:
                            c.state = C.EXITED
                    else:
                        log.warning("pool update of %s to %s failed: %s", c.id[:12], format_cpulist(want), e.details())
        if done:
            self._dirty.set()
        return done

    def _update_cpuset(self, c: C.Container, cpus: frozenset[int], mems: frozenset[int]) -> None:
        res = pb.LinuxContainerResources.FromString(bytes.fromhex(c.resources)) if c.resources else \
            pb.LinuxContainerResources()
        res.cpuset_cpus, res.cpuset_mems = format_cpulist(cpus), format_cpulist(mems)
        self.runtime.update_resources(c.id, res)
        with self.lock:
            c.cpus, c.mems, c.resources = res.cpuset_cpus, res.cpuset_mems, res.SerializeToString().hex()

    # -- moves --------------------------------------------------------------------------------------
    def move(self, container_id: str, cpus: str, mems: str | None = None, who: str = "unknown",
             why: str = "") -> MoveRecord:
        """Apply a new cpuset (and mems) to a running container; the record says what happened."""
        with self.apply_lock:
            with self.lock:
                c = self.cache.containers.get(container_id)
                rec = MoveRecord(time=self.clock(), container_id=container_id, who=who, why=why,
                                 from_cpus=c.cpus if c else "", to_cpus=cpus, from_mems=c.mems if c else "",
                                 to_mems=mems or "", result="refused")
                if c is not None:
                    rec.container, rec.pod, rec.namespace = c.name, c.pod_name, c.namespace
                try:
                    target, target_mems = self._check_move(c, cpus, mems)
                    rec.to_cpus, rec.to_mems = format_cpulist(target), format_cpulist(target_mems)
                except (Refused, ValueError) as e:
                    rec.error = str(e)
                    return self._record(rec)
            try:
                self._update_cpuset(c, target, target_mems)
            except grpc.RpcError as e:
                rec.result, rec.error = "failed", f"{e.code().name}: {e.details()}"
                return self._record(rec)
            with self.lock:
                if c.placement != C.EXCLUSIVE:
                    c.placement, c.pinned_cpus = C.PINNED, rec.to_cpus
                c.reason = f"moved by {who}: {why}" if why else f"moved by {who}"
                rec.result = "applied"
                self.moves_total += 1
        self._dirty.set()
        if c.placement == C.EXCLUSIVE:
            self.apply_pool()
        return self._record(rec)

    def _check_move(self, c: C.Container | None, cpus: str, mems: str | None) -> tuple[frozenset[int], frozenset[int]]:
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
        if c.placement == C.EXCLUSIVE:
            if not self.cfg.allow_move_exclusive:
                raise Refused("exclusive container (relay.allow_move_exclusive is off)")
            if target & taken.all:
                raise Refused(f"CPUs {format_cpulist(target & taken.all)} are exclusive to other containers")
            if target & self.alloc.reserved:
                raise Refused(f"CPUs {format_cpulist(target & self.alloc.reserved)} are reserved")
            if len(self.alloc.shared_base - taken.all - target) < self.alloc.min_shared_cpus:
                raise Refused("the shared pool would become too small")
        else:
            pool = self.alloc.shared_pool(taken.all | (c.cpu_set if c.placement == C.EXCLUSIVE else frozenset()))
            allowed = pool | (self.alloc.reserved if c.placement == C.RESERVED else frozenset())
            if target - allowed:
                raise Refused(f"CPUs {format_cpulist(target - allowed)} are outside the shared pool "
                              f"{format_cpulist(pool)}")
        nodes = frozenset(self.alloc.topology.numa_nodes)
        target_mems = parse_cpulist(mems) if mems else self.alloc.mems_of(target)
        if nodes and target_mems - nodes:
            raise Refused(f"NUMA nodes {format_cpulist(target_mems - nodes)} do not exist")
        return target, target_mems

    def _record(self, rec: MoveRecord) -> MoveRecord:
        self.moves.append(rec)
        log.info("move %s %s -> %s by %s: %s%s", rec.container_id[:12], rec.from_cpus, rec.to_cpus, rec.who,
                 rec.result, f" ({rec.error})" if rec.error else "")
        try:
            with open(self.state_dir / MOVES_FILE, "a") as f:
                f.write(rec.model_dump_json() + "\n")
        except OSError as e:
            log.warning("cannot append to %s: %s", self.state_dir / MOVES_FILE, e)
        return rec

    # -- resync and reconcile -----------------------------------------------------------------------
    def check_version(self, timeout: float | None = None) -> pb.VersionResponse:
        v = self.runtime.version(timeout)
        self.runtime_version = f"{v.runtime_name} {v.runtime_version}"
        problem = untested_runtime(v)
        if problem and not self.cfg.allow_untested_runtimes:
            if self.problem is None:
                log.error("refusing to relay: %s", problem)
            self.problem = (FAILED_PRECONDITION, f"cri-resmgr relay: {problem}")
        else:
            self.problem = None
        return v

    def reconcile(self) -> dict[str, int]:
        """Make the cache agree with the runtime; adopt containers the relay did not see created."""
        self.check_version()
        pods = {p.id: p for p in self.runtime.list_pods()}
        ctrs = {c.id: c for c in self.runtime.list_containers()}
        summary = {"pods_added": 0, "pods_removed": 0, "containers_added": 0, "containers_removed": 0, "exited": 0}
        released: list[C.Container] = []
        with self.lock:
            for pid in [p for p in self.cache.pods if p not in pods]:
                del self.cache.pods[pid]
                summary["pods_removed"] += 1
            for cid in [c for c in self.cache.containers if c not in ctrs]:
                c = self.cache.containers.pop(cid)
                summary["containers_removed"] += 1
                if c.live:
                    released.append(c)
            for cid, it in ctrs.items():
                c = self.cache.containers.get(cid)
                state = STATE_NAMES.get(it.state, C.UNKNOWN)
                if c is not None and c.state != state:
                    if c.live and state not in C.LIVE_STATES:
                        released.append(c)
                        summary["exited"] += 1
                    c.state = state
            new_pods = [p for pid, p in pods.items() if pid not in self.cache.pods]
            new_ctrs = [it for cid, it in ctrs.items() if cid not in self.cache.containers]
            for pid, p in pods.items():
                if pid in self.cache.pods:
                    self.cache.pods[pid].state = "ready" if p.state == pb.SANDBOX_READY else "notready"
        for p in new_pods:
            self._adopt_pod(p)
            summary["pods_added"] += 1
        for it in new_ctrs:
            self._adopt_container(it)
            summary["containers_added"] += 1
        if released:
            self._released(released, "gone from the runtime or exited")
        self.apply_pool()
        if any(summary.values()):
            self._dirty.set()
        return summary

    def _adopt_pod(self, p: pb.PodSandbox) -> None:
        try:
            parent = self.runtime.pod_cgroup_parent(p.id)
        except grpc.RpcError:
            parent = ""
        with self.lock:
            self.cache.pods[p.id] = C.Pod(
                id=p.id, name=p.metadata.name, namespace=p.metadata.namespace, uid=p.metadata.uid,
                qos_class=qos_from_cgroup_parent(parent), cgroup_parent=parent, annotations=dict(p.annotations),
                labels=dict(p.labels), state="ready" if p.state == pb.SANDBOX_READY else "notready",
                created=p.created_at / 1e9)

    def _adopt_container(self, it: pb.Container) -> None:
        """A container created while the relay was not looking: keep an exclusive cpuset it already has
        when its request says exclusive and nobody else holds those CPUs; otherwise it joins the pool."""
        try:
            d = self.runtime.container_detail(it.id)
        except grpc.RpcError:
            return
        with self.lock:
            pod = self.cache.pods.get(it.pod_sandbox_id)
            parent = d.cgroup_parent or (pod.cgroup_parent if pod else "")
            res = d.resources or pb.LinuxContainerResources()
            est = estimate(res.cpu_shares, res.cpu_quota, res.cpu_period, res.memory_limit_in_bytes, parent)
            ann = effective_annotations(dict(pod.annotations) if pod else {}, dict(it.annotations), it.metadata.name)
            c = C.Container(
                id=it.id, pod_id=it.pod_sandbox_id, name=it.metadata.name, namespace=pod.namespace if pod else "",
                pod_name=pod.name if pod else "", pod_uid=pod.uid if pod else "", qos_class=est.qos_class,
                cgroup_parent=parent, annotations=ann, cpu_request_milli=est.cpu_request_milli,
                cpu_limit_milli=est.cpu_limit_milli, memory_limit_bytes=est.memory_limit_bytes,
                avx512=_truthy(ann.get(A_AVX512)), state=STATE_NAMES.get(it.state, C.UNKNOWN),
                cpus=res.cpuset_cpus, mems=res.cpuset_mems, resources=res.SerializeToString().hex(),
                created=it.created_at / 1e9, reason="adopted at resync")
            held = c.cpu_set
            taken = self._taken().all
            if (est.whole_cpus and len(held) == est.whole_cpus and held <= self.alloc.allocatable
                    and not held & taken and c.live):
                c.placement = C.EXCLUSIVE
            elif c.namespace in self.cfg.reserved_namespaces and self.alloc.reserved:
                c.placement = C.RESERVED
            else:
                c.placement = C.SHARED
            self.cache.containers[c.id] = c

    def resync(self) -> dict[str, int] | None:
        try:
            return self.reconcile()
        except grpc.RpcError as e:
            log.warning("resync with %s failed (%s); the cache stays as saved until the runtime answers",
                        self.runtime.path, e.code().name)
            return None

    def on_upstream(self, up: bool, why: str) -> None:
        self.runtime_up = up
        if up:
            log.info("runtime %s reachable", self.runtime.path)
            self._wake.set()  # reconcile now: the runtime may have restarted
        else:
            log.warning("runtime unreachable: %s", why)

    # -- threads ------------------------------------------------------------------------------------
    def start_threads(self) -> None:
        for name, fn in (("reconcile", self._reconcile_loop), ("persist", self._persist_loop),
                         ("events", self._events_loop)):
            t = threading.Thread(target=fn, name=f"relay-{name}", daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._dirty.set()
        for t in self._threads:
            if t.name != "relay-events":
                t.join(timeout=5)
        self.persist()

    def persist(self) -> None:
        with self.lock:
            text = self.cache.to_json()
        try:
            C.save(text, self.state_dir)
        except OSError as e:
            log.error("cannot save the relay cache to %s: %s", self.state_dir, e)

    def _persist_loop(self) -> None:
        while not self._stop.is_set():
            self._dirty.wait()
            self._dirty.clear()
            if self._stop.is_set():
                break
            self.persist()

    def _reconcile_loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.cfg.reconcile_interval_seconds)
            self._wake.clear()
            if self._stop.is_set():
                break
            try:
                self.reconcile()
                self.runtime_up = True
            except grpc.RpcError as e:
                # Only a runtime that does not answer is down; one that answers with an error is up.
                self.runtime_up = e.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
                log.debug("reconcile: runtime %s: %s", self.runtime.path, e.code().name)
            except Exception:
                log.exception("reconcile failed")

    def _events_loop(self) -> None:
        delay = 0.5
        while not self._stop.is_set():
            try:
                for ev in self.runtime.events():
                    delay = 0.5
                    self._on_event(ev)
                    if self._stop.is_set():
                        return
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                    log.info("runtime has no GetContainerEvents; exits are found by reconcile every %gs",
                             self.cfg.reconcile_interval_seconds)
                    return
            self._stop.wait(delay)
            delay = min(delay * 2, 10)

    def _on_event(self, ev: pb.ContainerEventResponse) -> None:
        released = []
        with self.lock:
            c = self.cache.containers.get(ev.container_id)
            if c is None:
                return
            if ev.container_event_type in (pb.CONTAINER_STOPPED_EVENT, pb.CONTAINER_DELETED_EVENT) and c.live:
                c.state = C.EXITED
                released.append(c)
            if ev.container_event_type == pb.CONTAINER_DELETED_EVENT:
                self.cache.containers.pop(c.id, None)
        if released:
            self._released(released, "stopped (runtime event)")

    # -- views --------------------------------------------------------------------------------------
    def state(self) -> RelayState:
        with self.lock:
            taken = self._taken()
            views = [ContainerView(
                id=c.id, pod_id=c.pod_id, name=c.name, pod=c.pod_name, namespace=c.namespace, pod_uid=c.pod_uid,
                qos_class=c.qos_class, state=c.state, placement=c.placement, cpus=c.cpus, mems=c.mems,
                cpu_request_milli=c.cpu_request_milli, cpu_limit_milli=c.cpu_limit_milli,
                memory_limit_bytes=c.memory_limit_bytes, annotations=c.annotations, cgroup_path=c.cgroup_path,
                reason=c.reason) for c in self.cache.containers.values()]
            return RelayState(
                runtime_up=self.runtime_up, runtime=self.runtime_version,
                problem=self.problem[1] if self.problem else None,
                shared_pool=format_cpulist(self.alloc.shared_pool(taken.all)),
                reserved=format_cpulist(self.alloc.reserved),
                exclusive={c.id: c.cpus for c in self.cache.containers.values() if c.placement == C.EXCLUSIVE and c.live},
                containers=views, pods=len(self.cache.pods))

    def gauges(self) -> dict[str, float]:
        from .. import metrics as M

        with self.lock:
            taken = self._taken().all
            return {M.RELAY_RUNTIME_UP.name: float(self.runtime_up), M.RELAY_EXCLUSIVE_CPUS.name: float(len(taken)),
                    M.RELAY_SHARED_POOL_CPUS.name: float(len(self.alloc.shared_pool(taken))),
                    M.RELAY_MOVES.name: float(self.moves_total)}


def moves_log(state_dir: Path) -> list[MoveRecord]:
    path = Path(state_dir) / MOVES_FILE
    try:
        return [MoveRecord.model_validate(json.loads(line)) for line in path.read_text().splitlines() if line]
    except FileNotFoundError:
        return []
