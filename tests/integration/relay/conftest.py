"""A private containerd for the whole session (see tests/integration/containerd.py), and per-test kubelets
whose pods are always removed, so that tests on this 2-CPU machine never see each other's allocations."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from ..containerd import Containerd, missing_prerequisites
from ..cri import CriClient, Kubelet


@pytest.fixture(scope="session")
def containerd():
    reason = missing_prerequisites()
    if reason:
        pytest.skip(reason)
    base = Path(tempfile.mkdtemp(prefix="crirm-containerd-"))
    c = Containerd(base).up()
    yield c
    problems = c.cleanup()
    assert not problems, problems


@pytest.fixture
def kubelets(containerd, tmp_path):
    """``make(socket)`` gives a Kubelet talking to ``socket``; everything they created is removed after the test."""
    made: list[Kubelet] = []

    def make(socket: Path) -> Kubelet:
        k = Kubelet(CriClient(socket), containerd.cgroup_parent, tmp_path / "pod-logs")
        made.append(k)
        return k

    yield make
    direct = Kubelet(CriClient(containerd.socket), containerd.cgroup_parent, tmp_path / "pod-logs")
    for k in made:
        direct.pods.extend(k.pods)
        k.c.close()
    direct.cleanup()
    # Every test starts from a runtime without pods: a relay started by the next test resyncs its cache
    # from the runtime, so a leftover sandbox here would show up in that test's allocations.
    left = direct.remove_all_pods()
    direct.c.close()
    assert not left, f"sandboxes that could not be removed: {left}"
