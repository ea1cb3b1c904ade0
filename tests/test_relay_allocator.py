"""Exclusive CPU placement on the large fixture machines (cri_resmgr/topology/fixtures.py)."""

from __future__ import annotations

import pytest

from cri_resmgr.placement.allocator import CpuAllocator, Hints, InsufficientCpus, Taken
from cri_resmgr.sysfs import parse_cpulist
from cri_resmgr.topology import discover
from cri_resmgr.topology.fixtures import MACHINES, build_sysfs


@pytest.fixture(scope="module")
def xeon(tmp_path_factory):
    return discover(build_sysfs(MACHINES["xeon-2s-112c-snc2"], tmp_path_factory.mktemp("xeon")))


@pytest.fixture(scope="module")
def epyc(tmp_path_factory):
    return discover(build_sysfs(MACHINES["epyc-1s-64c-8l3"], tmp_path_factory.mktemp("epyc")))


def numa_of(topo, cpus):
    return {topo.cpus[c].numa_node for c in cpus}


def whole_cores(topo, cpus):
    return all(topo.cores()[topo.cpus[c].core] <= cpus for c in cpus)


def test_request_matching_a_numa_node_gets_exactly_that_node(xeon):
    a = CpuAllocator(xeon)
    node_size = len(xeon.numa_nodes[0].cpus)  # 28 cores x 2 threads under SNC2
    p = a.allocate(node_size, Taken())
    assert p.cpus in {n.cpus for n in xeon.numa_nodes.values()}
    assert p.reason.startswith("whole numa") and len(p.mems) == 1


def test_request_matching_a_die_gets_the_whole_die_and_both_its_nodes(xeon):
    a = CpuAllocator(xeon)
    die = frozenset(c.id for c in xeon.cpus.values() if (c.package, c.die) == (1, 0))
    # with package 0 partly used, the only whole free die is package 1's
    used = a.allocate(4, Taken())
    p = a.allocate(len(die), Taken(other=used.cpus))
    assert p.cpus == die and p.reason == "whole die 1/0"
    assert p.mems == frozenset(numa_of(xeon, die)) and len(p.mems) == 2


def test_small_requests_take_whole_cores_in_one_numa_node(xeon):
    a = CpuAllocator(xeon)
    for n in (2, 4, 6, 16):
        p = a.allocate(n, Taken())
        assert len(p.cpus) == n and len(numa_of(xeon, p.cpus)) == 1 and whole_cores(xeon, p.cpus), (n, p)


def test_odd_request_fills_a_half_used_core_before_breaking_a_new_one(xeon):
    a = CpuAllocator(xeon)
    first = a.allocate(1, Taken())
    (cpu,) = first.cpus
    sibling = xeon.cores()[xeon.cpus[cpu].core] - first.cpus
    second = a.allocate(3, Taken(other=first.cpus))
    assert sibling <= second.cpus  # the hole is filled
    assert len(numa_of(xeon, second.cpus | first.cpus)) == 1


def test_tightest_fit_prefers_the_fullest_node_that_still_fits(xeon):
    a = CpuAllocator(xeon)
    nodes = xeon.numa_nodes
    # node 0 nearly full, node 1 half full, 2 and 3 empty: 8 CPUs go to node 1, 60 to nowhere single
    taken = frozenset(sorted(nodes[0].cpus)[:52]) | frozenset(sorted(nodes[1].cpus)[:28])
    p = a.allocate(8, Taken(other=taken))
    assert numa_of(xeon, p.cpus) == {1}
    p = a.allocate(4, Taken(other=taken))
    assert numa_of(xeon, p.cpus) == {0}


def test_request_larger_than_any_node_spreads_over_the_nearest_nodes(xeon):
    a = CpuAllocator(xeon)
    node_size = len(xeon.numa_nodes[0].cpus)
    p = a.allocate(node_size + 8, Taken())
    nodes = numa_of(xeon, p.cpus)
    assert len(nodes) == 2 and len(p.cpus) == node_size + 8
    # both in one package: SLIT distance 12 beats 21 across sockets
    assert len({xeon.cpus[c].package for c in p.cpus}) == 1


