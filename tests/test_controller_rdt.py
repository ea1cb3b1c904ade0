"""RDT allocation classes: the schemata computation against hand-computed schemata (pure), and the
controller on the FUSE resctrl emulator, which refuses what the kernel refuses (tests/resctrlfs.py,
Documentation/arch/x86/resctrl.rst)."""

from __future__ import annotations

import errno
import os
import subprocess
import time
from pathlib import Path

import pytest

from cri_resmgr.config import ConfigError, build_config
from cri_resmgr.placement.controllers.base import Plan
from cri_resmgr.placement.controllers.rdt import RdtController, parse_size, schemata_domains
from cri_resmgr.placement.controllers.schemata import (
    BandwidthInfo,
    BitRange,
    CacheInfo,
    PercentRange,
    ResctrlInfo,
    Share,
    Size,
    compute_schemata,
    parse_l3_amount,
)

from .controller_cgroups import CGROUP, Sandbox, context, unavailable
from .resctrlfs import AllocationRules, ResctrlEmulator, fuse_unavailable

MiB = 1 << 20
L3 = CacheInfo(cbm_bits=12, min_cbm_bits=1, num_closids=16, domains=(0, 1), cache_bytes=12 * MiB)  # 1 MiB per bit
MB = BandwidthInfo(min_bandwidth=10, bandwidth_gran=10, num_closids=8, domains=(0, 1))
HW = ResctrlInfo(L3, MB)


def rdt(partitions: dict, **kw):
    return build_config({"controls": {"rdt": {"partitions": partitions, **kw}}}, env={}).controls.rdt


def lines(partitions: dict, info: ResctrlInfo = HW, **kw) -> dict[str, list[str]]:
    out, problems = compute_schemata(rdt(partitions, **kw), info)
    assert not problems, problems
    return {n: s.lines for n, s in out.items()}


def problems_of(partitions: dict, info: ResctrlInfo = HW, **kw) -> list[str]:
    return compute_schemata(rdt(partitions, **kw), info)[1]


# -- pure: amounts and schemata --------------------------------------------------------------------------
def test_amount_forms_parse():
    assert parse_l3_amount("50%") == Share(50)
    assert parse_l3_amount("20-60%") == PercentRange(20, 60)
    assert parse_l3_amount("0xf0") == BitRange(4, 7)
    assert parse_l3_amount("4-7") == BitRange(4, 7)
    assert parse_l3_amount("2MiB") == Size(2 * MiB)
    assert parse_l3_amount("512kiB") == Size(512 * 1024)
    for bad, why in (("0x5", "not contiguous"), ("120%", "over 100%"), ("60-20%", "low < high"), ("", "expected"),
                     ("0x0", "empty"), ("lots", "expected")):
        with pytest.raises(ValueError, match=why):
            parse_l3_amount(bad)


def test_exclusive_and_shared_partitions_as_in_the_ancestors_issue():
    # 12 bits: exclusive 50% = bits 0-5 (0x03f), shared 50% = bits 6-11 (0xfc0); BestEffort takes the
    # lowest 50% of shared = bits 6-8 (0x1c0).
    got = lines({"exclusive": {"l3": "50%", "classes": {"Guaranteed": {"l3": "100%"}}},
                 "shared": {"l3": "50%", "classes": {"Burstable": {"l3": "100%", "mb": "55%"},
                                                     "BestEffort": {"l3": "50%", "mb": "5%"}}}})
    assert got == {"Guaranteed": ["L3:0=3f;1=3f", "MB:0=100;1=100"],
                   "Burstable": ["L3:0=fc0;1=fc0", "MB:0=60;1=60"],  # 55% rounds up to bandwidth_gran 10
                   "BestEffort": ["L3:0=1c0;1=1c0", "MB:0=10;1=10"]}  # 5% is below min_bandwidth 10


