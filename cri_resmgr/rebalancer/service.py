"""The rebalancer inside the agent: a thread that runs a round every ``rebalancer.interval_seconds``.

The move applier follows ``rebalancer.applier``: ``relay`` — the relay's move API on its control socket
(``relay.control_socket``, default ``run_dir/relay-control.sock``); ``cgroup`` — write the container
cgroups' cpusets directly (:class:`~.executor.CgroupMoveApplier`, paths from the cgroup collector's
discovery); ``auto`` — the relay when its control socket exists, else cgroups. Requests, annotations and
exclusivity come from the relay's cache whenever the socket exists. Configuration reloads take
effect at the next round.

A round's planning (most of its cost: at 1,000 containers about 200 ms against 50 ms for reading the inputs) is
skipped while nothing it reads has changed: :class:`ChangeGate` compares the inputs with those of the last planned
round (``rebalancer.skip_threshold``, at least every ``rebalancer.max_skip_seconds``). Skipped rounds are counted
(``cri_resmgr_rebalancer_rounds_total{result}``) and the last reason is kept for ``/api/v1/rebalancer/plan``.
"""

from __future__ import annotations

import logging
import math
import threading
from dataclasses import dataclass, fields, replace
from pathlib import Path

from ..config import RebalancerConfig
from ..heap import release_free_heap
from .executor import CgroupMoveApplier, MoveApplier, Rebalancer, RoundRecord
from .problem import ContainerInput
from .relay_client import RelayMetadata, RelayMoveApplier, control_client
from .signals import Inputs

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


# The measured inputs of a container, each with the scale below which a change is measured against the scale
# instead of the value (a container going from 0.001 to 0.002 CPUs has doubled, and nothing has changed).
SIGNAL_FLOORS = {"cpu_usage": 1.0, "cpu_request": 1.0, "avx512_ratio": 0.1, "llc_misses_per_second": 1e6,
                 "memory_bandwidth_bytes_per_second": 1e9, "llc_occupancy_bytes": float(8 << 20)}
# Everything else a container input holds (identity, cpuset, QoS, annotations, when it last moved) must be equal.
_EXACT = tuple(f.name for f in fields(ContainerInput) if f.name not in SIGNAL_FLOORS)


@dataclass
class SkippedRound:
    time: float
    reason: str


def input_change(old: Inputs, new: Inputs, threshold: float) -> str | None:
    """What changed between two rounds' inputs by more than ``threshold``, or None. A signal changes when one
    container's value moves by more than ``threshold`` of max(|old|, its floor), or when the sum of every
    container's moves exceeds ``threshold`` of max(the signal's old total, its floor): many small drifts add up.
    A value that ``new`` lacks (None: not measured in the window, as when RDT monitoring rotates through more
    containers than it has RMIDs or perf counters go to the busiest first) is no change: the last one measured holds
    (:func:`held`). A value measured for the first time is."""
    if old.missing != new.missing or old.high_priority_cpus != new.high_priority_cpus:
        return "the signals available changed"
    if len(old.containers) != len(new.containers):
        return f"{len(new.containers)} containers, {len(old.containers)} before"
    for a, b in zip(old.containers, new.containers, strict=True):
        for name in _EXACT:
            if getattr(a, name) != getattr(b, name):
                return f"{name} of {b.id[:12]}"
    for name, floor in SIGNAL_FLOORS.items():
        moved = total = 0.0
        for a, b in zip(old.containers, new.containers, strict=True):
            x, y = getattr(a, name), getattr(b, name)
            if y is None:
                continue
            if x is None:
                return f"{name} of {b.id[:12]}: measured for the first time"
            d = abs(y - x)
            if d > threshold * max(abs(x), floor) or math.isnan(d):
                return f"{name} of {b.id[:12]}: {x:.4g} -> {y:.4g}"
            moved += d
            total += abs(x)
        if moved > threshold * max(total, floor):
            return f"{name}: containers moved {moved:.4g} in all ({total:.4g} before)"
    return None


def held(old: Inputs | None, new: Inputs) -> Inputs:
    """``new`` with each signal it lacks (None: not measured in the window) taken from the same container in
    ``old``: the reference the next rounds are compared with."""
    if old is None:
        return new
    before = {c.id: c for c in old.containers}
    out = []
    for c in new.containers:
        o = before.get(c.id)
        fill = {} if o is None else {name: getattr(o, name) for name in SIGNAL_FLOORS
                                     if getattr(c, name) is None and getattr(o, name) is not None}
        out.append(replace(c, **fill) if fill else c)
    return Inputs(out, new.missing, new.high_priority_cpus)


