"""The controller framework: class resolution from annotations and QoS defaults, enforcement, live
re-enforcement on reload, rejected reloads keeping the running classes, release, state and metrics —
on real cgroup v1 blkio and cpu files."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from cri_resmgr.config import ConfigError, build_config
from cri_resmgr.placement.controllers.blockio import parse_device_values
from cri_resmgr.placement.controllers.classes import annotation_key, resolve_class
from cri_resmgr.placement.controllers.manager import ControlManager
from cri_resmgr.placement.controllers.rt import RUNTIME

from .controller_cgroups import CGROUP, Sandbox, bfq_missing, context, loop_device, sample, unavailable

MiB = 1 << 20


def test_resolution_prefers_container_then_pod_annotation_then_qos_default():
    pod, ctr = annotation_key("blockio", "pod"), annotation_key("blockio", "container.app")
    assert pod == "blockioclass.cri-resource-manager.intel.com/pod"
    defaults = {"BestEffort": "slow"}
    assert resolve_class("blockio", "app", {pod: "p", ctr: "c"}, "BestEffort", defaults).cls == "c"
    assert resolve_class("blockio", "other", {pod: "p", ctr: "c"}, "BestEffort", defaults).cls == "p"
    r = resolve_class("blockio", "app", {}, "BestEffort", defaults)
    assert (r.cls, r.source) == ("slow", "defaults.BestEffort")
    assert resolve_class("blockio", "app", {}, "Guaranteed", defaults).cls is None
    assert resolve_class("rdt", "app", {pod: "p"}, "", {}).cls is None  # another control's annotation


@pytest.fixture
def env(tmp_path):
    why = unavailable("blkio", "cpu")
    if why:
        pytest.skip(why)
    if not (CGROUP / "cpu" / RUNTIME).exists():
        pytest.skip("kernel without CONFIG_RT_GROUP_SCHED")
    with loop_device(tmp_path, 16 * MiB) as (dev, mm):
        sb = Sandbox(("blkio", "cpu"))
        yield sb, dev, mm
        sb.cleanup()


def config(dev: str, slow_bps: int = MiB, defaults: dict | None = None, rt: int = 10000, extra: dict | None = None):
    return build_config({"controls": {
        "blockio": {"classes": {"slow": {"devices": [{"devices": dev, "write_bps": slow_bps}]},
                                "fast": {"weight": 500} if bfq_missing() is None else {}},
                    "defaults": defaults if defaults is not None else {"BestEffort": "slow"}},
        "rt": {"classes": {"audio": {"runtime_us": rt}}}, **(extra or {})}}, env={})


def wbps(sb: Sandbox, path: str) -> dict[str, int]:
    return parse_device_values((sb.dir("blkio", path) / "blkio.throttle.write_bps_device").read_text())


def test_enforce_reload_release_and_metrics(env):
    sb, dev, mm = env
    m = ControlManager.from_config(config(dev))
    be = context(sb.container("pod1", "be"), name="be", pod="pod1", qos="BestEffort")
    rt = context(sb.container("pod2", "rt"), name="rt", pod="pod2", qos="Burstable",
                 annotations={annotation_key("rt", "pod"): "audio", annotation_key("blockio", "container.rt"): "fast"})
    bad = context(sb.container("pod3", "bad"), name="bad", pod="pod3",
                  annotations={annotation_key("blockio", "pod"): "nonesuch"})
    for c in (be, rt, bad):
        m.started(c)
    assert wbps(sb, be.cgroup_path) == {mm: MiB}
    assert bfq_missing() or (sb.dir("blkio", rt.cgroup_path) / "blkio.bfq.weight").read_text().strip() == "500"
    assert int((sb.dir("cpu", rt.cgroup_path) / RUNTIME).read_text()) == 10000
    assert m.container_classes(rt.id) == {"blockio": "fast", "rt": "audio"}
    assert m.container_errors(bad.id) == {"blockio": "unknown blockio class 'nonesuch' (from "
                                                     "blockioclass.cri-resource-manager.intel.com/pod)"}
    text = m.metrics_text()
    assert sample(text, "cri_resmgr_container_blockio_class", namespace="default", pod="pod1", container="be",
                  container_id="be", pod_uid="uid-pod1", qos_class="BestEffort", **{"class": "slow"}) == 1
    assert sample(text, "cri_resmgr_container_blockio_class", pod="pod3", **{"class": "nonesuch"}) == 0
    assert sample(text, "cri_resmgr_control_class_containers", control="rt", **{"class": "audio"}) == 1
    assert sample(text, "cri_resmgr_control_errors_total", control="blockio") == 1

    # Reload with a new class value and a new class mapping: running containers follow.
    assert m.reconfigure(config(dev, slow_bps=2 * MiB, defaults={"BestEffort": "fast"}, rt=20000)) == []
    m.reload([be, rt, bad])
    assert wbps(sb, be.cgroup_path) == {}  # BestEffort now maps to "fast": the throttle went
    assert bfq_missing() or (sb.dir("blkio", be.cgroup_path) / "blkio.bfq.weight").read_text().strip() == "500"
    assert int((sb.dir("cpu", rt.cgroup_path) / RUNTIME).read_text()) == 20000
    assert int((sb.dir("cpu", "/" + sb.top) / RUNTIME).read_text()) == 20000

    # A reload naming a device that does not exist is rejected: nothing changes.
    assert m.reconfigure(config("/dev/nonexistent-disk")) == [
        "controls.blockio.classes.slow.devices[0].devices: '/dev/nonexistent-disk' matches no block device under /dev"]
    m.reload([be, rt, bad])
    assert m.container_classes(be.id) == {"blockio": "fast"}

    # Stop: the RT runtime goes back up the tree.
    m.stopped(rt)
    assert int((sb.dir("cpu", "/" + sb.top) / RUNTIME).read_text()) == 0
    assert m.container_classes(rt.id) == {}
    assert sample(m.metrics_text(), "cri_resmgr_control_class_containers", control="rt", **{"class": "audio"}) == 0


def test_taking_a_class_away_on_reload_releases_it(env):
    sb, dev, mm = env
    m = ControlManager.from_config(config(dev))
    be = context(sb.container("pod1", "be"), name="be", pod="pod1", qos="BestEffort")
    m.started(be)
    assert wbps(sb, be.cgroup_path) == {mm: MiB}
    assert m.reconfigure(config(dev, defaults={})) == []
    m.reload([be])
    assert m.container_classes(be.id) == {}


@pytest.mark.parametrize("controls, key", [
    ({"blockio": {"classes": {"x": {"devices": [{"devices": "/dev/nonexistent*", "read_bps": 1}]}}}},
     "controls.blockio.classes.x.devices[0].devices"),
    ({"rt": {"classes": {"x": {"runtime_us": 10**9}}}}, "controls.rt.classes.x.runtime_us"),
    ({"rdt": {"l3": "on", "partitions": {"p": {"classes": {"x": {}}}}}}, "controls.rdt.l3"),
])
def test_node_level_problems_refuse_the_configuration_naming_the_key(controls, key):
    if not (CGROUP / "cpu" / RUNTIME).exists():
        pytest.skip("kernel without CONFIG_RT_GROUP_SCHED")
    cfg = build_config({"controls": controls, "paths": {"resctrl": "/nonexistent-resctrl"}}, env={})
    with pytest.raises(ConfigError) as e:
        ControlManager.from_config(cfg)
    assert e.value.problems[0].startswith(key + ":"), e.value.problems


def test_disabled_control_is_never_enforced(tmp_path):
    cfg = build_config({"controls": {"blockio": {"enabled": False, "classes": {"x": {"weight": 10}},
                                                 "defaults": {"BestEffort": "x"}}}}, env={})
    m = ControlManager.from_config(cfg)
    assert m.apply(context("/nonexistent/c", qos="BestEffort")) == {}


def test_unknown_default_class_is_a_config_error():
    with pytest.raises(ConfigError, match=r"controls.blockio: Value error, defaults.BestEffort: unknown class 'x'"):
        build_config({"controls": {"blockio": {"defaults": {"BestEffort": "x"}}}}, env={})


def test_exit_status_2_for_a_bad_class_config_at_start(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("controls:\n  rdt:\n    partitions:\n      a: {l3: '60%'}\n      b: {l3: '50%'}\n")
    r = subprocess.run([sys.executable, "-m", "cri_resmgr.cli", "config", "--config", str(bad)], capture_output=True,
                       text=True, cwd=Path(__file__).parent.parent)
    assert r.returncode == 2 and "over 100%" in r.stderr, r.stderr


def test_disabling_a_control_on_reload_releases_what_it_granted(env):
    sb, dev, _ = env
    m = ControlManager.from_config(config(dev))
    rt = context(sb.container("pod", "rt"), name="rt", annotations={annotation_key("rt", "pod"): "audio"})
    m.started(rt)
    assert int((sb.dir("cpu") / RUNTIME).read_text()) == 10000
    off = config(dev, extra={"rt": {"enabled": False, "classes": {"audio": {"runtime_us": 10000}}}})
    assert m.reconfigure(off) == []
    m.reload([rt])
    assert int((sb.dir("cpu") / RUNTIME).read_text()) == 0
    assert m.container_classes(rt.id) == {}
