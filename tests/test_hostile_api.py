"""Hostile requests to the REST API (issue 12): matchers with backtracking traps, escapes, oversized answers,
non-finite times; each answered quickly with a 4xx whose detail names the parameter."""

from __future__ import annotations

import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient

from cri_resmgr.agent import Agent
from cri_resmgr.config import build_config
from cri_resmgr.store import QueryError, Sample, parse_matchers
from cri_resmgr.store.query import MAX_REGEX_BYTES, MAX_RESPONSE_POINTS, unquote_go
from cri_resmgr.topology.fixtures import MACHINES, build_sysfs
from cri_resmgr.web.app import create_app

from .cgroupfs import Values, make_v2

CID = "a" * 64  # the review's trap: a 64-hex container_id of one repeated character
UID = "12345678-aaaa-bbbb-cccc-0123456789ab"
BUSY = "cri_resmgr_cpu_busy_seconds_total"


def make_agent(tmp_path: Path, api: dict | None = None, clock=None, **extra) -> Agent:
    sysfs = build_sysfs(MACHINES["small-offline-isolated"], tmp_path / "sys")
    cg = tmp_path / "cgroup"
    make_v2(cg, f"kubepods/burstable/pod{UID}/{CID}", Values())
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "stat").write_text("".join(f"cpu{i} {i} 0 0 100 0 0 0 0\n" for i in range(7)))
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("")
    data = {"state_dir": str(tmp_path / "state"), "run_dir": str(tmp_path / "run"),
            "api": api or {"token": "s3cret-token"},
            "paths": {"sysfs": str(sysfs), "cgroup": str(cg), "proc": str(proc)},
            "collectors": {"cgroup": {"interval_seconds": 3600}, "cpu": {"interval_seconds": 3600}},
            "rebalancer": {"enabled": False}, **extra}
    cfg = build_config(data, env={"NODE_NAME": "t"})
    a = Agent(cfg, config_path=cfg_file, clock=clock)
    a.start()
    deadline = time.time() + 10
    while not a.ready() and time.time() < deadline:
        time.sleep(0.05)
    return a


@pytest.fixture
def agent(tmp_path: Path):
    a = make_agent(tmp_path)
    yield a
    a.stop()


@pytest.fixture
def client(agent):
    return TestClient(create_app(agent))


# -- matchers: RE2, fully anchored, Go string literals ------------------------------------------------------
@pytest.mark.parametrize("pattern", ["(a+)+b", "(a|aa)+b", "(a*)*b", "a{8}(a+)+b", "(.*a){20}b"])
def test_backtracking_regex_on_64_hex_container_id_answers_at_once(client, pattern):
    # Reproduction from the review: Python's re.fullmatch never finished on the 64-character id.
    t0 = time.monotonic()
    r = client.get("/api/v1/series", params={"metric": "cri_resmgr_container_cpu_usage_seconds_total",
                                             "match[]": f'{{container_id=~"{pattern}"}}'})
    elapsed = time.monotonic() - t0
    assert r.status_code == 200 and r.json() == [], r.text
    assert elapsed < 2.0, f"{pattern}: {elapsed:.2f}s"


def test_regex_is_fully_anchored_and_dot_matches_newline():
    (m,) = parse_matchers('{k=~"a.b"}')
    assert m.matches({"k": "a\nb"}) and not m.matches({"k": "xa\nb"}) and not m.matches({"k": "a\nbx"})
    (m,) = parse_matchers('{k=~"aa|b"}')  # anchoring wraps the whole alternation, as Prometheus does
    assert m.matches({"k": "b"}) and not m.matches({"k": "aab"}) and not m.matches({"k": "bb"})
    (m,) = parse_matchers('{k!~""}')
    assert not m.matches({}) and m.matches({"k": "x"})


