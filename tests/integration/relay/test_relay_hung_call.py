"""A runtime that hangs one call (issue 11): a real containerd 1.6 whose runc shim runs a wrapper that blocks
exactly one runc operation of one marked container (tests/integration/relay/runc_hang.py), while every
other call of the runtime goes on. Pods churn through the relay meanwhile, and a sampler reads the placement
invariants from the kernel's cgroup cpuset files every few milliseconds (never from the relay, and not through
the runtime either: containerd 1.6 answers no ListContainers while one container's update hangs, since its
UpdateContainerResources holds that container's status lock across the runc call):

- no CPU in the cpusets of two running Guaranteed (exclusive, 1 CPU) containers;
- no running non-Guaranteed container's cpuset holds a running Guaranteed container's CPU.

"Running" is read from the kernel too: the cgroup holds a process that is not runc's init waiting for
``runc start`` (comm ``runc:[2:INIT]``: it has not exec'd the container's program yet).

containerd 1.6 makes no runc call in CreateContainer (the task, and with it the cgroup, is made by
StartContainer: ``runc create`` then ``runc start``), so the hung calls are a StartContainer (``runc create``)
and an UpdateContainerResources (``runc update``, the relay's pool updates).
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from cri_api.v1 import api_pb2 as pb

from cri_resmgr.collectors.cgroup import detect_layout
from cri_resmgr.sysfs import format_cpulist, parse_cpulist

from ..containerd import Containerd, missing_prerequisites
from ..cri import CriClient, Kubelet, PodSpec, RunningPod, container_config, guaranteed
from ..helpers import CGROUP_ROOT, wait_for
from .harness import RelayProcess
from .runc_hang import RuncHang

pytestmark = pytest.mark.integration

ONLINE = parse_cpulist(Path("/sys/devices/system/cpu/online").read_text())
START_HOLD_SECONDS = 5.0  # EngineSettings.start_hold_seconds: the longest a start is held, then let through
RUNC_INIT_COMM = "runc:[2:INIT]"  # runc's init before it execs the container's program (runc libcontainer/nsenter)
HOLD_TIMEOUTS = "cri_resmgr_relay_start_hold_timeouts_total"


def cpuset_root() -> Path:
    layout = detect_layout(CGROUP_ROOT)
    assert layout is not None
    return layout.cpuset if layout.version == 1 and layout.cpuset else layout.root


class KernelSampler(threading.Thread):
    """Reads the cgroups (cpuset.cpus, cgroup.procs) of the test's containers under the runtime's cgroup prefix:
    those in ``known``, registered when their create returns (before the start that makes the cgroup). Sandboxes
    (pause) are left out: the relay does not place them."""

    def __init__(self, top: Path, known: set[str], interval: float = 0.01):
        super().__init__(daemon=True)
        self.top = top  # <cpuset root>/<prefix>/kubepods
        self.known = known
        self.interval = interval
        self.stop_event = threading.Event()
        self.samples = 0
        self.violations: list[str] = []
        self.phase = "start"

    @staticmethod
    def _running(cg: Path) -> bool:
        for pid in (cg / "cgroup.procs").read_text().split():
            with contextlib.suppress(OSError):
                if Path(f"/proc/{pid}/comm").read_text().strip() != RUNC_INIT_COMM:
                    return True
        return False

    def containers(self) -> Iterator[tuple[str, bool, Path]]:
        """(container id, exclusive, cgroup) of the known containers."""
        for pod_dir in [*self.top.glob("pod*"), *self.top.glob("besteffort/pod*"), *self.top.glob("burstable/pod*")]:
            exclusive = pod_dir.parent == self.top  # kubepods/pod<uid>: a Guaranteed pod
            with contextlib.suppress(OSError):
                for cg in pod_dir.iterdir():
                    if cg.name in self.known:
                        yield cg.name, exclusive, cg

    def read(self) -> dict[str, tuple[bool, frozenset[int]]]:
        """Running containers -> (exclusive, cpus); a container counts only if running before and after its
        cpuset was read (running at two instants, it ran in between with that cpuset)."""
        out = {}
        for cid, exclusive, cg in list(self.containers()):
            try:
                if not self._running(cg):
                    continue
                cpus = parse_cpulist((cg / "cpuset.cpus").read_text())
                if self._running(cg):
                    out[cid] = (exclusive, cpus)
            except (OSError, ValueError):
                continue  # gone meanwhile
        return out

    def sample(self) -> None:
        seen = self.read()
        owner: dict[int, str] = {}
        for cid, (exclusive, cpus) in seen.items():
            if not exclusive:
                continue
            if len(cpus) != 1:
                self.violations.append(f"{self.phase}: exclusive {cid[:12]} has {format_cpulist(cpus)}")
            for cpu in cpus:
                if cpu in owner:
                    self.violations.append(f"{self.phase}: CPU {cpu} in {cid[:12]} and {owner[cpu][:12]}")
                owner[cpu] = cid
        for cid, (exclusive, cpus) in seen.items():
            clash = cpus & owner.keys()
            if not exclusive and clash:
                self.violations.append(f"{self.phase}: shared {cid[:12]} {format_cpulist(cpus)} on exclusive "
                                       f"CPUs {format_cpulist(clash)} of {owner[min(clash)][:12]}")
        self.samples += 1

    def run(self) -> None:
        while not self.stop_event.wait(self.interval):
            self.sample()

    def stop(self) -> None:
        self.stop_event.set()
        self.join(10)


class VersionProbe(threading.Thread):
    """Version through the relay every 100 ms on kubelet's kind of connection (one channel kept open)."""

    def __init__(self, socket_path: Path):
        super().__init__(daemon=True)
        self.client = CriClient(socket_path, timeout=2)
        self.stop_event = threading.Event()
        self.worst = 0.0
        self.calls = 0
        self.failures: list[str] = []

    def run(self) -> None:
        while not self.stop_event.wait(0.1):
            t0 = time.monotonic()
            try:
                self.client.runtime.Version(pb.VersionRequest(), timeout=2)
            except grpc.RpcError as e:
                self.failures.append(f"{e.code().name} after {time.monotonic() - t0:.2f}s")
            self.worst = max(self.worst, time.monotonic() - t0)
            self.calls += 1

    def stop(self) -> None:
        self.stop_event.set()
        self.join(10)
        self.client.close()


