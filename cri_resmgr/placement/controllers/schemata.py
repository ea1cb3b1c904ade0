"""RDT allocation: from partitions and classes to resctrl schemata. Pure functions, no file access.

The rules are the kernel's (Documentation/arch/x86/resctrl.rst):

- a cache allocation is a capacity bitmask (CBM) within ``info/L3/cbm_mask``; its 1-bits must be contiguous
  (unless ``info/L3/sparse_masks`` is 1) and at least ``info/L3/min_cbm_bits`` many;
- memory bandwidth (MB) is a percentage rounded to ``info/MB/bandwidth_gran``, at least
  ``info/MB/min_bandwidth``; with the ``mba_MBps`` mount option it is MBps instead;
- with CDP (mount option ``cdp``) the L3 resource is split into ``L3CODE`` and ``L3DATA``;
- every control group uses a CLOSID; ``num_closids`` (the smallest over the enabled resources) bounds them,
  the root group's included.

On top, the ancestor's partitions (its issue "RDT: non-overlapping cache allocations"): a partition takes a
share of the whole cache, partitions never overlap, and the classes in a partition share its bits. Amounts:

======================= ===================================== =========================================
form                    in a partition (of the whole cache)   in a class (of its partition)
======================= ===================================== =========================================
``50%``                 the first free 50% (in config order) the lowest 50% of the partition's bits
``20-60%``              that range of the cache               that range of the partition
``0xff0``               exactly these bits                    these bits counted from the partition's first
``4-11``                bits 4 to 11 (inclusive)              likewise, relative
``2MiB`` / ``512kiB``   enough bits for that size, first free enough bits for that size, from the first
======================= ===================================== =========================================

Percentages become bits by rounding to the nearest bit (``floor(x + 0.5)``) at both ends of a range, so
consecutive partitions of 50% + 50% of an odd cache still meet exactly.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

# What this module reads of the configuration (config.RdtControlConfig and its parts), as read-only protocols:
# config.py validates with these functions, so importing it here would make a cycle.
RdtAmount = str | Mapping[str, str]


class RdtClassSpec(Protocol):
    @property
    def l3(self) -> RdtAmount | None: ...
    @property
    def l3_code(self) -> RdtAmount | None: ...
    @property
    def l3_data(self) -> RdtAmount | None: ...
    @property
    def mb(self) -> RdtAmount | None: ...
    @property
    def required(self) -> Sequence[str]: ...


class RdtPartitionSpec(Protocol):
    @property
    def l3(self) -> RdtAmount: ...
    @property
    def classes(self) -> Mapping[str, RdtClassSpec]: ...


class RdtControlConfig(Protocol):
    @property
    def l3(self) -> str: ...
    @property
    def mb(self) -> str: ...
    @property
    def cdp(self) -> str: ...
    @property
    def partitions(self) -> Mapping[str, RdtPartitionSpec]: ...

ROOT_CLASS = "system/default"  # the root resctrl group (the ancestor's name for it)
MBPS_MAX = 2**32 - 1  # resctrl.rst: with mba_MBps the default MB value is "unlimited", U32_MAX


@dataclass(frozen=True)
class Share:
    percent: float


@dataclass(frozen=True)
class PercentRange:
    lo: float
    hi: float


@dataclass(frozen=True)
class BitRange:
    lo: int
    hi: int  # inclusive


@dataclass(frozen=True)
class Size:
    bytes: int


L3Amount = Share | PercentRange | BitRange | Size

_UNITS = {"kib": 1024, "kb": 1024, "mib": 1024**2, "mb": 1024**2, "gib": 1024**3}


def _num(text: str) -> float:
    v = float(text)
    if not math.isfinite(v):
        raise ValueError(f"{text!r} is not a number")
    return v


def parse_l3_amount(text: str) -> L3Amount:
    """``50%``, ``20-60%``, ``0xf0``, ``4-7``, ``2MiB``, ``512kiB`` -> an amount; ValueError says what is wrong."""
    t = text.strip()
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*-\s*(\d+(?:\.\d+)?)\s*%", t)
    if m:
        lo, hi = _num(m[1]), _num(m[2])
        if not 0 <= lo < hi <= 100:
            raise ValueError(f"{text!r}: a percent range needs 0 <= low < high <= 100")
        return PercentRange(lo, hi)
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*%", t)
    if m:
        p = _num(m[1])
        if not 0 < p <= 100:
            raise ValueError(f"{text!r}: over 100% or not positive")
        return Share(p)
    m = re.fullmatch(r"0[xX]([0-9a-fA-F]+)", t)
    if m:
        mask = int(m[1], 16)
        if mask == 0:
            raise ValueError(f"{text!r}: an empty bitmask")
        lo = (mask & -mask).bit_length() - 1
        hi = mask.bit_length() - 1
        if mask != ((1 << (hi - lo + 1)) - 1) << lo:
            raise ValueError(f"{text!r}: the mask's 1-bits are not contiguous (resctrl.rst: CBMs must be)")
        return BitRange(lo, hi)
    m = re.fullmatch(r"(\d+)\s*-\s*(\d+)", t)
    if m:
        lo_i, hi_i = int(m[1]), int(m[2])
        if lo_i > hi_i:
            raise ValueError(f"{text!r}: a bit range needs low <= high")
        return BitRange(lo_i, hi_i)
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kKmMgG]i?[bB])", t)
    if m:
        n = int(_num(m[1]) * _UNITS[m[2].lower()])
        if n <= 0:
            raise ValueError(f"{text!r}: a size must be positive")
        return Size(n)
    raise ValueError(f"{text!r}: expected 50%, 20-60%, 0xf0, 4-7, 2MiB or 512kiB")


@dataclass(frozen=True)
class MbAmount:
    value: float
    mbps: bool  # False: percent


def parse_mb_amount(text: str) -> MbAmount:
    t = text.strip()
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*%", t)
    if m:
        p = _num(m[1])
        if not 0 < p <= 100:
            raise ValueError(f"{text!r}: over 100% or not positive")
        return MbAmount(p, False)
    m = re.fullmatch(r"(\d+)\s*MBps", t)
    if m:
        v = int(m[1])
        if v <= 0:
            raise ValueError(f"{text!r}: must be positive")
        return MbAmount(v, True)
    raise ValueError(f"{text!r}: expected a percentage (50%) or MBps (2000MBps)")


def per_domain(value: RdtAmount, domains: tuple[int, ...], default: str) -> dict[int, str]:
    """A str applies to every cache id; a mapping gives ids (``"0"``, ``"1"``) and ``all`` as the rest."""
    if isinstance(value, str):
        return {d: value for d in domains}
    rest = value.get("all", default)
    return {d: value.get(str(d), rest) for d in domains}


def _keys(value: RdtAmount) -> list[str]:
    return ["all"] if isinstance(value, str) else list(value)


def _texts(value: RdtAmount) -> dict[str, str]:
    return {"all": value} if isinstance(value, str) else dict(value)


def check_partitions(cfg: RdtControlConfig) -> list[str]:
    """What is wrong whatever the hardware: syntax, over 100%, overlapping ranges, duplicate class names.
    Messages name the key under ``controls.rdt``."""
    problems: list[str] = []
    seen: dict[str, str] = {}
    pct: dict[str, list[tuple[str, float, float | None]]] = {}  # domain key -> (partition, lo|size, hi)
    bits: dict[str, list[tuple[str, int, int]]] = {}
    for pname, part in cfg.partitions.items():
        for key in _keys(part.l3):
            if key != "all" and not key.isdigit():
                problems.append(f"partitions.{pname}.l3.{key}: cache ids are numbers (or 'all')")
        for key, l3text in _texts(part.l3).items():
            try:
                a = parse_l3_amount(l3text)
            except ValueError as e:
                problems.append(f"partitions.{pname}.l3: {e}")
                continue
            if isinstance(a, Share):
                pct.setdefault(key, []).append((pname, a.percent, None))
            elif isinstance(a, PercentRange):
                pct.setdefault(key, []).append((pname, a.lo, a.hi))
            elif isinstance(a, BitRange):
                bits.setdefault(key, []).append((pname, a.lo, a.hi))
        for cname, c in part.classes.items():
            if cname in seen:
                problems.append(f"partitions.{pname}.classes.{cname}: class also defined in partition {seen[cname]}")
            seen[cname] = pname
            for fname in ("l3", "l3_code", "l3_data"):
                v = getattr(c, fname)
                for key, text in (_texts(v).items() if v is not None else []):
                    try:
                        parse_l3_amount(text)
                    except ValueError as e:
                        where = "" if key == "all" else f".{key}"
                        problems.append(f"partitions.{pname}.classes.{cname}.{fname}{where}: {e}")
            if c.mb is not None:
                for key, text in _texts(c.mb).items():
                    try:
                        parse_mb_amount(text)
                    except ValueError as e:
                        where = "" if key == "all" else f".{key}"
                        problems.append(f"partitions.{pname}.classes.{cname}.mb{where}: {e}")
    for key, items in pct.items():
        total = sum((hi - lo) if hi is not None else lo for _, lo, hi in items)
        if total > 100 + 1e-9:
            names = ", ".join(n for n, _, _ in items)
            problems.append(f"partitions.*.l3{'' if key == 'all' else '.' + key}: partitions {names} take "
                            f"{total:g}% of the cache (over 100%)")
        ranges = [(n, lo, hi) for n, lo, hi in items if hi is not None]
        for i, (pa, alo, ahi) in enumerate(ranges):
            for pb, blo, bhi in ranges[i + 1:]:
                if alo < bhi and blo < ahi:
                    problems.append(f"partitions.{pb}.l3: {blo:g}-{bhi:g}% overlaps partition {pa} ({alo:g}-{ahi:g}%)")
    for bitems in bits.values():
        for i, (pa, balo, bahi) in enumerate(bitems):
            for pb, bblo, bbhi in bitems[i + 1:]:
                if balo <= bbhi and bblo <= bahi:
                    problems.append(f"partitions.{pb}.l3: bits {bblo}-{bbhi} overlap partition {pa} "
                                    f"(bits {balo}-{bahi})")
    return problems


# -- the hardware ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CacheInfo:
    """info/L3 (or info/L3CODE with CDP)."""

    cbm_bits: int  # width of cbm_mask
    min_cbm_bits: int
    num_closids: int
    domains: tuple[int, ...]
    shareable_bits: int = 0
    cache_bytes: int | None = None  # for kiB/MiB amounts

    @property
    def bytes_per_bit(self) -> float | None:
        return self.cache_bytes / self.cbm_bits if self.cache_bytes else None


@dataclass(frozen=True)
class BandwidthInfo:
    """info/MB."""

    min_bandwidth: int
    bandwidth_gran: int
    num_closids: int
    domains: tuple[int, ...]
    mbps: bool = False  # mounted with mba_MBps


@dataclass(frozen=True)
class ResctrlInfo:
    l3: CacheInfo | None
    mb: BandwidthInfo | None
    cdp: bool = False


def _round(x: float) -> int:
    return math.floor(x + 0.5)


def _first_free(n: int, taken: list[tuple[int, int]]) -> int:
    """Lowest bit from which ``n`` bits overlap none of the ``taken`` [lo, hi) spans."""
    lo = 0
    for tlo, thi in sorted(taken):
        if lo + n <= tlo:
            break
        lo = max(lo, thi)
    return lo


def _span(a: L3Amount, width: int, taken: list[tuple[int, int]], pos: float,
          bytes_per_bit: float | None) -> tuple[int, int, float]:
    """(first bit, end bit exclusive, new percent position) of an amount within ``width`` bits. A share or a
    size takes the first free bits (``taken`` spans); a share's size follows the running percent position,
    so that consecutive shares meet without a gap or overlap."""
    if isinstance(a, Share):
        n = max(1, _round((pos + a.percent) * width / 100) - _round(pos * width / 100))
        lo = _first_free(n, taken)
        return lo, lo + n, pos + a.percent
    if isinstance(a, PercentRange):
        lo, hi = _round(a.lo * width / 100), _round(a.hi * width / 100)
        return lo, max(hi, lo + 1), pos
    if isinstance(a, BitRange):
        return a.lo, a.hi + 1, pos
    if bytes_per_bit is None:
        raise ValueError("a size needs the L3 cache size (controls.rdt.l3_cache_bytes, or sysfs cache/index3/size)")
    n = math.ceil(a.bytes / bytes_per_bit)
    lo = _first_free(n, taken)
    return lo, lo + n, pos


@dataclass(frozen=True)
class Layout:
    """Bits of a partition per cache id: (first bit, number of bits)."""

    bits: Mapping[int, tuple[int, int]]


def place_partitions(cfg: RdtControlConfig, l3: CacheInfo) -> tuple[dict[str, Layout], list[str]]:
    """Lay the partitions out on the cache, in the order the config lists them."""
    out: dict[str, dict[int, tuple[int, int]]] = {n: {} for n in cfg.partitions}
    problems: list[str] = []
    for d in l3.domains:
        pos = 0.0
        placed: list[tuple[str, int, int]] = []
        for pname, part in cfg.partitions.items():
            text = per_domain(part.l3, (d,), "100%")[d]
            try:
                lo, hi, pos = _span(parse_l3_amount(text), l3.cbm_bits, [(a, b) for _, a, b in placed], pos,
                                    l3.bytes_per_bit)
            except ValueError as e:
                problems.append(f"controls.rdt.partitions.{pname}.l3: {e}")
                continue
            if hi > l3.cbm_bits:
                problems.append(f"controls.rdt.partitions.{pname}.l3: {text!r} needs bits {lo}-{hi - 1} on cache id {d}"
                                f" but the cache has {l3.cbm_bits} (info/L3/cbm_mask)")
                continue
            if hi - lo < l3.min_cbm_bits:
                problems.append(f"controls.rdt.partitions.{pname}.l3: {text!r} is {hi - lo} bit(s), below "
                                f"info/L3/min_cbm_bits ({l3.min_cbm_bits})")
            for other, olo, ohi in placed:
                if lo < ohi and olo < hi:
                    problems.append(f"controls.rdt.partitions.{pname}.l3: bits {lo}-{hi - 1} overlap partition "
                                    f"{other} (bits {olo}-{ohi - 1}) on cache id {d}")
            placed.append((pname, lo, hi))
            out[pname][d] = (lo, hi - lo)
    return {n: Layout(b) for n, b in out.items()}, problems


def class_mask(text: str, part: tuple[int, int], l3: CacheInfo) -> int:
    """A class's CBM within its partition ``(first bit, bits)``; ValueError with the reason."""
    first, width = part
    lo, hi, _ = _span(parse_l3_amount(text), width, [], 0.0, l3.bytes_per_bit)
    if hi > width:
        raise ValueError(f"{text!r} needs {hi} bits but its partition has {width}")
    if hi - lo < l3.min_cbm_bits:
        raise ValueError(f"{text!r} is {hi - lo} bit(s), below info/L3/min_cbm_bits ({l3.min_cbm_bits})")
    return ((1 << (hi - lo)) - 1) << (first + lo)


