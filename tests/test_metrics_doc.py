"""docs/metrics.md is generated from cri_resmgr/metrics.py and kept in sync; declared label names are the ones the
agent really exports."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from cri_resmgr import metrics as M
from cri_resmgr.collectors.sst import SstCollector
from cri_resmgr.config import RemoteWriteConfig, SstCollectorConfig
from cri_resmgr.export.remote_write import RemoteWriter
from cri_resmgr.nri.stats import NriStats
from cri_resmgr.relay.stats import RelayStats
from cri_resmgr.store import Store
from cri_resmgr.topology import discover
from cri_resmgr.topology.fixtures import MACHINES, build_sysfs
from cri_resmgr.web.app import create_app

from .nodefixture import FixtureContainer, FixtureNode, kubepods

ROOT = Path(__file__).resolve().parent.parent
GEN = ROOT / "docs" / "generate_metrics.py"


def test_checked_in_metrics_doc_equals_a_regeneration(tmp_path):
    r = subprocess.run([sys.executable, str(GEN), "--check"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr
    stale = tmp_path / "metrics.md"
    stale.write_text((ROOT / "docs" / "metrics.md").read_text().replace("| counter |", "| gauge |", 1))
    r = subprocess.run([sys.executable, str(GEN), "--check", "--out", str(stale)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 1 and "out of date" in r.stderr


def test_doc_lists_every_metric_with_type_and_help():
    text = (ROOT / "docs" / "metrics.md").read_text()
    for spec in M.all_specs().values():
        row = next((line for line in text.splitlines() if line.startswith(f"| `{spec.name}` |")), None)
        assert row is not None, spec.name
        assert f"| {spec.type} |" in row and spec.help.replace("|", "\\|") in row


def test_every_metric_declares_its_labels():
    """So the doc shows them and the test below can hold the exporters to them."""
    undeclared = sorted(s.name for s in M.all_specs().values() if s.labels is None)
    assert not undeclared, f"define(..., labels=(...)) missing for {undeclared}"


def _label_sets(text: str, seen: dict[str, set[tuple[str, ...]]]) -> None:
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if fam.type == "histogram":  # _bucket{le}, _sum and _count series of the declared name
                name, labels = fam.name, [k for k in s.labels if k != "le"]
            else:
                name, labels = s.name, list(s.labels)
            seen.setdefault(name, set()).add(tuple(sorted(labels)))


def test_declared_labels_are_what_the_agent_exports(tmp_path):
    node = FixtureNode(tmp_path, "small-offline-isolated",
                       [kubepods("3", "c", "0-1"), FixtureContainer("demo/x", "2", name="x", namespace="demo")]).start()
    try:
        node.feed({})
        node.feed({c: 0.5 for c in node.cpus})
        text = TestClient(create_app(node.agent)).get("/metrics").text
    finally:
        node.stop()
    seen: dict[str, set[tuple[str, ...]]] = {}
    _label_sets(text, seen)
    # Sources the fixture agent does not run: the SST collector on a fixture Xeon's sysfs, the relay's and the NRI
    # plugin's statistics.
    sysfs = build_sysfs(MACHINES["xeon-2s-112c-snc2"], tmp_path / "xeon" / "sys")
    for smp in SstCollector(sysfs, SstCollectorConfig(isst_device=tmp_path / "no-isst"), discover(sysfs)).collect(0.0):
        seen.setdefault(smp.metric, set()).add(tuple(sorted(smp.labels)))
    stats = RelayStats()
    stats.record("/runtime.v1.RuntimeService/Version", "OK", 0.001)
    _label_sets(stats.render(), seen)
    nri = NriStats()
    nri.record("CreateContainer", "ok", 0.002)
    _label_sets(nri.render(), seen)
    w = RemoteWriter(lambda: RemoteWriteConfig(url="http://127.0.0.1:1/"), Store())
    for d in w.self_metrics():
        seen.setdefault(d.spec.name, set()).add(tuple(sorted(d.labels)))
    checked = 0
    for name, label_sets in seen.items():
        spec = M.lookup(name)
        if spec is None or spec.labels is None:
            continue
        assert label_sets == {tuple(sorted(spec.labels))}, (name, label_sets, spec.labels)
        checked += 1
    # cgroup, cpu, collector health, config, store, remote_write, SST, relay and NRI request metrics
    assert checked >= 31, checked
