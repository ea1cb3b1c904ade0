"""CPU priority from Intel Speed Select: SST-BF base frequencies and SST-PP levels.

- SST-BF: ``<sysfs>/devices/system/cpu/cpuN/cpufreq/base_frequency`` (kHz; intel_pstate,
  Documentation/admin-guide/pm/intel-speed-select.rst). Read fresh every run, because a change of
  SST-PP level changes the base frequencies. High-priority CPUs: :mod:`cri_resmgr.topology.sst`.
- SST-PP: through the isst interface device (:mod:`cri_resmgr.collectors.isst`) when it exists;
  otherwise the level is reported as ``unknown`` with the reason.

Without cpufreq (VMs, kernels without intel_pstate) the collector is down with that reason; the agent
goes on.
"""

from __future__ import annotations

from pathlib import Path

from .. import metrics as M
from ..config import SstCollectorConfig
from ..store import Sample
from ..sysfs import read_int
from ..topology import Topology
from ..topology.sst import HIGH, classify
from .base import Collector, Probe
from .isst import SstPp, read_sst_pp


class SstCollector(Collector):
    name = "sst"

    def __init__(self, sysfs_root: Path, cfg: SstCollectorConfig | None = None, topology: Topology | None = None):
        self.sysfs_root = Path(sysfs_root)
        self.cfg = cfg or SstCollectorConfig()
        self.topology = topology or Topology()
        self.last_pp: SstPp | None = None
        self.high_priority: frozenset[int] = frozenset()
        self.last_freq_cpus = 0

    def _cpu_dir(self) -> Path:
        return self.sysfs_root / "devices/system/cpu"

    def base_frequencies_hz(self) -> dict[int, int]:
        out = {}
        for cpu in sorted(self.topology.cpus):
            khz = read_int(self._cpu_dir() / f"cpu{cpu}/cpufreq/base_frequency")
            if khz:
                out[cpu] = khz * 1000
        return out

    def probe(self) -> Probe:
        if not self.topology.cpus:
            return Probe(False, f"no CPUs discovered under {self._cpu_dir()}")
        has_freq = any((self._cpu_dir() / f"cpu{c}/cpufreq/base_frequency").exists() for c in self.topology.cpus)
        has_isst = Path(self.cfg.isst_device).exists()
        if not has_freq and not has_isst:
            return Probe(False, f"no cpufreq base_frequency under {self._cpu_dir()}/cpu*/cpufreq and no "
                                f"{self.cfg.isst_device}: SST-BF and SST-PP unknown on this machine")
        parts = []
        if not has_freq:
            parts.append("no cpufreq base_frequency: SST-BF unknown")
        if self.last_pp is not None and self.last_pp.status != "ok":
            parts.append(f"SST-PP unknown: {self.last_pp.reason}")
        return Probe(True, "; ".join(parts) or "ok")

    def status(self) -> str | None:
        parts = []
        if self.last_freq_cpus == 0:
            parts.append("no cpufreq base_frequency: SST-BF unknown")
        else:
            parts.append(f"SST-BF {'enabled' if self.high_priority else 'not enabled'}: "
                         f"{len(self.high_priority)} high-priority CPUs of {self.last_freq_cpus}")
        if self.last_pp is not None:
            parts.append("SST-PP " + ("levels: " + ", ".join(
                f"package {lv.package} level {lv.current_level}/{lv.max_level}" for lv in self.last_pp.levels)
                if self.last_pp.status == "ok" else f"unknown: {self.last_pp.reason}"))
        return "; ".join(parts)

    def collect(self, now: float) -> list[Sample]:
        samples: list[Sample] = []
        freqs = self.base_frequencies_hz()
        self.last_freq_cpus = len(freqs)
        packages = {c.id: c.package for c in self.topology.cpus.values()}
        if freqs:
            bf = classify(freqs, packages)
            self.high_priority = bf.high_priority
            for cpu, hz in freqs.items():
                lab = self.topology.cpu_labels(cpu)
                samples.append(Sample(M.CPU_BASE_FREQUENCY.name, lab, float(hz)))
                samples.append(Sample(M.CPU_SST_BF_HIGH_PRIORITY.name, lab,
                                      1.0 if bf.priority.get(cpu) == HIGH else 0.0))
            samples.append(Sample(M.NODE_SST_BF_ENABLED.name, {}, 1.0 if bf.enabled else 0.0))
        first_cpu: dict[int, int] = {}
        for cpu, pkg in sorted(packages.items()):
            first_cpu.setdefault(pkg, cpu)
        pp = read_sst_pp(self.cfg.isst_device, first_cpu)
        self.last_pp = pp
        if pp.status == "ok":
            for lv in pp.levels:
                lab = {"package": str(lv.package)}
                samples.append(Sample(M.NODE_SST_PP_LEVEL.name, lab, float(lv.current_level)))
                samples.append(Sample(M.NODE_SST_PP_MAX_LEVEL.name, lab, float(lv.max_level)))
                status = "locked" if lv.locked else ("enabled" if lv.enabled else "disabled")
                samples.append(Sample(M.NODE_SST_PP_STATUS.name, {**lab, "status": status}, 1.0))
        else:
            for pkg in sorted(first_cpu):
                samples.append(Sample(M.NODE_SST_PP_STATUS.name, {"package": str(pkg), "status": "unknown"}, 1.0))
        return samples