@pytest.fixture(scope="module")
def hanging_containerd() -> Iterator[tuple[Containerd, RuncHang]]:
    reason = missing_prerequisites()
    if reason:
        pytest.skip(reason)
    if len(ONLINE) < 2:
        pytest.skip("needs at least 2 online CPUs (one exclusive, one shared)")
    base = Path(tempfile.mkdtemp(prefix="crirm-hang-"))
    runc = shutil.which("runc")
    assert runc is not None
    hang = RuncHang(base / "hang", runc, base / "state")
    c = Containerd(base, runc_binary=hang.binary).up()
    yield c, hang
    hang.release_all()
    problems = c.cleanup()
    assert not problems, problems


@dataclass
class Node:
    containerd: Containerd
    hang: RuncHang
    relay: RelayProcess
    kubelet: Kubelet
    direct: Kubelet
    sampler: KernelSampler
    probe: VersionProbe
    known: set[str] = field(default_factory=set)
    n: int = 0

    def pod(self, qos: str) -> RunningPod:
        self.n += 1
        return self.kubelet.run_pod(PodSpec(f"p{self.n}", qos=qos))

    def create(self, p: RunningPod, cfg: pb.ContainerConfig) -> str:
        cid = self.kubelet.create(p, cfg)
        self.known.add(cid)  # before its start: the sampler sees its cgroup from the moment it exists
        return cid

    def run_container(self, p: RunningPod, cfg: pb.ContainerConfig) -> str:
        cid = self.create(p, cfg)
        self.kubelet.start(cid)
        return cid

    def cgroup(self, p: RunningPod, cid: str) -> Path:
        return cpuset_root() / self.containerd.cgroup_parent(p.spec.qos, p.spec.uid).lstrip("/") / cid

    def kernel_cpus(self, p: RunningPod, cid: str) -> frozenset[int]:
        return parse_cpulist((self.cgroup(p, cid) / "cpuset.cpus").read_text())

    def counter(self, name: str) -> float:
        return self.relay.client().state().counters.get(name, 0.0)

    def books_match_kernel(self) -> None:
        """Every running container's cpuset in the relay's books is the one the kernel has; the relay's own
        check against the kernel finds nothing; no reservation is left pending."""
        st = self.relay.client().state()
        assert st.pending == 0, st.pending
        running = self.sampler.read()
        for v in st.containers:
            if v.state == "running":
                assert v.id in running, f"{v.id[:12]} running in the books, not in the kernel"
                assert parse_cpulist(v.cpus) == running[v.id][1], (v.id[:12], v.cpus, running[v.id])
        excl = {cid: parse_cpulist(c) for cid, c in st.exclusive.items()}
        kernel_excl = {cid: cpus for cid, (x, cpus) in running.items() if x}
        assert {cid: cpus for cid, cpus in excl.items() if cid in running} == kernel_excl, (excl, kernel_excl)
        inv = self.relay.client().invariants()
        assert inv.violations == [], inv.violations


