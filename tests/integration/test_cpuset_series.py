"""Issue 12 (8): a changed cpuset of a real cgroup makes no new series.

The kernel's cpuset of a real container cgroup is rewritten as a shared pool would be (all CPUs, one
CPU, all again); the cgroup collector's samples go into a store. The store must keep one
``cri_resmgr_container_cpuset_cpus`` series for the container whose value is the CPU count, and the
rebalancer must read the new CPU list from the collector's latest reading.
"""

from __future__ import annotations

import os

import pytest

from cri_resmgr import metrics as M
from cri_resmgr.collectors.cgroup import CgroupCollector
from cri_resmgr.config import RebalancerConfig
from cri_resmgr.rebalancer.signals import read_inputs
from cri_resmgr.store import Matcher, Store
from cri_resmgr.sysfs import parse_cpulist

from .helpers import CGROUP_ROOT, RealCgroup, can_make_cgroups

pytestmark = pytest.mark.integration


def test_cpuset_change_of_a_real_cgroup_makes_no_new_series():
    if reason := can_make_cgroups():
        pytest.skip(reason)
    cg = RealCgroup(unified=False).create()
    try:
        layout = cg.layout
        cpuset_dir = (layout.cpuset if layout.version == 1 else layout.root)
        if cpuset_dir is None or not (cpuset_dir / cg.rel / "cpuset.cpus").exists():
            pytest.skip("no cpuset controller for the test cgroup")
        effective = cpuset_dir / cg.rel / ("cpuset.effective_cpus" if layout.version == 1 else "cpuset.cpus.effective")
        all_cpus = sorted(os.sched_getaffinity(0))
        lists = [",".join(map(str, all_cpus)), str(all_cpus[-1]), ",".join(map(str, all_cpus))]
        col = CgroupCollector(CGROUP_ROOT)
        store = Store(600)
        name, mine = M.CONTAINER_CPUSET_CPUS.name, [Matcher("container_id", "=", cg.container_id)]
        try:
            for t, cpus in enumerate(lists, start=1):
                (cpuset_dir / cg.rel / "cpuset.cpus").write_text(cpus)
                kernel = parse_cpulist(effective.read_text())  # what the kernel made of it
                assert kernel == parse_cpulist(cpus)
                store.append("cgroup", float(t), col.collect(float(t)), 1.0)
                refs = store.select(name, mine)
                assert len(refs) == 1 and "cpus" not in refs[0].label_dict, [r.label_dict for r in refs]
                assert {r.label_dict["container_id"]: v for r, _t, v in store.latest(name)}[cg.container_id] == len(
                    kernel)
                assert col.cpusets()[cg.container_id] == kernel
                inputs = read_inputs(store, RebalancerConfig(), float(t), cpusets=col.cpusets())
                assert {c.id: c.cpuset for c in inputs.containers}[cg.container_id] == kernel
        finally:
            col.close()
    finally:
        cg.remove()
