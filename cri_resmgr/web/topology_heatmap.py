"""Topology heatmap (``/api/v1/heatmap/topology``), the metric catalogue the UI's pickers read
(``/api/v1/heatmap/metrics``), and the helpers behind ``/api/v1/heatmap``'s ``top=N`` and ``format=csv``.

The topology heatmap lays the node out package → die → core → thread. Each thread (CPU) carries the
metric's value at ``at``, its SST-BF priority class and the containers whose cpuset contains it. Handlers
only read the store, the topology and the cgroup collector's last scan; they never collect.
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Iterable
from typing import Annotated, Literal

import numpy as np
from fastapi import APIRouter, Query, Response
from pydantic import BaseModel, Field

from .. import metrics as M
from ..store import QueryError, heatmap
from ..sysfs import format_cpulist
from ..topology import Topology
from ..topology.sst import classify_cpus
from .params import matchers_of, require_known_metric

SstClass = Literal["high", "low"]


def sst_bf_classes(topology: Topology) -> dict[int, SstClass | None]:
    """SST-BF priority class per CPU (:func:`cri_resmgr.topology.sst.classify_cpus`: ``high`` above the package's
    lowest base frequency, ``low`` at it), None where the package has no SST-BF split or no base frequencies."""
    bf = classify_cpus(topology.cpus.values())
    return {c: bf.priority.get(c) for c in topology.cpus}  # type: ignore[misc]


# -- response models -------------------------------------------------------------------------------
class ThreadCell(BaseModel):
    cpu: int
    value: float | None = Field(description="the metric at `at`; null when the CPU has no sample in the window")
    sst_priority: SstClass | None = Field(description="SST-BF class; null without an SST-BF split or base frequencies")
    base_frequency_hz: int | None
    numa_node: int
    isolated: bool
    containers: list[int] = Field(description="indexes into `containers` of those whose cpuset holds this CPU")


class CoreCell(BaseModel):
    core: int = Field(description="node-unique core number (lowest CPU id of its threads)")
    core_id: int = Field(description="core id as the kernel reports it (unique within a package)")
    numa_node: int
    l2_id: int | None
    l3_id: int | None
    threads: list[ThreadCell]


class DieCell(BaseModel):
    id: int
    cores: list[CoreCell]


class PackageCell(BaseModel):
    id: int
    dies: list[DieCell]


class PlacedContainer(BaseModel):
    container_id: str
    name: str
    pod: str
    namespace: str
    qos_class: str
    cpus: str = Field(description="effective cpuset as a CPU list")
    cpu_count: int


class TopologyHeatmapModel(BaseModel):
    metric: str
    unit: str
    fn: str
    at: float
    window_seconds: float
    min: float | None
    max: float | None
    sst_bf: bool = Field(description="true when some package has SST-BF high-priority CPUs")
    packages: list[PackageCell]
    containers: list[PlacedContainer]


class MetricInfo(BaseModel):
    name: str
    type: str
    unit: str
    help: str
    per_cpu: bool = Field(description="its series carry a `cpu` label (topology heatmap, by=cpu/core/...)")
    per_container: bool = Field(description="its series carry container labels (by=container/pod)")
    series: int
    interval_seconds: float | None = Field(
        None, description="how often it is collected (median spacing of its newest samples); a heatmap step "
                          "shorter than this leaves empty columns")


# -- helpers for /api/v1/heatmap ---------------------------------------------------------------------
def rank_rows(rows: list[str], matrix: np.ndarray, top: int | None) -> tuple[list[str], np.ndarray]:
    """Keep the ``top`` rows with the largest total over the window (NaN counts as 0), largest first;
    ties keep the original (sorted) order. Rows without any value rank last."""
    if top is None or not rows:
        return rows, matrix
    totals = np.nansum(np.where(np.isnan(matrix), 0.0, matrix), axis=1) if matrix.size else np.zeros(len(rows))
    has = ~np.all(np.isnan(matrix), axis=1) if matrix.size else np.zeros(len(rows), dtype=bool)
    # lexsort: last key is primary. Primary: rows with data first; then larger totals; then original order.
    order = np.lexsort((np.arange(len(rows)), -totals, ~has))[:top]
    return [rows[i] for i in order], matrix[order]


def _csv_number(v: float) -> str:
    return "" if v is None or (isinstance(v, float) and math.isnan(v)) else repr(float(v))


def heatmap_csv(rows: list[str], times: Iterable[float], matrix: np.ndarray) -> str:
    """Wide CSV (RFC 4180): a header ``row,<t0>,<t1>,...`` (Unix seconds), then one line per row; an empty
    cell is a step without a sample."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\r\n")
    w.writerow(["row", *(repr(float(t)) for t in times)])
    for name, vals in zip(rows, matrix.tolist(), strict=True):
        w.writerow([name, *(_csv_number(v) for v in vals)])
    return buf.getvalue()


