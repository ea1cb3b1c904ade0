"""Block-IO classes: proportional weight and throttling per device, on cgroup v1 ``blkio`` or v2 ``io``.

v1 (Documentation/admin-guide/cgroup-v1/blkio-controller.rst):
  ``blkio.throttle.{read,write}_{bps,iops}_device`` take ``<major>:<minor> <value>``; value 0 removes the
  rule. Weight is ``blkio.bfq.weight`` (BFQ, 1-1000, default 100; per device ``blkio.bfq.weight_device``)
  or ``blkio.weight`` (CFQ, gone since 5.0); these exist only in non-root cgroups.
v2 (Documentation/admin-guide/cgroup-v2.rst, "IO"):
  ``io.max`` takes ``<major>:<minor> rbps=<n> wbps=<n> riops=<n> wiops=<n>`` ("max" lifts a limit);
  ``io.weight`` takes ``default <w>`` or ``<major>:<minor> <w>`` (1-10000, default 100).
Throttling acts on whole disks: blkcg_conf_open_bdev() refuses partitions (ENODEV), so patterns that match
partitions are reported, not silently dropped.
"""

from __future__ import annotations

import glob
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ... import metrics as M
from ...config import BlockioClass, BlockioControlConfig
from ..context import ContainerContext
from .base import ControlError, ControlType, NoCgroupYet, Plan
from .cgroups import container_hierarchy, describe, write_file

V1_THROTTLE = {"read_bps": "blkio.throttle.read_bps_device", "write_bps": "blkio.throttle.write_bps_device",
               "read_iops": "blkio.throttle.read_iops_device", "write_iops": "blkio.throttle.write_iops_device"}
V2_KEYS = {"read_bps": "rbps", "write_bps": "wbps", "read_iops": "riops", "write_iops": "wiops"}
LIMITS = tuple(V1_THROTTLE)
DEFAULT_WEIGHT = 100  # BFQ's and io.weight's default


@dataclass(frozen=True)
class DeviceLimits:
    path: str  # as the user knows it: /dev/vda
    major: int
    minor: int
    weight: int | None = None
    read_bps: int | None = None
    write_bps: int | None = None
    read_iops: int | None = None
    write_iops: int | None = None

    @property
    def dev(self) -> str:
        return f"{self.major}:{self.minor}"

    def limit(self, name: str) -> int | None:
        value: int | None = getattr(self, name)
        return value


@dataclass(frozen=True)
class ClassLimits:
    weight: int | None
    devices: tuple[DeviceLimits, ...]


