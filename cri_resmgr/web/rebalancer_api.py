"""REST for the rebalancer: the current advice, the history of rounds, and a round on demand.

``GET /api/v1/rebalancer/plan`` — the last round (plan, outcomes, mode); ``GET /api/v1/rebalancer/history``
— past rounds, newest last; ``POST /api/v1/rebalancer/run`` — run a round now (bearer token, like
``/api/v1/config/reload``), in the configured mode or ``?mode=advise``. The GET handlers only read.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, HTTPException, Query
from pydantic import BaseModel

from ..rebalancer.executor import RoundRecord


class RebalancerStatus(BaseModel):
    enabled: bool
    mode: str
    interval_seconds: float
    rounds: int
    moves_total: dict[str, int]
    last: RoundRecord | None
    rounds_skipped_total: int = 0  # the loop's rounds whose planning was skipped: no input had changed
    last_skip_time: float | None = None
    last_skip_reason: str | None = None


def rebalancer_router(agent, require_token: Callable) -> APIRouter:
    r = APIRouter(prefix="/api/v1/rebalancer", tags=["rebalancer"])

    def service():
        svc = getattr(agent, "rebalancer", None)
        if svc is None:
            raise HTTPException(503, "the rebalancer is not running (agent starting?)")
        return svc

    @r.get("/plan", response_model=RebalancerStatus)
    def plan() -> RebalancerStatus:
        svc = service()
        cfg = agent.cfg.rebalancer
        eng = svc.engine
        skip = svc.gate.last_skip
        return RebalancerStatus(enabled=cfg.enabled, mode=cfg.mode, interval_seconds=cfg.interval_seconds,
                                rounds=len(eng.history), moves_total=dict(eng.moves_total), last=eng.last,
                                rounds_skipped_total=svc.gate.skipped_total,
                                last_skip_time=skip.time if skip else None,
                                last_skip_reason=skip.reason if skip else None)

    @r.get("/history", response_model=list[RoundRecord])
    def history(limit: Annotated[int, Query(ge=1, le=10_000)] = 100) -> list[RoundRecord]:
        return list(service().engine.history)[-limit:]

    @r.post("/run", response_model=RoundRecord, dependencies=[Depends(require_token)])
    def run(mode: Annotated[Literal["advise", "enforce"] | None, Query()] = None) -> RoundRecord:
        svc = service()
        cfg = agent.cfg.rebalancer
        if not cfg.enabled or cfg.mode == "off":
            raise HTTPException(409, "the rebalancer is off (rebalancer.enabled / rebalancer.mode)")
        if mode == "enforce" and cfg.mode != "enforce":
            raise HTTPException(409, "enforce needs rebalancer.mode: enforce in the configuration")
        return svc.run_now(mode)

    return r
