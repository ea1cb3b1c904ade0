"""Store benchmarks: ingest rate, query_range latency, heatmap matrix latency, bytes per sample.

Baseline in the same run: the same work done with a plain Python per-series list of (t, v) tuples,
which is what a hand-rolled "dict of lists" store does. Prints medians; asserts nothing.

    .venv/bin/python bench/store_bench.py
"""

from __future__ import annotations

import numpy as np
from _util import median_time

from cri_resmgr.store import Sample, Store, heatmap, query_range

timeit = median_time


def row(name, ours, base, unit, target, higher_is_better=False):
    ratio = (ours / base) if higher_is_better else (base / ours if ours else float("inf"))
    print(f"{name:<44} {ours:>12.4g} {unit:<10} baseline {base:>12.4g} {unit:<10} x{ratio:>7.1f}   target {target}")


def main():
    print(f"{'benchmark':<44} {'cri-resmgr':>12} {'':<10} {'':>21} {'':<10} {'speedup':>8}")
    # --- ingest: 1000 series per row (a busy node's collector run), 1 s resolution
    nser, nrows = 1000, 600
    keys = [("m", {"cpu": str(i % 224), "container": f"c{i}"}) for i in range(nser)]
    vals = np.random.default_rng(0).random((nrows, nser))

    def ingest_vector():
        s = Store(retention_seconds=3600)
        h = s.prepare("t", keys)
        for r in range(nrows):
            h = s.write(h, 1000.0 + r, vals[r])

    def ingest_samples():
        s = Store(retention_seconds=3600)
        for r in range(nrows):
            s.append("t", 1000.0 + r, [Sample(m, lab, v) for (m, lab), v in zip(keys, vals[r], strict=True)])

    def ingest_baseline():
        d: dict = {}
        for r in range(nrows):
            for (m, lab), v in zip(keys, vals[r], strict=True):
                d.setdefault((m, tuple(sorted(lab.items()))), []).append((1000.0 + r, v))

    tb = timeit(ingest_baseline, 3)
    tv = timeit(ingest_vector, 3)
    ts_ = timeit(ingest_samples, 3)
    n = nser * nrows
    row("ingest, prepared rows (samples/s)", n / tv, n / tb, "samples/s", ">= 1e6", True)
    row("ingest, Sample objects (samples/s)", n / ts_, n / tb, "samples/s", ">= 1e6", True)

    # --- query_range: one series over 1 h at 1 s
    s = Store(retention_seconds=3600)
    h = s.prepare("t", [("q_total", {"cpu": str(i)}) for i in range(224)])
    base: dict = {}
    for r in range(3600):
        v = np.full(224, float(r))
        h = s.write(h, 1000.0 + r, v)
        base.setdefault("0", []).append((1000.0 + r, float(r)))
    from cri_resmgr.store import parse_matchers

    m = parse_matchers('cpu="0"')

    def qr():
        query_range(s, "q_total", m, 1000, 4599, 1, agg="avg")

    def qr_base():
        pts = base["0"]
        out = []
        j = 0
        for k in range(3600):
            t = 1000 + k
            acc = []
            while j < len(pts) and pts[j][0] <= t:
                acc.append(pts[j][1])
                j += 1
            out.append(sum(acc) / len(acc) if acc else None)

    row("query_range 1 series, 1 h @ 1 s (ms)", timeit(qr) * 1e3, timeit(qr_base) * 1e3, "ms", "< 1 ms")

    # --- heatmap 256 rows x 720 steps
    s2 = Store(retention_seconds=3600)
    h2 = s2.prepare("t", [("h", {"cpu": str(i)}) for i in range(256)])
    rng = np.random.default_rng(1)
    for r in range(3600):
        h2 = s2.write(h2, 1000.0 + r, rng.random(256))

    def hm():
        heatmap(s2, "h", "cpu", 1005, 4600, 5, agg="avg")

    def hm_base():
        # per-row python bucketing of the same data
        ts, V = s2.raw_matrix("t", list(range(256)), 0, 1e12)
        for c in range(256):
            vs = V[:, c]
            buckets: dict = {}
            for t, v in zip(ts.tolist(), vs.tolist(), strict=True):
                buckets.setdefault(int((t - 1000) // 5), []).append(v)

    row("heatmap 256 rows x 720 steps (ms)", timeit(hm, 5) * 1e3, timeit(hm_base, 3) * 1e3, "ms", "<= 20 ms")

    # --- bytes per sample: random floats (the codec's worst case) and agent-shaped series
    def per_sample(store, table):
        tab = store.tables[table]
        ncols = sum(k is not None for k in tab.keys)
        plain = tab.count * (ncols * 8 + 8)  # a float64 ring with a shared float64 time axis
        return tab.nbytes() / (tab.count * ncols), plain / (tab.count * ncols)

    import pickle

    _, V = s2.raw_matrix("t", list(range(16)), 0, 1e12)
    tsr, _ = s2.raw_matrix("t", [], 0, 1e12)
    py = len(pickle.dumps({c: [(float(t), float(v)) for t, v in zip(tsr, V[:, c], strict=True)] for c in range(16)}))
    ours, plain = per_sample(s2, "t")
    print(f"{'bytes/sample, random floats (worst case)':<44} {ours:>12.2f} {'B':<10} baseline "
          f"{plain:>12.2f} {'B (float64 ring)':<10} x{plain / ours:>7.1f}   target <= 5")
    print(f"{'':<44} {'':>12} {'':<10} baseline {py / (len(tsr) * 16):>12.2f} B (pickled list of tuples)")
    s3 = agent_shaped_store()
    ours, plain = per_sample(s3, "cgroup")
    print(f"{'bytes/sample, agent-shaped (200 containers)':<44} {ours:>12.2f} {'B':<10} baseline "
          f"{plain:>12.2f} {'B (float64 ring)':<10} x{plain / ours:>7.1f}   target <= 5")


def agent_shaped_store(containers: int = 200, rows: int = 3600):
    """What the cgroup collector writes for ``containers`` busy containers over an hour at 1 s: CPU seconds
    as it computes them (cgroup v2 ``usage_usec`` / 1e6), throttling counters, memory usage and working set in
    pages, a limit that does not change, and an up flag."""
    rng = np.random.default_rng(11)
    s = Store(retention_seconds=rows)
    names = ["cpu_usage_seconds_total", "cpu_throttled_periods_total", "cpu_throttled_seconds_total",
             "memory_usage_bytes", "memory_working_set_bytes", "memory_limit_bytes", "up"]
    keys = [(f"cri_resmgr_container_{n}", {"container_id": f"{i:064x}", "pod_uid": f"pod-{i}"})
            for n in names for i in range(containers)]
    h = s.prepare("cgroup", keys)
    cpu_us = np.zeros(containers, dtype=np.int64)  # the kernel's counters are integers (cpu.stat usage_usec)
    thr_p = np.zeros(containers)
    thr_us = np.zeros(containers, dtype=np.int64)
    mem = rng.integers(1 << 24, 1 << 31, containers).astype(float)
    limit = np.full(containers, float(4 << 30))
    for r in range(rows):
        cpu_us += rng.integers(0, 800_000, containers)
        hit = rng.random(containers) < 0.1
        thr_p += hit
        thr_us += np.where(hit, rng.integers(0, 50_000, containers), 0)
        mem += rng.integers(-64, 65, containers) * 4096.0
        ws = mem - rng.integers(0, 256, containers) * 4096.0
        h = s.write(h, 1.7e9 + r + rng.uniform(-0.002, 0.002),
                    np.concatenate([cpu_us / 1e6, thr_p, thr_us / 1e6, mem, ws, limit, np.ones(containers)]))
    return s


if __name__ == "__main__":
    main()
