"""/metrics render time from the store against a plain prometheus-client registry holding the same series.

Both render with prometheus_client.generate_latest in this run; medians of repeated renders.

    .venv/bin/python bench/metrics_bench.py
"""

from __future__ import annotations

import functools
import time

from _util import median_time
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from cri_resmgr import metrics as M
from cri_resmgr.export.exposition import Exposition
from cri_resmgr.export.reference import StoreCollector, make_registry, render
from cri_resmgr.store import Sample, Store


def build(n: int):
    """n series: half a per-container counter, half a per-container gauge, with container labels."""
    store = Store()
    plain = CollectorRegistry(auto_describe=False)
    labels = list(M.CONTAINER_LABELS)
    c = Counter(M.CONTAINER_CPU_USAGE.name.removesuffix("_total"), M.CONTAINER_CPU_USAGE.help, labels, registry=plain)
    g = Gauge(M.CONTAINER_MEMORY_USAGE.name, M.CONTAINER_MEMORY_USAGE.help, labels, registry=plain)
    samples = []
    for i in range(n // 2):
        lab = {"namespace": f"ns{i % 20}", "pod": f"pod-{i}", "container": f"c{i}", "container_id": f"{i:064x}",
               "pod_uid": f"uid-{i}", "qos_class": "Burstable"}
        samples.append(Sample(M.CONTAINER_CPU_USAGE.name, lab, float(i)))
        samples.append(Sample(M.CONTAINER_MEMORY_USAGE.name, lab, float(i * 1024)))
        c.labels(**lab).inc(i)
        g.labels(**lab).set(i * 1024)
    store.append("cgroup", time.time(), samples, 5.0)
    return make_registry(StoreCollector(store)), plain, Exposition(store)


def main():
    print(f"{'series':>8} {'/metrics (agent)':>18} {'StoreCollector+generate_latest':>32} {'plain registry':>16}"
          f" {'agent/plain':>12}   target: <= 50 ms at 20k, not slower than plain")
    for n in (5_000, 20_000):
        coll, plain, expo = build(n)
        assert expo.render().count(b"\n") > n and render(coll).count(b"\n") > n  # all series rendered
        expo.render()  # first scrape fills the label cache; steady state is what a scraper sees
        t_expo = median_time(expo.render)
        t_coll = median_time(functools.partial(render, coll), 5)
        t_plain = median_time(functools.partial(generate_latest, plain), 5)
        print(f"{n:>8} {t_expo * 1e3:>15.1f} ms {t_coll * 1e3:>29.1f} ms {t_plain * 1e3:>13.1f} ms "
              f"{t_expo / t_plain:>12.2f}")


if __name__ == "__main__":
    main()