# -- topology heatmap ------------------------------------------------------------------------------
def _placed(agent) -> list[tuple[PlacedContainer, frozenset[int]]]:
    col = agent.collectors.get("cgroup") if getattr(agent, "collectors", None) else None
    infos = list(col.containers.values()) if col is not None else []
    online = frozenset(agent.topology.cpus)
    names: dict[frozenset[int], str] = {}  # most containers share a few cpusets (the shared pool): format once
    out = []
    for info in infos:
        cpus = info.stats.cpuset
        if cpus is None:
            continue
        cpus = frozenset(cpus) & online
        if not cpus:
            continue
        text = names.get(cpus)
        if text is None:
            text = names[cpus] = format_cpulist(cpus)
        i = info.identity
        out.append((PlacedContainer.model_construct(
            container_id=i.container_id, name=i.name, pod=i.pod, namespace=i.namespace, qos_class=i.qos_class,
            cpus=text, cpu_count=len(cpus)), cpus))
    out.sort(key=lambda pc: (pc[0].namespace, pc[0].pod, pc[0].name, pc[0].container_id))
    return out


def _containers_by_cpu(placed: list[tuple[PlacedContainer, frozenset[int]]]) -> dict[int, list[int]]:
    """CPU -> sorted indexes of the containers on it; built per distinct cpuset (list extends, not appends)."""
    groups: dict[frozenset[int], list[int]] = {}
    for idx, (_pc, cpus) in enumerate(placed):
        groups.setdefault(cpus, []).append(idx)
    by_cpu: dict[int, list[int]] = {}
    for cpus, idxs in groups.items():
        for c in cpus:
            lst = by_cpu.get(c)
            if lst is None:
                by_cpu[c] = list(idxs)
            else:
                lst.extend(idxs)
    if len(groups) > 1:
        for lst in by_cpu.values():
            lst.sort()
    return by_cpu


def topology_heatmap(agent, metric: str, at: float, window: float, fn: str | None = None,
                     matchers: list | None = None, combine: str = "sum") -> TopologyHeatmapModel:
    """Build the topology heatmap. ``fn`` defaults to ``rate`` for counters (``*_total``)."""
    topo: Topology = agent.topology
    store = agent.store
    if not math.isfinite(at):
        raise QueryError("at must be a finite number of Unix seconds")
    if window <= 0 or not math.isfinite(window):
        raise QueryError(f"window must be > 0 seconds, got {window}")
    eff_fn = fn or M.default_fn(metric)
    refs = store.select(metric, matchers or [])
    if refs and not any("cpu" in r.label_dict for r in refs):
        raise QueryError(f"metric {metric!r} has no per-CPU series (no 'cpu' label); "
                         "see /api/v1/heatmap/metrics for the ones that do")
    values: dict[int, float] = {}
    if refs:
        # One step ending at `at`: raw gauges take the last sample in (at - window, at], counters the
        # average rate over that window (the store's own bucketing; see store/query.py).
        rows, _times, matrix = heatmap(store, metric, "cpu", at, at, window, agg="last", matchers=matchers,
                                       fn=eff_fn, combine=combine)
        for name, v in zip(rows, matrix[:, 0].tolist(), strict=True):
            if name.isdigit() and not math.isnan(v):
                values[int(name)] = v
    placed = _placed(agent)
    by_cpu = _containers_by_cpu(placed)
    sst = sst_bf_classes(topo)

    packages = []
    cpus = topo.cpus
    for p in topo.packages:
        dies = []
        for d in topo.dies(p):
            cores: dict[int, list] = {}
            for c in cpus.values():
                if c.package == p and c.die == d:
                    cores.setdefault(c.core, []).append(c)
            core_cells = []
            for core in sorted(cores):
                threads = sorted(cores[core], key=lambda c: c.id)
                first = threads[0]
                core_cells.append(CoreCell.model_construct(
                    core=core, core_id=first.core_id, numa_node=first.numa_node, l2_id=first.l2_id,
                    l3_id=first.l3_id,
                    threads=[ThreadCell.model_construct(cpu=t.id, value=values.get(t.id), sst_priority=sst.get(t.id),
                                        base_frequency_hz=t.base_frequency_hz, numa_node=t.numa_node,
                                        isolated=t.isolated, containers=by_cpu.get(t.id, []))
                             for t in threads],
                ))
            dies.append(DieCell.model_construct(id=d, cores=core_cells))
        packages.append(PackageCell.model_construct(id=p, dies=dies))
    present = [v for c, v in values.items() if c in cpus]
    spec = M.lookup(metric)
    unit = spec.unit if spec else ""
    if eff_fn == "rate":
        unit = "ratio" if unit == "seconds" else (f"{unit}/s" if unit else "1/s")
    return TopologyHeatmapModel(
        metric=metric, unit=unit, fn=eff_fn, at=at, window_seconds=window,
        min=min(present) if present else None, max=max(present) if present else None,
        sst_bf=any(v == "high" for v in sst.values()), packages=packages,
        containers=[pc for pc, _ in placed],
    )


