import math

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cri_resmgr import metrics as M
from cri_resmgr.export.exposition import DirectSample, Exposition, format_family, format_histogram
from cri_resmgr.export.reference import StoreCollector, make_registry, render
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
    assert 'cri_resmgr_cpu_busy_seconds_total{cpu="0"} 5.0' in text
    assert '{cpu="1"}' not in text.split("busy")[1].split("#")[0]


def _parsed(text: str) -> set[tuple[str, tuple[tuple[str, str], ...], float]]:
    return {(s.name, tuple(sorted(s.labels.items())), s.value)
            for fam in text_string_to_metric_families(text) for s in fam.samples if not s.name.endswith("_created")}


def test_family_and_histogram_writers_match_prometheus_client():
    """The shared writers for values outside the store (relay and NRI statistics) against the library's own
    Counter and Histogram over the same observations, hostile label values included."""
    from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

    reg = CollectorRegistry()
    c = Counter(M.RELAY_REQUESTS.name, M.RELAY_REQUESTS.help, ["method", "code"], registry=reg)
    h = Histogram(M.RELAY_REQUEST_DURATION.name, M.RELAY_REQUEST_DURATION.help, ["method"], registry=reg,
                  buckets=(0.001, 0.01, 1.0))
    weird = 'a"b\\c\nd'
    c.labels("Version", "OK").inc(3)
    c.labels(weird, "Unknown").inc()
    observations = {"Version": [0.0005, 0.002, 0.5, 7.0], weird: [0.01]}
    for method, values in observations.items():
        for v in values:
            h.labels(method).observe(v)
    ours = format_family(M.RELAY_REQUESTS, [([("method", "Version"), ("code", "OK")], 3.0),
                                             ([("method", weird), ("code", "Unknown")], 1.0)])
    rows = []
    for method, values in observations.items():
        counts = [0, 0, 0, 0]
        for v in values:
            counts[next(i for i, b in enumerate((0.001, 0.01, 1.0, math.inf)) if v <= b)] += 1
        rows.append(([("method", method)], (0.001, 0.01, 1.0), counts, sum(values)))
    ours += format_histogram(M.RELAY_REQUEST_DURATION, rows)
    assert _parsed(ours) == _parsed(generate_latest(reg).decode())
    with pytest.raises(ValueError, match="bucket counts"):
        format_histogram(M.RELAY_REQUEST_DURATION, [([], (1.0,), [1], 1.0)])


def test_remembered_lines_follow_every_change_like_the_reference():
    """One Exposition scraped after each of many changes (values that change or stay, NaN and ±Inf appearing and
    going, series going stale, new series, columns reclaimed and reused by other series, a metric in two tables)
    renders what prometheus-client renders from the same store, and byte for byte what a fresh Exposition does."""
    rng = np.random.default_rng(3)
    s = Store(retention_seconds=20)
    e = Exposition(s, direct)
    specials = [math.nan, math.inf, -math.inf, 0.0, -0.0, 1e21, 2.5]
    for step in range(60):
        t = 1000.0 + step
        gen = step // 15  # a new set of containers every 15 rows: the old ones' columns are reclaimed later
        rows = []
        for k in range(12):
            v = float(rng.choice(specials)) if rng.random() < 0.2 else float(rng.integers(0, 3)) + 0.5 * k
            if rng.random() < 0.85:  # some series skip a row: not live in it
                rows.append(Sample(M.CONTAINER_CPU_USAGE.name, {"container_id": f"g{gen}-c{k}"}, v))
        s.append("cg", t, rows, 1.0)
        s.append("other", t, [Sample(M.CONTAINER_CPU_USAGE.name, {"container_id": "elsewhere"}, float(step % 4)),
                              Sample(M.CPU_BUSY.name, {"cpu": str(step % 3)}, float(step))], 1.0)
        ours = e.render()
        assert ours == Exposition(s, direct).render(), step
        assert families(ours.decode()) == families(render(make_registry(StoreCollector(s, direct))).decode()), step


def test_a_series_added_while_a_scrape_runs_does_not_hide_the_others():
    """A collector adds a series (a new column) after the scrape took its plan but before it read the values:
    the series already planned are all still exported, and the new one with the next scrape."""
    s = Store()
    s.append("t", 1, [Sample(M.CPU_BUSY.name, {"cpu": str(i)}, float(i)) for i in range(5)])
    ex = Exposition(s)
    ex.render()
    read = s.latest_vectors

    def racing():
        s.append("t", 2, [Sample(M.CPU_BUSY.name, {"cpu": str(i)}, float(i)) for i in range(6)])
        return read()

    s.latest_vectors = racing  # type: ignore[method-assign]
    text = ex.render().decode()
    s.latest_vectors = read  # type: ignore[method-assign]
    busy = [ln for ln in text.splitlines() if ln.startswith(M.CPU_BUSY.name)]
    assert len(busy) == 5, text
    assert len([ln for ln in ex.render().decode().splitlines() if ln.startswith(M.CPU_BUSY.name)]) == 6


