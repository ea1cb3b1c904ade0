"""One typed configuration model for the agent.

Sources, lowest precedence first:

1. the model's defaults (the agent runs on these alone);
2. the YAML file given with ``--config``;
3. ``node_overrides[<node name>]`` from that file, where the node name comes from
   ``node_name``, else ``NODE_NAME``, else the hostname;
4. environment variables ``CRI_RESMGR_<KEY>``, nested keys joined by ``__``
   (``CRI_RESMGR_PATHS__SYSFS=/tmp/sys``); values are parsed as YAML scalars;
5. command-line flags (``--listen``, ``--state-dir``, ...).

Every error is reported as ``<key.path>: <problem>`` so that a user can find the
offending line; :class:`ConfigError` carries the list.
"""

from __future__ import annotations

import copy
import os
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

ENV_PREFIX = "CRI_RESMGR_"


class ConfigError(Exception):
    """A configuration that cannot be used; ``problems`` are ``key.path: message`` lines."""

    def __init__(self, problems: list[str], source: str = "config"):
        self.problems = problems
        self.source = source
        super().__init__(f"{source}: " + "; ".join(problems))

    def render(self) -> str:
        lines = [f"invalid configuration ({self.source}):"]
        lines += [f"  {p}" for p in self.problems]
        return "\n".join(lines)


class _Strict(BaseModel):
    # Unknown keys are errors, not silently ignored: a typo must not fall back to a default.
    model_config = ConfigDict(extra="forbid", validate_default=True)


class Paths(_Strict):
    """Filesystem roots. Every file the agent reads lives under one of these."""

    sysfs: Path = Path("/sys")
    cgroup: Path = Path("/sys/fs/cgroup")
    proc: Path = Path("/proc")
    resctrl: Path = Path("/sys/fs/resctrl")


class StoreConfig(_Strict):
    retention_seconds: float = Field(3600.0, gt=0, description="how much history each series keeps")
    resolution_seconds: float = Field(
        1.0, gt=0, description="finest expected sample interval; sizes the ring buffers"
    )
    checkpoint: bool = Field(True, description="write the store to state_dir and restore it at start")
    checkpoint_interval_seconds: float = Field(60.0, gt=0)
    max_series: int = Field(200_000, gt=0, description="series beyond this are dropped and counted")


class ExtraCgroup(_Strict):
    """A cgroup outside the Kubernetes hierarchy to watch as if it were a container."""

    name: str = Field(min_length=1)
    path: str = Field(min_length=1, description="path relative to the cgroup root, e.g. 'demo/busy'")
    namespace: str = "default"
    pod: str = ""


class CgroupCollectorConfig(_Strict):
    enabled: bool = True
    interval_seconds: float = Field(5.0, gt=0)
    extra_cgroups: list[ExtraCgroup] = Field(default_factory=list)


class CpuCollectorConfig(_Strict):
    enabled: bool = True
    interval_seconds: float = Field(2.0, gt=0)


class Collectors(_Strict):
    cgroup: CgroupCollectorConfig = Field(default_factory=CgroupCollectorConfig)
    cpu: CpuCollectorConfig = Field(default_factory=CpuCollectorConfig)


class ApiConfig(_Strict):
    token: str | None = Field(
        None, description="bearer token required by mutating endpoints; none means they are disabled"
    )


class Config(_Strict):
    listen: str = Field("127.0.0.1:8891", description="HOST:PORT of the HTTP server")
    node_name: str | None = Field(None, description="defaults to $NODE_NAME, then the hostname")
    run_dir: Path = Path("/var/run/cri-resmgr")
    state_dir: Path = Path("/var/lib/cri-resmgr")
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    paths: Paths = Field(default_factory=Paths)
    store: StoreConfig = Field(default_factory=StoreConfig)
    collectors: Collectors = Field(default_factory=Collectors)
    api: ApiConfig = Field(default_factory=ApiConfig)

    @field_validator("listen")
    @classmethod
    def _check_listen(cls, v: str) -> str:
        parse_listen(v)
        return v

    def listen_address(self) -> tuple[str, int]:
        return parse_listen(self.listen)