def metric_catalogue(store) -> list[MetricInfo]:
    """Every stored metric with its metadata and which groupings its labels allow."""
    out = []
    for name, refs in sorted(store.series_by_metric().items()):
        labels: set[str] = set()
        for ref in refs[:64]:  # series of one metric share their label names; a sample is enough
            labels.update(k for k, _ in ref.labels)
        spec = M.lookup(name)
        out.append(MetricInfo(
            name=name, type=spec.type if spec else ("counter" if M.is_counter(name) else "gauge"),
            unit=spec.unit if spec else "", help=spec.help if spec else "",
            per_cpu="cpu" in labels, per_container="container_id" in labels, series=len(refs),
            interval_seconds=_collection_interval(store, refs[0]),
        ))
    return out


def _collection_interval(store, ref) -> float | None:
    span = store.span()
    if span is None:
        return None
    ts, _ = store.raw(ref, max(span[0], span[1] - 600.0), span[1])
    steps = np.diff(np.asarray(ts, dtype=np.float64)[-33:])
    steps = steps[steps > 0]
    return float(np.median(steps)) if len(steps) else None


def router(agent) -> APIRouter:
    r = APIRouter()

    @r.get("/api/v1/heatmap/topology", response_model=TopologyHeatmapModel)
    def get_topology_heatmap(
        metric: str = "cri_resmgr_cpu_utilization_ratio",
        at: Annotated[float | None, Query(description="Unix seconds; default now")] = None,
        window: Annotated[float, Query(gt=0, description="seconds before `at` a value may come from")] = 30.0,
        fn: Annotated[Literal["raw", "rate"] | None, Query(description="default rate for *_total")] = None,
        combine: Annotated[Literal["sum", "avg", "max", "min"],
                           Query(description="how series of one CPU combine")] = "sum",
        match: Annotated[list[str], Query(alias="match[]", description='label matchers, e.g. {container_id="x"}')] = [],  # noqa: B006
    ) -> Response:  # a TopologyHeatmapModel (response_model), serialised here
        require_known_metric(agent.store, metric, "/api/v1/heatmap/metrics")
        # The agent's sample clock (never steps back), so a wall clock set back still finds the newest samples.
        body = topology_heatmap(agent, metric, agent.now() if at is None else at, window, fn, matchers_of(match),
                                combine)
        # Serialised once by pydantic-core: FastAPI would otherwise dump and re-validate the whole tree
        # (~45 k container indexes on a 224-CPU node with a 440-container shared pool).
        return Response(body.model_dump_json(), media_type="application/json")

    @r.get("/api/v1/heatmap/metrics", response_model=list[MetricInfo])
    def get_metric_catalogue() -> list[MetricInfo]:
        return metric_catalogue(agent.store)

    return r