def _uncached_render(s: Store, direct_samples) -> bytes:
    """The exposition without any remembered text: every line formatted from the store's live values with the
    shared writer (format_family), family by family in the store's order."""
    from cri_resmgr.export.exposition import format_family

    def order(labels):  # the container's labels first (the part shared by its series), then the others
        return ([p for p in labels if p[0] in M.CONTAINER_LABELS]
                + [p for p in labels if p[0] not in M.CONTAINER_LABELS])

    live = {ref: v for ref, _, v in s.latest()}  # (SeriesRefs are values: equal for the same series)
    out = []
    for metric, refs in s.series_by_metric().items():
        rows = [(order(ref.labels), live[ref]) for ref in refs if ref in live]
        if rows:
            out.append(format_family(M.spec_of(metric), rows))
    grouped: dict[str, list] = {}
    specs = {}
    for d in direct_samples():
        specs[d.spec.name] = d.spec
        grouped.setdefault(d.spec.name, []).append((sorted(d.labels.items()), d.value))
    out += [format_family(specs[name], rows) for name, rows in grouped.items()]
    return "".join(out).encode()


def test_exposition_is_byte_identical_to_the_uncached_render_and_shares_label_text():
    """Scraped after every change (values changing or not, NaN and ±Inf, series going stale and coming back, new
    containers, reclaimed columns, hostile label values, labels besides the container's), the remembered pieces
    give byte for byte what formatting every line afresh gives; and a container's label text is one string, shared
    by all its series' lines, PSI-style ones with more labels included."""
    rng = np.random.default_rng(7)
    s = Store(retention_seconds=12)
    e = Exposition(s, direct)
    specials = [math.nan, math.inf, -math.inf, -0.0, 1e21, 1 / 3]
    for step in range(40):
        gen = step // 10
        rows = []
        for k in range(8):
            labels = {"container_id": f"g{gen}-{k}", "pod": 'p"\\\n', "namespace": "ns"}
            series = [(M.CONTAINER_CPU_USAGE.name, labels), (M.CONTAINER_MEMORY_USAGE.name, labels)]
            series += [(M.CONTAINER_PRESSURE_STALLED.name, {**labels, "resource": r, "kind": "some", "a": "1"})
                       for r in ("cpu", "io")]
            for m, lab in series:
                if rng.random() < 0.9:
                    v = float(rng.choice(specials)) if rng.random() < 0.2 else float(rng.integers(0, 4))
                    rows.append(Sample(m, lab, v))
        rows.append(Sample(M.CPU_BUSY.name, {"cpu": str(step % 3)}, float(step)))
        rows.append(Sample("cri_resmgr_test_unlabelled", {}, float(step)))
        s.append("cg", 1000.0 + step, rows, 1.0)
        assert e.render() == _uncached_render(s, direct), step
    heads: dict = {}
    for _, runs in e._families():
        for run in runs:
            for labels, head in zip(run.labels, run.pieces[1::5], strict=True):
                heads.setdefault(dict(labels).get("container_id"), set()).add(id(head))
    heads.pop(None)  # (the series without a container)
    assert len(heads) >= 8 and all(len(ids) == 1 for ids in heads.values())


def test_serving_metrics_does_not_import_prometheus_client():
    """The served agent's web app imports no prometheus-client (its import cost ~1.8 MB of RSS for a constant);
    the library stays the tests' reference only."""
    import subprocess
    import sys

    code = ("import sys; import cri_resmgr.web.app; import cri_resmgr.serve; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'prometheus_client'))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert r.stdout.strip() == "[]", r.stdout + r.stderr


def test_label_text_of_containers_gone_is_let_go():
    """Containers come and go (their series reclaimed by the store): the label parts the exposition keeps stay
    bounded by those in use, not by every container ever seen, and what it renders stays right."""
    s = Store(retention_seconds=4)
    e = Exposition(s)
    for gen in range(40):
        s.append("cg", 1000.0 + gen, [Sample(M.CONTAINER_CPU_USAGE.name, {"container_id": f"g{gen}-{k}"}, 1.0)
                                      for k in range(100)], 1.0)
        assert e.render() == _uncached_render(s, lambda: ())
    live = {dict(r.labels)["container_id"] for refs in s.series_by_metric().values() for r in refs}
    assert len(live) < 1000
    held = len(e._labels._heads)
    assert held <= 2 * len(live) + 1024 < 4000, (held, len(live))


def test_series_of_equal_value_share_one_value_text():
    """Formatted whole (the first scrape, or most values changed), the series of one value hold one text for it
    (1,000 idle containers: ~1.4 k distinct values in 20 k series); 0.0 and -0.0 stay two, NaN its own."""
    s = Store()
    values = [0.0, 0.0, -0.0, 5.0, 5.0, math.nan, math.nan, 0.0]
    s.append("cg", 1.0, [Sample(M.CONTAINER_CPU_USAGE.name, {"container_id": f"c{i}"}, v)
                         for i, v in enumerate(values)], 1.0)
    e = Exposition(s)
    text = e.render().decode()
    assert text == _uncached_render(s, lambda: ()).decode() and 'container_id="c2"} -0.0\n' in text
    (run,), = [runs for m, runs in e._families() if m == M.CONTAINER_CPU_USAGE.name]
    texts = run.pieces[3::5]
    by_value: dict = {}
    for v, t in zip(values, texts, strict=True):
        by_value.setdefault(repr(v), set()).add(id(t))
    assert by_value.keys() == {"0.0", "-0.0", "5.0", "nan"} and all(len(ids) == 1 for ids in by_value.values())
    assert len({id(t) for t in texts}) == 4