def test_every_class_amount_form_within_a_partition():
    # partition "25-100%" of 12 bits = bits 3-11 (0xff8, 9 bits); class amounts are relative to bit 3.
    classes = {"pct": {"l3": "34%"},          # round(0.34 * 9) = 3 bits -> bits 3-5  = 0x038
               "range": {"l3": "50-100%"},    # floor(4.5 + 0.5) = 5 .. 9 -> bits 8-11 = 0xf00
               "mask": {"l3": "0x6"},         # bits 1-2 of the partition -> 4-5     = 0x030
               "bits": {"l3": "2-4"},         # bits 5-7                            = 0x0e0
               "size": {"l3": "1.5MiB"},      # ceil(1.5) = 2 bits -> bits 3-4       = 0x018
               "small": {"l3": "512kiB"}}     # 1 bit -> bit 3                      = 0x008
    got = lines({"p": {"l3": "25-100%", "classes": classes}}, mb="off")
    assert {n: v[0] for n, v in got.items()} == {
        "pct": "L3:0=38;1=38", "range": "L3:0=f00;1=f00", "mask": "L3:0=30;1=30", "bits": "L3:0=e0;1=e0",
        "size": "L3:0=18;1=18", "small": "L3:0=8;1=8"}


def test_partitions_of_an_odd_cache_meet_exactly():
    odd = ResctrlInfo(CacheInfo(cbm_bits=11, min_cbm_bits=1, num_closids=16, domains=(0,)), None)
    got = lines({"a": {"l3": "50%", "classes": {"A": {}}}, "b": {"l3": "50%", "classes": {"B": {}}}}, odd)
    assert got == {"A": ["L3:0=3f"], "B": ["L3:0=7c0"]}  # bits 0-5 and 6-10


def test_partition_as_bitmask_bit_range_and_size():
    got = lines({"a": {"l3": "0xf00", "classes": {"A": {}}}, "b": {"l3": "0-3", "classes": {"B": {"l3": "50%"}}},
                 "c": {"l3": "2MiB", "classes": {"C": {}}}}, mb="off")
    assert got == {"A": ["L3:0=f00;1=f00"], "B": ["L3:0=3;1=3"], "C": ["L3:0=30;1=30"]}  # C: next free, bits 4-5


def test_per_cache_id_amounts():
    got = lines({"p": {"l3": {"all": "50%", "1": "100%"}, "classes": {"X": {"l3": {"all": "100%", "0": "50%"}}}}},
                mb="off")
    assert got == {"X": ["L3:0=7;1=fff"]}


def test_mba_mbps_values():
    info = ResctrlInfo(L3, BandwidthInfo(10, 10, 8, (0, 1), mbps=True))
    assert lines({"p": {"classes": {"X": {"mb": "2000MBps"}}}}, info)["X"][1] == "MB:0=2000;1=2000"
    assert lines({"p": {"classes": {"X": {}}}}, info)["X"][1] == "MB:0=4294967295;1=4294967295"
    assert problems_of({"p": {"classes": {"X": {"mb": "50%"}}}}, info) == [
        "controls.rdt.partitions.p.classes.X.mb: '50%': resctrl is mounted with mba_MBps, so MB is MBps"]
    assert problems_of({"p": {"classes": {"X": {"mb": "100MBps"}}}}) == [
        "controls.rdt.partitions.p.classes.X.mb: '100MBps': resctrl is mounted without mba_MBps, so MB is a percentage"]


def test_cdp_code_and_data_schemas():
    info = ResctrlInfo(CacheInfo(12, 1, 8, (0,)), None, cdp=True)
    got = lines({"p": {"classes": {"X": {"l3_code": "0-3", "l3_data": "50%"}, "Y": {"l3": "25%"}}}}, info)
    assert got == {"X": ["L3CODE:0=f", "L3DATA:0=3f"], "Y": ["L3CODE:0=7", "L3DATA:0=7"]}


