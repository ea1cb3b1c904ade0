"""What a container asked for, recovered from what kubelet sends over CRI.

kubelet does not pass requests and limits as such. It converts them (pkg/kubelet/cm/helpers_linux.go,
``MilliCPUToShares`` and ``MilliCPUToQuota``; pkg/kubelet/kuberuntime/kuberuntime_container_linux.go):

- ``cpu_shares = max(2, milliCPU_request * 1024 // 1000)`` (2 is ``MinShares``: no request, or 1-2m);
- ``cpu_quota = max(1000, milliCPU_limit * cpu_period // 1000)`` with ``cpu_period`` 100000 µs, only when
  there is a limit (``MinQuotaPeriod`` is 1000 µs);
- ``memory_limit_in_bytes`` = the memory limit (0: none).

``shares = floor(m * 1.024)`` maps different m to different shares once m >= 3 (the step 1.024 exceeds
1), so ``m = ceil(shares * 1000 / 1024)`` recovers the request exactly. Rounding down instead turns
100m (102 shares) into 99m. The quota is no substitute: it is clipped at 1000 µs (10m).

The QoS class is not sent either; kubelet's cgroup layout implies it (pkg/kubelet/cm/qos_container_manager_linux.go):
``kubepods/burstable/pod<uid>``, ``kubepods/besteffort/pod<uid>``, ``kubepods/pod<uid>`` (Guaranteed), or
with the systemd driver ``kubepods-burstable-pod<uid>.slice`` etc.
"""

from __future__ import annotations

from dataclasses import dataclass

MIN_SHARES = 2
GUARANTEED, BURSTABLE, BEST_EFFORT = "Guaranteed", "Burstable", "BestEffort"


@dataclass(frozen=True)
class Resources:
    """The CPU and memory resources a runtime call carries (CRI ``LinuxContainerResources``, NRI
    ``LinuxResources``), in kubelet's terms."""

    cpu_shares: int = 0
    cpu_quota: int = 0
    cpu_period: int = 0
    memory_limit_bytes: int = 0
    cpuset_cpus: str = ""
    cpuset_mems: str = ""


@dataclass(frozen=True)
class Estimate:
    qos_class: str  # Guaranteed, Burstable, BestEffort, or "" when the parent is not a kubepods cgroup
    cpu_request_milli: int
    cpu_limit_milli: int | None  # None: no CPU limit
    memory_limit_bytes: int | None

    @property
    def whole_cpus(self) -> int:
        """CPUs for exclusive placement: a Guaranteed request of whole CPUs, else 0."""
        if self.qos_class != GUARANTEED or self.cpu_request_milli < 1000 or self.cpu_request_milli % 1000:
            return 0
        return self.cpu_request_milli // 1000


def milli_from_shares(shares: int) -> int:
    if shares <= MIN_SHARES:
        return 0
    return -(-shares * 1000 // 1024)


def milli_from_quota(quota: int, period: int) -> int | None:
    if quota <= 0 or period <= 0:
        return None
    return -(-quota * 1000 // period)


def qos_from_cgroup_parent(parent: str) -> str:
    parts = [p for p in parent.strip("/").split("/") if p]
    if not any(p == "kubepods" or p.startswith("kubepods") or "-kubepods" in p for p in parts):
        return ""
    for p in parts:
        low = p.removesuffix(".slice")
        if low == "burstable" or low.startswith("kubepods-burstable"):
            return BURSTABLE
        if low == "besteffort" or low.startswith("kubepods-besteffort"):
            return BEST_EFFORT
    return GUARANTEED


def estimate(cpu_shares: int, cpu_quota: int, cpu_period: int, memory_limit: int, cgroup_parent: str) -> Estimate:
    qos = qos_from_cgroup_parent(cgroup_parent)
    limit = milli_from_quota(cpu_quota, cpu_period)
    request = milli_from_shares(cpu_shares)
    if qos == GUARANTEED and cpu_shares <= MIN_SHARES and limit is not None:
        # requests == limits for Guaranteed: below 3m the shares say nothing, the quota still does.
        request = limit
    elif qos == BEST_EFFORT:
        request, limit = 0, None
    return Estimate(qos, request, limit, memory_limit or None)


def estimate_resources(res: Resources, cgroup_parent: str) -> Estimate:
    return estimate(res.cpu_shares, res.cpu_quota, res.cpu_period, res.memory_limit_bytes, cgroup_parent)
