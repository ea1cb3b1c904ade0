"""An in-process agent on fixture trees (sysfs from topology/fixtures.py, a cgroup v2 tree and /proc/stat in
the kernel's formats), fed deterministically: collectors run only when a test calls :meth:`FixtureNode.feed`.
Used by the heatmap API tests, the browser test and the heatmap benchmark's checks."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from cri_resmgr.agent import Agent
from cri_resmgr.config import Collectors, build_config
from cri_resmgr.topology.fixtures import MACHINES, build_sysfs

from .cgroupfs import Values, make_v2


@dataclass(frozen=True)
class FixtureContainer:
    rel: str  # cgroup path relative to the root
    cpus: str
    name: str = ""  # set for extra_cgroups (named in config); "" for kubepods paths (name from the path)
    namespace: str = "default"
    pod: str = ""
    usage_ns: int = 5_000_000_000


def kubepods(uid_digit: str, cid_char: str, cpus: str, qos: str = "burstable") -> FixtureContainer:
    uid = f"{uid_digit * 8}-aaaa-bbbb-cccc-0123456789ab"
    prefix = f"kubepods/{qos}" if qos != "guaranteed" else "kubepods"
    return FixtureContainer(f"{prefix}/pod{uid}/{cid_char * 64}", cpus)


@dataclass
class FixtureNode:
    tmp: Path
    machine: str = "xeon-2s-112c-snc2"
    containers: list[FixtureContainer] = field(default_factory=list)
    agent: Agent | None = None
    api: dict = field(default_factory=dict)  # the config's api section (tokens)
    _busy: dict[int, int] = field(default_factory=dict)
    _idle: dict[int, int] = field(default_factory=dict)

    def start(self) -> FixtureNode:
        spec = MACHINES[self.machine]
        sysfs = build_sysfs(spec, self.tmp / "sys")
        self.cg = self.tmp / "cgroup"
        for c in self.containers:
            make_v2(self.cg, c.rel, Values(cpus=c.cpus, usage_ns=c.usage_ns))
        if not self.containers:
            make_v2(self.cg, "empty", Values())
        self.proc = self.tmp / "proc"
        self.proc.mkdir(exist_ok=True)
        self.cpus = sorted(set(range(spec.cpus)) - set(spec.offline))
        self._busy = {c: 1000 + c for c in self.cpus}
        self._idle = {c: 5000 for c in self.cpus}
        self._write_stat()
        extra = [{"name": c.name, "path": c.rel, "namespace": c.namespace, "pod": c.pod}
                 for c in self.containers if c.name]
        # Only the cgroup and cpu collectors run (on the fixture trees); the others would read the real host.
        others = {n: {"enabled": False} for n in Collectors.model_fields if n not in ("cgroup", "cpu")}
        cfg = build_config(
            {"state_dir": str(self.tmp / "state"), "run_dir": str(self.tmp / "run"),
             "store": {"checkpoint": False}, "api": self.api,
             "paths": {"sysfs": str(sysfs), "cgroup": str(self.cg), "proc": str(self.proc)},
             "collectors": {"cgroup": {"interval_seconds": 3600, "extra_cgroups": extra},
                            "cpu": {"interval_seconds": 3600}, **others}},
            env={"NODE_NAME": "fixture-node"})
        self.agent = Agent(cfg)
        self.agent.start()
        deadline = time.time() + 20
        while not self.agent.ready() and time.time() < deadline:
            time.sleep(0.02)
        assert self.agent.ready(), "fixture agent did not run its collectors"
        return self

    def stop(self) -> None:
        if self.agent:
            self.agent.stop()

    def _write_stat(self) -> None:
        # Documentation/filesystems/proc.rst 1.7: cpuN user nice system idle iowait irq softirq steal
        lines = [f"cpu{c} {self._busy[c]} 0 0 {self._idle[c]} 0 0 0 0\n" for c in self.cpus]
        (self.proc / "stat").write_text("".join(lines))

    def feed(self, fractions: dict[int, float], ticks: int = 100, usage_step_ns: dict[str, int] | None = None) -> float:
        """Advance every CPU's /proc/stat by ``ticks`` with busy share ``fractions[cpu]`` (default 0), advance
        the named containers' CPU usage, run both collectors once; return the time of the cpu run."""
        time.sleep(0.005)  # distinct timestamps
        for c in self.cpus:
            b = round(fractions.get(c, 0.0) * ticks)
            self._busy[c] += b
            self._idle[c] += ticks - b
        self._write_stat()
        for rel, step in (usage_step_ns or {}).items():
            f = self.cg / rel / "cpu.stat"
            text = f.read_text().splitlines()
            usec = int(text[0].split()[1]) + step // 1000
            f.write_text("\n".join([f"usage_usec {usec}", *text[1:]]) + "\n")
        t0 = time.time()
        self.agent.run_collector_once("cpu")
        self.agent.run_collector_once("cgroup")
        return t0