def test_mb_on_an_mbm_only_system_degrades_when_optional_and_fails_when_required():
    no_mb = ResctrlInfo(L3, None)
    out, problems = compute_schemata(rdt({"p": {"classes": {"X": {"l3": "50%", "mb": "50%"}}}}), no_mb)
    assert not problems and out["X"].lines == ["L3:0=3f;1=3f"]
    assert out["X"].notes == ["mb left out: not available or off"]
    assert problems_of({"p": {"classes": {"X": {"mb": "50%", "required": ["mb"]}}}}, no_mb) == [
        "controls.rdt.partitions.p.classes.X.required: mb is required, but mb allocation is not available"]
    assert problems_of({"p": {"classes": {"X": {}}}}, no_mb, mb="on") == [
        "controls.rdt.mb: on, but no info/MB in resctrl (MBM-only or no MBA)"]


def test_hardware_limits_are_problems():
    strict = ResctrlInfo(CacheInfo(cbm_bits=12, min_cbm_bits=2, num_closids=4, domains=(0,)), None)
    assert problems_of({"p": {"classes": {"X": {"l3": "0x1"}}}}, strict) == [
        "controls.rdt.partitions.p.classes.X.l3: '0x1' is 1 bit(s), below info/L3/min_cbm_bits (2)"]
    assert problems_of({"p": {"classes": {c: {} for c in "ABCD"}}}, strict) == [
        "controls.rdt.partitions: 4 classes need 4 CLOSIDs besides the root group's; resctrl has 4 in all "
        "(info/*/num_closids)"]
    assert problems_of({"p": {"l3": "8-13", "classes": {"X": {}}}}, strict) == [
        "controls.rdt.partitions.p.l3: '8-13' needs bits 8-13 on cache id 0 but the cache has 12 (info/L3/cbm_mask)"]
    assert problems_of({"a": {"l3": "0-5"}, "b": {"l3": "50%", "classes": {"X": {}}}}, strict) == []


@pytest.mark.parametrize("partitions, message", [
    ({"a": {"l3": "60%"}, "b": {"l3": "50%"}}, "partitions a, b take 110% of the cache (over 100%)"),
    ({"a": {"l3": "0-5"}, "b": {"l3": "4-11"}}, "partitions.b.l3: bits 4-11 overlap partition a (bits 0-5)"),
    ({"a": {"l3": "0-60%"}, "b": {"l3": "50-100%"}}, "partitions.b.l3: 50-100% overlaps partition a (0-60%)"),
    ({"a": {"classes": {"X": {"l3": "120%"}}}}, "partitions.a.classes.X.l3: '120%': over 100%"),
    ({"a": {"classes": {"X": {}}}, "b": {"classes": {"X": {}}}}, "partitions.b.classes.X: class also defined"),
])
def test_bad_partitions_are_rejected_by_the_config_naming_the_key(partitions, message):
    with pytest.raises(ConfigError) as e:
        rdt(partitions)
    assert any(p.startswith("controls.rdt: ") and message in p for p in e.value.problems), e.value.problems


def test_sysfs_and_schemata_parsers():
    assert parse_size("32768K\n") == 32 * MiB and parse_size("2M") == 2 * MiB and parse_size("x") is None
    assert schemata_domains("L3:0=fff;1=fff\nMB:0=100;1=100\n", "MB") == (0, 1)
    assert schemata_domains("MB:0=100\n", "L3") == ()


# -- the controller on the emulator ----------------------------------------------------------------------
@pytest.fixture
def mount(tmp_path):
    why = fuse_unavailable()
    if why:
        pytest.skip(why)
    made: list[ResctrlEmulator] = []

    def make(**kw) -> ResctrlEmulator:
        emu = ResctrlEmulator(**kw).mount(tmp_path / f"resctrl{len(made)}")
        made.append(emu)
        return emu

    yield make
    for emu in made:
        emu.unmount()


