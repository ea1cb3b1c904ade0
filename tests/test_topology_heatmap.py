"""/api/v1/heatmap/topology on the large topology fixtures, and /api/v1/heatmap's top=N and format=csv."""

from __future__ import annotations

import csv
import io
import time

import numpy as np
import pytest
from fastapi.testclient import TestClient

from cri_resmgr.sysfs import parse_cpulist
from cri_resmgr.topology.fixtures import MACHINES
from cri_resmgr.web.app import create_app
from cri_resmgr.web.topology_heatmap import rank_rows, sst_bf_classes

from .nodefixture import FixtureContainer, FixtureNode, kubepods

PINNED = kubepods("1", "a", "0-3,112-115", qos="guaranteed")
SHARED = kubepods("2", "b", "8-111,120-223")
NAMED = FixtureContainer("demo/worker", "4-5", name="worker", namespace="demo", pod="w")


@pytest.fixture
def xeon(tmp_path):
    node = FixtureNode(tmp_path, "xeon-2s-112c-snc2", [PINNED, SHARED, NAMED]).start()
    yield node
    node.stop()


@pytest.fixture
def client(xeon):
    return TestClient(create_app(xeon.agent))


def all_threads(body):
    return [(p["id"], d["id"], c, t) for p in body["packages"] for d in p["dies"] for c in d["cores"]
            for t in c["threads"]]


def test_layout_follows_package_die_core_thread_order(client, xeon):
    body = client.get("/api/v1/heatmap/topology").json()
    topo = xeon.agent.topology
    assert [p["id"] for p in body["packages"]] == [0, 1]
    threads = all_threads(body)
    assert sorted(t["cpu"] for *_, t in threads) == sorted(topo.cpus)  # every online CPU exactly once
    for pkg, die, core, t in threads:
        cpu = topo.cpus[t["cpu"]]
        assert (cpu.package, cpu.die, cpu.core, cpu.numa_node) == (pkg, die, core["core"], t["numa_node"])
    for p in body["packages"]:
        cores = p["dies"][0]["cores"]
        assert len(cores) == 56
        assert [c["core"] for c in cores] == sorted(c["core"] for c in cores)
        for c in cores:
            cpus = [t["cpu"] for t in c["threads"]]
            assert cpus == sorted(topo.cores()[c["core"]])  # both hyperthreads, in CPU order
    # Linux numbering on this machine: cpu N and N+112 are siblings.
    first = body["packages"][0]["dies"][0]["cores"][0]
    assert [t["cpu"] for t in first["threads"]] == [0, 112]


def test_values_are_each_cpus_utilisation_at_the_time_asked(client, xeon):
    f1 = {c: (c % 10) / 10 for c in xeon.cpus}
    f2 = {c: ((c + 3) % 10) / 10 for c in xeon.cpus}
    xeon.feed({})  # first sample: utilisation needs two /proc/stat reads
    t1 = xeon.feed(f1)
    time.sleep(0.05)
    xeon.feed(f2)
    now_body = client.get("/api/v1/heatmap/topology", params={"metric": "cri_resmgr_cpu_utilization_ratio"}).json()
    assert now_body["unit"] == "ratio" and now_body["fn"] == "raw"
    got = {t["cpu"]: t["value"] for *_, t in all_threads(now_body)}
    assert got == pytest.approx(f2)
    past = client.get("/api/v1/heatmap/topology",
                      params={"metric": "cri_resmgr_cpu_utilization_ratio", "at": t1 + 0.02}).json()
    assert {t["cpu"]: t["value"] for *_, t in all_threads(past)} == pytest.approx(f1)
    assert past["min"] == pytest.approx(0.0) and past["max"] == pytest.approx(0.9)
    # Before any sample: no values, but the layout is still complete.
    empty = client.get("/api/v1/heatmap/topology", params={"at": t1 - 3600}).json()
    assert all(t["value"] is None for *_, t in all_threads(empty)) and empty["min"] is None


