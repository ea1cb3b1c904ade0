"""Prometheus exposition built from the store's latest values.

A prometheus-client *custom collector* (client_python's "custom collectors" pattern): nothing is
registered at import time, ``collect()`` builds fresh families from the store on every scrape, and the
registry is private to the agent.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric

from .. import metrics as M
from ..store import Store


@dataclass(frozen=True)
class DirectSample:
    """A value that lives outside the store (agent self-metrics)."""

    spec: M.MetricSpec
    labels: dict[str, str]
    value: float


class StoreCollector:
    def __init__(self, store: Store, direct: Callable[[], Iterable[DirectSample]] = lambda: ()):
        self.store = store
        self.direct = direct

    def describe(self):
        # No describe at registration: that would run a full collect() (client_python calls collect()
        # when describe() is absent and auto_describe is on). Returning nothing keeps registration cheap.
        return []

    def collect(self):
        families: dict[str, Metric] = {}

        def family(spec: M.MetricSpec) -> Metric:
            fam = families.get(spec.name)
            if fam is None:
                base = spec.name[: -len("_total")] if spec.type == "counter" else spec.name
                fam = families[spec.name] = Metric(base, spec.help, spec.type, unit="")
            return fam

        for ref, _t, value in self.store.latest():
            spec = M.lookup(ref.metric)
            if spec is None:
                spec = M.MetricSpec(ref.metric, "counter" if ref.metric.endswith("_total") else "gauge",
                                    f"{ref.metric} (no metadata)")
            family(spec).add_sample(spec.name, dict(ref.labels), value)
        for d in self.direct():
            family(d.spec).add_sample(d.spec.name, d.labels, d.value)
        yield from families.values()


def make_registry(collector: StoreCollector) -> CollectorRegistry:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(collector)
    return reg


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
