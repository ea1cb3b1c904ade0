"""The relay's move API and container cache as the rebalancer's :class:`MoveApplier` and
:class:`MetadataSource`, over the relay's control socket (:mod:`cri_resmgr.relay.control`)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path

from ..sysfs import format_cpulist, parse_cpulist
from .executor import MoveResult
from .explain import Explanation
from .signals import ContainerMetadata

log = logging.getLogger(__name__)


class RelayMoveApplier:
    """Moves through UpdateContainerResources via the relay, which keeps its cache and shared pool
    consistent, refuses exclusive containers unless ``relay.allow_move_exclusive``, and logs the move."""

    def __init__(self, client):
        self.client = client  # cri_resmgr.relay.control.ControlClient

    def apply(self, container_id: str, cpus: frozenset[int], mems: frozenset[int] | None, reason: str,
              explanation: Explanation | None = None) -> MoveResult:
        import grpc

        ex = explanation or Explanation()
        try:
            rec = self.client.move(container_id, format_cpulist(cpus), format_cpulist(mems) if mems else None,
                                   who="rebalancer", why=reason, gain_by_term=ex.gain_by_term,
                                   separates=ex.separates)
        except grpc.RpcError as e:
            return MoveResult(False, f"relay control socket: {e.code().name}: {e.details()}")
        if rec.result != "applied":
            return MoveResult(False, f"relay {rec.result}: {rec.error}")
        return MoveResult(True, None, parse_cpulist(rec.to_cpus))


class RelayMetadata:
    """Requests, QoS, annotations and exclusivity from the relay's container cache."""

    def __init__(self, client):
        self.client = client
        self._warned = False

    def metadata(self) -> Mapping[str, ContainerMetadata] | None:
        """None when the relay's state cannot be read (then nothing is known, not "no containers")."""
        import grpc

        try:
            st = self.client.state()
        except grpc.RpcError as e:
            if not self._warned:
                log.warning("relay state unavailable (%s); planning without requests and annotations", e.code().name)
                self._warned = True
            return None
        self._warned = False
        return {c.id: ContainerMetadata(cpu_request=c.cpu_request_milli / 1000.0, annotations=dict(c.annotations),
                                        qos=c.qos_class or None, exclusive=c.placement == "exclusive")
                for c in st.containers}


def control_client(path: Path):
    from ..relay.control import ControlClient

    return ControlClient(path, timeout=10)