def test_counter_metric_is_shown_as_rate_over_the_window(client, xeon):
    xeon.feed({})
    time.sleep(0.2)
    xeon.feed({c: 0.5 for c in xeon.cpus})
    body = client.get("/api/v1/heatmap/topology", params={"metric": "cri_resmgr_cpu_busy_seconds_total"}).json()
    assert body["fn"] == "rate" and body["unit"] == "ratio"
    store = xeon.agent.store
    for *_, t in all_threads(body)[:10]:
        (ref,) = [r for r in store.select("cri_resmgr_cpu_busy_seconds_total") if r.label_dict["cpu"] == str(t["cpu"])]
        ts, vs = store.raw(ref, body["at"] - body["window_seconds"] - 60, body["at"])
        # the independent computation: increase over the window / time covered, from the raw samples
        inside = ts > body["at"] - body["window_seconds"]
        k = np.flatnonzero(inside)
        lo = max(k[0] - 1, 0)
        expect = (vs[k[-1]] - vs[lo]) / (ts[k[-1]] - ts[lo])
        assert t["value"] == pytest.approx(expect)


def test_sst_bf_classes_match_the_fixture_high_priority_cores(client):
    body = client.get("/api/v1/heatmap/topology").json()
    spec = MACHINES["xeon-2s-112c-snc2"]
    high = {t["cpu"] for *_, t in all_threads(body) if t["sst_priority"] == "high"}
    assert high == set(spec.base_frequency_overrides_khz)
    assert body["sst_bf"] is True
    assert {t["sst_priority"] for *_, t in all_threads(body)} == {"high", "low"}
    for *_, t in all_threads(body):
        assert t["base_frequency_hz"] == spec.base_frequency_overrides_khz.get(t["cpu"], spec.base_frequency_khz) * 1000


def test_placements_list_each_container_on_exactly_its_cpuset(client, xeon):
    body = client.get("/api/v1/heatmap/topology").json()
    conts = body["containers"]
    assert [c["namespace"] for c in conts] == sorted(c["namespace"] for c in conts)
    by_id = {c["container_id"]: i for i, c in enumerate(conts)}
    pinned, shared, named = by_id["a" * 64], by_id["b" * 64], by_id["worker"]
    assert conts[named]["name"] == "worker" and conts[named]["pod"] == "w" and conts[named]["cpus"] == "4-5"
    assert conts[pinned]["qos_class"] == "Guaranteed" and conts[pinned]["cpu_count"] == 8
    for *_, t in all_threads(body):
        on = {i for i in t["containers"]}
        cpu = t["cpu"]
        assert (pinned in on) == (cpu in parse_cpulist("0-3,112-115"))
        assert (shared in on) == (cpu in parse_cpulist(SHARED.cpus))
        assert (named in on) == (cpu in (4, 5))
        assert t["containers"] == sorted(t["containers"])
    free = sorted(t["cpu"] for *_, t in all_threads(body) if not t["containers"])
    assert free == [6, 7, 116, 117, 118, 119]


