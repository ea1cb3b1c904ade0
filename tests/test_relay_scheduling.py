"""The relay's event-loop thread asks for a short scheduler slice (cri_resmgr/relay/scheduling.py): on the real
kernel, in a thread of its own (the slice, nice and policy are per thread), read back from the kernel."""

from __future__ import annotations

import os
import platform
import threading

import pytest

from cri_resmgr.relay import scheduling
from cri_resmgr.relay.scheduling import MIN_SLICE_NS, request_slice

pytestmark = pytest.mark.skipif(platform.machine() not in scheduling._NR, reason="no sched_setattr number here")


def in_thread(fn):
    box: list = []
    t = threading.Thread(target=lambda: box.append(fn()))
    t.start()
    t.join(10)
    return box[0]


def kernel_honours_custom_slices() -> bool:
    # Linux 6.12 added SCHED_OTHER custom slices; older kernels accept the field and read back 0.
    major, minor = (int(x) for x in platform.release().split(".")[:2])
    return (major, minor) >= (6, 12)


def test_the_slice_is_read_back_from_the_kernel_and_nice_is_kept():
    def run():
        os.nice(3)  # Linux: the calling thread's nice
        before = os.getpriority(os.PRIO_PROCESS, 0)
        got = request_slice(300_000)
        return before, got, os.getpriority(os.PRIO_PROCESS, 0), os.sched_getscheduler(0)

    before, got, after, policy = in_thread(run)
    assert got.error == ""
    assert after == before  # the relay gets its slice, never a higher priority
    assert policy == os.SCHED_OTHER
    assert got.slice_ns == (300_000 if kernel_honours_custom_slices() else 0)


def test_a_slice_below_the_kernels_minimum_is_asked_for_at_the_minimum():
    got = in_thread(lambda: request_slice(1_000))
    assert got.error == ""
    if kernel_honours_custom_slices():
        assert got.slice_ns == MIN_SLICE_NS


def test_a_policy_other_than_sched_other_is_left_as_the_operator_set_it():
    def run():
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
        got = request_slice(200_000)
        return got, os.sched_getscheduler(0)

    got, policy = in_thread(run)
    assert "not SCHED_OTHER" in got.error
    assert policy == os.SCHED_BATCH