def parse_listen(v: str) -> tuple[str, int]:
    """Split ``HOST:PORT`` (``[::1]:8891`` for IPv6) and check the port range."""
    host, sep, port = v.rpartition(":")
    if not sep or not host:
        raise ValueError(f"expected HOST:PORT, got {v!r}")
    host = host.strip("[]")
    try:
        port_n = int(port)
    except ValueError:
        raise ValueError(f"port {port!r} is not a number") from None
    if not 0 <= port_n <= 65535:
        raise ValueError(f"port {port_n} is outside 0..65535")
    return host, port_n


def default_node_name(env: Mapping[str, str]) -> str:
    return env.get("NODE_NAME") or socket.gethostname()


def _deep_merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), dict):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def _format_errors(err: ValidationError, prefix: str = "") -> list[str]:
    problems = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "<root>"
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown key"
        elif "input" in e and not isinstance(e["input"], (dict, list)):
            msg = f"{msg} (got {e['input']!r})"
        problems.append(f"{prefix}{loc}: {msg}")
    return problems


def env_overrides(env: Mapping[str, str]) -> dict[str, Any]:
    """``CRI_RESMGR_A__B=v`` becomes ``{"a": {"b": v}}``; values are YAML scalars."""
    out: dict[str, Any] = {}
    for name, raw in env.items():
        if not name.startswith(ENV_PREFIX):
            continue
        keys = [k.lower() for k in name[len(ENV_PREFIX):].split("__") if k]
        if not keys:
            continue
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:
            value = raw
        if isinstance(value, (dict, list)):
            value = raw  # a structure in an env var is more likely a string with a colon
        node = out
        for k in keys[:-1]:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise ConfigError([f"{'.'.join(keys)}: conflicts with {name}"], source="environment")
        node[keys[-1]] = value
    return out


def read_config_file(path: Path) -> dict[str, Any]:
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ConfigError([f"cannot read: {e.strerror}"], source=str(path)) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        raise ConfigError([f"{where}not valid YAML: {getattr(e, 'problem', e)}"], source=str(path)) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError([f"<root>: expected a mapping of keys, got {type(data).__name__}"], source=str(path))
    return data


def build_config(
    file_data: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    flags: Mapping[str, Any] | None = None,
    source: str = "config",
) -> Config:
    """Merge all sources and validate. Raises :class:`ConfigError`."""
    env = os.environ if env is None else env
    data = dict(file_data or {})
    overrides = data.pop("node_overrides", None) or {}
    if not isinstance(overrides, Mapping):
        raise ConfigError(["node_overrides: expected a mapping of node name to options"], source=source)

    try:
        base = Config.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_errors(e), source=source) from None

    # Check every node's overrides, not just this node's: a broken entry for another node
    # would otherwise only surface when the DaemonSet lands there.
    problems: list[str] = []
    for node, over in overrides.items():
        if not isinstance(over, Mapping):
            problems.append(f"node_overrides.{node}: expected a mapping of options")
            continue
        if "node_overrides" in over:
            problems.append(f"node_overrides.{node}.node_overrides: cannot be nested")
            continue
        try:
            Config.model_validate(_deep_merge(data, over))
        except ValidationError as e:
            problems += _format_errors(e, prefix=f"node_overrides.{node}.")
    if problems:
        raise ConfigError(problems, source=source)

    node_name = base.node_name or default_node_name(env)
    merged = dict(data)
    if node_name in overrides:
        merged = _deep_merge(merged, overrides[node_name])
    try:
        merged = _deep_merge(merged, env_overrides(env))
        Config.model_validate(merged)
    except ValidationError as e:
        raise ConfigError(_format_errors(e), source="environment") from None
    merged = _deep_merge(merged, {k: v for k, v in (flags or {}).items() if v is not None})
    try:
        cfg = Config.model_validate(merged)
    except ValidationError as e:
        raise ConfigError(_format_errors(e), source="command line") from None
    return cfg.model_copy(update={"node_name": cfg.node_name or node_name})


def load_config(
    path: Path | None,
    env: Mapping[str, str] | None = None,
    flags: Mapping[str, Any] | None = None,
) -> Config:
    file_data = read_config_file(path) if path else {}
    return build_config(file_data, env=env, flags=flags, source=str(path) if path else "config")
