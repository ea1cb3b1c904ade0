"""The NRI plugin's handlers with the real placement engine on a fixture topology (64-core EPYC-like, 8 L3s):
NRI requests in, NRI answers out, decoded and checked field by field. No runtime: the runtime's side of these
exchanges is covered against a real containerd 1.7 in tests/integration/nri/."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from cri_resmgr.nri.plugin import SUBSCRIBED, NriPort, Plugin, RuntimeView
from cri_resmgr.nri.proto import nri_pb2 as api
from cri_resmgr.nri.ttrpc import Call, Code, RpcError
from cri_resmgr.placement.engine import Engine, EngineSettings
from cri_resmgr.sysfs import parse_cpulist
from cri_resmgr.topology import discover
from cri_resmgr.topology.fixtures import MACHINES, build_sysfs


@pytest.fixture(scope="module")
def topology(tmp_path_factory):
    return discover(build_sysfs(MACHINES["epyc-1s-64c-8l3"], tmp_path_factory.mktemp("sys")))


def make_plugin(topology, state_dir) -> Plugin:
    state_dir.mkdir(exist_ok=True)
    view = RuntimeView()
    port = NriPort(view, lambda: None)
    engine = Engine(EngineSettings(), topology, state_dir, port, cgroup_root=state_dir / "no-cgroups",
                    cache_name="nri-cache.json")
    return Plugin(engine, view, port)


def call(method: str) -> Call:
    return Call(method, time.monotonic() + 5)


def pod(uid: str, qos: str = "Guaranteed", **ann: str) -> api.PodSandbox:
    mid = "" if qos == "Guaranteed" else f"/{qos.lower()}"
    p = api.PodSandbox(id=f"pod-{uid}", name=f"p{uid}", uid=uid, namespace="default", annotations=ann)
    p.linux.cgroup_parent = f"/kubepods{mid}/pod{uid}"
    return p


def container(cid: str, p: api.PodSandbox, milli: int = 0, cpus: str = "",
              state: int = api.CONTAINER_UNKNOWN) -> api.Container:
    c = api.Container(id=cid, pod_sandbox_id=p.id, name=f"c{cid}", state=state)
    r = c.linux.resources
    r.cpu.shares.value = max(2, milli * 1024 // 1000)
    if milli:
        r.cpu.quota.value, r.cpu.period.value = milli * 100, 100000
        r.memory.limit.value = 64 << 20
    if cpus:
        r.cpu.cpus = cpus
    return c


def create(plugin: Plugin, p: api.PodSandbox, c: api.Container) -> api.CreateContainerResponse:
    raw = plugin.create_container(api.CreateContainerRequest(pod=p, container=c).SerializeToString(),
                                  call("CreateContainer"))
    return api.CreateContainerResponse.FromString(raw)


def sync(plugin: Plugin, pods, ctrs) -> api.SynchronizeResponse:
    raw = plugin.synchronize(api.SynchronizeRequest(pods=pods, containers=ctrs).SerializeToString(),
                             call("Synchronize"))
    return api.SynchronizeResponse.FromString(raw)


def test_configure_subscribes_to_the_lifecycle_events(topology, tmp_path):
    plugin = make_plugin(topology, tmp_path / "s")
    req = api.ConfigureRequest(runtime_name="containerd", runtime_version="1.7.24")
    raw = plugin.configure(req.SerializeToString(), call("Configure"))
    events = api.ConfigureResponse.FromString(raw).events
    assert {e for e in range(1, 12) if events & (1 << (e - 1))} == set(SUBSCRIBED)
    assert plugin.port.describe() == "containerd 1.7.24 over NRI"


def test_exclusive_create_adjusts_its_cpuset_and_moves_shared_containers_off_in_the_same_answer(topology, tmp_path):
    plugin = make_plugin(topology, tmp_path / "s")
    be = pod("be", "BestEffort")
    sync(plugin, [be], [container("shared1", be, cpus="0-127", state=api.CONTAINER_RUNNING)])
    g = pod("g")
    resp = create(plugin, g, container("excl1", g, milli=8000))
    got = parse_cpulist(resp.adjust.linux.resources.cpu.cpus)
    assert len(got) == 8 and resp.adjust.linux.resources.cpu.mems == "0"
    (upd,) = resp.update
    assert upd.container_id == "shared1"
    pool = parse_cpulist(upd.linux.resources.cpu.cpus)
    assert pool == frozenset(range(128)) - got
    assert upd.linux.resources.cpu.shares.value == 2  # the rest of its resources travel unchanged
    st = plugin.engine.state()
    assert parse_cpulist(st.exclusive["excl1"]) == got and parse_cpulist(st.shared_pool) == pool


def test_shared_create_gets_the_pool_and_no_updates(topology, tmp_path):
    plugin = make_plugin(topology, tmp_path / "s")
    sync(plugin, [], [])
    b = pod("b", "Burstable")
    resp = create(plugin, b, container("s1", b, milli=500))
    assert parse_cpulist(resp.adjust.linux.resources.cpu.cpus) == frozenset(range(128)) and not resp.update


def test_stop_returns_the_exclusive_cpus_to_the_shared_containers_after_its_answer(topology, tmp_path):
    """The stop is answered at once (no update for the runtime to apply before the stop returns); then the pool
    worker is woken to give the CPUs back through UpdateContainers."""
    plugin = make_plugin(topology, tmp_path / "s")
    be, g = pod("be", "BestEffort"), pod("g")
    sync(plugin, [be], [container("shared1", be, cpus="0-127", state=api.CONTAINER_RUNNING)])
    create(plugin, g, container("excl1", g, milli=4000))
    e = plugin.engine
    e._pool_wake.clear()
    c = call("StopContainer")
    raw = plugin.methods()["StopContainer"].handler(
        api.StopContainerRequest(pod=g, container=api.Container(id="excl1")).SerializeToString(), c)
    assert raw == b"" and not e._pool_wake.is_set()
    c.run_after()  # the server runs this once the answer is sent
    assert e._pool_wake.is_set()
    assert [(t[0], parse_cpulist(t[1])) for t in e.pool_targets()] == [("shared1", frozenset(range(128)))]


def test_insufficient_cpus_is_answered_as_resource_exhausted(topology, tmp_path):
    plugin = make_plugin(topology, tmp_path / "s")
    sync(plugin, [], [])
    g = pod("g")
    with pytest.raises(RpcError) as e:
        create(plugin, g, container("huge", g, milli=128000))  # the pool must keep one CPU
    assert e.value.code == Code.RESOURCE_EXHAUSTED and "insufficient CPUs" in e.value.message
    assert plugin.engine.state().pending == 0


def test_late_create_is_undone(topology, tmp_path):
    plugin = make_plugin(topology, tmp_path / "s")
    sync(plugin, [], [])
    g = pod("g")
    late = Call("CreateContainer", time.monotonic() + 5)
    assert late.expire()  # the server already answered with the fail-open response
    raw = plugin.create_container(api.CreateContainerRequest(pod=g, container=container("x", g, milli=2000))
                                  .SerializeToString(), late)
    assert raw == b""
    st = plugin.engine.state()
    assert st.exclusive == {} and st.pending == 0 and st.containers == []


def test_restarted_plugin_adopts_its_exclusive_containers_without_booking_twice(topology, tmp_path):
    first = make_plugin(topology, tmp_path / "s")
    sync(first, [], [])
    g = pod("g")
    c = container("excl1", g, milli=4000)
    cpus = create(first, g, c).adjust.linux.resources.cpu.cpus
    first.engine.persist()
    # a new process: same state dir; Synchronize reports the container as running with the cpuset it has
    second = make_plugin(topology, tmp_path / "s")
    c.linux.resources.cpu.cpus, c.state = cpus, api.CONTAINER_RUNNING
    resp = sync(second, [g], [c])
    assert not resp.update  # nothing to change
    assert second.engine.state().exclusive == {"excl1": cpus}
    g2 = pod("g2")
    other = parse_cpulist(create(second, g2, container("excl2", g2, milli=4000)).adjust.linux.resources.cpu.cpus)
    assert len(other) == 4 and other.isdisjoint(parse_cpulist(cpus))


def test_split_synchronize_is_collected_until_the_last_part(topology, tmp_path):
    plugin = make_plugin(topology, tmp_path / "s")
    a, b = pod("a", "BestEffort"), pod("b", "BestEffort")
    first = plugin.synchronize(api.SynchronizeRequest(pods=[a], containers=[container("ca", a, cpus="0-127")],
                                                      more=True).SerializeToString(), call("Synchronize"))
    assert api.SynchronizeResponse.FromString(first).more and not plugin.synchronized.is_set()
    sync(plugin, [b], [container("cb", b, cpus="0-127")])
    assert {c.id for c in plugin.engine.state().containers} == {"ca", "cb"}


def test_state_change_events_are_named_for_metrics_and_tracked(topology, tmp_path):
    plugin = make_plugin(topology, tmp_path / "s")
    sync(plugin, [], [])
    g = pod("g")
    create(plugin, g, container("c1", g, milli=2000))
    for ev, want in ((api.START_CONTAINER, "StartContainer"), (api.REMOVE_CONTAINER, "RemoveContainer"),
                     (api.REMOVE_POD_SANDBOX, "RemovePodSandbox")):
        cl = call("StateChange")
        plugin.state_change(api.StateChangeEvent(event=ev, pod=g, container=api.Container(id="c1"))
                            .SerializeToString(), cl)
        assert cl.event == want
    assert plugin.engine.state().containers == [] and "c1" not in plugin.view.containers


@pytest.mark.parametrize("index,ok", [("90", True), ("05", True), ("9", False), ("100", False), ("ab", False)])
def test_plugin_index_is_exactly_two_digits_as_nri_requires(index, ok):
    from pydantic import ValidationError

    from cri_resmgr.config import NriConfig

    if ok:
        assert NriConfig(plugin_index=index).plugin_index == index
    else:
        with pytest.raises(ValidationError, match="plugin_index"):
            NriConfig(plugin_index=index)


def test_pod_annotations_steer_placement_as_with_the_relay(topology, tmp_path):
    plugin = make_plugin(topology, tmp_path / "s")
    sync(plugin, [], [])
    g = pod("g", **{"cri-resmgr.io/exclusive.container.cshared": "false"})
    shared = create(plugin, g, container("shared", g, milli=2000))  # whole CPUs, but told to share
    assert parse_cpulist(shared.adjust.linux.resources.cpu.cpus) == frozenset(range(128)) and not shared.update
    excl = create(plugin, g, container("excl", g, milli=2000))  # the pod's other container is exclusive
    assert len(parse_cpulist(excl.adjust.linux.resources.cpu.cpus)) == 2
    assert [u.container_id for u in excl.update] == ["shared"]
    views = {v.id: v for v in plugin.engine.state().containers}
    assert views["shared"].placement == "shared" and views["excl"].placement == "exclusive"


def test_direct_event_calls_of_newer_runtimes_do_what_state_change_does(topology, tmp_path):
    """NRI >= 0.7 (containerd 2.x) calls RunPodSandbox, StartContainer, ... directly; an unserved one would be
    answered UNIMPLEMENTED and fail the pod there."""
    plugin = make_plugin(topology, tmp_path / "s")
    m = plugin.methods()
    sync(plugin, [], [])
    g = pod("g")
    assert m["RunPodSandbox"].handler(api.RunPodSandboxRequest(pod=g).SerializeToString(), call("RunPodSandbox")) \
        == b""
    assert plugin.engine.pod("pod-g") is not None
    create(plugin, g, container("c1", g, milli=2000))
    m["StartContainer"].handler(api.StartContainerRequest(pod=g, container=api.Container(id="c1"))
                                .SerializeToString(), call("StartContainer"))
    assert plugin.engine.container("c1").state == "running"
    m["RemoveContainer"].handler(api.RemoveContainerRequest(pod=g, container=api.Container(id="c1"))
                                 .SerializeToString(), call("RemoveContainer"))
    assert plugin.engine.container("c1") is None and plugin.engine.state().exclusive == {}
    m["RemovePodSandbox"].handler(api.RemovePodSandboxRequest(pod=g).SerializeToString(), call("RemovePodSandbox"))
    assert plugin.engine.pod("pod-g") is None


def test_hooks_wake_the_engines_threads_only_after_their_answer_and_only_when_the_pool_changed(topology, tmp_path):
    """A shared create wakes no pool worker, save or controllers (the pool is unchanged), only the persist thread
    for its lazy save, once (the second create finds it due already); an exclusive one wakes the pool worker and a
    save. All only once the answer is out (Call.run_after, which the server runs after sending it); the updates
    its exclusive answer carries are in the books, so the pool worker has nothing left to send."""
    plugin = make_plugin(topology, tmp_path / "s")
    m = plugin.methods()
    be = pod("be", "BestEffort")
    sync(plugin, [be], [container("shared1", be, cpus="0-127", state=api.CONTAINER_RUNNING)])
    e = plugin.engine
    e._pool_wake.clear()  # Synchronize's adoption saves at once; the engine's threads are not running here
    e._dirty.clear()
    e._persist_wake.clear()
    e._lazy_dirty = False  # as after the persist thread's save
    before = e.wakeups()

    for i in range(2):
        c = call("CreateContainer")
        b = pod(f"b{i}", "Burstable")
        m["CreateContainer"].handler(api.CreateContainerRequest(pod=b, container=container(f"s{i}", b, milli=500))
                                     .SerializeToString(), c)
        assert not e._persist_wake.is_set()  # not before the answer is out
        c.run_after()
        assert e._persist_wake.is_set() == (i == 0)  # the second: its save is due already
        e._persist_wake.clear()
        # shared: no pool worker, no save, no controllers; the lazy save asked for once
        assert {k: v - before[k] for k, v in e.wakeups().items()} == {
            "pool": 0, "persist": 0, "persist_tick": 1, "controllers": 0}
        assert not e._pool_wake.is_set() and not e._dirty.is_set()

    c = call("CreateContainer")
    g = pod("g")
    raw = m["CreateContainer"].handler(api.CreateContainerRequest(pod=g, container=container("x1", g, milli=4000))
                                       .SerializeToString(), c)
    ups = {u.container_id: u.linux.resources.cpu.cpus for u in api.CreateContainerResponse.FromString(raw).update}
    assert set(ups) == {"shared1", "s0", "s1"}
    assert not e._pool_wake.is_set() and not e._dirty.is_set()  # the answer is not sent yet: nothing woken
    assert e.wakeups()["pool"] == before["pool"] + 1  # asked for, deferred
    c.run_after()
    assert e._pool_wake.is_set() and e._dirty.is_set()
    assert e.pool_targets() == []  # shared1's new cpuset (the answer's update) is in the books
    assert {cid: e.container(cid).cpus for cid in ups} == ups


def _voluntary_switches(native_id: int) -> int:
    # proc(5) /proc/[pid]/task/[tid]/status: voluntary_ctxt_switches, one per time the thread went to sleep
    for line in Path(f"/proc/self/task/{native_id}/status").read_text().splitlines():
        if line.startswith("voluntary_ctxt_switches:"):
            return int(line.split()[1])
    raise AssertionError("no voluntary_ctxt_switches")


def test_an_idle_engine_s_threads_sleep_until_they_have_work_and_a_lazy_save_still_lands(topology, tmp_path):
    """Every wake-up of an engine thread may land in a hook and take the interpreter from it (issue 15): with
    nothing to do, the pool worker, the persist thread and the controllers' thread do not wake at all (they used
    to every 0.5-1 s); a change the runtime can tell again wakes the persist thread once, and it saves it."""
    import json

    from cri_resmgr.config import Config
    from cri_resmgr.placement.controllers.manager import ControlManager

    plugin = make_plugin(topology, tmp_path / "s")
    e = plugin.engine
    e.add_controller(ControlManager.from_config(Config()))
    e.start()
    try:
        sync(plugin, [], [])
        time.sleep(0.5)  # Synchronize's save and the controllers' start-up reload are done
        threads = {n: e._threads[n].thread for n in ("pool", "persist", "controllers")}
        before = {n: _voluntary_switches(t.native_id) for n, t in threads.items()}
        time.sleep(2.2)  # two ticks of the old 1 s waits, four of the 0.5 s one
        assert {n: _voluntary_switches(t.native_id) - before[n] for n, t in threads.items()} == {
            "pool": 0, "persist": 0, "controllers": 0}
        b = pod("b", "BestEffort")
        m = plugin.methods()
        c = call("RunPodSandbox")
        m["RunPodSandbox"].handler(api.RunPodSandboxRequest(pod=b).SerializeToString(), c)
        c.run_after()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            if e.cache_path.exists() and [p["id"] for p in json.loads(e.cache_path.read_text())["pods"]] == [b.id]:
                break
            time.sleep(0.05)
        else:
            raise AssertionError("the lazy save did not land")
    finally:
        e.stop()


def test_a_failing_hook_still_runs_its_wake_ups(topology, tmp_path):
    plugin = make_plugin(topology, tmp_path / "s")
    sync(plugin, [], [])
    g = pod("g")
    create(plugin, g, container("x1", g, milli=2000))
    e = plugin.engine
    e._pool_wake.clear()

    stopped = e.stopped

    def boom(*a, **kw):
        stopped(*a, **kw)
        raise RuntimeError("bug after the release")

    e.stopped = boom  # StopContainer of an exclusive container fails after the engine released its CPUs
    c = call("StopContainer")
    with pytest.raises(RuntimeError):
        plugin.methods()["StopContainer"].handler(
            api.StopContainerRequest(pod=g, container=api.Container(id="x1")).SerializeToString(), c)
    c.run_after()
    assert e._pool_wake.is_set()  # the pool worker still gives the CPUs back
