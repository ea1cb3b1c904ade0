"""FastAPI app: /metrics, health, and the REST API. Handlers read the agent's state and store through
Pydantic response models; they never trigger collection."""

from __future__ import annotations

import hmac
import math
import time
from pathlib import Path
from typing import Annotated, Any

import numpy as np
from fastapi import Depends, FastAPI, Header, HTTPException, Query, Response
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel

from .. import __version__
from .. import metrics as M
from ..export.exposition import Exposition
from ..export.relay_metrics import RelayMetrics
from ..store import QueryError, heatmap, parse_matchers, query_range
from ..store.query import AGGS, HEATMAP_BY
from ..sysfs import format_cpulist
from .rebalancer_api import rebalancer_router
from . import topology_heatmap as th
from .ui import mount_ui


MatchQ = Annotated[list[str], Query(alias="match[]", description='label matchers, e.g. {cpu="0"}')]


class CollectorModel(BaseModel):
    name: str
    enabled: bool
    up: bool
    reason: str
    interval_seconds: float
    last_run: float | None
    last_duration_seconds: float
    runs_total: int
    errors_total: int
    last_error: str | None


class ConfigModel(BaseModel):
    active: dict[str, Any]
    source: str | None
    node_name: str | None
    last_error: str | None
    last_error_time: float | None
    last_reload_time: float | None
    reloads_total: int
    reload_errors_total: int
    pending_restart: list[str]


class CpuModel(BaseModel):
    id: int
    package: int
    die: int
    core_id: int
    core: int
    numa_node: int
    l2_id: int | None
    l3_id: int | None
    isolated: bool
    base_frequency_hz: int | None
    sst_bf_priority: str = ""


class CacheModel(BaseModel):
    level: int
    type: str
    size_bytes: int
    id: int
    cpus: str


class NumaModel(BaseModel):
    id: int
    cpus: str
    distances: dict[str, int]


class TopologyModel(BaseModel):
    online: str
    offline: str
    isolated: str
    packages: list[int]
    cpus: list[CpuModel]
    caches: list[CacheModel]
    numa_nodes: list[NumaModel]


class ContainerModel(BaseModel):
    container_id: str
    name: str
    pod: str
    namespace: str
    pod_uid: str
    qos_class: str
    runtime: str
    cgroup_path: str
    cpu_usage_seconds: float | None
    memory_usage_bytes: int | None
    memory_working_set_bytes: int | None
    cpuset: str | None
    last_seen: float


class SeriesModel(BaseModel):
    metric: str
    labels: dict[str, str]


class RangeSeries(BaseModel):
    labels: dict[str, str]
    values: list[float | None]


class RangeModel(BaseModel):
    metric: str
    unit: str
    times: list[float]
    series: list[RangeSeries]


class HeatmapModel(BaseModel):
    metric: str
    by: str
    unit: str
    rows: list[str]
    times: list[float]
    values: list[list[float | None]]


def _nan_to_none(a: np.ndarray) -> list[float | None]:
    return [None if (isinstance(x, float) and math.isnan(x)) else x for x in a.tolist()]


def _unit(metric: str, fn: str) -> str:
    spec = M.lookup(metric)
    unit = spec.unit if spec else ""
    if fn == "rate":
        # seconds per second is a ratio (busy fraction); anything else is per second.
        return "ratio" if unit == "seconds" else (f"{unit}/s" if unit else "1/s")
    return unit


def _time_window(start: float | None, end: float | None, step: float | None, default_span: float = 300.0,
                 points: int = 120) -> tuple[float, float, float]:
    end = time.time() if end is None else end
    start = end - default_span if start is None else start
    if step is None:
        step = max(1.0, (end - start) / points)
    return start, end, step


def topology_model(t) -> TopologyModel:
    return TopologyModel(
        online=format_cpulist(t.online), offline=format_cpulist(t.offline),
        isolated=format_cpulist(t.isolated), packages=t.packages,
        cpus=[CpuModel(**c.__dict__) for c in sorted(t.cpus.values(), key=lambda c: c.id)],
        caches=[CacheModel(level=c.level, type=c.type, size_bytes=c.size_bytes, id=c.id,
                           cpus=format_cpulist(c.cpus)) for c in t.caches],
        numa_nodes=[NumaModel(id=n.id, cpus=format_cpulist(n.cpus),
                              distances={str(k): v for k, v in n.distances.items()})
                    for n in t.numa_nodes.values()],
    )


