"""The reference Prometheus exposition: prometheus-client's ``generate_latest`` over a custom collector of the
store's latest values. Not what the agent serves (that is :mod:`.exposition`, ~20x faster at 20 k series,
bench/metrics_bench.py); kept so tests/test_exposition.py and the benchmark can hold the fast writer to the
library's output.

A client_python *custom collector*: nothing is registered at import time, ``collect()`` builds fresh families
from the store on every scrape, and the registry is private.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric

from .. import metrics as M
from ..store import Store
from .exposition import DirectSample


class StoreCollector:
    def __init__(self, store: Store, direct: Callable[[], Iterable[DirectSample]] = lambda: ()):
        self.store = store
        self.direct = direct

    def describe(self) -> list[Metric]:
        # No describe at registration: that would run a full collect() (client_python calls collect()
        # when describe() is absent and auto_describe is on). Returning nothing keeps registration cheap.
        return []

    def collect(self) -> Iterable[Metric]:
        families: dict[str, Metric] = {}

        def family(spec: M.MetricSpec) -> Metric:
            fam = families.get(spec.name)
            if fam is None:
                base = spec.name[: -len("_total")] if spec.type == "counter" else spec.name
                fam = families[spec.name] = Metric(base, spec.help, spec.type, unit="")
            return fam

        for ref, _t, value in self.store.latest():
            spec = M.spec_of(ref.metric)
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
