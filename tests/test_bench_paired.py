"""bench/paired.py: the sign-test interval for a median and its bootstrap cross-check, against binomial tails
computed by hand."""

from __future__ import annotations

import random
import statistics
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import json

import paired
from paired import binomial_half_cdf, bootstrap_interval, sign_test_interval, sign_test_rank


def test_binomial_tails_match_hand_computed_sums():
    assert binomial_half_cdf(10, 1) == 11 / 1024  # C(10,0) + C(10,1)
    assert binomial_half_cdf(10, 2) == 56 / 1024  # + C(10,2) = 45
    assert binomial_half_cdf(20, 5) == 21700 / 2 ** 20  # 1 + 20 + 190 + 1140 + 4845 + 15504
    assert binomial_half_cdf(6, -1) == 0.0 and binomial_half_cdf(6, 6) == 1.0


def test_sign_test_rank_is_the_largest_with_tail_within_alpha():
    # n = 10: P(B <= 1) = 0.0107 <= 0.025 < P(B <= 2) = 0.0547, so the interval is [x(2), x(9)]
    assert sign_test_rank(10) == 2
    # n = 20: P(B <= 5) = 0.0207 <= 0.025 < P(B <= 6) = 0.0577: [x(6), x(15)]
    assert sign_test_rank(20) == 6
    # n = 6: P(B <= 0) = 1/64 = 0.0156: [x(1), x(6)]; n = 5: 1/32 = 0.031 > 0.025: no 95 % interval
    assert sign_test_rank(6) == 1
    assert sign_test_rank(5) == 0


@pytest.mark.parametrize("n", [1023, 1024, 1075, 1200, 5000])
def test_sign_test_rank_past_a_floats_range(n):
    # 2.0 ** n overflows a float beyond n = 1023; a bench of 1,200 paired lifecycles got there. The rank still
    # obeys its definition, and sits near the normal approximation n/2 - 0.98 sqrt(n)
    k = sign_test_rank(n)
    assert 2 * binomial_half_cdf(n, k - 1) <= 0.05 < 2 * binomial_half_cdf(n, k)
    assert abs(k - (n / 2 - 0.98 * n ** 0.5)) <= 2


def test_sign_test_interval_takes_those_order_statistics_and_states_its_coverage():
    xs = [9.0, 1.0, 8.0, 2.0, 7.0, 3.0, 6.0, 4.0, 5.0, 10.0]  # sorted: 1..10
    got = sign_test_interval(xs)
    assert got is not None
    assert (got.low, got.high) == (2.0, 9.0)
    assert got.coverage == pytest.approx(1 - 2 * 11 / 1024)  # 0.9785
    twenty = sign_test_interval([float(i) for i in range(20, 0, -1)])
    assert twenty is not None and (twenty.low, twenty.high) == (6.0, 15.0)
    assert twenty.coverage == pytest.approx(1 - 2 * 21700 / 2 ** 20)  # 0.9586
    assert sign_test_interval([1.0, 2.0, 3.0, 4.0, 5.0]) is None
    assert sign_test_interval([]) is None


def test_bootstrap_interval_brackets_the_median_and_repeats_with_its_seed():
    xs = [float(i) for i in range(1, 102)]  # median 51
    a = bootstrap_interval(xs, resamples=500)
    assert a.low <= 51.0 <= a.high
    assert a.low > 35 and a.high < 67  # the median of 101 uniform values moves by ~±8 at 95 %
    assert bootstrap_interval(xs, resamples=500) == a
    assert bootstrap_interval([3.0] * 7, resamples=50)[:2] == (3.0, 3.0)
    with pytest.raises(ValueError):
        bootstrap_interval([])


def _lifecycle(total: float) -> dict[str, float]:
    # a lifecycle as relay_bench.py records it: seconds per call; its total is what is paired
    return {"RunPodSandbox": total * 0.4, "CreateContainer": total * 0.1, "StartContainer": total * 0.5}


def _saved(path: Path, direct: list[float], **targets: list[float]) -> Path:
    from relay_bench import save_run  # the bench's own writer: the round trip is what is checked

    per = {"direct": [_lifecycle(t) for t in direct], **{k: [_lifecycle(t) for t in v] for k, v in targets.items()}}
    save_run(path, 3, lifecycles=per)
    return path


def test_runs_pool_with_each_lifecycle_paired_within_its_own_run(tmp_path, capsys):
    # run a: lifecycles ~0.1 s, the relay +1 %; run b: ~0.2 s, the relay +3 %. Paired within each run the ratios
    # are exactly those; paired across the runs (or unpaired) they would be ~-50 % or ~+100 %
    a = _saved(tmp_path / "a.json", [0.1 + 0.001 * i for i in range(21)],
               relay=[(0.1 + 0.001 * i) * 1.01 for i in range(21)], direct2=[0.1 + 0.001 * i for i in range(21)])
    b = _saved(tmp_path / "b.json", [0.2 + 0.001 * i for i in range(11)],
               relay=[(0.2 + 0.001 * i) * 1.03 for i in range(11)])
    runs = [paired.run_ratios(json.loads(p.read_text()), str(p)) for p in (a, b)]
    pooled = paired.pool(runs)
    assert len(pooled["relay"]) == 32 and len(pooled["direct2"]) == 21
    assert min(pooled["relay"]) == pytest.approx(0.01) and max(pooled["relay"]) == pytest.approx(0.03)
    assert statistics.median(pooled["relay"]) == pytest.approx(0.01)  # 21 of the 32 pairs are run a's
    assert paired.main([str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert "pooled over 2 runs" in out
    assert "relay   +1.00 %" in out and "(n=32)" in out
    assert "direct2 +0.00 %" in out and "(n=21)" in out


def test_a_baseline_other_than_direct_pairs_two_targets_of_the_same_round(tmp_path, capsys):
    # alt1 is 2 % slower than alt2 in every pair; against direct both move with direct's spread
    direct = [0.1 + 0.003 * (i % 5) for i in range(15)]
    alt2 = [0.12 + 0.001 * i for i in range(15)]
    a = _saved(tmp_path / "a.json", direct, alt1=[t * 1.02 for t in alt2], alt2=alt2)
    runs = paired.run_ratios(json.loads(a.read_text()), str(a), baseline="alt2")
    assert set(runs) == {"direct", "alt1"}
    assert runs["alt1"] == pytest.approx([0.02] * 15)
    assert paired.main([str(a), "--baseline", "alt2"]) == 0
    out = capsys.readouterr().out
    assert "target / alt2 - 1" in out and "alt1    +2.00 %" in out
    assert paired.main([str(a), "--baseline", "alt3"]) == 2
    assert "no alt3 lifecycles to pair with" in capsys.readouterr().err


@pytest.mark.parametrize(("content", "named"), [
    (None, "No such file"),
    ("{not json", "not JSON"),
    (json.dumps({"format": 99, "lifecycles": {}}), "not a relay_bench.py --save file"),
    (json.dumps({"format": paired.RUN_FORMAT, "lifecycles": {"relay": []}}), "no direct lifecycles"),
    (json.dumps({"format": paired.RUN_FORMAT,
                 "lifecycles": {"direct": [{"a": 0.1}], "relay": [{"a": 0.1}, {"a": 0.2}]}}),
     "target 'relay' has 2 lifecycles, direct 1"),
    (json.dumps({"format": paired.RUN_FORMAT, "lifecycles": {"direct": [{"a": -1}], "relay": [{"a": 1}]}}),
     "target 'direct': lifecycles must be"),
    (json.dumps({"format": paired.RUN_FORMAT, "lifecycles": {"direct": [{"a": "x"}], "relay": [{}]}}),
     "lifecycles must be"),
])
def test_a_run_that_cannot_be_pooled_exits_2_naming_the_file_and_the_problem(tmp_path, capsys, content, named):
    path = tmp_path / "run.json"
    if content is not None:
        path.write_text(content)
    assert paired.main([str(path)]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and named in err


def _latencies(n: int, seed: int) -> list[float]:
    # calls of ~0.5 ms with a tail: every 40th round a burst of 4 slow rounds (a scrape), as a loaded machine has
    rng = random.Random(seed)
    return [0.0005 + rng.random() * 0.0001 + (0.002 * rng.random() if i % 40 < 4 else 0.0) for i in range(n)]


def test_quantile_difference_pools_the_runs_and_keeps_each_rounds_pair():
    # the relay adds exactly 0.3 ms to every call of its round: whatever blocks a resample draws, the same blocks
    # of both targets are drawn, so every resample's p99 difference is 0.3 ms (unpaired it would spread)
    runs = []
    for seed in (1, 2, 3):
        direct = _latencies(1000, seed)
        runs.append({"direct": direct, "relay": [d + 0.0003 for d in direct]})
    for q in (0.5, 0.99):
        est, iv = paired.quantile_difference(runs, "relay", "direct", q, block=50, resamples=200)
        assert est == pytest.approx(0.0003) and iv.low == pytest.approx(0.0003) and iv.high == pytest.approx(0.0003)
    # the estimate is the pooled quantile's (the bench's definition: rank floor(q n) + 1), not a mean of the runs'
    pooled = sum((r["direct"] for r in runs), [])
    assert paired.pct(pooled, 0.99) == sorted(pooled)[2970]


def test_quantile_difference_interval_covers_a_tail_difference_and_shrinks_with_runs():
    # the relay's extra time is its own noise (not a shift): one call in 25 takes 3 ms more, past direct's slowest
    # (~2.6 ms), so the relay's p99 is one of those calls and direct's one of its bursts. Its true p99
    # difference is a property of the two distributions; more runs narrow the interval around it
    def run(seed: int) -> dict[str, list[float]]:
        rng = random.Random(100 + seed)
        direct = _latencies(2000, seed)
        return {"direct": direct, "relay": [d + (0.003 if rng.random() < 0.04 else 0.0) for d in direct]}

    few = [run(s) for s in range(2)]
    many = [run(s) for s in range(12)]
    est_f, iv_f = paired.quantile_difference(few, "relay", "direct", 0.99, resamples=300)
    est_m, iv_m = paired.quantile_difference(many, "relay", "direct", 0.99, resamples=300)
    assert iv_m.low <= est_m <= iv_m.high and iv_f.low <= est_f <= iv_f.high
    assert iv_m.low > 0.0005  # the slow calls lift the tail, and the interval says so
    assert iv_m.high - iv_m.low < iv_f.high - iv_f.low
    with pytest.raises(ValueError, match="same, non-zero number"):
        paired.quantile_difference([{"direct": [0.1, 0.2], "relay": [0.1]}], "relay", "direct", 0.5)
    with pytest.raises(ValueError, match="whole block"):
        paired.quantile_difference([{"direct": [0.1] * 10, "relay": [0.1] * 10}], "relay", "direct", 0.5)


def test_saved_calls_pool_into_p50_and_p99_per_method(tmp_path, capsys):
    from relay_bench import save_run

    files = []
    for seed in (1, 2):
        direct = _latencies(400, seed)
        calls = {"Version": {"direct": direct, "relay": [d + 0.0002 for d in direct]},
                 "ListContainers": {"direct": direct, "relay": [d + 0.0001 for d in direct]}}
        files.append(tmp_path / f"run{seed}.json")
        save_run(files[-1], 1, calls=calls)
    assert paired.main(["--calls", *map(str, files)]) == 0
    out = capsys.readouterr().out
    assert "pooled over 2 runs" in out and "Version (800 calls per target" in out
    assert "relay   p50 +0.200 [+0.200, +0.200]   p99 +0.200 [+0.200, +0.200]" in out
    assert "relay   p50 +0.100 [+0.100, +0.100]" in out
    # a lifecycles-only file has no calls; a target short of calls is named
    _saved(tmp_path / "lc.json", [0.1] * 6, relay=[0.1] * 6)
    assert paired.main(["--calls", str(tmp_path / "lc.json")]) == 2
    assert "no phase 2 calls" in capsys.readouterr().err
    (tmp_path / "short.json").write_text(json.dumps(
        {"format": paired.RUN_FORMAT, "calls": {"Version": {"direct": [0.1, 0.2], "relay": [0.1]}}}))
    assert paired.main(["--calls", str(tmp_path / "short.json")]) == 2
    assert "Version: target 'relay' has 1 calls, direct 2" in capsys.readouterr().err
