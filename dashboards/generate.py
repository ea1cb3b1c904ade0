"""Grafana dashboards for cri-resmgr, generated with grafana-foundation-sdk (Grafana Labs' maintained builder
library) and checked in as JSON next to this file.

    .venv/bin/python dashboards/generate.py          # rewrite dashboards/*.json
    .venv/bin/python dashboards/generate.py --check  # exit 1 if a checked-in file differs from a regeneration

Every query filters on ``instance=~"$instance"`` (the scrape target, one per node) and uses Grafana's
``$__rate_interval`` for rates. Metric names are the ones defined in cri_resmgr/metrics.py; those of parts not
merged yet are listed in PLANNED_METRICS with the issue that will export them (tests/test_dashboards.py checks
both: every metric a query uses is either defined or planned, and every query runs against a real Prometheus).
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.builders import heatmap, prometheus, stat, table, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common as cm
from grafana_foundation_sdk.models import dashboard as dm
from grafana_foundation_sdk.models import heatmap as hm
from grafana_foundation_sdk.models import prometheus as pm

OUT_DIR = Path(__file__).resolve().parent

# Metrics the dashboards show before their exporter exists in this repository, with who will export them.
PLANNED_METRICS: dict[str, str] = {}

DS = dm.DataSourceRef(type_val="prometheus", uid="${datasource}")
INST = 'instance=~"$instance"'
CONT = f'{INST}, namespace=~"$namespace"'
BY_CONTAINER = "namespace, pod, container, container_id"
CONTAINER_LEGEND = "{{namespace}}/{{pod}}/{{container}} {{container_id}}"
MBM_TOTAL = CONT + ', scope="total"'
MBM_LOCAL = CONT + ', scope="local"'
NOT_OK = INST + ', code!="OK"'


@dataclass(frozen=True)
class Q:
    expr: str
    legend: str = ""
    instant: bool = False


@dataclass(frozen=True)
class P:
    kind: str  # timeseries | heatmap | stat | table
    title: str
    queries: tuple[Q, ...]
    unit: str = ""
    description: str = ""
    width: int = 12
    height: int = 8
    max: float | None = None


@dataclass(frozen=True)
class D:
    uid: str
    title: str
    description: str
    rows: tuple[tuple[str, tuple[P, ...]], ...]
    variables: tuple[str, ...] = ("instance",)
    tags: tuple[str, ...] = field(default=("cri-resmgr",))


def rate(metric: str, sel: str = INST) -> str:
    return f"rate({metric}{{{sel}}}[$__rate_interval])"


NODE = D(
    uid="cri-resmgr-node", title="cri-resmgr / Node overview",
    description="Per-CPU utilisation and AVX-512 heatmaps, Speed Select (SST-BF/PP), RDT totals, agent health.",
    rows=(
        ("CPU", (
            P("heatmap", "CPU utilisation per CPU",
              (Q(f"max by (cpu) (cri_resmgr_cpu_utilization_ratio{{{INST}}})", "{{cpu}}"),), "percentunit",
              "Busy fraction of each CPU (/proc/stat), one row per CPU.", width=24, height=10, max=1),
            P("heatmap", "AVX-512 share of context switches per CPU",
              (Q(f"max by (cpu) (cri_resmgr_cpu_avx512_ratio{{{INST}}})", "{{cpu}}"),), "percentunit",
              "Share of each CPU's context switches that saved live AVX-512 (ZMM_Hi256) state (eBPF).",
              width=12, height=10, max=1),
            P("heatmap", "AVX-512 context switches per CPU",
              (Q(f"sum by (cpu) ({rate('cri_resmgr_cpu_avx512_switches_total')})", "{{cpu}}"),), "ops",
              "Context switches per second that saved live AVX-512 state, per CPU.", width=12, height=10),
            P("timeseries", "Node CPU busy",
              (Q(f"sum by (instance) ({rate('cri_resmgr_cpu_busy_seconds_total')})", "{{instance}}"),), "none",
              "CPUs' worth of non-idle time.", width=24, height=7),
        )),
        ("Speed Select (SST)", (
            P("stat", "SST-BF enabled", (Q(f"max by (instance) (cri_resmgr_node_sst_bf_enabled{{{INST}}})",
                                           "{{instance}}"),), "bool_yes_no", width=6, height=5),
            P("stat", "SST-BF high-priority CPUs",
              (Q(f"sum by (instance) (cri_resmgr_cpu_sst_bf_high_priority{{{INST}}})", "{{instance}}"),), "none",
              width=6, height=5),
            P("stat", "SST-PP level", (Q(f"cri_resmgr_node_sst_pp_level{{{INST}}}",
                                         "{{instance}} package {{package}}"),), "none", width=6, height=5),
            P("stat", "SST-PP highest level", (Q(f"cri_resmgr_node_sst_pp_max_level{{{INST}}}",
                                                 "{{instance}} package {{package}}"),), "none", width=6, height=5),
            P("table", "SST-BF high-priority cores",
              (Q(f"cri_resmgr_cpu_sst_bf_high_priority{{{INST}}} == 1", instant=True),), "none",
              "CPUs whose base frequency is above their package's lowest (SST-BF high priority).", height=8),
            P("heatmap", "Base frequency per CPU",
              (Q(f"max by (cpu) (cri_resmgr_cpu_base_frequency_hertz{{{INST}}})", "{{cpu}}"),), "hertz", height=8),
        )),
        ("Memory bandwidth and cache (RDT)", (
            P("timeseries", "Memory bandwidth per L3 domain",
              (Q(f"sum by (instance, cache_id, scope) ({rate('cri_resmgr_node_memory_bandwidth_bytes_total')})",
                 "{{instance}} L3 {{cache_id}} {{scope}}"),), "Bps"),
            P("timeseries", "LLC occupancy per L3 domain",
              (Q(f"sum by (instance, cache_id) (cri_resmgr_node_llc_occupancy_bytes{{{INST}}})",
                 "{{instance}} L3 {{cache_id}}"),), "bytes"),
        )),
        ("Agent", (
            P("timeseries", "Collectors up",
              (Q(f"cri_resmgr_collector_up{{{INST}}}", "{{instance}} {{collector}}"),), "bool",
              "0 with the reason in /api/v1/collectors (docs/troubleshooting.md).", width=8, max=1),
            P("timeseries", "Collector run time",
              (Q(f"cri_resmgr_collector_duration_seconds{{{INST}}}", "{{instance}} {{collector}}"),), "s", width=8),
            P("timeseries", "Collector errors",
              (Q(f"sum by (instance, collector) ({rate('cri_resmgr_collector_errors_total')})",
                 "{{instance}} {{collector}}"),), "ops", width=8),
            P("timeseries", "Store series",
              (Q(f"cri_resmgr_store_series{{{INST}}}", "{{instance}} series"),
               Q(f"{rate('cri_resmgr_store_series_dropped_total')}", "{{instance}} dropped/s")), "short", width=8),
            P("timeseries", "Configuration reloads",
              (Q(f"increase(cri_resmgr_config_reloads_total{{{INST}}}[$__rate_interval])", "{{instance}} accepted"),
               Q(f"increase(cri_resmgr_config_reload_errors_total{{{INST}}}[$__rate_interval])",
                 "{{instance}} rejected")), "short", width=8),
            P("timeseries", "remote_write",
              (Q(rate("cri_resmgr_remote_write_samples_sent_total"), "{{instance}} sent"),
               Q(rate("cri_resmgr_remote_write_samples_failed_total"), "{{instance}} failed"),
               Q(rate("cri_resmgr_remote_write_samples_dropped_total"), "{{instance}} dropped"),
               Q(f"cri_resmgr_remote_write_pending_samples{{{INST}}}", "{{instance}} pending")), "short",
              "Samples per second sent, rejected and dropped (queue full), and samples pending.", width=8),
        )),
    ),
)

CONTAINERS = D(
    uid="cri-resmgr-containers", title="cri-resmgr / Containers",
    description="Per-container CPU, memory, AVX-512, CPI, LLC misses, memory bandwidth and cache occupancy.",
    variables=("instance", "namespace"),
    rows=(
        ("CPU and memory", (
            P("timeseries", "CPU usage",
              (Q(f"sum by ({BY_CONTAINER}) ({rate('cri_resmgr_container_cpu_usage_seconds_total', CONT)})",
                 CONTAINER_LEGEND),), "none", "CPUs' worth of time used."),
            P("timeseries", "CPU throttling",
              (Q(f"sum by ({BY_CONTAINER}) ({rate('cri_resmgr_container_cpu_cfs_throttled_periods_total', CONT)})"
                 f" / sum by ({BY_CONTAINER}) ({rate('cri_resmgr_container_cpu_cfs_periods_total', CONT)})",
                 CONTAINER_LEGEND),), "percentunit", "Share of CFS periods in which the container was throttled."),
            P("timeseries", "Memory working set",
              (Q(f"sum by ({BY_CONTAINER}) (cri_resmgr_container_memory_working_set_bytes{{{CONT}}})",
                 CONTAINER_LEGEND),), "bytes"),
            P("table", "CPUs per container",
              (Q(f"max by ({BY_CONTAINER}) (cri_resmgr_container_cpuset_cpus{{{CONT}}})", instant=True),),
              "none", "Number of CPUs in the effective cpuset (the CPU list: cpuset in the agent's "
              "/api/v1/containers)."),
        )),
        ("AVX-512", (
            P("heatmap", "AVX-512 ratio per container",
              (Q(f"max by ({BY_CONTAINER}) (cri_resmgr_container_avx512_ratio{{{CONT}}})", CONTAINER_LEGEND),),
              "percentunit", "Share of the container's context switches with live AVX-512 state.", max=1),
            P("timeseries", "AVX-512 active",
              (Q(f"max by ({BY_CONTAINER}) (cri_resmgr_container_avx512_active{{{CONT}}})", CONTAINER_LEGEND),),
              "bool", "1 while the ratio is above the threshold (with hysteresis).", max=1),
            P("timeseries", "AVX-512 context switches",
              (Q(f"sum by ({BY_CONTAINER}) ({rate('cri_resmgr_container_avx512_switches_total', CONT)})",
                 CONTAINER_LEGEND),), "ops"),
            P("table", "Last AVX-512 use",
              (Q(f"max by ({BY_CONTAINER}) (cri_resmgr_container_avx512_last_use_timestamp_seconds{{{CONT}}})"
                 " * 1000", instant=True),), "dateTimeAsIso"),
        )),
        ("CPI and last-level cache (perf)", (
            P("timeseries", "Cycles per instruction",
              (Q(f"max by ({BY_CONTAINER}) (cri_resmgr_container_cycles_per_instruction{{{CONT}}})",
                 CONTAINER_LEGEND),), "none"),
            P("timeseries", "LLC misses",
              (Q(f"sum by ({BY_CONTAINER}) ({rate('cri_resmgr_container_llc_misses_total', CONT)})",
                 CONTAINER_LEGEND),), "ops"),
            P("timeseries", "LLC miss ratio",
              (Q(f"sum by ({BY_CONTAINER}) ({rate('cri_resmgr_container_llc_misses_total', CONT)})"
                 f" / sum by ({BY_CONTAINER}) ({rate('cri_resmgr_container_llc_references_total', CONT)})",
                 CONTAINER_LEGEND),), "percentunit"),
            P("timeseries", "Context switches (perf)",
              (Q(f"sum by ({BY_CONTAINER}) ({rate('cri_resmgr_container_context_switches_total', CONT)})",
                 CONTAINER_LEGEND),), "ops"),
        )),
        ("Memory bandwidth and cache occupancy (RDT)", (
            P("timeseries", "Memory bandwidth",
              (Q(f"sum by ({BY_CONTAINER}) ({rate('cri_resmgr_container_memory_bandwidth_bytes_total', MBM_TOTAL)})",
                 CONTAINER_LEGEND),), "Bps", "RDT MBM total bandwidth, summed over L3 domains."),
            P("timeseries", "Local share of memory bandwidth",
              (Q(f"sum by ({BY_CONTAINER}) ({rate('cri_resmgr_container_memory_bandwidth_bytes_total', MBM_LOCAL)})"
                 f" / sum by ({BY_CONTAINER}) ({rate('cri_resmgr_container_memory_bandwidth_bytes_total', MBM_TOTAL)})",
                 CONTAINER_LEGEND),), "percentunit"),
            P("timeseries", "LLC occupancy",
              (Q(f"sum by ({BY_CONTAINER}) (cri_resmgr_container_llc_occupancy_bytes{{{CONT}}})",
                 CONTAINER_LEGEND),), "bytes", "RDT CMT occupancy, summed over L3 domains."),
            P("timeseries", "Containers without RDT monitoring",
              (Q(f"count by (instance, reason) (cri_resmgr_container_rdt_monitored{{{INST}}} == 0)",
                 "{{instance}} {{reason}}"),), "short", "E.g. out of RMIDs; see docs/troubleshooting.md."),
        )),
    ),
)

RELAY = D(
    uid="cri-resmgr-relay", title="cri-resmgr / CRI relay",
    description="Requests between kubelet and the runtime through the relay: rate, errors, latency; placement.",
    rows=(
        ("Requests", (
            P("timeseries", "Request rate by method",
              (Q(f"sum by (method) ({rate('cri_resmgr_relay_requests_total')})", "{{method}}"),), "reqps"),
            P("timeseries", "Errors by method and code",
              (Q(f"sum by (method, code) ({rate('cri_resmgr_relay_requests_total', NOT_OK)})",
                 "{{method}} {{code}}"),), "reqps"),
            P("timeseries", "Latency p99 by method",
              (Q("histogram_quantile(0.99, sum by (le, method) "
                 f"({rate('cri_resmgr_relay_request_duration_seconds_bucket')}))", "{{method}}"),), "s"),
            P("timeseries", "Latency p50 by method",
              (Q("histogram_quantile(0.5, sum by (le, method) "
                 f"({rate('cri_resmgr_relay_request_duration_seconds_bucket')}))", "{{method}}"),), "s"),
            P("timeseries", "Mean latency by method",
              (Q(f"sum by (method) ({rate('cri_resmgr_relay_request_duration_seconds_sum')})"
                 f" / sum by (method) ({rate('cri_resmgr_relay_request_duration_seconds_count')})", "{{method}}"),),
              "s", width=24),
        )),
        ("Runtime and placement", (
            P("stat", "Runtime reachable", (Q(f"cri_resmgr_relay_runtime_up{{{INST}}}", "{{instance}}"),),
              "bool_yes_no", width=8, height=5),
            P("timeseries", "Exclusive and shared CPUs",
              (Q(f"cri_resmgr_relay_exclusive_cpus{{{INST}}}", "{{instance}} exclusive"),
               Q(f"cri_resmgr_relay_shared_pool_cpus{{{INST}}}", "{{instance}} shared pool")), "short", width=8),
            P("timeseries", "Moves applied by the relay",
              (Q(f"sum by (result) (increase(cri_resmgr_relay_moves_total{{{INST}}}[$__rate_interval]))",
                 "{{result}}"),), "short", width=8),
        )),
    ),
)

REBALANCER = D(
    uid="cri-resmgr-rebalancer", title="cri-resmgr / Rebalancer",
    description="Moves planned and applied, interference cost before and after, planning time.",
    rows=(
        ("Rebalancer", (
            P("timeseries", "Moves by result",
              (Q(f"sum by (result) (increase(cri_resmgr_rebalancer_moves_total{{{INST}}}[$__rate_interval]))",
                 "{{result}}"),), "short"),
            P("timeseries", "Interference cost",
              (Q(f"max by (instance, when) (cri_resmgr_rebalancer_cost{{{INST}}})", "{{instance}} {{when}}"),), "none",
              "Cost of the current placement and of the planned one (cost model in docs/rebalancer.md)."),
            P("timeseries", "Plan duration", (Q(f"cri_resmgr_rebalancer_plan_duration_seconds{{{INST}}}",
                                                "{{instance}}"),), "s"),
            P("stat", "Moves in the last 24 h",
              (Q(f"sum by (result) (increase(cri_resmgr_rebalancer_moves_total{{{INST}}}[24h]))", "{{result}}"),),
              "short", height=8),
        )),
    ),
)

DASHBOARDS = {"node": NODE, "containers": CONTAINERS, "relay": RELAY, "rebalancer": REBALANCER}


# -- building ---------------------------------------------------------------------------------------
def _target(q: Q, ref: str) -> prometheus.Dataquery:
    t = prometheus.Dataquery().expr(q.expr).ref_id(ref).datasource(DS)
    if q.legend:
        t = t.legend_format(q.legend)
    return t.instant().format(pm.PromQueryFormat.TABLE) if q.instant else t.range()


def _panel(p: P):
    # One of four builder classes with the same fluent methods (title, datasource, unit, ...) but no common base
    # class in the SDK that declares them.
    b: Any
    if p.kind == "timeseries":
        b = timeseries.Panel().fill_opacity(10).line_width(1)
    elif p.kind == "heatmap":
        b = (heatmap.Panel().calculate(False).cell_gap(1)
             .color(heatmap.HeatmapColorOptions().mode(hm.HeatmapColorMode.SCHEME).scheme("Viridis")
                    .scale(hm.HeatmapColorScale.LINEAR).steps(64))
             .y_axis(heatmap.YAxisConfig().axis_placement(cm.AxisPlacement.LEFT))
             .rows_frame(heatmap.RowsHeatmapOptions().layout(cm.HeatmapCellLayout.AUTO)))
        b = b.cell_values(heatmap.CellValues().unit(p.unit)) if p.unit else b
    elif p.kind == "stat":
        b = stat.Panel()
    elif p.kind == "table":
        b = table.Panel()
    else:
        raise ValueError(f"unknown panel kind {p.kind!r}")
    b = b.title(p.title).datasource(DS).span(p.width).height(p.height)
    if p.description:
        b = b.description(p.description)
    if p.unit and p.kind != "heatmap":
        b = b.unit(p.unit)
    if p.max is not None and p.kind in ("timeseries", "stat"):
        b = b.min(0).max(p.max)
    for i, q in enumerate(p.queries):
        b = b.with_target(_target(q, chr(ord("A") + i)))
    return b


def _variable(name: str):
    if name == "instance":
        return (db.QueryVariable("instance").label("node").datasource(DS)
                .query("label_values(cri_resmgr_collector_up, instance)")
                .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED).multi(True).include_all(True).all_value(".*")
                .sort(dm.VariableSort.ALPHABETICAL_ASC))
    if name == "namespace":
        return (db.QueryVariable("namespace").label("namespace").datasource(DS)
                .query('label_values(cri_resmgr_container_cpu_usage_seconds_total{instance=~"$instance"}, namespace)')
                .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED).multi(True).include_all(True).all_value(".*")
                .sort(dm.VariableSort.ALPHABETICAL_ASC))
    raise ValueError(name)


def build(d: D) -> dict:
    b = (db.Dashboard(d.title).uid(d.uid).description(d.description).tags(list(d.tags)).editable()
         .time("now-1h", "now").refresh("30s").timezone("browser")
         .tooltip(dm.DashboardCursorSync.CROSSHAIR)
         .with_variable(db.DatasourceVariable("datasource").label("Prometheus").type("prometheus"))
         .link(db.DashboardLink("cri-resmgr").type(dm.DashboardLinkType.DASHBOARDS).tags(["cri-resmgr"])
               .as_dropdown(True).include_vars(True).keep_time(True)))
    for v in d.variables:
        b = b.with_variable(_variable(v))
    n = 0
    for title, panels in d.rows:
        n += 1
        b = b.with_row(db.Row(title).id(n))
        for p in panels:
            n += 1
            b = b.with_panel(_panel(p).id(n))
    return json.loads(json.dumps(b.build(), cls=JSONEncoder))


def render(d: D) -> str:
    return json.dumps(build(d), indent=2, sort_keys=True) + "\n"


def queries(doc: dict) -> list[tuple[str, str]]:
    """(panel title, expr) of every target in a dashboard JSON."""
    out = []
    for p in doc.get("panels", []):
        for t in p.get("targets", []) or []:
            if t.get("expr"):
                out.append((p.get("title", ""), t["expr"]))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="compare with the checked-in files instead of writing")
    ap.add_argument("--out", type=Path, default=OUT_DIR)
    args = ap.parse_args(argv)
    stale = []
    for name, d in DASHBOARDS.items():
        path = args.out / f"{name}.json"
        text = render(d)
        if args.check:
            old = path.read_text() if path.exists() else ""
            if old != text:
                stale.append(path)
                sys.stdout.writelines(difflib.unified_diff(old.splitlines(True), text.splitlines(True),
                                                           str(path), "regenerated", n=2))
        else:
            path.write_text(text)
            print(f"wrote {path}")
    if stale:
        print(f"\n{len(stale)} dashboard(s) out of date; run: .venv/bin/python dashboards/generate.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
