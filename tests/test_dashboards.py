"""Grafana dashboards: the checked-in JSON is what the generator produces, every query is valid PromQL, and every
metric a query uses is defined in cri_resmgr/metrics.py or listed as planned (with the issue exporting it)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from .dashq import DASHBOARD_DIR, all_queries, concrete, generator, load, metric_names, spec_of

promql_parser = pytest.importorskip("promql_parser", reason="promql-parser (PyPI) is not installed")


def test_checked_in_dashboards_equal_a_regeneration(tmp_path):
    pytest.importorskip("grafana_foundation_sdk", reason="grafana-foundation-sdk (PyPI) is not installed")
    r = subprocess.run([sys.executable, str(DASHBOARD_DIR / "generate.py"), "--check"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr
    # and the check really compares: a changed file is reported
    gen = generator()
    r2 = subprocess.run([sys.executable, str(DASHBOARD_DIR / "generate.py"), "--out", str(tmp_path)],
                        capture_output=True, text=True, timeout=120)
    assert r2.returncode == 0
    (tmp_path / "node.json").write_text((tmp_path / "node.json").read_text().replace("CPU utilisation", "CPU use"))
    r3 = subprocess.run([sys.executable, str(DASHBOARD_DIR / "generate.py"), "--check", "--out", str(tmp_path)],
                        capture_output=True, text=True, timeout=120)
    assert r3.returncode == 1 and "node.json" in r3.stderr + r3.stdout
    assert set(load()) == set(gen.DASHBOARDS)


def test_dashboards_cover_what_users_look_for():
    titles = {name: [p["title"] for p in doc["panels"]] for name, doc in load().items()}
    assert {"node", "containers", "relay", "rebalancer"} <= set(titles)
    assert {"CPU utilisation per CPU", "AVX-512 share of context switches per CPU",
            "SST-BF high-priority cores"} <= set(titles["node"])
    assert {"AVX-512 ratio per container", "Cycles per instruction", "LLC misses", "Memory bandwidth",
            "LLC occupancy"} <= set(titles["containers"])
    assert {"Request rate by method", "Latency p99 by method"} <= set(titles["relay"])
    assert {"Moves by result", "Interference cost"} <= set(titles["rebalancer"])
    heatmaps = [p for p in load()["node"]["panels"] if p["type"] == "heatmap"]
    assert heatmaps and all(p["targets"][0]["legendFormat"] == "{{cpu}}" for p in heatmaps)


@pytest.mark.parametrize("dashboard,panel,expr", all_queries(), ids=lambda v: v if len(v) < 60 else None)
def test_query_parses_as_promql(dashboard, panel, expr):
    promql_parser.parse(concrete(expr))  # raises ValueError naming the problem


def test_every_metric_is_defined_or_planned():
    planned = generator().PLANNED_METRICS
    unknown = {}
    for dashboard, panel, expr in all_queries():
        for name in metric_names(expr):
            if spec_of(name) is None and name not in planned:
                unknown.setdefault(name, []).append(f"{dashboard}: {panel}")
            assert name.startswith("cri_resmgr_"), name
    assert not unknown, f"metrics used by dashboards but neither in cri_resmgr/metrics.py nor planned: {unknown}"
    defined_now = [n for n in planned if spec_of(n) is not None]
    assert not defined_now, f"now defined in metrics.py, remove from PLANNED_METRICS: {defined_now}"


def test_every_query_filters_by_instance():
    for dashboard, panel, expr in all_queries():
        for name in metric_names(expr):
            assert f'{name}{{instance=~"$instance"' in expr, (dashboard, panel, expr)
