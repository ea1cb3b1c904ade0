"""SST-BF classification on the 2-socket SST-BF fixture, SST-PP decoding, and absence of cpufreq."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest

from cri_resmgr import metrics as M
from cri_resmgr.agent import Agent
from cri_resmgr.collectors import isst
from cri_resmgr.collectors.sst import SstCollector
from cri_resmgr.config import SstCollectorConfig, build_config
from cri_resmgr.topology import discover
from cri_resmgr.topology.fixtures import MACHINES, build_sysfs
from cri_resmgr.topology.sst import classify


def test_classify_marks_cpus_above_their_packages_lowest_base_frequency():
    bf = classify({0: 2_600, 1: 2_000, 2: 2_000, 3: 2_100, 4: 2_000}, {0: 0, 1: 0, 2: 0, 3: 1, 4: 1})
    assert bf.enabled and bf.high_priority == {0, 3}
    assert bf.priority == {0: "high", 1: "low", 2: "low", 3: "high", 4: "low"}
    assert bf.package_low_hz == {0: 2_000, 1: 2_000}
    flat = classify({0: 2_000, 1: 2_000}, {0: 0, 1: 0})
    assert not flat.enabled and flat.priority == {} and flat.high_priority == frozenset()
    assert not classify({0: None, 1: 0}, {0: 0, 1: 0}).enabled


@pytest.fixture(scope="module")
def xeon(tmp_path_factory):
    spec = MACHINES["xeon-2s-112c-snc2"]
    return spec, build_sysfs(spec, tmp_path_factory.mktemp("xeon") / "sys")


def test_high_priority_cpus_of_the_sst_bf_fixture_are_identified_exactly(xeon, tmp_path):
    spec, sysfs = xeon
    topo = discover(sysfs)
    col = SstCollector(sysfs, SstCollectorConfig(isst_device=tmp_path / "no-isst"), topo)
    assert col.probe().ok
    s = col.collect(0.0)
    expected = frozenset(spec.base_frequency_overrides_khz)
    assert len(expected) == 32 and col.high_priority == expected
    high = {int(x.labels["cpu"]) for x in s if x.metric == M.CPU_SST_BF_HIGH_PRIORITY.name and x.value == 1.0}
    low = {int(x.labels["cpu"]) for x in s if x.metric == M.CPU_SST_BF_HIGH_PRIORITY.name and x.value == 0.0}
    assert high == expected and low == set(topo.cpus) - expected
    freq = {int(x.labels["cpu"]): x.value for x in s if x.metric == M.CPU_BASE_FREQUENCY.name}
    assert freq[0] == 2.6e9 and freq[8] == 2.0e9 and len(freq) == spec.cpus
    assert next(x.value for x in s if x.metric == M.NODE_SST_BF_ENABLED.name) == 1.0
    (sample,) = [x for x in s if x.metric == M.CPU_BASE_FREQUENCY.name and x.labels["cpu"] == "56"]
    assert sample.labels["package"] == "1"  # per-CPU labels from the topology
    # the topology marks the same CPUs
    assert {c.id for c in topo.cpus.values() if c.sst_bf_priority == "high"} == expected
    assert {c.sst_bf_priority for c in topo.cpus.values()} == {"high", "low"}
    # SST-PP: no isst device here -> unknown, said once per package
    pp = {x.labels["package"]: x.labels["status"] for x in s if x.metric == M.NODE_SST_PP_STATUS.name}
    assert pp == {"0": "unknown", "1": "unknown"}
    assert "SST-PP unknown" in col.status() and "32 high-priority CPUs of 224" in col.status()


def test_base_frequency_is_read_fresh_each_run(xeon, tmp_path):
    _spec, sysfs = xeon
    topo = discover(sysfs)
    col = SstCollector(sysfs, SstCollectorConfig(isst_device=tmp_path / "no-isst"), topo)
    f = sysfs / "devices/system/cpu/cpu9/cpufreq/base_frequency"
    old = f.read_text()
    try:
        f.write_text("2700000\n")  # an SST-PP level change moves base frequencies
        col.collect(0.0)
        assert 9 in col.high_priority
    finally:
        f.write_text(old)


def test_absent_cpufreq_is_reported_not_fatal(tmp_path):
    sysfs = build_sysfs(MACHINES["this-vm"], tmp_path / "sys")  # like this VM: no cpufreq directory
    cfg = build_config({"paths": {"sysfs": str(sysfs)},
                        "collectors": {"sst": {"isst_device": str(tmp_path / "none")}}}, env={})
    agent = Agent(cfg)
    agent.topology = discover(sysfs)
    agent._build_collectors()
    agent.run_collector_once("sst")
    h = agent.health["sst"]
    assert (h.up, h.errors_total, h.runs_total) == (False, 0, 1)
    assert "no cpufreq base_frequency" in h.reason and "unknown" in h.reason


def test_this_machine_without_cpufreq_says_so():
    topo = discover(Path("/sys"))
    if any(Path(f"/sys/devices/system/cpu/cpu{c}/cpufreq/base_frequency").exists() for c in topo.cpus):
        pytest.skip("this machine has cpufreq base_frequency")
    p = SstCollector(Path("/sys"), SstCollectorConfig(isst_device=Path("/dev/no-isst-here")), topo).probe()
    assert not p.ok and "no cpufreq base_frequency" in p.reason


def test_mailbox_levels_info_is_decoded():
    # version 1, max level 4, current level 2, locked, enabled
    lv = isst.decode_levels_info(1 | 4 << 8 | 2 << 16 | 1 << 24 | 1 << 31, package=1)
    assert (lv.package, lv.max_level, lv.current_level, lv.locked, lv.enabled) == (1, 4, 2, True, True)
    lv = isst.decode_levels_info(3 << 8, package=0)
    assert (lv.current_level, lv.max_level, lv.locked, lv.enabled) == (0, 3, False, False)


def test_isst_structs_and_ioctl_numbers_match_the_uapi_header():
    assert ctypes.sizeof(isst.IsstPlatformInfo) == 8
    assert ctypes.sizeof(isst.IsstMboxCmd) == 24 and ctypes.sizeof(isst.IsstMboxCmds) == 28
    assert ctypes.sizeof(isst.IsstPerfLevelInfo) == 11
    assert isst.ISST_IF_GET_PLATFORM_INFO == 0x8008FE00  # _IOR(0xFE, 0, struct isst_if_platform_info *)
    assert isst.ISST_IF_MBOX_COMMAND == 0xC008FE03  # _IOWR(0xFE, 3, ...)
    assert isst.ISST_IF_PERF_LEVELS == 0xC008FE09
    info = isst.IsstPerfLevelInfo(max_level=4, current_level=3, feature_state=1, locked=0, enabled=1)
    lv = isst.decode_perf_level_info(info, 0)
    assert (lv.current_level, lv.max_level, lv.sst_bf_enabled, lv.enabled) == (3, 4, True, True)


def test_sst_pp_is_unknown_without_a_working_isst_device(tmp_path):
    missing = isst.read_sst_pp(tmp_path / "isst_interface", {0: 0})
    assert missing.status == "unknown" and "does not exist" in missing.reason
    not_a_device = tmp_path / "plain-file"
    not_a_device.write_text("")
    r = isst.read_sst_pp(not_a_device, {0: 0})  # the ioctl answers ENOTTY on a regular file
    assert r.status == "unknown" and "ISST_IF_GET_PLATFORM_INFO" in r.reason and "ENOTTY" in r.reason
