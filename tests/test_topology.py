import os
from pathlib import Path

import pytest

from cri_resmgr.sysfs import format_cpulist, parse_cpulist, parse_size
from cri_resmgr.topology import discover
from cri_resmgr.topology.fixtures import MACHINES, build_sysfs
from cri_resmgr.topology.render import render_tree


@pytest.mark.parametrize("text,expected", [
    ("0-3,8,10-11\n", {0, 1, 2, 3, 8, 10, 11}), ("", set()), ("\n", set()), ("5", {5}),
])
def test_parse_cpulist(text, expected):
    assert parse_cpulist(text) == expected


@pytest.mark.parametrize("bad", ["3-1", "a", "1,,2", "1-"])
def test_parse_cpulist_rejects_malformed(bad):
    with pytest.raises(ValueError):
        parse_cpulist(bad)


def test_format_cpulist_round_trip():
    for s in [{0, 1, 2, 5}, set(), {7}, set(range(0, 224, 2))]:
        assert parse_cpulist(format_cpulist(s)) == s


def test_parse_size():
    assert parse_size("32768K\n") == 32 * 1024 * 1024 and parse_size("512") == 512


@pytest.mark.parametrize("name", sorted(MACHINES))
def test_discovery_matches_generator_spec(tmp_path: Path, name: str):
    spec = MACHINES[name]
    topo = discover(build_sysfs(spec, tmp_path))
    layout = {r["cpu"]: r for r in spec.layout()}
    online = set(layout) - spec.offline
    assert set(topo.cpus) == online
    assert topo.offline == spec.offline and topo.isolated == spec.isolated
    assert len(topo.packages) == spec.packages
    assert len(topo.numa_nodes) == spec.numa_nodes
    assert len(topo.caches_at(3)) == spec.packages * spec.dies_per_package * spec.l3_per_die
    assert len(topo.caches_at(2)) == spec.cores
    for cid, c in topo.cpus.items():
        r = layout[cid]
        assert (c.package, c.die, c.core_id, c.numa_node, c.l3_id) == (
            r["package"], r["die"], r["core_id"], r["numa_node"], r["l3_id"]), cid
        assert c.core == min(s for s in r["siblings"] if s not in spec.offline)
        assert c.isolated == (cid in spec.isolated)
        khz = spec.base_frequency_overrides_khz.get(cid, spec.base_frequency_khz)
        assert c.base_frequency_hz == (khz * 1000 if khz else None)
    for a, n in topo.numa_nodes.items():
        for b, d in n.distances.items():
            assert d == spec.distance(a, b)
    for l3 in topo.caches_at(3):
        assert l3.size_bytes == spec.l3_kib_per_domain * 1024


def test_snc_machine_shape(tmp_path: Path):
    topo = discover(build_sysfs(MACHINES["xeon-2s-112c-snc2"], tmp_path))
    assert len(topo.cpus) == 224 and len(topo.cores()) == 112
    # cpu0 and cpu112 are hyperthread siblings of core 0
    assert topo.cpus[0].core == topo.cpus[112].core == 0
    assert [len(n.cpus) for n in topo.numa_nodes.values()] == [56] * 4
    assert topo.numa_nodes[0].distances == {0: 10, 1: 12, 2: 21, 3: 21}
    assert topo.cpus[0].base_frequency_hz == 2_600_000_000 and topo.cpus[8].base_frequency_hz == 2_000_000_000


def test_epyc_has_eight_l3_domains_of_eight_cores(tmp_path: Path):
    topo = discover(build_sysfs(MACHINES["epyc-1s-64c-8l3"], tmp_path))
    l3 = topo.caches_at(3)
    assert len(l3) == 8 and all(len(c.cpus) == 16 for c in l3)
    assert topo.cpus[0].l3_id == topo.cpus[7].l3_id != topo.cpus[8].l3_id


def test_missing_files_degrade(tmp_path: Path):
    (tmp_path / "devices/system/cpu/cpu0").mkdir(parents=True)
    topo = discover(tmp_path)
    assert set(topo.cpus) == {0} and topo.cpus[0].package == 0 and topo.numa_nodes[0].cpus == {0}
    assert discover(tmp_path / "nothing").cpus == {}


def test_tree_shows_hierarchy(tmp_path: Path):
    out = render_tree(discover(build_sysfs(MACHINES["small-offline-isolated"], tmp_path)))
    assert "offline 7" in out and "isolated 3" in out
    assert "cpu 3 isolated" in out and "L3 #0 32 MiB" in out and "core 0 (numa 0) L2 2 MiB" in out


def test_this_machine_real_sysfs():
    topo = discover(Path("/sys"))
    assert len(topo.cpus) == len(os.sched_getaffinity(0)) or len(topo.cpus) == os.cpu_count()
    assert topo.caches, "real sysfs should list caches"
    assert all(c.core in topo.cpus for c in topo.cpus.values())