@pytest.fixture
def node(hanging_containerd, tmp_path) -> Iterator[Node]:
    c, hang = hanging_containerd
    relay = RelayProcess(tmp_path / "relay", c.socket)
    relay.start()
    k = Kubelet(CriClient(relay.socket), c.cgroup_parent, tmp_path / "pod-logs")
    direct = Kubelet(CriClient(c.socket, timeout=15), c.cgroup_parent, tmp_path / "pod-logs")
    known: set[str] = set()
    sampler = KernelSampler(cpuset_root() / c.cgroup_prefix / "kubepods", known)
    probe = VersionProbe(relay.socket)
    sampler.start()
    probe.start()
    n = Node(c, hang, relay, k, direct, sampler, probe, known)
    try:
        yield n
    finally:
        sampler.stop()
        probe.stop()
        hang.release_all()  # what the test left hung goes on now
        direct.pods.extend(k.pods)
        k.c.close()
        direct.cleanup()
        left = direct.remove_all_pods()
        direct.c.close()
        if sampler.violations:
            print(f"kernel samples flagged {len(sampler.violations)}; relay log {relay.log_path}")
        relay.stop()
        assert not left, f"sandboxes that could not be removed: {left}"


def in_thread(fn, *args) -> tuple[threading.Thread, dict]:
    """Run ``fn(*args)`` in a thread; the dict gets ``result`` or ``error`` and the ``seconds`` it took."""
    out: dict = {}

    def run() -> None:
        t0 = time.monotonic()
        try:
            out["result"] = fn(*args)
        except grpc.RpcError as e:
            out["error"] = e.code()
        out["seconds"] = time.monotonic() - t0

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def test_a_hung_start_delays_only_the_exclusive_start_its_cgroup_could_collide_with(node):
    """One BestEffort container's start hangs in containerd (its ``runc create``): other creates and starts go
    on, the relay answers Version throughout, and an exclusive container taking a CPU that the hung container's
    spec held when its start went through is not started until that start has returned and the container been
    re-pinned: containerd 1.6 applies an update of a starting container to its spec only, and the task is built
    from the spec as it was when the start began (seen here: the kernel showed the late-started BestEffort
    container on the exclusive CPU of a Guaranteed one that had started meanwhile). A start whose caller gives
    up (deadline) releases what it held once the runtime reports it exited."""
    k, hang, s = node.kubelet, node.hang, node.sampler
    s.phase = "hung-start"
    xp = node.pod("BestEffort")
    x = node.create(xp, container_config("app", env=RuncHang.env("create")))
    xt, xout = in_thread(k.start, x)
    hang.wait_hung("create", x)
    assert not xout, xout  # the start is held inside the runtime, not refused

    # Other containers are created and started meanwhile; the shared one at once.
    t0 = time.monotonic()
    bp = node.pod("BestEffort")
    b = node.run_container(bp, container_config("app"))
    assert time.monotonic() - t0 < 3, "a BestEffort pod waited for the hung start"
    gp = node.pod("Guaranteed")
    t0 = time.monotonic()
    g = node.create(gp, guaranteed("app", 1000))
    assert time.monotonic() - t0 < 2, "an exclusive create waited for the hung start"
    gt, gout = in_thread(k.start, g)
    # The pool update moving the hung container off the new exclusive CPU was made meanwhile (containerd took it
    # into the spec only): the books say it is off, the cgroup it will get does not.
    g_books = parse_cpulist(node.relay.client().state().exclusive[g])
    wait_for(lambda: not any(parse_cpulist(v.cpus) & g_books for v in node.relay.client().state().containers
                             if v.id == x), timeout=5, what="the books move the hung container off the new CPU")
    time.sleep(1.0)
    assert xt.is_alive(), "the hung start returned before it was released"
    assert not gout, f"the exclusive start went on while the hung one could still come up on its CPU: {gout}"
    hang.release("create", x)  # the runtime answers again, before any deadline
    xt.join(15)
    gt.join(15)
    assert "result" in xout and "result" in gout, (xout, gout)
    g_cpus = node.kernel_cpus(gp, g)
    assert len(g_cpus) == 1, g_cpus
    assert not node.kernel_cpus(xp, x) & g_cpus and not node.kernel_cpus(bp, b) & g_cpus
    assert gout["seconds"] < START_HOLD_SECONDS, f"exclusive start held {gout['seconds']:.1f}s (let through)"
    assert node.counter(HOLD_TIMEOUTS) == 0
    wait_for(lambda: node.relay.client().state().pending == 0, timeout=5, what="no reservation pending")
    node.books_match_kernel()

    # A start whose caller gives up: DEADLINE_EXCEEDED to it; the runtime marks the container exited, and
    # what it held comes back, so the next exclusive container starts without waiting for the hold to end.
    s.phase = "hung-start-deadline"
    k.stop_remove_container(g)
    yp = node.pod("BestEffort")
    y = node.create(yp, container_config("app", env=RuncHang.env("create")))
    yt, yout = in_thread(lambda: k.c.runtime.StartContainer(pb.StartContainerRequest(container_id=y), timeout=2))
    hang.wait_hung("create", y)
    g2p = node.pod("Guaranteed")
    g2 = node.create(g2p, guaranteed("app", 1000))
    g2t, g2out = in_thread(k.start, g2)
    yt.join(10)
    assert yout.get("error") == grpc.StatusCode.DEADLINE_EXCEEDED, yout
    g2t.join(15)
    assert "result" in g2out, g2out
    assert g2out["seconds"] < START_HOLD_SECONDS, f"exclusive start held {g2out['seconds']:.1f}s (let through)"
    wait_for(lambda: node.direct.status(y).status.state == pb.CONTAINER_EXITED, timeout=10, what="y exited")
    hang.release("create", y)  # the runtime's late runc create: its task was already given up
    time.sleep(1.0)
    assert node.counter(HOLD_TIMEOUTS) == 0
    wait_for(lambda: node.relay.client().state().pending == 0, timeout=5, what="no reservation pending")
    node.books_match_kernel()

    # Nothing leaked: with every pod gone, no CPU is exclusive in the books and the pool is every CPU.
    for p in list(k.pods):
        k.stop_remove_pod(p)
    st = node.relay.client().state()
    assert st.exclusive == {} and parse_cpulist(st.shared_pool) == ONLINE, (st.exclusive, st.shared_pool)

    assert node.probe.failures == [] and node.probe.worst < 2.0, (node.probe.failures, node.probe.worst)
    assert s.violations == [], s.violations[:20]
    assert s.samples >= 100, s.samples
    print(f"samples {s.samples}; Version worst {node.probe.worst * 1000:.1f} ms over {node.probe.calls} calls; "
          f"exclusive start held {gout['seconds']:.2f}s behind the hung start, {g2out['seconds']:.2f}s behind "
          f"the one given up")


