"""One private containerd 1.7 with NRI for the session (fetched once into a cache: containerd17.py), and
per-test kubelets whose pods are always removed, so that tests on this 2-CPU machine never see each other's
allocations."""

from __future__ import annotations

import pytest

from ..cri import CriClient, Kubelet
from .containerd17 import FetchError
from .harness import start_containerd17


@pytest.fixture(scope="session")
def containerd17():
    try:
        c = start_containerd17()
    except FetchError as e:
        pytest.skip(f"containerd 1.7 not available: {e}")
    yield c
    problems = c.cleanup()
    assert not problems, problems


@pytest.fixture
def kubelet(containerd17, tmp_path):
    k = Kubelet(CriClient(containerd17.socket), containerd17.cgroup_parent, tmp_path / "pod-logs")
    yield k
    k.cleanup()
    left = k.remove_all_pods()
    k.c.close()
    assert not left, f"sandboxes that could not be removed: {left}"