def mb_value(text: str, mb: BandwidthInfo) -> int:
    a = parse_mb_amount(text)
    if a.mbps != mb.mbps:
        raise ValueError(f"{text!r}: resctrl is mounted {'with' if mb.mbps else 'without'} mba_MBps, so MB is "
                         f"{'MBps' if mb.mbps else 'a percentage'}")
    if a.mbps:
        return int(a.value)
    v = math.ceil(a.value / mb.bandwidth_gran) * mb.bandwidth_gran
    return min(100, max(mb.min_bandwidth, v))


def format_line(resource: str, values: Mapping[int, int], hex_values: bool) -> str:
    """``L3:0=ff0;1=ff0`` / ``MB:0=50;1=50`` (resctrl.rst, "Schemata files - general concepts")."""
    return f"{resource}:" + ";".join(f"{d}={v:x}" if hex_values else f"{d}={v}" for d, v in sorted(values.items()))


@dataclass
class ClassSchemata:
    name: str
    partition: str
    lines: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what was left out (optional features)

    @property
    def text(self) -> str:
        return "".join(f"{line}\n" for line in self.lines)


@dataclass(frozen=True)
class Features:
    l3: bool
    mb: bool
    cdp: bool


def features(cfg: RdtControlConfig, info: ResctrlInfo) -> tuple[Features, list[str]]:
    """on / off / auto per feature against what resctrl offers (the ancestor's tri-state knob)."""
    problems = []
    have = {"l3": info.l3 is not None, "mb": info.mb is not None, "cdp": info.cdp}
    why = {"l3": "no info/L3 (or L3CODE) in resctrl", "mb": "no info/MB in resctrl (MBM-only or no MBA)",
           "cdp": "resctrl is not mounted with -o cdp"}
    use = {}
    for f in ("l3", "mb", "cdp"):
        mode = getattr(cfg, f)
        if mode == "on" and not have[f]:
            problems.append(f"controls.rdt.{f}: on, but {why[f]}")
        use[f] = mode != "off" and have[f]
    return Features(use["l3"], use["mb"], use["cdp"]), problems


