"""Series under the operator's control: families switched off, labels dropped, cardinality per family.

``series.disable`` lists metric families (full names, or fnmatch patterns such as
``cri_resmgr_container_perf_*``) whose samples are dropped before they reach the store, like cAdvisor's
``--disable_metrics`` but per family. ``series.drop_labels`` maps a family (or pattern) to label names
removed from its series; series that then coincide are summed into one (so dropping ``cpu`` from a
per-CPU counter gives the node's total, and dropping ``container_id`` keeps one series per container name).
The rules are applied by the agent to every collector's samples before they are stored, so /metrics,
the REST API and remote_write all see the same series.
"""

from __future__ import annotations

import fnmatch
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from .. import metrics as M
from ..config import SeriesConfig
from ..store import Sample


@dataclass(frozen=True)
class _Rule:
    keep: bool
    drop: frozenset[str]


_KEEP = _Rule(True, frozenset())


class SeriesFilter:
    """Applies ``series.disable`` and ``series.drop_labels``; reads the config through ``get_cfg`` on every
    call, so a reload takes effect on the next cycle. Decisions are cached per family name."""

    def __init__(self, get_cfg: Callable[[], SeriesConfig]):
        self.get_cfg = get_cfg
        self._cfg: SeriesConfig | None = None
        self._rules: dict[str, _Rule] = {}
        self.dropped_samples: dict[str, int] = {}  # family -> samples not stored because it is disabled
        self._lock = threading.Lock()

    def _rule(self, metric: str, cfg: SeriesConfig) -> _Rule:
        r = self._rules.get(metric)
        if r is None:
            keep = not any(fnmatch.fnmatchcase(metric, pat) for pat in cfg.disable)
            drop: set[str] = set()
            for pat, labels in cfg.drop_labels.items():
                if fnmatch.fnmatchcase(metric, pat):
                    drop.update(labels)
            r = self._rules[metric] = _Rule(keep, frozenset(drop)) if (not keep or drop) else _KEEP
        return r

    def active(self) -> bool:
        cfg = self.get_cfg()
        return bool(cfg.disable or cfg.drop_labels)

    def apply(self, samples: Iterable[Sample]) -> list[Sample]:
        cfg = self.get_cfg()
        samples = list(samples)
        if not (cfg.disable or cfg.drop_labels):
            return samples
        with self._lock:
            if cfg is not self._cfg:
                self._cfg, self._rules = cfg, {}
            out: list[Sample] = []
            merged: dict[tuple[str, tuple[tuple[str, str], ...]], int] = {}
            for s in samples:
                r = self._rule(s.metric, cfg)
                if r is _KEEP:
                    out.append(s)
                    continue
                if not r.keep:
                    self.dropped_samples[s.metric] = self.dropped_samples.get(s.metric, 0) + 1
                    continue
                labels = {k: v for k, v in s.labels.items() if k not in r.drop}
                key = (s.metric, tuple(sorted(labels.items())))
                i = merged.get(key)
                if i is None:
                    merged[key] = len(out)
                    out.append(Sample(s.metric, labels, s.value))
                else:
                    out[i] = Sample(s.metric, out[i].labels, out[i].value + s.value)
            return out


@dataclass(frozen=True)
class FamilyCardinality:
    family: str
    series: int
    enabled: bool
    dropped_labels: tuple[str, ...]


class Cardinality:
    """Series per family in the store, recomputed at most every ``max_age_seconds`` (a scrape must stay
    cheap at 1,000 containers)."""

    def __init__(self, store, series_filter: SeriesFilter | None = None, max_age_seconds: float = 10.0,
                 clock: Callable[[], float] = time.monotonic):
        self.store = store
        self.filter = series_filter
        self.max_age_seconds = max_age_seconds
        self.clock = clock
        self._at: float | None = None
        self._last: list[FamilyCardinality] = []
        self._lock = threading.Lock()

    def families(self) -> list[FamilyCardinality]:
        with self._lock:
            now = self.clock()
            if self._at is not None and now - self._at < self.max_age_seconds:
                return self._last
            cfg = self.filter.get_cfg() if self.filter is not None else SeriesConfig()
            out = []
            names = set(self.store.metrics()) | set(self.filter.dropped_samples if self.filter else ())
            for name in sorted(names):
                drop: set[str] = set()
                for pat, labels in cfg.drop_labels.items():
                    if fnmatch.fnmatchcase(name, pat):
                        drop.update(labels)
                enabled = not any(fnmatch.fnmatchcase(name, pat) for pat in cfg.disable)
                out.append(FamilyCardinality(name, self.store.count(name), enabled, tuple(sorted(drop))))
            self._at, self._last = now, out
            return out

    def self_metrics(self) -> list:
        from ..export.exposition import DirectSample

        return [DirectSample(M.STORE_FAMILY_SERIES, {"family": f.family}, float(f.series)) for f in self.families()]
