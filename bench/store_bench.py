"""Store benchmarks: ingest rate, query_range latency, heatmap matrix latency, bytes per sample.

Baseline in the same run: the same work done with a plain Python per-series list of (t, v) tuples,
which is what a hand-rolled "dict of lists" store does. Prints medians; asserts nothing.

    .venv/bin/python bench/store_bench.py
"""

from __future__ import annotations


import numpy as np

from _util import median_time  # noqa: E402  (also puts the repo on sys.path)

from cri_resmgr.store import Sample, Store, heatmap, query_range  # noqa: E402


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
            s.append("t", 1000.0 + r, [Sample(m, lab, v) for (m, lab), v in zip(keys, vals[r])])

    def ingest_baseline():
        d: dict = {}
        for r in range(nrows):
            for (m, lab), v in zip(keys, vals[r]):
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
        data = s2.tables["t"]
        ts = data.ts[data.order()]
        for c in range(256):
            vs = data.vals[data.order(), c]
            buckets: dict = {}
            for t, v in zip(ts.tolist(), vs.tolist()):
                buckets.setdefault(int((t - 1000) // 5), []).append(v)

    row("heatmap 256 rows x 720 steps (ms)", timeit(hm, 5) * 1e3, timeit(hm_base, 3) * 1e3, "ms", "<= 20 ms")

    # --- bytes per sample
    tab = s2.tables["t"]
    used = tab.vals[:, :256].nbytes + tab.ts.nbytes
    samples = tab.count * 256
    import pickle

    py = len(pickle.dumps({c: [(float(t), float(v)) for t, v in zip(tab.ts, tab.vals[:, c])] for c in range(16)}))
    print(f"{'bytes per stored sample (incl. timestamps)':<44} {used / samples:>12.2f} {'B':<10} baseline "
          f"{py / (tab.count * 16):>12.2f} {'B (pickled list of tuples)':<26} target <= 5")


if __name__ == "__main__":
    main()