def compute_schemata(cfg: RdtControlConfig, info: ResctrlInfo) -> tuple[dict[str, ClassSchemata], list[str]]:
    """Schemata text per class (``system/default`` is the root group), or the problems."""
    feats, problems = features(cfg, info)
    layouts: dict[str, Layout] = {}
    if feats.l3 and info.l3 is not None:
        layouts, p2 = place_partitions(cfg, info.l3)
        problems += p2
    out: dict[str, ClassSchemata] = {}
    for pname, part in cfg.partitions.items():
        for cname, c in part.classes.items():
            key = f"controls.rdt.partitions.{pname}.classes.{cname}"
            cs = ClassSchemata(cname, pname)
            wants_mb = c.mb is not None
            for f, wanted in (("l3", True), ("mb", wants_mb), ("cdp", c.l3_code is not None or c.l3_data is not None)):
                if wanted and not getattr(feats, f):
                    if f in c.required:
                        state = f"off (controls.rdt.{f})" if getattr(cfg, f) == "off" else "not available"
                        problems.append(f"{key}.required: {f} is required, but {f} allocation is {state}")
                    elif f != "l3" or c.l3 is not None:
                        cs.notes.append(f"{f} left out: not available or off")
            for f in c.required:
                if f == "mb" and not wants_mb:
                    problems.append(f"{key}.required: mb is required but the class sets no mb")
            if feats.l3 and info.l3 is not None and pname in layouts:
                l3 = info.l3
                # Mounted with CDP there is no L3 resource, only L3CODE/L3DATA; with cdp: off both get l3.
                code, data = (c.l3_code or c.l3, c.l3_data or c.l3) if feats.cdp else (c.l3, c.l3)
                res_amounts = [("L3CODE", code), ("L3DATA", data)] if info.cdp else [("L3", c.l3)]
                for res, amount in res_amounts:
                    vals: dict[int, int] = {}
                    for d, text in per_domain(amount if amount is not None else "100%", l3.domains, "100%").items():
                        part_bits = layouts[pname].bits.get(d)
                        if part_bits is None:
                            continue
                        try:
                            vals[d] = class_mask(text, part_bits, l3)
                        except ValueError as e:
                            problems.append(f"{key}.{res.lower() if res != 'L3' else 'l3'}: {e}")
                    if vals:
                        cs.lines.append(format_line(res, vals, hex_values=True))
            if feats.mb and info.mb is not None:
                mb = info.mb
                default = str(MBPS_MAX) + "MBps" if mb.mbps else "100%"
                vals = {}
                for d, text in per_domain(c.mb if c.mb is not None else default, mb.domains, default).items():
                    try:
                        vals[d] = mb_value(text, mb)
                    except ValueError as e:
                        problems.append(f"{key}.mb: {e}")
                cs.lines.append(format_line("MB", vals, hex_values=False))
            out[cname] = cs
    groups = [n for n in out if n != ROOT_CLASS]
    closids = [r.num_closids for r, on in ((info.l3, feats.l3), (info.mb, feats.mb)) if r is not None and on]
    if closids and len(groups) > min(closids) - 1:
        problems.append(f"controls.rdt.partitions: {len(groups)} classes need {len(groups)} CLOSIDs besides the root "
                        f"group's; resctrl has {min(closids)} in all (info/*/num_closids)")
    return out, list(dict.fromkeys(problems))  # one line per problem, not per cache id
