"""Intel Speed Select Technology - Base Frequency (SST-BF): which cores are the high-priority ones.

With SST-BF enabled, some cores of a package get a higher guaranteed (base) frequency than the rest.
The kernel shows each CPU's base frequency in ``cpuN/cpufreq/base_frequency`` (kHz, intel_pstate;
Documentation/admin-guide/pm/intel-speed-select.rst, "Intel(R) SST-BF": "the base frequency of the
high priority cores" is higher, and user space tells them apart by reading this file).
A CPU is high-priority when its base frequency is above the lowest base frequency in its package; a
package whose CPUs all share one base frequency has no SST-BF split (every CPU is "normal").
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

HIGH = "high"
LOW = "low"


@dataclass(frozen=True)
class SstBf:
    enabled: bool  # some package has a high-priority subset
    priority: dict[int, str]  # cpu -> "high" | "low" (only CPUs of packages with a split), else absent
    package_low_hz: dict[int, int]  # package -> lowest base frequency

    @property
    def high_priority(self) -> frozenset[int]:
        return frozenset(c for c, p in self.priority.items() if p == HIGH)


def classify(base_frequency_hz: Mapping[int, int | None], package_of: Mapping[int, int]) -> SstBf:
    """Split CPUs into SST-BF classes per package. CPUs without a base frequency are left out."""
    by_pkg: dict[int, dict[int, int]] = {}
    for cpu, hz in base_frequency_hz.items():
        if hz:
            by_pkg.setdefault(package_of.get(cpu, 0), {})[cpu] = hz
    priority: dict[int, str] = {}
    low: dict[int, int] = {}
    for pkg, freqs in by_pkg.items():
        lo = min(freqs.values())
        low[pkg] = lo
        if max(freqs.values()) == lo:
            continue
        for cpu, hz in freqs.items():
            priority[cpu] = HIGH if hz > lo else LOW
    return SstBf(bool(priority), priority, low)


def classify_cpus(cpus: Iterable) -> SstBf:
    """:func:`classify` over topology ``Cpu`` records (their ``base_frequency_hz`` and ``package``)."""
    cpus = list(cpus)
    return classify({c.id: c.base_frequency_hz for c in cpus}, {c.id: c.package for c in cpus})
