"""What a front end's control socket (:mod:`cri_resmgr.relay.control`) serves from the engine: the same methods
whichever front end (the CRI relay or the NRI plugin) runs, so the rebalancer and the agent need not know which."""

from __future__ import annotations

from collections.abc import Callable

from .api import ContainerView, InvariantView, MoveRecord, RelayState
from .engine import Engine


class EngineControl:
    """Mixed into a front end that has ``engine`` and ``decorate`` (e.g. the resource controllers' classes)."""

    engine: Engine
    decorate: Callable[[ContainerView], None] | None

    def _decorated(self, s: RelayState) -> RelayState:
        if self.decorate is not None:
            for v in s.containers:
                self.decorate(v)
        return s

    def move(self, container_id: str, cpus: str, mems: str | None = None, who: str = "unknown", why: str = "",
             deadline: float | None = None, gain_by_term: dict[str, float] | None = None,
             separates: list[dict[str, str | float]] | None = None) -> MoveRecord:
        return self.engine.move(container_id, cpus, mems, who, why, deadline, gain_by_term, separates)

    def moves(self) -> list[MoveRecord]:
        return self.engine.moves()

    def reconcile(self) -> dict[str, int]:
        return self.engine.reconcile().as_dict()

    def invariants(self) -> InvariantView:
        self.engine.check_and_repair()
        return self.engine.invariant_view()
