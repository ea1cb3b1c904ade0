"""The relay's event-loop thread runs ahead of ordinary work (cri_resmgr/relay/scheduling.py): on the real kernel,
each case in a thread of its own (nice, policy and slice are per thread), read back from the kernel."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import textwrap
import threading

import pytest

from cri_resmgr.relay import scheduling
from cri_resmgr.relay.scheduling import MIN_SLICE_NS, prioritise

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


def test_raised_priority_and_slice_are_read_back_from_the_kernel_for_this_thread_only():
    if os.geteuid() != 0:
        pytest.skip("lowering nice needs CAP_SYS_NICE (root)")
    main_nice = os.getpriority(os.PRIO_PROCESS, 0)

    def run():
        got = prioritise(-7, 300_000)
        return got, os.getpriority(os.PRIO_PROCESS, 0), os.sched_getscheduler(0)

    got, nice, policy = in_thread(run)
    assert got.error == "" and got.nice == nice == -7
    assert policy == os.SCHED_OTHER  # never a real-time task
    assert got.slice_ns == (300_000 if kernel_honours_custom_slices() else 0)
    assert os.getpriority(os.PRIO_PROCESS, 0) == main_nice  # the other threads keep theirs


def test_a_slice_below_the_kernels_minimum_is_asked_for_at_the_minimum():
    got = in_thread(lambda: prioritise(os.getpriority(os.PRIO_PROCESS, 0), 1_000))
    assert got.error == ""
    if kernel_honours_custom_slices():
        assert got.slice_ns == MIN_SLICE_NS


def test_a_policy_other_than_sched_other_is_left_as_the_operator_set_it():
    def run():
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
        before = os.getpriority(os.PRIO_PROCESS, 0)
        got = prioritise(-5, 200_000)
        return got, os.sched_getscheduler(0), before, os.getpriority(os.PRIO_PROCESS, 0)

    got, policy, before, after = in_thread(run)
    assert "not SCHED_OTHER" in got.error
    assert policy == os.SCHED_BATCH and after == before


def test_without_cap_sys_nice_the_nice_is_kept_the_slice_taken_and_the_refusal_named():
    """For real: a process that gave up root (setuid to nobody) asks for nice -10."""
    if os.geteuid() != 0:
        pytest.skip("needs root to become another user")
    code = textwrap.dedent("""
        import os, resource
        from cri_resmgr.relay.scheduling import prioritise  # imported while the interpreter's files are readable
        resource.setrlimit(resource.RLIMIT_NICE, (0, 0))  # no unprivileged nice raising either
        os.setgid(65534); os.setuid(65534)
        got = prioritise(-10, 250_000)
        print(got.nice, got.slice_ns, os.getpriority(os.PRIO_PROCESS, 0), "|", got.error)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, out.stderr
    nums, error = out.stdout.split("|")
    nice, slice_ns, actual = (int(x) for x in nums.split())
    assert nice == actual == 0
    assert "nice -10 refused" in error and "CAP_SYS_NICE" in error
    assert slice_ns == (250_000 if kernel_honours_custom_slices() else 0)