def test_a_hung_pool_update_holds_no_other_update_and_no_create(node):
    """One running BestEffort container's ``runc update`` hangs (the relay's pool update moving it off a CPU
    that just became exclusive): the exclusive container's create completes at once, the other shared
    container leaves that CPU before the exclusive one starts, the exclusive start is held at most
    START_HOLD_SECONDS (then let through, counted: the hung container cannot leave), and once the runtime
    answers again the books and the kernel agree."""
    k, hang, s = node.kubelet, node.hang, node.sampler
    s.phase = "hung-update"
    xp = node.pod("BestEffort")
    x = node.run_container(xp, container_config("app", env=RuncHang.env("update")))
    bp = node.pod("BestEffort")
    b = node.run_container(bp, container_config("app"))
    assert node.kernel_cpus(xp, x) == ONLINE and node.kernel_cpus(bp, b) == ONLINE
    holds = node.counter(HOLD_TIMEOUTS)

    gp = node.pod("Guaranteed")
    t0 = time.monotonic()
    g = node.create(gp, guaranteed("app", 1000))
    assert time.monotonic() - t0 < 2, "an exclusive create waited for pool updates"
    hang.wait_hung("update", x)
    # From the moment the start may be let through, the hung container may share the exclusive CPU: the runtime
    # never ran its update. Any other sharing is a failure.
    s.phase = "hung-update-let-through"
    t0 = time.monotonic()
    k.start(g)
    held = time.monotonic() - t0
    g_cpus = node.kernel_cpus(gp, g)
    assert len(g_cpus) == 1, g_cpus
    # the other shared container was moved off regardless of the hung update
    assert not node.kernel_cpus(bp, b) & g_cpus, (node.kernel_cpus(bp, b), g_cpus)
    assert START_HOLD_SECONDS - 0.5 <= held <= START_HOLD_SECONDS + 1.5, f"start held {held:.1f}s"
    assert node.kernel_cpus(xp, x) & g_cpus  # the hung container is still there: its update never ran
    assert node.counter(HOLD_TIMEOUTS) == holds + 1  # let through after the bound, and counted

    # Another exclusive create, refused for lack of CPUs at once (not held behind the hung update).
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as refused:
        node.create(node.pod("Guaranteed"), guaranteed("app", 1000))
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert time.monotonic() - t0 < 2

    hang.release("update", x)
    wait_for(lambda: not node.kernel_cpus(xp, x) & g_cpus, timeout=15, interval=0.05,
             what="the hung container off the exclusive CPU once the runtime answers")
    s.phase = "hung-update-released"
    wait_for(lambda: node.relay.client().invariants().violations == [], timeout=15, what="invariants hold")
    node.books_match_kernel()
    assert node.probe.failures == [] and node.probe.worst < 2.0, (node.probe.failures, node.probe.worst)
    # the one sharing allowed: the hung container on the exclusive CPU, after the start was let through
    bad = [v for v in s.violations if not (v.startswith("hung-update-let-through") and f"shared {x[:12]}" in v)]
    assert bad == [], bad[:20]
    # and the sampler is not blind: it saw that sharing while it lasted
    assert any(f"shared {x[:12]}" in v for v in s.violations), s.violations[:5]
    assert s.samples >= 50, s.samples
    print(f"samples {s.samples}; exclusive start held {held:.2f}s; Version worst {node.probe.worst * 1000:.1f} ms")
