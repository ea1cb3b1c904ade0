"""The queries of the checked-in Grafana dashboards (dashboards/*.json), made concrete for PromQL tools."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

from cri_resmgr import metrics as M

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD_DIR = ROOT / "dashboards"

# Grafana's template variables, as a test Prometheus scraping every second can answer them.
VARIABLES = {"$__rate_interval": "5s", "$__interval": "1s", "$__range": "1m", "$instance": ".*", "$namespace": ".*"}


def generator():
    spec = importlib.util.spec_from_file_location("dashboards_generate", DASHBOARD_DIR / "generate.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses resolve string annotations through sys.modules
    spec.loader.exec_module(mod)
    return mod


def load() -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in sorted(DASHBOARD_DIR.glob("*.json"))}


def all_queries() -> list[tuple[str, str, str]]:
    """(dashboard, panel title, expr) with template variables still in."""
    out = []
    for name, doc in load().items():
        for p in doc.get("panels", []):
            for t in p.get("targets") or []:
                if t.get("expr"):
                    out.append((name, p["title"], t["expr"]))
    return out


def concrete(expr: str) -> str:
    for k in sorted(VARIABLES, key=len, reverse=True):
        expr = expr.replace(k, VARIABLES[k])
    left = re.findall(r"\$\w+", expr)
    assert not left, f"unknown template variables {left} in {expr!r}"
    return expr


def metric_names(expr: str) -> list[str]:
    import promql_parser as pp

    names: list[str] = []

    def pre(node):
        if isinstance(node, pp.VectorSelector) and node.name:
            names.append(node.name)

    pp.walk(pp.parse(concrete(expr)), pre)
    return sorted(set(names))


def spec_of(name: str) -> M.MetricSpec | None:
    """The metrics.py definition of a series name (histograms expose _bucket, _sum and _count)."""
    spec = M.lookup(name)
    if spec is not None:
        return spec
    for suffix in ("_bucket", "_sum", "_count"):
        if name.endswith(suffix):
            base = M.lookup(name[: -len(suffix)])
            if base is not None and base.type == "histogram":
                return base
    return None
