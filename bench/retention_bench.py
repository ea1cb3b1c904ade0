"""What the store's tables hold over an hour past their retention, with sealed blocks merged as the store merges
them, beside the policy before (blocks waiting until they add up to a merged one), in the same run.

A checkpoint the agent wrote (``bench/scale_bench.py`` leaves one per agent run under its temporary directory,
``agent-*/state``) is restored, and every table's rows are continued through the store's write path
(``Store.append_columns``, as ``scale_bench.py --fill`` does) for its retention and one more; over that second hour
the bytes each table holds (``Table.nbytes``: hot block, sealed blocks, per-column state) are sampled after every
row. Prints per table the mean and the largest, and the CPU the writes took (sealing and merging included), for
both policies. Asserts nothing.

    .venv/bin/python bench/retention_bench.py /tmp/cri-resmgr-scale-XXXX/agent-1000-None-0/state
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
from scale_bench import fill_to_retention

from cri_resmgr.store import Store, tsdb
from cri_resmgr.store.checkpoint import restore

INTERVALS = {"cgroup": 5.0, "rdt": 2.0, "avx512": 2.0, "cpu": 2.0}  # the agent's defaults, seconds


def merge_when_they_add_up(self):
    """The policy before (stop 35's tree): the newest sealed blocks smaller than the merged size, merged once they
    add up to it."""
    target = tsdb.compact_rows_for(self.capacity, self.block_rows, self.max_block_rows)
    rows = k = 0
    for b in reversed(self.blocks):
        if b.n >= target:
            break
        rows, k = rows + b.n, k + 1
    if k < 2 or rows < target:
        return None
    return list(self.blocks)[-k:]


def run(state: Path, retention: float) -> dict[str, tuple[float, float, float, int]]:
    store = Store(retention_seconds=retention)
    res = restore(store, state, interval_of=lambda t: INTERVALS.get(t, 1.0), now=time.time() + 1e9)
    if not res.restored:
        sys.exit(f"retention_bench: no checkpoint restored from {state}: {res.error}")
    seen: dict[str, list[int]] = {}
    cpu: dict[str, float] = {}

    def each(name, tab):
        seen.setdefault(name, []).append(tab.nbytes())

    for name in list(store.tables):  # one table at a time (a store holding it alone), to time each
        one = Store(retention_seconds=retention)
        tab = one.tables[name] = store.tables[name]
        for col, key in enumerate(tab.keys):  # (the store's index finds a series' column)
            if key is not None:
                one.adopt_series(tab, key, col)
        t0 = time.process_time()
        fill_to_retention(one, past=1.0, each=each)
        cpu[name] = time.process_time() - t0
    return {name: (float(np.mean(v)), float(max(v)), cpu[name], len(store.tables[name].blocks))
            for name, v in seen.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("state", type=Path, help="a directory holding the agent's checkpoint (store.npz)")
    ap.add_argument("--retention", type=float, default=3600.0, help="seconds (default: the agent's hour)")
    a = ap.parse_args()
    if not (a.state / "store.npz").is_file():
        sys.exit(f"retention_bench: {a.state} holds no store.npz (a scale_bench run leaves agent-*/state)")
    ours = run(a.state, a.retention)
    saved = tsdb.Table.merge_tail
    tsdb.Table.merge_tail = merge_when_they_add_up
    try:
        before = run(a.state, a.retention)
    finally:
        tsdb.Table.merge_tail = saved
    print(f"{'table':<12} {'mean MiB':>9} {'max MiB':>8} {'write CPU s':>11}   "
          f"{'before: mean':>12} {'max':>6} {'CPU s':>6}   mean ratio")
    tot = [0.0, 0.0, 0.0, 0.0]
    for name, (m, x, c, _) in ours.items():
        bm, bx, bc, _ = before[name]
        tot = [tot[0] + m, tot[1] + bm, tot[2] + x, tot[3] + bx]
        print(f"{name:<12} {m / 2**20:9.2f} {x / 2**20:8.2f} {c:11.2f}   {bm / 2**20:12.2f} {bx / 2**20:6.2f} "
              f"{bc:6.2f}   {m / bm if bm else float('nan'):.3f}")
    print(f"{'all':<12} {tot[0] / 2**20:9.2f} {tot[2] / 2**20:8.2f} {'':>11}   {tot[1] / 2**20:12.2f} "
          f"{tot[3] / 2**20:6.2f}        {tot[0] / tot[1]:.3f}  (sums of the per-table means and maxima)")


if __name__ == "__main__":
    main()
