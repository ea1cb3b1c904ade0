"""Where an NRI hook's time goes (cri_resmgr/nri/trace.py): each part produced for real on this machine — a
thread burning CPU, one sleeping, one sharing a CPU with another process, a garbage collection, another thread
holding the interpreter — and the slow answers' log line, counts and metrics (cri_resmgr/nri/stats.py)."""

from __future__ import annotations

import gc
import logging
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from cri_resmgr.nri.stats import NriStats
from cri_resmgr.nri.trace import GcPauses, HookTrace, HookTracer, phase_durations
from cri_resmgr.nri.ttrpc import Call, Message, MessageType, Method, Server, encode_request


def spin(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def traced(tracer: HookTracer, body) -> HookTrace:
    t0 = time.monotonic()
    start = tracer.begin()
    body()
    return tracer.end(start, "X", "ok", t0, time.monotonic())


def test_a_thread_on_a_cpu_is_cpu_and_a_sleeping_one_is_blocked():
    tracer = HookTracer()
    busy = traced(tracer, lambda: spin(0.02))
    assert busy.cpu_seconds > 0.5 * busy.wall_seconds
    asleep = traced(tracer, lambda: time.sleep(0.02))
    assert asleep.blocked_seconds > 0.015 and asleep.cpu_seconds < 0.005
    assert asleep.voluntary_switches >= 1
    assert asleep.cause == "blocked"
    assert abs(asleep.cpu_seconds + asleep.runqueue_seconds + asleep.blocked_seconds - asleep.wall_seconds) < 1e-3


@pytest.mark.skipif(not Path("/proc/thread-self/schedstat").exists(), reason="no schedstat (CONFIG_SCHED_INFO)")
def test_sharing_a_cpu_with_another_process_is_run_queue_time():
    cpu = sorted(os.sched_getaffinity(0))[0]
    hog = subprocess.Popen([sys.executable, "-c", f"import os\nos.sched_setaffinity(0, {{{cpu}}})\nwhile True: pass"])
    tracer = HookTracer()
    mask = os.sched_getaffinity(0)
    result: list[HookTrace] = []

    def on_that_cpu() -> None:
        os.sched_setaffinity(0, {cpu})  # this thread only
        time.sleep(0.2)  # the hog is running there by now
        result.append(traced(tracer, lambda: spin(0.1)))

    try:
        t = threading.Thread(target=on_that_cpu)
        t.start()
        t.join()
    finally:
        hog.kill()
        hog.wait()
        os.sched_setaffinity(0, mask)
    r = result[0]
    assert r.runqueue_seconds > 0.2 * r.wall_seconds, r.describe()
    assert r.involuntary_switches >= 1


def test_another_thread_holding_the_interpreter_shows_as_blocked_with_its_cpu():
    tracer = HookTracer()
    old = sys.getswitchinterval()
    sys.setswitchinterval(0.005)
    stop = threading.Event()
    started = threading.Event()

    def busy() -> None:
        started.set()
        while not stop.is_set():
            sum(range(1000))

    t = threading.Thread(target=busy)
    t.start()
    started.wait()
    try:
        r = traced(tracer, lambda: [sum(range(1000)) for _ in range(2000)])  # ~20 ms of CPU: several intervals
    finally:
        stop.set()
        t.join()
        sys.setswitchinterval(old)
    assert r.blocked_seconds > 0.004 and r.voluntary_switches >= 1, r.describe()  # waited for the interpreter
    assert r.others_cpu_seconds > 0.004, r.describe()  # while the other thread ran


def test_a_garbage_collection_inside_the_hook_is_counted_and_named_the_cause():
    pauses = GcPauses()
    pauses.install()
    try:
        tracer = HookTracer(gc_pauses=pauses)
        junk = [[i] * 3 for i in range(200_000)]
        for a, b in zip(junk, junk[1:], strict=False):
            a.append(b)  # tracked containers: a full collection walks them all
        r = traced(tracer, lambda: gc.collect(2))
        assert pauses.count[2] >= 1 and pauses.seconds[2] > 0
        assert r.gc_seconds > 0.5 * r.wall_seconds
        assert r.cause == "gc"
    finally:
        pauses.uninstall()
    assert pauses.callback not in gc.callbacks


def test_only_the_part_of_a_pause_inside_the_interval_counts():
    now = [0.0]
    pauses = GcPauses(clock=lambda: now[0])
    for start, end in ((1.0, 2.0), (3.0, 4.0), (5.0, 6.0)):
        now[0] = start
        pauses.callback("start", {"generation": 0})
        now[0] = end
        pauses.callback("stop", {"generation": 0})
    assert pauses.within(1.5, 3.5) == pytest.approx(1.0)  # half of each of the first two
    assert pauses.within(6.0, 9.0) == 0.0
    assert pauses.count == [3, 0, 0] and pauses.seconds[0] == pytest.approx(3.0)


def test_time_neither_on_a_cpu_nor_queued_nor_asleep_is_steal():
    """A thread that never slept cannot have been waiting for anything: what its CPU clock and run-queue time do
    not cover, its virtual CPU was not running (the trace's interval is stretched here as a stolen vCPU would)."""
    tracer = HookTracer()
    start = tracer.begin()
    t1 = time.monotonic()
    r = tracer.end(start, "X", "ok", t1 - 0.005, t1)
    assert r.voluntary_switches == 0
    assert r.steal_seconds > 0.004 and r.blocked_seconds == 0.0 and r.cause == "steal"


def test_phases_are_the_gaps_between_marks():
    assert phase_durations(10.0, [("ttrpc", 10.5), ("place", 11.0), ("encode", 11.25)]) == (
        ("ttrpc", 0.5), ("place", 0.5), ("encode", 0.25))


def test_the_server_traces_each_answer_and_slow_ones_are_logged_counted_and_exported(caplog):
    """A hook that sleeps past 2 ms: the server hands its trace (with the handler's marks) to the stats, which log
    it with its breakdown, count it by cause and export the parts; a fast one is traced but not counted slow."""
    pauses = GcPauses()
    stats = NriStats(pauses)
    sent: list[bytes] = []

    def slow(raw: bytes, call: Call) -> bytes:
        call.mark("decode")
        time.sleep(0.005)
        call.mark("place")
        return b""

    def fast(raw: bytes, call: Call) -> bytes:
        return b""

    with ThreadPoolExecutor(1) as ex:
        server = Server(sent.append, {"svc/CreateContainer": Method(slow, b"", inline=True),
                                      "svc/StopContainer": Method(fast, b"", inline=True)}, ex, 1.0,
                        tracer=HookTracer(gc_pauses=pauses), on_trace=stats.record_trace)
        try:
            with caplog.at_level(logging.INFO, logger="cri_resmgr.nri.stats"):
                for sid, method in ((1, "CreateContainer"), (3, "StopContainer")):
                    server.receive(Message(sid, MessageType.REQUEST,
                                           encode_request("svc", method, b"", 2.0)).encode())
        finally:
            server.close()
    assert len(sent) == 2
    slowest = stats.slowest()
    assert [t.event for t in slowest] == ["CreateContainer", "StopContainer"]
    t = slowest[0]
    assert t.wall_seconds > 0.005 and t.cause == "blocked"
    assert [name for name, _ in t.phases] == ["ttrpc", "decode", "place", "handler", "encode"]
    assert dict(t.phases)["place"] >= 0.005
    assert stats.slow_counts() == {("CreateContainer", "blocked"): 1}
    assert [r.message for r in caplog.records if "slow NRI answer" in r.message] == [
        f"slow NRI answer: {t.describe()}"]
    text = stats.render()
    assert 'cri_resmgr_nri_slow_requests_total{event="CreateContainer",cause="blocked"} 1' in text
    assert 'cri_resmgr_nri_request_time_seconds_total{event="CreateContainer",part="blocked"}' in text
    assert 'cri_resmgr_nri_gc_pauses_total{generation="2"}' in text


def test_the_slowest_answers_kept_are_the_slowest():
    stats = NriStats(slow_seconds=10.0)
    for i in range(40):
        stats.record_trace(HookTrace("StartContainer", "ok", i / 1000, 0, 0, i / 1000, 0, 0, 0, 1, 0))
    kept = [round(t.wall_seconds * 1000) for t in stats.slowest()]
    assert kept == list(range(39, 39 - len(kept), -1)) and len(kept) == 16
