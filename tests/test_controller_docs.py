"""docs/resource-control.md's examples are loaded and run: each config example is accepted and enforced on
this machine (blkio and cpu cgroups; RDT on the resctrl emulator), and the RDT schemata the document shows are
the ones the emulator ends up holding."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from cri_resmgr.config import build_config
from cri_resmgr.placement.controllers.blockio import parse_device_values
from cri_resmgr.placement.controllers.manager import ControlManager
from cri_resmgr.placement.controllers.rt import RUNTIME

from .controller_cgroups import Sandbox, bfq_missing, context, unavailable
from .resctrlfs import ResctrlEmulator, fuse_unavailable

DOC = Path(__file__).resolve().parent.parent / "docs" / "resource-control.md"


def blocks(kind: str) -> dict[str, str]:
    text = DOC.read_text()
    return {m[1]: m[2] for m in re.finditer(rf"<!-- {kind}: (\S+) -->\n```\w*\n(.*?)```", text, re.S)}


def test_the_document_has_the_examples_this_test_runs():
    assert set(blocks("example")) == {"blockio", "rt", "rdt"} and set(blocks("schemata")) == {"rdt"}


def test_blockio_example_is_enforced():
    why = unavailable("blkio")
    if why:
        pytest.skip(why)
    data = yaml.safe_load(blocks("example")["blockio"])
    cfg = build_config(data, env={})
    try:
        m = ControlManager.from_config(cfg)
    except Exception as e:  # the example names /dev/vd*: a machine without virtio disks cannot run it
        if "matches no block device" in str(e):
            pytest.skip(str(e))
        raise
    sb = Sandbox(("blkio",))
    try:
        ctx = context(sb.container("pod", "c"), qos="BestEffort")
        error = m.apply(ctx)["blockio"].error
        d = sb.dir("blkio", ctx.cgroup_path)
        assert set(parse_device_values((d / "blkio.throttle.write_bps_device").read_text()).values()) == {1048576}
        if bfq_missing() is None:
            assert error == ""
            assert (d / "blkio.bfq.weight").read_text().strip() == "50"
        else:  # the example's weight cannot be had on this kernel: said so, the throttle is there all the same
            assert error.startswith("no proportional weight here"), error
    finally:
        sb.cleanup()


def test_rt_example_is_enforced():
    why = unavailable("cpu")
    if why:
        pytest.skip(why)
    cfg = build_config(yaml.safe_load(blocks("example")["rt"]), env={})
    m = ControlManager.from_config(cfg)
    sb = Sandbox(("cpu",))
    try:
        ctx = context(sb.container("pod", "c"), annotations={"rtclass.cri-resource-manager.intel.com/pod": "audio"})
        assert m.apply(ctx)["rt"].error == ""
        assert int((sb.dir("cpu", ctx.cgroup_path) / RUNTIME).read_text()) == 50000
        m.stopped(ctx)
    finally:
        sb.cleanup()


def test_rdt_example_gives_the_documented_schemata(tmp_path):
    why = fuse_unavailable()
    if why:
        pytest.skip(why)
    data = yaml.safe_load(blocks("example")["rdt"])
    emu = ResctrlEmulator().mount(tmp_path / "resctrl")
    try:
        cfg = build_config({**data, "paths": {"resctrl": str(emu.mountpoint)}}, env={})
        ControlManager.from_config(cfg)
        want = dict(line.split(": ", 1) for line in blocks("schemata")["rdt"].strip().splitlines())
        for cls, schemata in want.items():
            d = emu.mountpoint if cls == "system/default" else emu.mountpoint / cls
            assert (d / "schemata").read_text().split() == schemata.split(), cls
    finally:
        emu.unmount()
