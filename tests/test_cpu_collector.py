from pathlib import Path

import pytest

from cri_resmgr import metrics as M
from cri_resmgr.collectors.cpu import CpuCollector, parse_proc_stat
from cri_resmgr.topology import discover
from cri_resmgr.topology.fixtures import MACHINES, build_sysfs

STAT = """cpu  10 0 10 100 0 0 0 0 0 0
cpu0 4 1 2 50 3 1 1 0 2 0
cpu1 6 0 8 50
intr 1 2 3
"""


def test_parse_proc_stat_busy_excludes_idle_iowait_and_guest():
    t = parse_proc_stat(STAT)
    assert t[0].busy_ticks == 4 + 1 + 2 + 1 + 1 and t[0].idle_ticks == 53
    assert t[1].busy_ticks == 14 and t[1].idle_ticks == 50  # short line (old kernel): missing fields are 0


def test_parse_proc_stat_ignores_garbage():
    assert parse_proc_stat("cpuX 1 2 3\nnonsense\n") == {}


def test_utilization_from_two_reads(tmp_path: Path):
    proc = tmp_path / "proc"
    proc.mkdir()
    topo = discover(build_sysfs(MACHINES["this-vm"], tmp_path / "sys"))
    col = CpuCollector(proc, topo, ticks_per_second=100)
    (proc / "stat").write_text("cpu0 100 0 0 100 0 0 0 0\ncpu1 0 0 0 200 0 0 0 0\n")
    first = col.collect(0)
    assert {s.metric for s in first} == {M.CPU_BUSY.name}
    (proc / "stat").write_text("cpu0 175 0 0 125 0 0 0 0\ncpu1 0 0 0 300 0 0 0 0\n")
    util = {s.labels["cpu"]: s.value for s in col.collect(1) if s.metric == M.CPU_UTILIZATION.name}
    assert util == {"0": pytest.approx(0.75), "1": 0.0}
    busy = [s for s in col.collect(2) if s.metric == M.CPU_BUSY.name]
    assert busy[0].value == 1.75 and busy[0].labels == {"cpu": "0", "core": "0", "die": "0",
                                                         "numa_node": "0", "package": "0"}
