import math

from prometheus_client.parser import text_string_to_metric_families

from cri_resmgr import metrics as M
from cri_resmgr.export.exposition import Exposition
from cri_resmgr.export.prometheus import DirectSample, StoreCollector, make_registry, render
from cri_resmgr.store import Sample, Store


def families(text: str):
    out = {}
    for fam in text_string_to_metric_families(text):
        out[fam.name] = (fam.type, fam.documentation,
                         sorted((s.name, tuple(sorted(s.labels.items())), repr(s.value)) for s in fam.samples))
    return out


def make_store():
    s = Store()
    tricky = {"container": 'we"ird\\na\nme', "pod": "p", "namespace": "ns", "container_id": "x", "pod_uid": "",
              "qos_class": ""}
    s.append("a", 1, [Sample(M.CONTAINER_CPU_USAGE.name, tricky, 12.5),
                      Sample(M.CONTAINER_MEMORY_USAGE.name, tricky, 1e21),
                      Sample(M.CPU_UTILIZATION.name, {"cpu": "0"}, math.nan),
                      Sample(M.CPU_UTILIZATION.name, {"cpu": "1"}, math.inf),
                      Sample("cri_resmgr_test_unknown_total", {}, 3.0)])
    s.append("b", 1, [Sample(M.CPU_BUSY.name, {"cpu": "0"}, 1.0)])
    s.append("b", 2, [Sample(M.CPU_BUSY.name, {"cpu": "1"}, 2.0)])  # cpu 0 is now stale: not exported
    return s


def direct():
    return [DirectSample(M.COLLECTOR_UP, {"collector": "cpu"}, 1.0), DirectSample(M.CONFIG_RELOAD_ERRORS, {}, 0.0)]


def test_fast_exposition_equals_prometheus_client_rendering():
    s = make_store()
    ours = Exposition(s, direct).render().decode()
    ref = render(make_registry(StoreCollector(s, direct))).decode()
    assert families(ours) == families(ref)
    assert Exposition(s, direct).render() == Exposition(s, direct).render()


def test_stale_series_not_exported_and_cache_follows_changes():
    s = make_store()
    e = Exposition(s, direct)
    text = e.render().decode()
    assert 'cri_resmgr_cpu_busy_seconds_total{cpu="1"} 2.0' in text
    assert 'cri_resmgr_cpu_busy_seconds_total{cpu="0"}' not in text
    s.append("b", 3, [Sample(M.CPU_BUSY.name, {"cpu": "0"}, 5.0)])
    text = e.render().decode()
    assert 'cri_resmgr_cpu_busy_seconds_total{cpu="0"} 5.0' in text and '{cpu="1"}' not in text.split("busy")[1].split("#")[0]