def test_linear_time_on_long_label_values():
    (m,) = parse_matchers('{k=~"(a+)+b"}')
    v = "a" * 200_000
    t0 = time.monotonic()
    assert not m.matches({"k": v})
    assert time.monotonic() - t0 < 1.0


def test_pattern_size_is_limited(client):
    big = "a" * (MAX_REGEX_BYTES + 1)
    r = client.get("/api/v1/series", params={"metric": BUSY, "match[]": f'{{cpu=~"{big}"}}'})
    assert r.status_code == 400 and r.json()["detail"].startswith("match[]:") and "longer than" in r.text
    # RE2's program budget: a repetition that compiles to a huge program is refused, not built.
    r = client.get("/api/v1/series", params={"metric": BUSY, "match[]": '{cpu=~"((a{100}){100}){100}"}'})
    assert r.status_code == 400 and r.json()["detail"].startswith("match[]:")


def test_non_ascii_value_matches_itself(client, agent):
    agent.store.append("x", 1.0, [Sample("m_x", {"pod": "café"}, 1.0)])
    r = client.get("/api/v1/series", params={"metric": "m_x", "match[]": '{pod="café"}'})
    assert [s["labels"]["pod"] for s in r.json()] == ["café"]
    (m,) = parse_matchers('{pod="café"}')
    assert m.value == "café" and not m.matches({"pod": "cafÃ©"})


@pytest.mark.parametrize("bad", [r'{cpu="\x"}', r'{cpu="\N"}', r'{cpu="\u12"}', r'{cpu="\ud800"}',
                                 r'{cpu="\xff"}', r'{cpu="\400"}', r'{cpu="\q"}', r'{cpu="\"}', r"{cpu='\"'}"])
def test_bad_escapes_are_400_naming_the_parameter(client, bad):
    r = client.get("/api/v1/query_range", params={"metric": BUSY, "match[]": bad})
    assert r.status_code == 400, (bad, r.status_code, r.text)
    assert r.json()["detail"].startswith("match[]:"), r.text


@pytest.mark.parametrize("body,quote,want", [
    (r"a\tb", '"', "a\tb"), (r"\x41\101\u00e9\U0001F600", '"', "AAé😀"), (r"\\\"", '"', '\\"'),
    (r"\'", "'", "'"), (r"\xc3\xa9", '"', "é"), ("é", '"', "é"), (r"\a\b\f\n\r\v", '"', "\a\b\f\n\r\v"),
])
def test_go_unquote(body, quote, want):
    assert unquote_go(body, quote) == want


def test_raw_backquoted_string_keeps_backslashes():
    (m,) = parse_matchers(r"{k=~`\d+`}")
    assert m.value == r"\d+" and m.matches({"k": "123"})


# -- bounded work per request --------------------------------------------------------------------------------
BIG = "m_big_busy_seconds_total"


def _fill_many_cpus(agent, cpus=224, rows=3600, t_end=None):
    t_end = agent.now() if t_end is None else t_end
    keys = [(BIG, {"cpu": str(c)}) for c in range(cpus)]
    h = agent.store.prepare("big", keys, 1.0)
    for i in range(rows):
        h = agent.store.write(h, t_end - rows + i, np.full(cpus, float(i)))
    return t_end


def test_over_cap_query_is_refused_before_it_costs_memory(client, agent):
    # The review's case: a 224-CPU metric over an hour at step=1 (~806k points; ~61 B each when built).
    t_end = _fill_many_cpus(agent)
    params = {"metric": BIG, "start": t_end - 3600, "end": t_end, "step": 1}
    client.get("/healthz")
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        r = client.get("/api/v1/query_range", params=params)
        over_peak = tracemalloc.get_traced_memory()[1] - base
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        ok = client.get("/api/v1/query_range", params={**params, "step": 4})  # 224 x 901: under the cap
        ok_peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    assert r.status_code == 400, r.text
    d = r.json()["detail"]
    assert str(MAX_RESPONSE_POINTS) in d and "narrow the query" in d and "step" in d and "match[]" in d
    assert ok.status_code == 200 and len(ok.json()["series"]) == 224
    assert over_peak < 8 << 20, f"refused query still took {over_peak / 2**20:.1f} MiB"
    assert over_peak * 4 < ok_peak, (over_peak, ok_peak)
    # Narrowed by matchers, the same step is answered.
    r = client.get("/api/v1/query_range", params={**params, "match[]": '{cpu=~"1[0-9]"}'})
    assert r.status_code == 200 and len(r.json()["series"]) == 10