def test_epyc_cores_carry_their_l3_domain(tmp_path):
    node = FixtureNode(tmp_path, "epyc-1s-64c-8l3").start()
    try:
        body = TestClient(create_app(node.agent)).get("/api/v1/heatmap/topology").json()
        cores = body["packages"][0]["dies"][0]["cores"]
        assert len(cores) == 64
        assert [c["l3_id"] for c in cores] == [i // 8 for i in range(64)]
        assert body["sst_bf"] is False and all(t["sst_priority"] is None for *_, t in all_threads(body))
    finally:
        node.stop()


def test_offline_cpu_is_absent_and_isolated_cpu_is_marked(tmp_path):
    node = FixtureNode(tmp_path, "small-offline-isolated").start()
    try:
        body = TestClient(create_app(node.agent)).get("/api/v1/heatmap/topology").json()
        threads = {t["cpu"]: t for *_, t in all_threads(body)}
        assert sorted(threads) == [0, 1, 2, 3, 4, 5, 6]
        assert [c for c, t in threads.items() if t["isolated"]] == [3]
    finally:
        node.stop()


@pytest.mark.parametrize("params,status,needle", [
    ({"metric": "cri_resmgr_container_memory_usage_bytes"}, 400, "no per-CPU series"),
    ({"metric": "nope"}, 400, "unknown metric"),
    ({"window": 0}, 422, "greater than 0"),
    ({"at": "noon"}, 422, "at"),
    ({"fn": "integral"}, 422, "fn"),
    ({"match[]": "{cpu="}, 400, "matcher"),
])
def test_bad_topology_parameters_say_what_is_wrong(client, params, status, needle):
    r = client.get("/api/v1/heatmap/topology", params=params)
    assert r.status_code == status and needle in r.text, r.text


def test_rank_rows_orders_by_total_and_puts_empty_rows_last():
    nan = np.nan
    m = np.array([[1.0, 1.0], [nan, nan], [5.0, nan], [3.0, 0.0], [0.0, 0.0], [2.0, 0.0]])
    rows, out = rank_rows(["a", "b", "c", "d", "e", "f"], m, 10)
    assert rows == ["c", "d", "a", "f", "e", "b"]  # a and f tie: original order
    assert np.array_equal(out[0], m[2], equal_nan=True)
    assert rank_rows(["a", "b", "c", "d", "e", "f"], m, 2)[0] == ["c", "d"]
    assert rank_rows([], np.empty((0, 3)), 5)[0] == []


def test_time_heatmap_top_n_and_csv(client, xeon):
    steps = {PINNED.rel: 3_000_000_000, SHARED.rel: 1_000_000_000, NAMED.rel: 2_000_000_000}
    start = time.time() - 1
    for _ in range(4):
        time.sleep(0.1)
        xeon.feed({}, usage_step_ns=steps)
    params = {"metric": "cri_resmgr_container_cpu_usage_seconds_total", "by": "container", "start": start,
              "end": time.time() + 0.5, "step": 0.5}
    full = client.get("/api/v1/heatmap", params=params).json()
    assert len(full["rows"]) == 3
    top2 = client.get("/api/v1/heatmap", params={**params, "top": 2}).json()
    totals = {r: np.nansum(np.array(v, dtype=float)) for r, v in zip(full["rows"], full["values"], strict=True)}
    assert top2["rows"] == sorted(totals, key=totals.get, reverse=True)[:2]
    assert top2["rows"][0] == "a" * 12  # the container that used the most CPU
    r = client.get("/api/v1/heatmap", params={**params, "top": 2, "format": "csv"})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/csv")
    table = list(csv.reader(io.StringIO(r.text)))
    assert table[0][0] == "row" and [float(x) for x in table[0][1:]] == pytest.approx(top2["times"])
    assert [row[0] for row in table[1:]] == top2["rows"]
    for row, vals in zip(table[1:], top2["values"], strict=True):
        assert [None if x == "" else float(x) for x in row[1:]] == vals
    assert client.get("/api/v1/heatmap", params={**params, "format": "xml"}).status_code == 422
    assert client.get("/api/v1/heatmap", params={**params, "top": 0}).status_code == 422


def test_metric_catalogue_says_which_groupings_apply(client, xeon):
    xeon.feed({})
    xeon.feed({})
    cat = {m["name"]: m for m in client.get("/api/v1/heatmap/metrics").json()}
    util = cat["cri_resmgr_cpu_utilization_ratio"]
    assert util["per_cpu"] and not util["per_container"] and util["series"] == 224 and util["unit"] == "ratio"
    mem = cat["cri_resmgr_container_memory_usage_bytes"]
    assert mem["per_container"] and not mem["per_cpu"] and mem["series"] == 3 and mem["type"] == "gauge"


def test_sst_helper_without_base_frequencies_is_unknown(tmp_path):
    node = FixtureNode(tmp_path, "this-vm").start()
    try:
        assert set(sst_bf_classes(node.agent.topology).values()) == {None}
    finally:
        node.stop()
