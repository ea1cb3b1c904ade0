"""A configuration reload reaches every collector through one call, ``Collector.reconfigure(section)``: the base
class takes the section as it is, collectors with bound state (the cgroup collector's runtime client, perf's open
descriptors) override it. Agent.reload no longer knows collector classes."""

from __future__ import annotations

from pathlib import Path

import yaml

from cri_resmgr.agent import Agent
from cri_resmgr.collectors.base import Collector
from cri_resmgr.collectors.names import RuntimeNames
from cri_resmgr.config import Collectors, load_config
from cri_resmgr.topology.fixtures import MACHINES, build_sysfs

from .cgroupfs import Values, make_v2


def _config(tmp: Path, sysfs: Path, **collectors: dict) -> dict:
    off = {n: {"enabled": False} for n in Collectors.model_fields if n not in ("cgroup", "cpu")}
    return {"state_dir": str(tmp / "state"), "run_dir": str(tmp / "run"), "store": {"checkpoint": False},
            "paths": {"sysfs": str(sysfs), "cgroup": str(tmp / "cgroup"), "proc": str(tmp / "proc")},
            "collectors": {"cgroup": {"interval_seconds": 3600, "runtime_socket": None},
                           "cpu": {"interval_seconds": 3600},
                           **{n: {**off.get(n, {}), **collectors.get(n, {})} for n in {*off, *collectors}}}}


def test_reload_hands_each_collector_its_new_section(tmp_path):
    sysfs = build_sysfs(MACHINES["small-offline-isolated"], tmp_path / "sys")
    make_v2(tmp_path / "cgroup", "empty", Values())
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc" / "stat").write_text("cpu  1 0 1 1 0 0 0 0 0 0\n")
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(_config(tmp_path, sysfs)))
    env = {"NODE_NAME": "n"}
    agent = Agent(load_config(path, env=env), path, env=env)
    agent.start()
    try:
        cg = agent.collectors["cgroup"]
        assert cg.names is None  # runtime_socket: null
        path.write_text(yaml.safe_dump(_config(
            tmp_path, sysfs, cgroup={"interval_seconds": 3600, "runtime_socket": str(tmp_path / "cri.sock"),
                                     "names_refresh_seconds": 5},
            sst={"interval_seconds": 7}, perf={"max_descriptors": 123})))
        assert agent.reload()
        assert isinstance(cg.names, RuntimeNames) and cg.names.socket_path == tmp_path / "cri.sock"
        assert cg.names.refresh_seconds == 5 and cg.cfg.names_refresh_seconds == 5
        assert agent.collectors["sst"].cfg.interval_seconds == 7  # the base class's reconfigure
        assert agent.collectors["perf"].cfg.max_descriptors == 123  # perf's own
        for name, col in agent.collectors.items():
            assert col.cfg == getattr(agent.cfg.collectors, name), name
        first = cg.names
        path.write_text(yaml.safe_dump(_config(tmp_path, sysfs, sst={"interval_seconds": 7})))
        assert agent.reload()
        assert cg.names is None and first is not None  # the client went with its socket
    finally:
        agent.stop()


def test_base_reconfigure_takes_the_section():
    c = Collector()
    section = object()
    c.reconfigure(section)
    assert c.cfg is section
