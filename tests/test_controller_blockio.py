"""Block-IO classes on real cgroup v1 blkio files (Documentation/admin-guide/cgroup-v1/blkio-controller.rst),
including a measured throttle on a loop device, and the v2 io.max/io.weight format on a file tree."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from cri_resmgr.config import build_config
from cri_resmgr.placement.controllers.base import ControlError, Plan
from cri_resmgr.placement.controllers.blockio import BlockioController, parse_device_values, parse_io_max

from .controller_cgroups import CGROUP, Sandbox, bfq_missing, context, loop_device, unavailable

MiB = 1 << 20


def section(classes: dict, defaults: dict | None = None):
    cfg = build_config({"controls": {"blockio": {"classes": classes, "defaults": defaults or {}}}}, env={})
    return cfg.controls.blockio


def plan(ctrl: BlockioController, classes: dict) -> Plan:
    p = ctrl.prepare(section(classes))
    assert isinstance(p, Plan), p
    return p


@pytest.fixture
def sandbox():
    why = unavailable("blkio")
    if why:
        pytest.skip(why)
    sb = Sandbox(("blkio",))
    yield sb
    sb.cleanup()


@pytest.fixture
def loopdev(tmp_path):
    with loop_device(tmp_path, 64 * MiB) as (dev, _):
        yield dev


def test_parsers_read_the_kernel_formats():
    assert parse_device_values("254:0 1048576\n7:3 10\n") == {"254:0": 1048576, "7:3": 10}
    assert parse_device_values("default 100\n8:0 300\n") == {"8:0": 300}
    assert parse_device_values("") == {}
    assert parse_io_max("8:16 rbps=2097152 wbps=max riops=max wiops=120\n") == {
        "8:16": {"rbps": "2097152", "wbps": "max", "riops": "max", "wiops": "120"}}


def test_pattern_resolves_to_major_minor_of_a_real_disk():
    disks = [d for d in ("vda", "sda", "nvme0n1") if Path(f"/dev/{d}").exists()]
    if not disks:
        pytest.skip("no /dev/vda, /dev/sda or /dev/nvme0n1 here")
    st = os.stat(f"/dev/{disks[0]}")
    found, _ = BlockioController(CGROUP).resolve_pattern(f"/dev/{disks[0][:2]}*")
    assert (f"/dev/{disks[0]}", os.major(st.st_rdev), os.minor(st.st_rdev)) in found


def test_unknown_device_pattern_is_a_problem_naming_the_key():
    problems = BlockioController(CGROUP).prepare(section({"slow": {"devices": [{"devices": "/dev/nonexistent*",
                                                                                  "write_bps": 1000}]}}))
    assert problems == ["controls.blockio.classes.slow.devices[0].devices: '/dev/nonexistent*' matches no block "
                        "device under /dev"]


def test_class_writes_throttle_and_weight_and_a_new_class_clears_old_rules(sandbox, loopdev):
    bfq = bfq_missing() is None
    ctrl = BlockioController(CGROUP)
    weight = {"weight": 200} if bfq else {}
    p = plan(ctrl, {"slow": {**weight, "devices": [{"devices": loopdev, "write_bps": MiB, "read_iops": 50}]},
                    "fast": {"devices": [{"devices": loopdev, "read_bps": 8 * MiB}]}})
    path = sandbox.container("pod", "c1")
    d = sandbox.dir("blkio", path)
    st = os.stat(loopdev)
    dev = f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}"
    ctrl.enforce(context(path), "slow", p)
    assert parse_device_values((d / "blkio.throttle.write_bps_device").read_text()) == {dev: MiB}
    assert parse_device_values((d / "blkio.throttle.read_iops_device").read_text()) == {dev: 50}
    if bfq:
        assert (d / "blkio.bfq.weight").read_text().split()[-1] == "200"
    ctrl.enforce(context(path), "fast", p)  # re-enforce with another class: the old rules go
    assert parse_device_values((d / "blkio.throttle.write_bps_device").read_text()) == {}
    assert parse_device_values((d / "blkio.throttle.read_iops_device").read_text()) == {}
    assert parse_device_values((d / "blkio.throttle.read_bps_device").read_text()) == {dev: 8 * MiB}
    if bfq:
        assert (d / "blkio.bfq.weight").read_text().split()[-1] == "100"


def test_a_weight_on_a_kernel_without_bfq_is_reported_and_the_throttles_still_apply(sandbox, loopdev):
    why = bfq_missing()
    if why is None:
        pytest.skip("this kernel has BFQ: the weight is written (the test above checks it)")
    ctrl = BlockioController(CGROUP)
    p = plan(ctrl, {"slow": {"weight": 200, "devices": [{"devices": loopdev, "write_bps": MiB}]}})
    path = sandbox.container("pod", "c1")
    with pytest.raises(ControlError, match=r"no proportional weight here"):
        ctrl.enforce(context(path), "slow", p)
    st = os.stat(loopdev)
    text = (sandbox.dir("blkio", path) / "blkio.throttle.write_bps_device").read_text()
    assert parse_device_values(text) == {f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}": MiB}


def test_per_device_weight_without_bfq_on_the_device_is_reported_with_the_kernels_errno(sandbox, loopdev):
    if bfq_missing():
        pytest.skip(bfq_missing())
    sched = Path(f"/sys/block/{Path(loopdev).name}/queue/scheduler")
    sched.write_text("none")
    ctrl = BlockioController(CGROUP)
    p = plan(ctrl, {"w": {"devices": [{"devices": loopdev, "weight": 300}]}})
    path = sandbox.container("pod", "c1")
    with pytest.raises(ControlError, match=r"blkio.bfq.weight_device: E(OPNOTSUPP|NOTSUP) "):
        ctrl.enforce(context(path), "w", p)
    if "bfq" in sched.read_text():
        sched.write_text("bfq")  # BFQ on our own loop device: now the kernel takes the per-device weight
        ctrl.enforce(context(path), "w", p)
        text = (sandbox.dir("blkio", path) / "blkio.bfq.weight_device").read_text()
        st = os.stat(loopdev)
        assert parse_device_values(text) == {f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}": 300}


def test_missing_container_cgroup_is_an_error(sandbox):
    ctrl = BlockioController(CGROUP)
    p = Plan(section({}), ("x",), {"x": None})
    with pytest.raises(ControlError, match="no blkio"):
        ctrl.enforce(context(f"/{sandbox.top}/gone/c"), "x", p)


def test_direct_writes_under_a_1MiB_per_second_class_run_at_1MiB_per_second(sandbox, loopdev):
    ctrl = BlockioController(CGROUP)
    p = plan(ctrl, {"slow": {"devices": [{"devices": loopdev, "write_bps": MiB}]}})
    path = sandbox.container("pod", "writer")
    ctrl.enforce(context(path), "slow", p)
    procs = sandbox.dir("blkio", path) / "cgroup.procs"

    def join() -> None:
        procs.write_text(str(os.getpid()))

    size = 3 * MiB
    t0 = time.monotonic()
    subprocess.run(["dd", "if=/dev/zero", f"of={loopdev}", "bs=64k", f"count={size // 65536}", "oflag=direct"],
                   preexec_fn=join, check=True, capture_output=True)
    rate = size / (time.monotonic() - t0)
    assert 0.8 * MiB <= rate <= 1.2 * MiB, f"{rate / MiB:.2f} MiB/s"
    written = (sandbox.dir("blkio", path) / "blkio.throttle.io_service_bytes").read_text()
    st = os.stat(loopdev)
    assert f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)} Write {size}" in written


def test_v2_io_max_and_io_weight_lines(tmp_path, loopdev, monkeypatch):
    # cgroup v2 is not delegated any controller on this host: the format is checked on a file tree
    # shaped like a v2 hierarchy (cgroup-v2.rst, "IO Interface Files").
    root = tmp_path / "cg"
    (root / "kubepods" / "c1").mkdir(parents=True)
    (root / "cgroup.controllers").write_text("cpu io memory\n")
    st = os.stat(loopdev)
    dev = f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}"
    (root / "kubepods" / "c1" / "io.max").write_text("9:9 rbps=1 wbps=max riops=max wiops=max\n")
    (root / "kubepods" / "c1" / "io.weight").write_text("default 100\n")
    ctrl = BlockioController(root)
    p = plan(ctrl, {"slow": {"weight": 50, "devices": [{"devices": loopdev, "write_bps": MiB, "read_iops": 10}]}})
    written: list[str] = []
    import cri_resmgr.placement.controllers.blockio as B

    real = B.write_file

    def recording_write(path: Path, text: str) -> None:  # records each write(2), then really does it
        written.append(f"{path.name}: {text}")
        real(path, text)

    monkeypatch.setattr(B, "write_file", recording_write)
    ctrl.enforce(context("/kubepods/c1"), "slow", p)
    assert written == ["io.max: 9:9 rbps=max wbps=max riops=max wiops=max",
                       f"io.max: {dev} rbps=max wbps={MiB} riops=10 wiops=max",
                       "io.weight: default 50"]