def test_reserved_cpus_are_never_exclusive_and_the_pool_keeps_its_minimum(xeon):
    reserved = parse_cpulist("0-1,112-113")
    a = CpuAllocator(xeon, reserved=reserved, min_shared_cpus=4)
    taken: frozenset[int] = frozenset()
    while True:
        try:
            p = a.allocate(8, Taken(other=taken))
        except InsufficientCpus as e:
            assert "insufficient CPUs" in str(e)
            break
        assert not p.cpus & reserved and not p.cpus & taken
        taken |= p.cpus
    pool = a.shared_pool(taken)
    assert 4 <= len(pool) < 12 and not pool & reserved


def test_reserved_cpus_must_be_online(xeon):
    with pytest.raises(ValueError, match="not online"):
        CpuAllocator(xeon, reserved=frozenset({999}))


def test_latency_critical_gets_sst_bf_high_priority_cores(xeon):
    a = CpuAllocator(xeon)
    hp = a.high_priority
    assert len(hp) == 32  # 8 cores x 2 threads x 2 packages in the fixture
    p = a.allocate(4, Taken(), Hints(latency_critical=True))
    assert p.cpus <= hp and "SST-BF" in p.reason
    # with the high-priority cores gone it still places, and says so
    p = a.allocate(4, Taken(other=hp), Hints(latency_critical=True))
    assert not p.cpus & hp and "using others" in p.reason


def test_affinity_and_anti_affinity_choose_the_numa_node(xeon):
    a = CpuAllocator(xeon)
    peer = frozenset(sorted(xeon.numa_nodes[2].cpus)[:4])
    near = a.allocate(4, Taken(other=peer), Hints(near=peer))
    assert numa_of(xeon, near.cpus) == {2}
    away = a.allocate(4, Taken(other=peer), Hints(away=frozenset(xeon.numa_nodes[0].cpus | xeon.numa_nodes[1].cpus)))
    assert numa_of(xeon, away.cpus) & {0, 1} == set()


def test_avx512_work_never_shares_a_core_with_other_exclusive_work(xeon):
    a = CpuAllocator(xeon)
    scalar = a.allocate(1, Taken())
    avx = a.allocate(3, Taken(other=scalar.cpus), Hints(avx512=True))
    cores = xeon.cores()
    for c in avx.cpus:
        assert not cores[xeon.cpus[c].core] & scalar.cpus
    # and a scalar job does not take the AVX-512 job's half core
    avx1 = a.allocate(1, Taken(), Hints(avx512=True))
    other = a.allocate(1, Taken(avx512=avx1.cpus))
    assert xeon.cpus[next(iter(other.cpus))].core != xeon.cpus[next(iter(avx1.cpus))].core


def test_epyc_request_of_one_ccd_gets_a_whole_l3(epyc):
    a = CpuAllocator(epyc)
    l3 = {frozenset(c.cpus) for c in epyc.caches_at(3)}
    p = a.allocate(16, Taken())
    assert p.cpus in l3 and p.reason.startswith("whole l3")


def test_epyc_small_requests_stay_in_one_l3_and_pack_the_fullest(epyc):
    a = CpuAllocator(epyc)
    l3_of = {c.id: c.l3_id for c in epyc.cpus.values()}
    first = a.allocate(4, Taken())
    second = a.allocate(4, Taken(other=first.cpus))
    assert len({l3_of[c] for c in first.cpus}) == 1
    assert {l3_of[c] for c in second.cpus} == {l3_of[c] for c in first.cpus}  # tightest: same CCD
    third = a.allocate(10, Taken(other=first.cpus | second.cpus))
    third_l3 = {l3_of[c] for c in third.cpus}
    assert len(third_l3) == 1 and third_l3 != {l3_of[next(iter(first.cpus))]}


def test_resize_keeps_the_cpus_it_had_when_they_still_fit(xeon):
    a = CpuAllocator(xeon)
    held = frozenset({10, 11, 122, 123})
    p = a.allocate(4, Taken(), Hints(prefer=held))
    assert p.cpus == held


def test_shared_pool_excludes_exclusive_reserved_and_isolated(tmp_path):
    topo = discover(build_sysfs(MACHINES["small-offline-isolated"], tmp_path))
    a = CpuAllocator(topo, reserved=frozenset({0}))
    assert 3 in topo.isolated and 7 not in topo.cpus
    taken = a.allocate(2, Taken())
    pool = a.shared_pool(taken.cpus)
    assert pool == frozenset(topo.cpus) - {0, 3} - taken.cpus
