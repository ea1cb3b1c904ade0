"""FastAPI app: /metrics, health, and the REST API. Handlers read the agent's state and store through
Pydantic response models; they never trigger collection."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Annotated, Any

import numpy as np
from fastapi import Depends, FastAPI, Header, HTTPException, Query, Response
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import BaseModel

from .. import __version__
from .. import metrics as M
from ..export.exposition import CONTENT_TYPE, Exposition
from ..export.relay_metrics import RelayMetrics
from ..store import QueryError, heatmap, query_range
from ..store.query import AGGS, HEATMAP_BY, MAX_RESPONSE_POINTS
from ..sysfs import format_cpulist
from . import topology_heatmap as th
from .guard import (
    COMMON_RESPONSES,
    TOKEN_RESPONSES,
    ErrorModel,
    HeavyPool,
    RequestGuard,
    parse_bearer,
    token_matches,
)
from .params import matchers_of, require_known_metric
from .rebalancer_api import rebalancer_router
from .series_api import series_router
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


# Series one /api/v1/series answer may list (each a few hundred bytes of JSON).
MAX_RESPONSE_SERIES = 50_000


class LoopModel(BaseModel):
    name: str
    running: bool
    restarts_total: int
    last_error: str | None
    last_error_time: float | None
    started: float | None


class StoreTableModel(BaseModel):
    name: str
    capacity_rows: int
    rows: int


class StoreStatusModel(BaseModel):
    series: int
    max_series: int
    series_dropped_total: int
    rows_out_of_order_total: int
    retention_seconds: float
    tables: list[StoreTableModel]
    checkpoint_errors_total: int
    restore_note: str | None
    clock_ahead_seconds: float
    max_response_points: int


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
    controls: dict[str, str] = {}  # resource control -> class, from the relay (docs/resource-control.md)
    control_errors: dict[str, str] = {}  # resource control -> why its class is not enforced


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
                 points: int = 120, now: float | None = None) -> tuple[float, float, float]:
    for name, v in (("start", start), ("end", end), ("step", step)):
        if v is not None and not math.isfinite(v):
            raise QueryError(f"{name}: must be a finite number of seconds, got {v}")
    end = (time.time() if now is None else now) if end is None else end
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


def create_app(agent, check_host: bool = False) -> FastAPI:
    """``check_host``: refuse Host headers other than loopback names on a loopback listen (the served agent
    turns it on; in-process test clients send ``Host: testserver``)."""
    # FastAPI's own OpenTelemetry (spans, request metrics, validation failures with their input) off, whatever the
    # environment says (FASTAPI_OTEL_AUTO_CONFIGURE): the API's requests carry tokens and hostile input, and the
    # agent's telemetry is its /metrics (tests/test_api_security.py).
    app = FastAPI(title="cri-resmgr", version=__version__, responses=COMMON_RESPONSES,
                  description="Per-container hardware signals, history and placement on one node.",
                  telemetry={"tracing": False, "metrics": False, "logs": False, "operation_spans": False,
                             "auto_configure": False})
    app.add_middleware(RequestGuard, agent=agent, check_host=check_host)
    heavy = HeavyPool()
    exposition = Exposition(agent.store, agent.self_metrics)

    def relay_control() -> Path:
        p = agent.cfg.relay.control_socket
        return Path(p) if p else Path(agent.run_dir) / "relay-control.sock"

    relay_metrics = RelayMetrics(relay_control)

    def relay_classes() -> dict[str, tuple[dict[str, str], dict[str, str]]]:
        """Resource-control classes and errors per container id from the relay's state; {} when no relay
        answers within half a second (docs/resource-control.md)."""
        path = relay_control()
        if not path.is_socket():
            return {}
        import grpc

        from ..relay.control import ControlClient

        client = ControlClient(path, timeout=0.5)
        try:
            return {c.id: (c.controls, c.control_errors) for c in client.state().containers}
        except grpc.RpcError:
            return {}
        finally:
            client.close()

    @app.exception_handler(QueryError)
    async def _query_error(_req, exc: QueryError):
        return JSONResponse(status_code=400, content={"detail": str(exc)})

    def require_token(authorization: Annotated[str | None, Header()] = None) -> None:
        token = agent.cfg.api.token
        if token is None:
            raise HTTPException(403, "api.token: mutating endpoints are disabled; set it in the configuration")
        if not token_matches(parse_bearer(authorization), token):
            raise HTTPException(401, "Authorization: missing or wrong bearer token (api.token)",
                                headers={"WWW-Authenticate": "Bearer"})

    @app.get("/metrics", include_in_schema=False)
    def metrics() -> Response:
        return Response(exposition.render() + relay_metrics.text(), media_type=CONTENT_TYPE)

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:  # on the event loop: no thread hand-off, answers under load
        return {"status": "ok"}

    @app.get("/readyz", responses={503: {"description": "collectors have not run yet"}})
    def readyz() -> Response:
        if agent.ready():
            return JSONResponse({"status": "ready"})
        return JSONResponse({"status": "starting: collectors have not run yet"}, status_code=503)

    @app.get("/api/v1/config", response_model=ConfigModel)
    def get_config() -> ConfigModel:
        st = agent.config_state
        active = st.active.model_dump(mode="json")  # secrets (SecretStr, URL user info) come out redacted
        return ConfigModel(
            active=active, source=st.source, node_name=st.active.node_name, last_error=st.last_error,
            last_error_time=st.last_error_time, last_reload_time=st.last_reload_time,
            reloads_total=st.reloads_total, reload_errors_total=st.reload_errors_total,
            pending_restart=st.pending_restart,
        )

    @app.post("/api/v1/config/reload", response_model=ConfigModel, dependencies=[Depends(require_token)],
              responses={**TOKEN_RESPONSES, 409: {"model": ErrorModel, "description": "the file was rejected; "
                                                  "the running configuration stays (detail says why)"}})
    def post_reload() -> ConfigModel:
        if not agent.reload():
            raise HTTPException(409, f"config file rejected, the running configuration stays: "
                                     f"{agent.config_state.last_error}")
        return get_config()

    @app.get("/api/v1/collectors", response_model=list[CollectorModel])
    def collectors() -> list[CollectorModel]:
        return [CollectorModel(**h.__dict__) for h in agent.health.values()]

    @app.get("/api/v1/loops", response_model=list[LoopModel])
    def loops() -> list[LoopModel]:
        """Supervised background loops (checkpoint, remote_write, rebalancer): restarts after errors."""
        return [LoopModel(**s.__dict__) for s in agent.loops.values()]

    @app.get("/api/v1/store", response_model=StoreStatusModel)
    def store_status() -> StoreStatusModel:
        st = agent.store
        with st.lock:
            tables = [StoreTableModel(name=t.name, capacity_rows=t.capacity, rows=t.count) for t in st.tables.values()]
        return StoreStatusModel(
            series=st.series_count, max_series=st.max_series, series_dropped_total=st.dropped_series,
            rows_out_of_order_total=st.rows_out_of_order, retention_seconds=st.retention_seconds, tables=tables,
            checkpoint_errors_total=agent.checkpoint_errors_total, restore_note=agent.restore_note,
            clock_ahead_seconds=agent.clock.ahead_seconds, max_response_points=MAX_RESPONSE_POINTS)

    @app.get("/api/v1/topology", response_model=TopologyModel)
    def topology() -> TopologyModel:
        return topology_model(agent.topology)

    @app.get("/api/v1/containers", response_model=list[ContainerModel])
    def containers() -> list[ContainerModel]:
        col = agent.collectors.get("cgroup")
        out = []
        classes = relay_classes() if col and col.containers else {}
        for info in (col.containers.values() if col else []):
            i, s = info.identity, info.stats
            ctl, ctl_errors = classes.get(i.container_id, ({}, {}))
            out.append(ContainerModel(
                container_id=i.container_id, name=i.name, pod=i.pod, namespace=i.namespace, pod_uid=i.pod_uid,
                qos_class=i.qos_class, runtime=i.runtime, cgroup_path=i.cgroup_path,
                cpu_usage_seconds=s.cpu_usage_seconds, memory_usage_bytes=s.memory_usage_bytes,
                memory_working_set_bytes=s.memory_working_set_bytes,
                cpuset=format_cpulist(s.cpuset) if s.cpuset is not None else None, last_seen=info.last_seen,
                controls=ctl, control_errors=ctl_errors,
            ))
        return sorted(out, key=lambda c: (c.namespace, c.pod, c.name, c.container_id))

    _matchers = matchers_of

    def _known_metric(metric: str) -> None:
        require_known_metric(agent.store, metric, "/api/v1/series")

    @app.get("/api/v1/series", response_model=list[SeriesModel])
    def series(metric: str | None = None, match: MatchQ = []) -> list[SeriesModel]:  # noqa: B006
        ms = _matchers(match)
        refs = []
        for name in ([metric] if metric else agent.store.metrics()):
            refs += agent.store.select(name, ms)
            if len(refs) > MAX_RESPONSE_SERIES:
                raise QueryError(f"match[]/metric: more than {MAX_RESPONSE_SERIES} series match; narrow the query "
                                 f"with metric and match[] matchers (/api/v1/series/summary counts them)")
        return [SeriesModel(metric=r.metric, labels=r.label_dict) for r in refs]

    @app.get("/api/v1/query_range", response_model=RangeModel)
    def range_query(
        metric: str,
        match: MatchQ = [],  # noqa: B006
        start: float | None = None,
        end: float | None = None,
        step: Annotated[float | None, Query(description="seconds > 0 between points")] = None,
        agg: Annotated[str, Query(description=f"one of {', '.join(AGGS)}")] = "avg",
        fn: Annotated[str, Query(description="raw, or rate for counters")] = "raw",
    ) -> Response:
        _known_metric(metric)
        start, end, step = _time_window(start, end, step, now=agent.now())
        ms = _matchers(match)

        def compute() -> str:  # at low priority, and rendered there, not on the event loop that answers /healthz
            times, res = query_range(agent.store, metric, ms, start, end, step, agg=agg, fn=fn)
            return RangeModel(metric=metric, unit=_unit(metric, fn), times=times.tolist(),
                              series=[RangeSeries(labels=r.labels, values=_nan_to_none(r.values)) for r in res]
                              ).model_dump_json()

        return Response(heavy.run(compute), media_type="application/json")

    @app.get("/api/v1/heatmap", response_model=HeatmapModel)
    def heatmap_query(
        metric: str,
        by: Annotated[str, Query(description=f"one of {', '.join(HEATMAP_BY)}")] = "cpu",
        match: MatchQ = [],  # noqa: B006
        start: float | None = None,
        end: float | None = None,
        step: Annotated[float | None, Query(description="seconds > 0 between points")] = None,
        agg: str = "avg",
        fn: Annotated[str | None, Query(description="raw or rate; default rate for *_total")] = None,
        combine: Annotated[str, Query(description="how series sharing a row combine: sum, avg, max, min")] = "sum",
        top: Annotated[int | None, Query(ge=1, description="only the N rows with the largest total, largest first")
                       ] = None,
        format: Annotated[str, Query(pattern="^(json|csv)$", description="json, or csv (one line per row)")] = "json",
    ) -> Response:
        _known_metric(metric)
        start, end, step = _time_window(start, end, step, now=agent.now())
        ms = _matchers(match)

        def compute() -> Response:  # at low priority, and rendered there, not on the event loop
            rows, times, matrix = heatmap(agent.store, metric, by, start, end, step, agg=agg, matchers=ms, fn=fn,
                                          combine=combine)
            rows, matrix = th.rank_rows(rows, matrix, top)
            if format == "csv":
                return PlainTextResponse(th.heatmap_csv(rows, times, matrix), media_type="text/csv",
                                         headers={"Content-Disposition": f'inline; filename="{metric}-by-{by}.csv"'})
            eff_fn = fn or M.default_fn(metric)
            body = HeatmapModel(metric=metric, by=by, unit=_unit(metric, eff_fn), rows=rows, times=times.tolist(),
                                values=[_nan_to_none(r) for r in matrix])
            return Response(body.model_dump_json(), media_type="application/json")

        return heavy.run(compute)

    app.include_router(th.router(agent))
    app.include_router(series_router(agent))
    app.include_router(rebalancer_router(agent, require_token), responses={
        **TOKEN_RESPONSES, 409: {"model": ErrorModel, "description": "the request conflicts with the rebalancer's "
                                                                    "state or mode (detail says how)"}})
    mount_ui(app)
    return app