def parse_device_values(text: str) -> dict[str, int]:
    """``<major>:<minor> <value>`` lines (v1 throttle and weight_device files) -> {"8:0": value}."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and ":" in parts[0]:
            try:
                out[parts[0]] = int(parts[1])
            except ValueError:
                continue
    return out


def parse_io_max(text: str) -> dict[str, dict[str, str]]:
    """v2 ``io.max``: ``8:16 rbps=2097152 wbps=max riops=max wiops=120`` -> {"8:16": {"rbps": "2097152", ...}}."""
    out: dict[str, dict[str, str]] = {}
    for line in text.splitlines():
        dev, *fields = line.split()
        if ":" in dev:
            out[dev] = dict(f.split("=", 1) for f in fields if "=" in f)
    return out


def io_max_line(d: DeviceLimits | None, dev: str) -> str:
    vals = {k2: (str(d.limit(k)) if d is not None and d.limit(k) else "max") for k, k2 in V2_KEYS.items()}
    return f"{dev} " + " ".join(f"{k}={v}" for k, v in vals.items())


class BlockioController(ControlType[BlockioControlConfig]):
    name = "blockio"
    class_metric = M.CONTAINER_BLOCKIO_CLASS

    def __init__(self, cgroup_root: Path, dev_root: Path = Path("/dev"), sysfs: Path = Path("/sys")):
        self.cgroup_root = Path(cgroup_root)
        self.dev_root = Path(dev_root)
        self.sysfs = Path(sysfs)

    # -- prepare: resolve device patterns -----------------------------------------------------------
    def resolve_pattern(self, pattern: str) -> tuple[list[tuple[str, int, int]], list[str]]:
        """Block devices a pattern names: ([(path, major, minor)], [partitions skipped]). The pattern is in
        /dev terms (``/dev/vd*``) and is looked up under ``paths.dev``."""
        rel = pattern[len("/dev/"):] if pattern.startswith("/dev/") else pattern.lstrip("/")
        found: list[tuple[str, int, int]] = []
        partitions: list[str] = []
        for p in sorted(glob.glob(str(self.dev_root / rel))):
            try:
                st = os.stat(p)
            except OSError:
                continue
            if not stat.S_ISBLK(st.st_mode):
                continue
            major, minor = os.major(st.st_rdev), os.minor(st.st_rdev)
            shown = "/dev/" + os.path.relpath(p, self.dev_root)
            # sysfs-block(5): /sys/dev/block/<maj>:<min>/partition exists only for partitions.
            if (self.sysfs / "dev" / "block" / f"{major}:{minor}" / "partition").exists():
                partitions.append(shown)
                continue
            found.append((shown, major, minor))
        return found, partitions

    def _class_limits(self, name: str, c: BlockioClass, problems: list[str]) -> ClassLimits:
        devices: dict[str, DeviceLimits] = {}
        for i, rule in enumerate(c.devices):
            found, partitions = self.resolve_pattern(rule.devices)
            if not found:
                why = (f"matches only partitions ({', '.join(partitions)}); limits apply to whole disks"
                       if partitions else f"matches no block device under {self.dev_root}")
                problems.append(f"{self.key('classes', name, 'devices', i, 'devices')}: {rule.devices!r} {why}")
                continue
            for path, major, minor in found:
                prev = devices.get(f"{major}:{minor}")
                vals = {k: getattr(rule, k) for k in ("weight", *LIMITS)}
                if prev is not None:  # later rules refine earlier ones for the same device
                    vals = {k: v if v is not None else getattr(prev, k) for k, v in vals.items()}
                devices[f"{major}:{minor}"] = DeviceLimits(path, major, minor, **vals)
        return ClassLimits(c.weight, tuple(devices.values()))

    def prepare(self, section: BlockioControlConfig) -> Plan[BlockioControlConfig] | list[str]:
        problems: list[str] = []
        limits = {name: self._class_limits(name, c, problems) for name, c in section.classes.items()}
        if problems:
            return problems
        return Plan(section, tuple(section.classes), limits)

    # -- enforce ------------------------------------------------------------------------------------
    def enforce(self, ctx: ContainerContext, cls: str, plan: Plan[BlockioControlConfig]) -> dict[str, Any]:
        h = container_hierarchy(self.cgroup_root, "blkio", ctx.cgroup_path) or \
            container_hierarchy(self.cgroup_root, "io", ctx.cgroup_path)
        if h is None:
            raise NoCgroupYet(f"no blkio (v1) or io (v2) cgroup for {ctx.cgroup_path or 'the container'} "
                               f"under {self.cgroup_root}")
        want: ClassLimits = plan.details[cls]
        d = h.dir_of(ctx.cgroup_path)
        errors = self._apply_v1(d, want) if h.version == 1 else self._apply_v2(d, want)
        if errors:
            raise ControlError("; ".join(errors))
        return {"cgroup": str(d), "version": h.version, "devices": [x.path for x in want.devices]}

    def _apply_v1(self, d: Path, want: ClassLimits) -> list[str]:
        errors: list[str] = []

        def put(name: str, text: str) -> None:
            try:
                write_file(d / name, text)
            except OSError as e:
                errors.append(f"write {text.strip()!r} to {name}: {describe(e)}")

        for limit, fname in V1_THROTTLE.items():
            try:
                current = parse_device_values((d / fname).read_text())
            except OSError as e:
                errors.append(f"read {fname}: {describe(e)}")
                continue
            desired = {x.dev: v for x in want.devices if (v := x.limit(limit))}
            for dev in current.keys() - desired.keys():
                put(fname, f"{dev} 0")  # blkio-controller.rst: a value of 0 removes the rule
            for dev, v in desired.items():
                if current.get(dev) != v:
                    put(fname, f"{dev} {v}")
        weight_file = next((n for n in ("blkio.bfq.weight", "blkio.weight") if (d / n).exists()), None)
        if weight_file is None:
            if want.weight is not None or any(x.weight for x in want.devices):
                errors.append("no proportional weight here (neither blkio.bfq.weight nor blkio.weight: "
                              "BFQ not loaded and CFQ gone)")
            return errors
        put(weight_file, f"{want.weight or DEFAULT_WEIGHT}")
        dev_file = f"{weight_file}_device"
        if (d / dev_file).exists():
            try:
                current = parse_device_values((d / dev_file).read_text())
            except OSError:
                current = {}
            desired = {x.dev: x.weight for x in want.devices if x.weight}
            for dev in current.keys() - desired.keys():
                put(dev_file, f"{dev} 0")
            for dev, w in desired.items():
                put(dev_file, f"{dev} {w}")
        return errors

    def _apply_v2(self, d: Path, want: ClassLimits) -> list[str]:
        errors: list[str] = []

        def put(name: str, text: str) -> None:
            try:
                write_file(d / name, text)
            except OSError as e:
                errors.append(f"write {text.strip()!r} to {name}: {describe(e)}")

        if (d / "io.max").exists():
            current = parse_io_max((d / "io.max").read_text())
            desired = {x.dev: x for x in want.devices if any(x.limit(k) for k in LIMITS)}
            for dev in current.keys() - desired.keys():
                put("io.max", io_max_line(None, dev))
            for dev, x in desired.items():
                put("io.max", io_max_line(x, dev))
        elif any(x.limit(k) for x in want.devices for k in LIMITS):
            errors.append("io.max is missing (io controller not enabled for this cgroup)")
        weight_file = next((n for n in ("io.weight", "io.bfq.weight") if (d / n).exists()), None)
        if weight_file is not None:
            put(weight_file, f"default {want.weight or DEFAULT_WEIGHT}")
            for x in want.devices:
                if x.weight:
                    put(weight_file, f"{x.dev} {x.weight}")
        elif want.weight is not None:
            errors.append("io.weight is missing (no io weight support for this cgroup)")
        return errors