def controller(emu: ResctrlEmulator) -> RdtController:
    return RdtController(emu.mountpoint, cgroup_root=CGROUP)


def committed(emu: ResctrlEmulator, partitions: dict, **kw) -> tuple[RdtController, Plan]:
    ctrl = controller(emu)
    p = ctrl.prepare(rdt(partitions, l3_cache_bytes=12 * MiB, **kw))
    assert isinstance(p, Plan), p
    assert ctrl.commit(p) == []
    return ctrl, p


def test_classes_become_groups_with_their_schemata_and_the_root_group_is_configured(mount):
    emu = mount()
    ctrl, p = committed(emu, {"exclusive": {"l3": "50%", "classes": {"Guaranteed": {}}},
                              "shared": {"l3": "50%", "classes": {"system/default": {"l3": "25%", "mb": "20%"},
                                                                  "BestEffort": {"l3": "50%", "mb": "50%"}}}})
    root = emu.mountpoint
    assert (root / "Guaranteed" / "schemata").read_text() == "L3:0=3f;1=3f\nMB:0=100;1=100\n"
    assert (root / "BestEffort" / "schemata").read_text() == "L3:0=1c0;1=1c0\nMB:0=50;1=50\n"
    assert (root / "schemata").read_text() == "L3:0=c0;1=c0\nMB:0=20;1=20\n"
    # a reload without BestEffort removes its group; the root group stays
    p2 = ctrl.prepare(rdt({"exclusive": {"l3": "50%", "classes": {"Guaranteed": {"l3": "50%"}}}}))
    assert isinstance(p2, Plan) and ctrl.commit(p2) == []
    assert not (root / "BestEffort").exists()
    assert (root / "Guaranteed" / "schemata").read_text() == "L3:0=7;1=7\nMB:0=100;1=100\n"


def test_emulator_refuses_what_the_kernel_refuses():
    rules = AllocationRules(min_cbm_bits=2)
    cur = rules.defaults(("L3", "MB"), (0, 1))
    for text, status in (("L3:0=5\n", "The mask 5 has non-consecutive 1-bits"),
                         ("L3:0=4\n", "Need at least 2 bits in the mask"),
                         ("L3:0=1fff\n", "Mask out of range"),
                         ("MB:0=5\n", "MB value 5 out of range [10,100]"),
                         ("L3:0=f\nL3CODE:0=f\n", "Unknown or unsupported resource name 'L3CODE'"),
                         ("L3:7=f\n", "Unknown domain 7")):
        with pytest.raises(Exception) as e:
            rules.apply(cur, text)
        assert getattr(e.value, "status", None) == status and e.value.errno == errno.EINVAL
    assert rules.apply(cur, "MB:1=55\n")["MB"] == {0: 100, 1: 60}


def test_kernel_refusals_reach_the_error_with_last_cmd_status(mount):
    emu = mount(rules=AllocationRules(l3_closids=16, mb_closids=4))  # 4 CLOSIDs: root + 3 groups
    os.mkdir(emu.mountpoint / "someone-else")  # another tool holds a CLOSID
    os.mkdir(emu.mountpoint / "and-another")
    ctrl = controller(emu)
    p = ctrl.prepare(rdt({"p": {"classes": {"A": {}, "B": {}}}}))
    assert isinstance(p, Plan)
    problems = ctrl.commit(p)
    assert problems == [f"controls.rdt.partitions.p.classes.B: mkdir {emu.mountpoint / 'B'}: ENOSPC (No space left on "
                        "device): Out of CLOSIDs"]
    with pytest.raises(OSError) as e:
        (emu.mountpoint / "A" / "schemata").write_text("L3:0=5\n")
    assert e.value.errno == errno.EINVAL
    assert (emu.mountpoint / "info" / "last_cmd_status").read_text().strip() == "The mask 5 has non-consecutive 1-bits"


