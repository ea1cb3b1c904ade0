"""The rebalancer inside the agent: a thread that runs a round every ``rebalancer.interval_seconds``.

The move applier follows ``rebalancer.applier``: ``relay`` — the relay's move API on its control socket
(``relay.control_socket``, default ``run_dir/relay-control.sock``); ``cgroup`` — write the container
cgroups' cpusets directly (:class:`~.executor.CgroupMoveApplier`, paths from the cgroup collector's
discovery); ``auto`` — the relay when its control socket exists, else cgroups. Requests, annotations and
exclusivity come from the relay's cache whenever the socket exists. Configuration reloads take
effect at the next round.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from ..config import RebalancerConfig
from .executor import CgroupMoveApplier, MoveApplier, Rebalancer
from .relay_client import RelayMetadata, RelayMoveApplier, control_client

log = logging.getLogger(__name__)


class _RelayLink:
    """The control socket, connected lazily (the relay may start after the agent)."""

    def __init__(self, agent):
        self.agent = agent
        self._client = None
        self._path: Path | None = None

    def path(self) -> Path:
        p = self.agent.cfg.relay.control_socket
        return Path(p) if p else Path(self.agent.run_dir) / "relay-control.sock"

    def client(self):
        p = self.path()
        if not p.exists():
            return None
        if self._client is None or self._path != p:
            self._client, self._path = control_client(p), p
        return self._client


class _Metadata:
    def __init__(self, link: _RelayLink):
        self.link = link

    def metadata(self):
        c = self.link.client()
        return RelayMetadata(c).metadata() if c is not None else None


class RebalancerService:
    def __init__(self, agent):
        self.agent = agent
        self.link = _RelayLink(agent)
        self.engine = Rebalancer(agent.store, lambda: agent.topology, lambda: agent.cfg.rebalancer,
                                 applier=self._applier, metadata=_Metadata(self.link), cpusets=self._cpusets)

    def _cpusets(self) -> dict[str, frozenset[int]]:
        col = self.agent.collectors.get("cgroup")
        return col.cpusets() if col is not None else {}

    def _cgroup_path(self, container_id: str) -> str | None:
        col = self.agent.collectors.get("cgroup")
        info = col.containers.get(container_id) if col is not None else None
        return info.identity.cgroup_path if info is not None else None

    def _applier(self, cfg: RebalancerConfig) -> MoveApplier | None:
        client = self.link.client() if cfg.applier in ("auto", "relay") else None
        if client is not None:
            return RelayMoveApplier(client)
        if cfg.applier == "relay":
            return None  # the round records "no move applier" for each move
        return CgroupMoveApplier(self.agent.cfg.paths.cgroup, self._cgroup_path)

    def run_now(self, mode: str | None = None):
        return self.engine.run_once(now=self.agent.now(), mode=mode)

    def start(self, stop: threading.Event) -> threading.Thread:
        t = threading.Thread(target=self._loop, args=(stop,), name="rebalancer", daemon=True)
        t.start()
        return t

    def _loop(self, stop: threading.Event) -> None:
        while not stop.wait(self.agent.cfg.rebalancer.interval_seconds):
            cfg = self.agent.cfg.rebalancer
            if not cfg.enabled or cfg.mode == "off":
                continue
            self.engine.run_once(now=self.agent.now())
