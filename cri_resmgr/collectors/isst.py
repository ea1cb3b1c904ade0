"""Read SST-PP (performance profile) levels through the Intel Speed Select interface device.

The device (``/dev/isst_interface``, drivers/platform/x86/intel/speed_select_if/) speaks ioctls whose
structures are the kernel's userspace ABI in ``include/uapi/linux/isst_if.h``:

- ``ISST_IF_GET_PLATFORM_INFO`` (_IOR 0xFE, 0) → ``struct isst_if_platform_info``
  ``{u16 api_version, driver_version, max_cmds_per_ioctl; u8 mbox_supported, mmio_supported}``.
  API version 1 is the mailbox interface (Cascade Lake .. Sapphire Rapids); 2 and later are TPMI
  (Granite Rapids+), as the kernel's own tool picks (tools/power/x86/intel-speed-select/isst-core.c).
- Mailbox (``ISST_IF_MBOX_COMMAND``, _IOWR 0xFE, 3, ``struct isst_if_mbox_cmds``): command CONFIG_TDP
  (0x7F), sub-command GET_LEVELS_INFO (0x00) answers ``version = resp[7:0]``, ``max level = resp[15:8]``,
  ``current level = resp[23:16]``, ``locked = resp[24]``, ``enabled = resp[31]`` (isst-core-mbox.c).
- TPMI (``ISST_IF_PERF_LEVELS``, _IOWR 0xFE, 9, ``struct isst_perf_level_info``, per socket and power
  domain): ``max_level``, ``level_mask``, ``current_level``, ``feature_state`` (bit 0: SST-BF on),
  ``locked``, ``enabled``, ``sst_bf_support``.

The ioctl numbers encode ``sizeof(struct ... *)`` (8 on 64-bit), because the header passes pointer types.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
from dataclasses import dataclass
from pathlib import Path

ISST_IF_MAGIC = 0xFE
_IOC_WRITE, _IOC_READ = 1, 2


def _ioc(direction: int, nr: int, size: int = 8) -> int:
    return (direction << 30) | (size << 16) | (ISST_IF_MAGIC << 8) | nr


ISST_IF_GET_PLATFORM_INFO = _ioc(_IOC_READ, 0)
ISST_IF_MBOX_COMMAND = _ioc(_IOC_READ | _IOC_WRITE, 3)
ISST_IF_PERF_LEVELS = _ioc(_IOC_READ | _IOC_WRITE, 9)

CONFIG_TDP = 0x7F
CONFIG_TDP_GET_LEVELS_INFO = 0x00


class IsstPlatformInfo(ctypes.Structure):
    _fields_ = [("api_version", ctypes.c_uint16), ("driver_version", ctypes.c_uint16),
                ("max_cmds_per_ioctl", ctypes.c_uint16), ("mbox_supported", ctypes.c_uint8),
                ("mmio_supported", ctypes.c_uint8)]


class IsstMboxCmd(ctypes.Structure):
    _fields_ = [("logical_cpu", ctypes.c_uint32), ("parameter", ctypes.c_uint32), ("req_data", ctypes.c_uint32),
                ("resp_data", ctypes.c_uint32), ("command", ctypes.c_uint16), ("sub_command", ctypes.c_uint16),
                ("reserved", ctypes.c_uint32)]


class IsstMboxCmds(ctypes.Structure):
    _fields_ = [("cmd_count", ctypes.c_uint32), ("mbox_cmd", IsstMboxCmd * 1)]


class IsstPerfLevelInfo(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint8) for n in (
        "socket_id", "power_domain_id", "max_level", "feature_rev", "level_mask", "current_level",
        "feature_state", "locked", "enabled", "sst_tf_support", "sst_bf_support")]


@dataclass(frozen=True)
class PerfLevels:
    package: int
    current_level: int
    max_level: int
    enabled: bool
    locked: bool
    sst_bf_enabled: bool | None = None  # known from TPMI only


@dataclass(frozen=True)
class SstPp:
    status: str  # "ok" or "unknown"
    reason: str
    levels: tuple[PerfLevels, ...] = ()


def decode_levels_info(resp: int, package: int) -> PerfLevels:
    """Decode the CONFIG_TDP GET_LEVELS_INFO mailbox response (see the module docstring)."""
    return PerfLevels(package=package, current_level=(resp >> 16) & 0xFF, max_level=(resp >> 8) & 0xFF,
                      enabled=bool(resp & (1 << 31)), locked=bool(resp & (1 << 24)))


def decode_perf_level_info(info: IsstPerfLevelInfo, package: int) -> PerfLevels:
    return PerfLevels(package=package, current_level=info.current_level, max_level=info.max_level,
                      enabled=bool(info.enabled), locked=bool(info.locked),
                      sst_bf_enabled=bool(info.feature_state & 1))


def read_sst_pp(device: Path, first_cpu_of_package: dict[int, int]) -> SstPp:
    """Query SST-PP levels per package; any failure gives ``status="unknown"`` with the reason."""
    device = Path(device)
    if not device.exists():
        return SstPp("unknown", f"{device} does not exist (isst_if drivers not loaded, or not an SST-capable Xeon)")
    try:
        fd = os.open(device, os.O_RDWR | os.O_CLOEXEC)
    except OSError as e:
        return SstPp("unknown", f"cannot open {device}: {e.strerror}")
    try:
        info = IsstPlatformInfo()
        try:
            fcntl.ioctl(fd, ISST_IF_GET_PLATFORM_INFO, info, True)
        except OSError as e:
            return SstPp("unknown", f"ISST_IF_GET_PLATFORM_INFO on {device} failed: "
                                    f"{errno.errorcode.get(e.errno or 0, e.errno)} ({e.strerror})")
        levels = []
        req: ctypes.Structure
        for pkg, cpu in sorted(first_cpu_of_package.items()):
            if info.api_version >= 2:
                q = IsstPerfLevelInfo(socket_id=pkg, power_domain_id=0)
                req, decode = q, lambda q=q, pkg=pkg: decode_perf_level_info(q, pkg)
                cmd = ISST_IF_PERF_LEVELS
            else:
                if not info.mbox_supported:
                    return SstPp("unknown", f"isst API v{info.api_version} without mailbox support")
                mbox = IsstMboxCmds(cmd_count=1)
                mbox.mbox_cmd[0] = IsstMboxCmd(logical_cpu=cpu, command=CONFIG_TDP,
                                               sub_command=CONFIG_TDP_GET_LEVELS_INFO)
                req, decode = mbox, lambda m=mbox, pkg=pkg: decode_levels_info(m.mbox_cmd[0].resp_data, pkg)
                cmd = ISST_IF_MBOX_COMMAND
            try:
                fcntl.ioctl(fd, cmd, req, True)
            except OSError as e:
                return SstPp("unknown", f"SST-PP query for package {pkg} failed: "
                                        f"{errno.errorcode.get(e.errno or 0, e.errno)} ({e.strerror})")
            levels.append(decode())
        return SstPp("ok", f"isst API v{info.api_version}", tuple(levels))
    finally:
        os.close(fd)