def test_mba_mbps_mount_and_cdp_on_the_emulator(mount):
    emu = mount(rules=AllocationRules(mba_mbps=True, cdp=True))
    ctrl, p = committed(emu, {"p": {"classes": {"X": {"l3_code": "25%", "l3_data": "50%", "mb": "3000MBps"}}}})
    assert (emu.mountpoint / "X" / "schemata").read_text() == "L3CODE:0=7;1=7\nL3DATA:0=3f;1=3f\nMB:0=3000;1=3000\n"


def test_mbm_only_system_degrades_optional_classes_and_refuses_required_ones(mount):
    emu = mount(allocation=())  # monitoring only: no info/L3, no info/MB, no CLOSIDs
    ctrl = controller(emu)
    p = ctrl.prepare(rdt({"p": {"classes": {"X": {"mb": "50%"}}}}))
    assert isinstance(p, Plan) and p.details is None and "not enforced" in p.notes[0]
    assert ctrl.commit(p) == []
    assert ctrl.enforce(context("/x/y"), "X", p) == {"degraded": p.notes[0]}
    assert ctrl.prepare(rdt({"p": {"classes": {"X": {"mb": "50%", "required": ["mb"]}}}})) == [
        "controls.rdt.partitions.p.classes.X.required: mb is required, but mb allocation is not available"]


def test_enforce_moves_every_thread_of_the_container_cgroup(mount):
    why = unavailable("cpu")
    if why:
        pytest.skip(why)
    emu = mount()
    ctrl, p = committed(emu, {"p": {"classes": {"X": {"l3": "50%"}}}})
    sb = Sandbox(("cpu",))
    path = sb.container("pod", "c1")
    procs = sb.dir("cpu", path) / "cgroup.procs"
    proc = subprocess.Popen(["sleep", "30"], preexec_fn=lambda: procs.write_text(str(os.getpid())))
    try:
        deadline = time.time() + 5
        while str(proc.pid) not in procs.read_text() and time.time() < deadline:
            time.sleep(0.01)
        st = ctrl.enforce(context(path), "X", p)
        assert st["threads"] == 1
        assert (emu.mountpoint / "X" / "tasks").read_text().split() == [str(proc.pid)]
    finally:
        proc.kill()
        proc.wait()
        sb.cleanup()


def test_mba_mbps_is_read_from_the_resctrl_mount_options(tmp_path):
    # proc(5) mountinfo: the super options after " - resctrl resctrl " carry mba_MBps when mounted with it.
    (tmp_path / "self").mkdir()
    mi = tmp_path / "self" / "mountinfo"
    mi.write_text("22 1 0:21 / /sys rw,nosuid - sysfs sysfs rw\n"
                  "40 22 0:35 / /sys/fs/resctrl rw,relatime shared:20 - resctrl resctrl rw,cdp,mba_MBps\n")
    assert RdtController(Path("/sys/fs/resctrl"), proc=tmp_path).mounted_mbps() is True
    mi.write_text("40 22 0:35 / /sys/fs/resctrl rw,relatime - resctrl resctrl rw\n")
    assert RdtController(Path("/sys/fs/resctrl"), proc=tmp_path).mounted_mbps() is False
    mi.write_text("22 1 0:21 / /sys rw,nosuid - sysfs sysfs rw\n")
    assert RdtController(Path("/sys/fs/resctrl"), proc=tmp_path).mounted_mbps() is None


def test_cdp_off_on_a_cdp_mount_gives_code_and_data_the_same_mask():
    info = ResctrlInfo(CacheInfo(12, 1, 8, (0,)), None, cdp=True)
    out, problems = compute_schemata(rdt({"p": {"classes": {"X": {"l3": "25%", "l3_code": "0-3"}}}}, cdp="off"), info)
    assert not problems and out["X"].lines == ["L3CODE:0=7", "L3DATA:0=7"]
    assert out["X"].notes == ["cdp left out: not available or off"]