class ChangeGate:
    """Skips the planning of a round whose inputs are those of the last planned round, within
    ``rebalancer.skip_threshold`` (:func:`input_change`). A round is planned all the same when the configuration,
    the mode, the topology or a cooldown changed, when the last recorded round failed (an error, a failed move),
    and at least every ``rebalancer.max_skip_seconds``."""

    def __init__(self, engine: Rebalancer):
        self.engine = engine
        self._ref: tuple[Inputs, RebalancerConfig, str, frozenset[str], float] | None = None
        self._topology: object = None  # the node's topology at the last planned round (rediscovered: a new one)
        self.planned_total = 0
        self.skipped_total = 0
        self.last_skip: SkippedRound | None = None
        self.last_plan_reason: str | None = None  # why the last round of the loop was planned

    @staticmethod
    def _cooling(inputs: Inputs, cfg: RebalancerConfig, now: float) -> frozenset[str]:
        return frozenset(c.id for c in inputs.containers
                         if c.last_moved is not None and now - c.last_moved < cfg.cooldown_seconds)

    def why_skip(self, inputs: Inputs, cfg: RebalancerConfig, now: float, mode: str) -> str | None:
        """The reason to skip this round, or None to plan it."""
        cooling = self._cooling(inputs, cfg, now)
        why, change = self._why_skip(inputs, cfg, now, mode, cooling)
        if why is None:
            self._ref = (held(self._ref[0] if self._ref else None, inputs), cfg, mode, cooling, now)
            self._topology = self.engine.topology()
            self.planned_total += 1
            self.last_plan_reason = change
        else:
            self.skipped_total += 1
            self.last_skip = SkippedRound(now, why)
        return why

    def _why_skip(self, inputs: Inputs, cfg: RebalancerConfig, now: float, mode: str,
                  cooling: frozenset[str]) -> tuple[str | None, str]:
        """(reason to skip or None, reason to plan)."""
        last = self.engine.last
        if self._ref is None or last is None:
            return None, "first round"
        if cfg.skip_threshold <= 0:
            return None, "skipping is off (rebalancer.skip_threshold 0)"
        if last.error is not None or any(o.result == "failed" for o in last.outcomes):
            return None, "the last round failed"
        ref, ref_cfg, ref_mode, ref_cooling, ref_time = self._ref
        if ref_cfg != cfg or ref_mode != mode:
            return None, "configuration or mode changed"
        if self.engine.topology() is not self._topology:
            return None, "the node's topology changed"
        if ref_cooling != cooling:
            return None, "a cooldown began or ended"
        if now - ref_time >= cfg.max_skip_seconds:
            return None, f"planned at least every {cfg.max_skip_seconds:g} s"
        change = input_change(ref, inputs, cfg.skip_threshold)
        if change is not None:
            return None, change
        return (f"no input changed by more than {cfg.skip_threshold:.0%} since the round planned at {ref_time:.0f} "
                f"({len(inputs.containers)} containers)"), ""


class RebalancerService:
    def __init__(self, agent):
        self.agent = agent
        self.link = _RelayLink(agent)
        self.engine = Rebalancer(agent.store, lambda: agent.topology, lambda: agent.cfg.rebalancer,
                                 applier=self._applier, metadata=_Metadata(self.link), cpusets=self._cpusets)
        self.gate = ChangeGate(self.engine)

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

    def run_now(self, mode: str | None = None) -> RoundRecord:
        """A round on demand (the API): always planned."""
        rec = self.engine.run_once(now=self.agent.now(), mode=mode)
        assert rec is not None  # without a gate every round is recorded
        return rec

    def tick(self) -> RoundRecord | None:
        """A round of the loop: None when its planning was skipped (:class:`ChangeGate`)."""
        rec = self.engine.run_once(now=self.agent.now(), gate=self.gate.why_skip)
        if rec is not None:
            release_free_heap()  # the planner's matrices, freed: out of the RSS
        return rec

    def start(self, stop: threading.Event) -> threading.Thread:
        t = threading.Thread(target=self._loop, args=(stop,), name="rebalancer", daemon=True)
        t.start()
        return t

    def _loop(self, stop: threading.Event) -> None:
        while not stop.wait(self.agent.cfg.rebalancer.interval_seconds):
            cfg = self.agent.cfg.rebalancer
            if not cfg.enabled or cfg.mode == "off":
                continue
            self.tick()