def test_heatmap_is_capped_too(client, agent):
    t_end = _fill_many_cpus(agent)
    r = client.get("/api/v1/heatmap", params={"metric": BIG, "start": t_end - 3600, "end": t_end, "step": 1})
    assert r.status_code == 400 and "narrow the query" in r.text


@pytest.mark.parametrize("params,name", [
    ({"start": -1e308, "end": 1e308}, "start"), ({"start": -1e308, "end": 1e308, "step": 1e305}, "start"),
    ({"start": 0, "end": 1e16, "step": 1e14}, "end"), ({"start": -9e15, "end": 9e15, "step": 1e14}, None),
    ({"step": 0}, "step"), ({"step": -1}, "step"),
    ({"step": "inf"}, "step"), ({"step": "nan"}, "step"), ({"start": "nan"}, "start"), ({"end": "-inf"}, "end"),
    ({"start": "inf", "end": "inf"}, "start"), ({"start": 0, "end": 1e9, "step": 1e-300}, "step"),
    ({"start": 5, "end": 1}, "end"),
])
def test_non_finite_and_absurd_times_are_400_naming_the_parameter(client, params, name):
    r = client.get("/api/v1/query_range", params={"metric": BUSY, **params})
    if name is None:  # finite and few points: answered
        assert r.status_code == 200, r.text
        return
    assert r.status_code == 400, r.text
    assert r.json()["detail"].startswith(f"{name}:"), r.text
    h = client.get("/api/v1/heatmap", params={"metric": BUSY, **params})
    assert h.status_code == 400 and h.json()["detail"].startswith(f"{name}:"), h.text


def test_query_error_is_a_value_error_naming_the_parameter():
    with pytest.raises(QueryError, match=r"^match\[\]: "):
        parse_matchers('{a=~"("}')


def test_series_listing_is_capped(client, agent, monkeypatch):
    import cri_resmgr.web.app as web_app

    monkeypatch.setattr(web_app, "MAX_RESPONSE_SERIES", 10)
    _fill_many_cpus(agent, cpus=20, rows=2)
    r = client.get("/api/v1/series", params={"metric": BIG})
    assert r.status_code == 400 and "narrow the query" in r.json()["detail"]
    assert len(client.get("/api/v1/series", params={"metric": BIG, "match[]": '{cpu=~"1."}'}).json()) == 10


def test_every_operation_documents_the_errors_it_can_answer(client):
    doc = client.get("/openapi.json").json()
    ops = [(p, m, op) for p, item in doc["paths"].items() for m, op in item.items()]
    assert len(ops) >= 15
    for path, method, op in ops:
        codes = set(op["responses"])
        assert {"400", "401", "421", "429"} <= codes, (path, method, codes)
        if method == "post":
            assert {"401", "403"} <= codes, (path, codes)
    assert "409" in doc["paths"]["/api/v1/config/reload"]["post"]["responses"]
    assert "503" in doc["paths"]["/readyz"]["get"]["responses"]


def test_heavy_work_runs_at_a_lower_cpu_priority():
    import os
    import threading

    from cri_resmgr.web.guard import HEAVY_NICE, HeavyPool

    pool = HeavyPool(workers=1)
    try:
        mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        theirs = pool.run(lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
    finally:
        pool.shutdown()
    assert theirs == min(19, mine + HEAVY_NICE) and os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine
