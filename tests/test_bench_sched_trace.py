"""bench/sched_trace.py: run-queue waits from ``perf script`` lines of a ``perf sched record``, attributed to slow
calls. The lines below are in the format perf 6.1 prints (``-F comm,pid,tid,cpu,time,event,trace``)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

from sched_trace import SchedTrace, parse

RELAY, RUNTIME, HOG = 100, 200, 300


def sw(t, cpu, prev, state, nxt, prev_pid=None, next_comm="x"):
    pp = prev_pid or prev
    return (f"  x {pp}/{prev} [{cpu:03d}] {t:.6f}: sched:sched_switch: prev_comm=x prev_pid={prev} prev_prio=120 "
            f"prev_state={state} ==> next_comm={next_comm} next_pid={nxt} next_prio=120")


def wake(t, cpu, by, pid, target):
    return f"  x {by}/{by} [{cpu:03d}] {t:.6f}: sched:sched_waking: comm=x pid={pid} prio=120 target_cpu={target:03d}"


LINES = [
    sw(0.900000, 0, 0, "R", HOG),  # the hog on CPU 0
    # relay woken on CPU 0 at 1.000, where the hog runs until 1.004 (a tick): 4 ms waiting
    wake(1.000000, 0, HOG, RELAY, 0),
    sw(1.004000, 0, HOG, "R", RELAY),
    # the relay is preempted (still runnable) at 1.0045 by the runtime, back at 1.0050
    sw(1.004500, 0, RELAY, "R", RUNTIME),
    sw(1.005000, 0, RUNTIME, "S", RELAY),
    sw(1.005200, 0, RELAY, "S", 0),
    # a runtime thread (tid 201 of 200) woken at 2.0 and on a CPU at once: no wait worth a call
    wake(2.000000, 1, HOG, 201, 1),
    sw(2.000001, 1, 0, "R", 201),
    sw(2.000100, 1, 201, "S", 0, prev_pid=RUNTIME),  # its line names it as thread 201 of process 200
]


def test_waits_start_at_the_wakeup_or_the_preemption_and_end_when_the_thread_runs():
    w = parse(LINES)
    assert w.by_tid[RELAY] == [(1.0, 1.004, 0), (1.0045, 1.005, 0)]
    assert w.by_tid[201] == [(2.0, 2.000001, 1)]
    assert w.tgid[201] == RUNTIME  # a thread's waits count for its process


def test_a_slow_calls_wait_is_the_overlap_with_the_call_and_the_cpu_holder_is_named():
    tr = SchedTrace(Path("/nonexistent"))
    tr.waits = parse(LINES)
    calls = [("relay", 1.002, 1.006), ("relay", 3.0, 3.0001), ("direct", 1.0, 1.0005)]
    out = tr.attribute(calls, {"relay": RELAY, "runtime": RUNTIME}, slower_than=0.001, names={"hog": HOG})
    assert set(out) == {"relay"}  # the others were fast
    n, waited, ran = out["relay"]
    assert n == 1
    assert abs(waited["relay"] - (0.002 + 0.0005)) < 1e-9  # 1.002-1.004 and 1.0045-1.005
    assert abs(ran["hog"] - 0.002) < 1e-9 and abs(ran["runtime"] - 0.0005) < 1e-9
