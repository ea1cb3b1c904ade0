"""The calibration tables of docs/rebalancer.md from ``cri-resmgr rebalance --calibrate`` reports.

Each report is re-summarised by the code as it stands (``calibrate.pool`` over that one report), one row a
run, then one row for all of them pooled (the same as ``--calibration-pool`` over the files). Prints a
Markdown table of the fit and the held-out points, and one of the peak fit beside it. Bandwidths in GB/s,
slowdowns in %, error = predicted / measured − 1.

    .venv/bin/python bench/calibration_table.py bench/calibration/run*.json
    .venv/bin/python bench/calibration_table.py --series bench/calibration/run2.json   # round by round

``--series`` prints each round of each report instead: clean or not, the probe alone (GB/s), its slowdown at
the three points and the peak phase's loss (%), and the foreign share: what the medians hide (a change of
the host's state within a run shows as a run of rounds at another level).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import _util  # noqa: F401  (makes the package importable from a checkout)

from cri_resmgr.rebalancer.calibrate import Calibration, Validation, pool

GB = 1e9
WEIGHT = 4.0  # the default memory_bandwidth weight: only the reported cost uses it, not a table column


def _pct(x: float | None, sign: bool = False) -> str:
    if x is None:
        return "–"
    return f"{100 * x:+.0f} %" if sign else f"{100 * x:.2f}"


def _interval(lo_hi: tuple[float, float]) -> str:
    lo, hi = lo_hi
    return f"[{100 * lo:.2f}, {100 * hi:.2f}]"


def _point(v: Validation) -> list[str]:
    inside = "yes" if v.predicted_inside_measured_interval else "no"
    return [f"{_pct(v.measured_slowdown)} {_interval(v.measured_slowdown_interval)}", _pct(v.predicted_slowdown),
            _pct(v.relative_error, sign=True), inside,
            _pct(v.predicted_slowdown_mean_load / v.measured_slowdown - 1 if v.measured_slowdown else None, sign=True)]


def main_row(name: str, c: Calibration) -> str:
    cells = [name, f"{len(c.clean_rounds)}/{len(c.rounds)}",
             f"{_pct(c.foreign_share)} / {_pct(c.foreign_share_max)}"]
    if not c.conclusive:
        return "| " + " | ".join(cells + [c.verdict] + [""] * 15) + " |"
    assert c.full and c.throttled and c.second_throttled and c.probe_alone_bytes_per_second
    assert c.hog_alone_bytes_per_second
    cap = c.fitted_capacity_bytes_per_second
    cells += [f"{c.probe_alone_bytes_per_second / GB:.2f}", f"{c.hog_alone_bytes_per_second / GB:.2f}",
              f"{c.throttled.hog_stream_share:.3f} / {c.second_throttled.hog_stream_share:.3f}",
              f"{cap / GB:.0f}" if cap else "–",
              f"{_pct(c.full.measured_slowdown)} {_interval(c.full.measured_slowdown_interval)}"]
    cells += _point(c.throttled) + _point(c.second_throttled)
    cells += ["yes" if c.within_tolerance else "no"]
    return "| " + " | ".join(cells) + " |"


def peak_row(name: str, c: Calibration) -> str:
    pf = c.peak_fit
    if pf is None:
        return f"| {name} | – | – | – | – | – | – |"
    cap = pf.fitted_capacity_bytes_per_second
    return "| " + " | ".join([
        name, f"{pf.peak_bytes_per_second / GB:.2f}", _pct(pf.peak_lost_share), f"{cap / GB:.0f}" if cap else "–",
        f"{_pct(pf.full_predicted_slowdown)} ({_pct(pf.full_relative_error, sign=True)})",
        f"{_pct(pf.throttled_predicted_slowdown)} ({_pct(pf.throttled_relative_error, sign=True)})",
        f"{_pct(pf.second_throttled_predicted_slowdown)} ({_pct(pf.second_throttled_relative_error, sign=True)})",
    ]) + " |"


def series(name: str, report: dict) -> None:
    c = pool([report], WEIGHT)
    print(f"run {name}: round, clean, B_p GB/s, slowdown % at points 1 / 2 / 3, peak loss %, foreign share")
    for i, r in enumerate(c.rounds):
        loss = 1 - r.peak_bytes_per_second / (r.first_hog_alone_bytes_per_second + r.hog_alone_bytes_per_second)
        print(f"{i:4d} {'C' if i in c.clean_rounds else '-'} {r.probe_alone_bytes_per_second / GB:6.2f} "
              f"{100 * r.slowdown:6.1f} {100 * r.throttled_slowdown:6.1f} {100 * r.second_throttled_slowdown:6.1f} "
              f"{100 * loss:6.1f} {r.disturbance.foreign_share:5.2f}")


def _name(path: Path) -> str:
    m = re.search(r"(\d+)", path.stem)
    return m.group(1) if m else path.stem


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("reports", nargs="+", type=Path)
    ap.add_argument("--series", action="store_true", help="each round of each report instead of the tables")
    args = ap.parse_args()
    reports = [json.loads(p.read_text()) for p in args.reports]
    if args.series:
        for p, r in zip(args.reports, reports, strict=True):
            series(_name(p), r)
        return
    rows = [(_name(p), pool([r], WEIGHT)) for p, r in zip(args.reports, reports, strict=True)]
    pooled = pool(reports, WEIGHT)
    print("| run | clean | foreign % median / max | B_p | B_h | s_t / s_t2 | fitted C | point 1 measured [95 %] "
          "| point 2 measured [95 %] | predicted | error | inside | mean-load error "
          "| point 3 measured [95 %] | predicted | error | inside | mean-load error | both ±25 % |")
    print("|" + "---|" * 19)
    for name, c in rows:
        print(main_row(name, c))
    print(main_row(f"**pooled {len(rows)}**", pooled))
    print()
    print("| run | P | peak loss % | peak-fit C | point 1 predicted (error) | point 2 | point 3 |")
    print("|" + "---|" * 7)
    for name, c in rows:
        print(peak_row(name, c))
    print(peak_row(f"**pooled {len(rows)}**", pooled))


if __name__ == "__main__":
    main()
