"""``/api/v1/series/summary``: cardinality per metric family, and which families the config disables or
strips labels from (``series.disable``, ``series.drop_labels``). Reads the agent's cached count (recomputed
at most every few seconds), so a request does bounded work whatever the node's size."""

from __future__ import annotations

from fastapi import APIRouter
from pydantic import BaseModel


class FamilyModel(BaseModel):
    family: str
    series: int
    enabled: bool
    dropped_labels: list[str]
    disabled_samples: int


class SeriesSummaryModel(BaseModel):
    series: int
    max_series: int
    dropped_samples: int
    families: list[FamilyModel]


def series_router(agent) -> APIRouter:
    router = APIRouter()

    @router.get("/api/v1/series/summary", response_model=SeriesSummaryModel)
    def series_summary() -> SeriesSummaryModel:
        dropped = dict(agent.series_filter.dropped_samples)
        fams = [FamilyModel(family=f.family, series=f.series, enabled=f.enabled, dropped_labels=list(f.dropped_labels),
                            disabled_samples=dropped.get(f.family, 0))
                for f in agent.cardinality.families()]
        fams.sort(key=lambda f: (-f.series, f.family))
        return SeriesSummaryModel(series=agent.store.series_count, max_series=agent.store.max_series,
                                  dropped_samples=agent.store.dropped_samples, families=fams)

    return router