def create_app(agent) -> FastAPI:
    app = FastAPI(title="cri-resmgr", version=__version__,
                  description="Per-container hardware signals, history and placement on one node.")
    exposition = Exposition(agent.store, agent.self_metrics)

    def relay_control() -> Path:
        p = agent.cfg.relay.control_socket
        return Path(p) if p else Path(agent.run_dir) / "relay-control.sock"

    relay_metrics = RelayMetrics(relay_control)

    @app.exception_handler(QueryError)
    async def _query_error(_req, exc: QueryError):
        return JSONResponse(status_code=400, content={"detail": str(exc)})

    def require_token(authorization: Annotated[str | None, Header()] = None) -> None:
        token = agent.cfg.api.token
        if not token:
            raise HTTPException(403, "mutating endpoints are disabled: set api.token in the configuration")
        given = (authorization or "").removeprefix("Bearer ").strip()
        if not hmac.compare_digest(given.encode(), token.encode()):
            raise HTTPException(401, "missing or wrong bearer token", headers={"WWW-Authenticate": "Bearer"})

    @app.get("/metrics", include_in_schema=False)
    def metrics() -> Response:
        return Response(exposition.render() + relay_metrics.text(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/healthz")
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz")
    def readyz() -> Response:
        if agent.ready():
            return JSONResponse({"status": "ready"})
        return JSONResponse({"status": "starting: collectors have not run yet"}, status_code=503)

    @app.get("/api/v1/config", response_model=ConfigModel)
    def get_config() -> ConfigModel:
        st = agent.config
        active = st.active.model_dump(mode="json")
        if active.get("api", {}).get("token"):
            active["api"]["token"] = "<redacted>"
        return ConfigModel(
            active=active, source=st.source, node_name=st.active.node_name, last_error=st.last_error,
            last_error_time=st.last_error_time, last_reload_time=st.last_reload_time,
            reloads_total=st.reloads_total, reload_errors_total=st.reload_errors_total,
            pending_restart=st.pending_restart,
        )

    @app.post("/api/v1/config/reload", response_model=ConfigModel, dependencies=[Depends(require_token)])
    def post_reload() -> ConfigModel:
        agent.reload()
        return get_config()

    @app.get("/api/v1/collectors", response_model=list[CollectorModel])
    def collectors() -> list[CollectorModel]:
        return [CollectorModel(**h.__dict__) for h in agent.health.values()]

    @app.get("/api/v1/topology", response_model=TopologyModel)
    def topology() -> TopologyModel:
        return topology_model(agent.topology)

    @app.get("/api/v1/containers", response_model=list[ContainerModel])
    def containers() -> list[ContainerModel]:
        col = agent.collectors.get("cgroup")
        out = []
        for info in (col.containers.values() if col else []):
            i, s = info.identity, info.stats
            out.append(ContainerModel(
                container_id=i.container_id, name=i.name, pod=i.pod, namespace=i.namespace, pod_uid=i.pod_uid,
                qos_class=i.qos_class, runtime=i.runtime, cgroup_path=i.cgroup_path,
                cpu_usage_seconds=s.cpu_usage_seconds, memory_usage_bytes=s.memory_usage_bytes,
                memory_working_set_bytes=s.memory_working_set_bytes,
                cpuset=format_cpulist(s.cpuset) if s.cpuset is not None else None, last_seen=info.last_seen,
            ))
        return sorted(out, key=lambda c: (c.namespace, c.pod, c.name, c.container_id))

    def _matchers(match: list[str]) -> list:
        out = []
        for m in match:
            out += parse_matchers(m)
        return out

    def _known_metric(metric: str) -> None:
        if metric not in agent.store.index and M.lookup(metric) is None:
            raise QueryError(f"unknown metric {metric!r}; see /api/v1/series for the stored ones")

    @app.get("/api/v1/series", response_model=list[SeriesModel])
    def series(metric: str | None = None, match: MatchQ = []) -> list[SeriesModel]:  # noqa: B006
        ms = _matchers(match)
        out = []
        for name in ([metric] if metric else agent.store.metrics()):
            out += [SeriesModel(metric=r.metric, labels=r.label_dict) for r in agent.store.select(name, ms)]
        return out

    @app.get("/api/v1/query_range", response_model=RangeModel)
    def range_query(
        metric: str,
        match: MatchQ = [],  # noqa: B006
        start: float | None = None,
        end: float | None = None,
        step: Annotated[float | None, Query(gt=0)] = None,
        agg: Annotated[str, Query(description=f"one of {', '.join(AGGS)}")] = "avg",
        fn: Annotated[str, Query(description="raw, or rate for counters")] = "raw",
    ) -> RangeModel:
        _known_metric(metric)
        start, end, step = _time_window(start, end, step)
        times, res = query_range(agent.store, metric, _matchers(match), start, end, step, agg=agg, fn=fn)
        return RangeModel(metric=metric, unit=_unit(metric, fn), times=times.tolist(),
                          series=[RangeSeries(labels=r.labels, values=_nan_to_none(r.values)) for r in res])

    @app.get("/api/v1/heatmap", response_model=HeatmapModel)
    def heatmap_query(
        metric: str,
        by: Annotated[str, Query(description=f"one of {', '.join(HEATMAP_BY)}")] = "cpu",
        match: MatchQ = [],  # noqa: B006
        start: float | None = None,
        end: float | None = None,
        step: Annotated[float | None, Query(gt=0)] = None,
        agg: str = "avg",
        fn: Annotated[str | None, Query(description="raw or rate; default rate for *_total")] = None,
        combine: Annotated[str, Query(description="how series sharing a row combine: sum, avg, max, min")] = "sum",
        top: Annotated[int | None, Query(ge=1, description="only the N rows with the largest total, largest first")] = None,
        format: Annotated[str, Query(pattern="^(json|csv)$", description="json, or csv (one line per row)")] = "json",
    ) -> HeatmapModel:
        _known_metric(metric)
        start, end, step = _time_window(start, end, step)
        rows, times, matrix = heatmap(agent.store, metric, by, start, end, step, agg=agg,
                                      matchers=_matchers(match), fn=fn, combine=combine)
        rows, matrix = th.rank_rows(rows, matrix, top)
        if format == "csv":
            return PlainTextResponse(th.heatmap_csv(rows, times, matrix), media_type="text/csv",
                                     headers={"Content-Disposition": f'inline; filename="{metric}-by-{by}.csv"'})
        eff_fn = fn or ("rate" if metric.endswith("_total") else "raw")
        return HeatmapModel(metric=metric, by=by, unit=_unit(metric, eff_fn), rows=rows, times=times.tolist(),
                            values=[_nan_to_none(r) for r in matrix])

    app.include_router(th.router(agent))
    app.include_router(rebalancer_router(agent, require_token))
    mount_ui(app)
    return app
