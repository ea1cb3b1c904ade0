"""Resolve configured perf event names to ``(type, config, config1)`` encodings.

Accepted spellings (``collectors.perf.events``):

- a generic name as the perf tool spells it (``cycles``, ``instructions``, ``cache-references``,
  ``cache-misses``, ``cpu-clock``, ``context-switches``, ``page-faults``, ... see :data:`GENERIC`);
- a raw core-PMU encoding in the perf tool's ``rNNNN`` syntax (hex config, e.g. ``r412e``);
- an event name from Intel perfmon JSON files (``LONGEST_LAT_CACHE.MISS``) when ``perfmon_path``
  points at a file or directory of them;
- any of these prefixed with ``<metric>=`` to count it under one of the named metrics, e.g.
  ``llc_misses=LONGEST_LAT_CACHE.MISS`` or ``cycles=r003c``.

Intel perfmon JSON (the files Intel publishes per CPU model, e.g. ``skylakex_core.json``): either a list
of event objects or ``{"Header": {...}, "Events": [...]}``, each with string fields ``EventName``,
``EventCode`` (``"0x2E"``, or ``"0xB7,0xBB"`` for offcore events: the first is used), ``UMask``, and
optional ``CounterMask``, ``Invert``, ``EdgeDetect``, ``AnyThread``, ``MSRIndex``/``MSRValue``.
They are encoded like the kernel's x86 core PMU format (``/sys/bus/event_source/devices/cpu/format/``:
``event=config:0-7``, ``umask=config:8-15``, ``edge=config:18``, ``any=config:21``, ``inv=config:23``,
``cmask=config:24-31``, ``offcore_rsp=config1:0-63``), which is the IA32_PERFEVTSELx layout of the
Intel SDM vol. 3B, 18.2.1. Uncore events (with a ``Unit`` field) cannot count per cgroup and are refused.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from . import perf_event as pe

# Metric keys the collector knows by name; every other event goes to the generic perf_events metric.
KNOWN_KEYS = ("cycles", "instructions", "llc_references", "llc_misses", "cpu_clock", "context_switches",
              "page_faults")


@dataclass(frozen=True)
class EventSpec:
    name: str  # as configured (the event label, and how errors name it)
    key: str  # metric key from KNOWN_KEYS, or "" for the generic metric
    type: int
    config: int
    config1: int = 0
    config2: int = 0


class EventResolveError(ValueError):
    pass


_LL = pe.PERF_COUNT_HW_CACHE_LL
GENERIC: dict[str, tuple[str, int, int]] = {
    # name: (metric key, type, config). "cache-references"/"cache-misses" are the LLC events on Intel:
    # the kernel maps them to the architectural "LLC Reference"/"LLC Misses" events (0x4f2e/0x412e,
    # arch/x86/events/intel/core.c intel_perfmon_event_map; Intel SDM vol. 3B, table 18-1).
    "cycles": ("cycles", pe.PERF_TYPE_HARDWARE, pe.PERF_COUNT_HW_CPU_CYCLES),
    "cpu-cycles": ("cycles", pe.PERF_TYPE_HARDWARE, pe.PERF_COUNT_HW_CPU_CYCLES),
    "instructions": ("instructions", pe.PERF_TYPE_HARDWARE, pe.PERF_COUNT_HW_INSTRUCTIONS),
    "cache-references": ("llc_references", pe.PERF_TYPE_HARDWARE, pe.PERF_COUNT_HW_CACHE_REFERENCES),
    "llc-references": ("llc_references", pe.PERF_TYPE_HARDWARE, pe.PERF_COUNT_HW_CACHE_REFERENCES),
    "cache-misses": ("llc_misses", pe.PERF_TYPE_HARDWARE, pe.PERF_COUNT_HW_CACHE_MISSES),
    "llc-misses": ("llc_misses", pe.PERF_TYPE_HARDWARE, pe.PERF_COUNT_HW_CACHE_MISSES),
    "branches": ("", pe.PERF_TYPE_HARDWARE, pe.PERF_COUNT_HW_BRANCH_INSTRUCTIONS),
    "branch-instructions": ("", pe.PERF_TYPE_HARDWARE, pe.PERF_COUNT_HW_BRANCH_INSTRUCTIONS),
    "branch-misses": ("", pe.PERF_TYPE_HARDWARE, pe.PERF_COUNT_HW_BRANCH_MISSES),
    "bus-cycles": ("", pe.PERF_TYPE_HARDWARE, pe.PERF_COUNT_HW_BUS_CYCLES),
    "ref-cycles": ("", pe.PERF_TYPE_HARDWARE, pe.PERF_COUNT_HW_REF_CPU_CYCLES),
    "stalled-cycles-frontend": ("", pe.PERF_TYPE_HARDWARE, pe.PERF_COUNT_HW_STALLED_CYCLES_FRONTEND),
    "stalled-cycles-backend": ("", pe.PERF_TYPE_HARDWARE, pe.PERF_COUNT_HW_STALLED_CYCLES_BACKEND),
    "llc-loads": ("", pe.PERF_TYPE_HW_CACHE, _LL | (pe.PERF_COUNT_HW_CACHE_OP_READ << 8)
                  | (pe.PERF_COUNT_HW_CACHE_RESULT_ACCESS << 16)),
    "llc-load-misses": ("", pe.PERF_TYPE_HW_CACHE, _LL | (pe.PERF_COUNT_HW_CACHE_OP_READ << 8)
                        | (pe.PERF_COUNT_HW_CACHE_RESULT_MISS << 16)),
    "llc-stores": ("", pe.PERF_TYPE_HW_CACHE, _LL | (pe.PERF_COUNT_HW_CACHE_OP_WRITE << 8)
                   | (pe.PERF_COUNT_HW_CACHE_RESULT_ACCESS << 16)),
    "llc-store-misses": ("", pe.PERF_TYPE_HW_CACHE, _LL | (pe.PERF_COUNT_HW_CACHE_OP_WRITE << 8)
                         | (pe.PERF_COUNT_HW_CACHE_RESULT_MISS << 16)),
    "cpu-clock": ("cpu_clock", pe.PERF_TYPE_SOFTWARE, pe.PERF_COUNT_SW_CPU_CLOCK),
    "task-clock": ("", pe.PERF_TYPE_SOFTWARE, pe.PERF_COUNT_SW_TASK_CLOCK),
    "page-faults": ("page_faults", pe.PERF_TYPE_SOFTWARE, pe.PERF_COUNT_SW_PAGE_FAULTS),
    "faults": ("page_faults", pe.PERF_TYPE_SOFTWARE, pe.PERF_COUNT_SW_PAGE_FAULTS),
    "context-switches": ("context_switches", pe.PERF_TYPE_SOFTWARE, pe.PERF_COUNT_SW_CONTEXT_SWITCHES),
    "cs": ("context_switches", pe.PERF_TYPE_SOFTWARE, pe.PERF_COUNT_SW_CONTEXT_SWITCHES),
    "cpu-migrations": ("", pe.PERF_TYPE_SOFTWARE, pe.PERF_COUNT_SW_CPU_MIGRATIONS),
    "minor-faults": ("", pe.PERF_TYPE_SOFTWARE, pe.PERF_COUNT_SW_PAGE_FAULTS_MIN),
    "major-faults": ("", pe.PERF_TYPE_SOFTWARE, pe.PERF_COUNT_SW_PAGE_FAULTS_MAJ),
}

DEFAULT_EVENTS = ("cycles", "instructions", "cache-references", "cache-misses")


@dataclass(frozen=True)
class PerfmonEvent:
    name: str
    config: int
    config1: int = 0


def _num(v: object, field: str, name: str) -> int:
    if v is None or v == "":
        return 0
    try:
        return int(str(v).split(",")[0].strip(), 0)
    except ValueError:
        raise EventResolveError(f"perfmon event {name}: field {field} is not a number: {v!r}") from None


def encode_perfmon(entry: dict) -> PerfmonEvent:
    """Encode one perfmon JSON event object as a raw core-PMU config (see the module docstring)."""
    name = entry.get("EventName")
    if not isinstance(name, str) or not name:
        raise EventResolveError(f"perfmon entry without EventName: {entry!r:.80}")
    if entry.get("Unit"):
        raise EventResolveError(f"perfmon event {name} is an uncore ({entry['Unit']}) event; "
                                "uncore PMUs cannot count per cgroup")
    if "EventCode" not in entry:
        raise EventResolveError(f"perfmon event {name} has no EventCode")
    code = _num(entry.get("EventCode"), "EventCode", name)
    umask = _num(entry.get("UMask"), "UMask", name)
    cmask = _num(entry.get("CounterMask"), "CounterMask", name)
    if code > 0xFF or umask > 0xFF or cmask > 0xFF:
        raise EventResolveError(f"perfmon event {name}: EventCode/UMask/CounterMask must fit 8 bits")
    config = (code | umask << 8 | (_num(entry.get("EdgeDetect"), "EdgeDetect", name) & 1) << 18
              | (_num(entry.get("AnyThread"), "AnyThread", name) & 1) << 21
              | (_num(entry.get("Invert"), "Invert", name) & 1) << 23 | cmask << 24)
    config1 = 0
    if _num(entry.get("MSRIndex"), "MSRIndex", name):
        config1 = _num(entry.get("MSRValue"), "MSRValue", name)
    return PerfmonEvent(name, config, config1)


def load_perfmon(path: Path) -> dict[str, PerfmonEvent]:
    """Load one perfmon JSON file, or every ``*.json`` in a directory. Names are matched case-insensitively.

    Entries that cannot be encoded (uncore events, missing fields) are left out; a file that is not
    perfmon JSON at all raises :class:`EventResolveError` naming it."""
    path = Path(path)
    files = sorted(path.glob("*.json")) if path.is_dir() else [path]
    out: dict[str, PerfmonEvent] = {}
    for f in files:
        try:
            data = json.loads(f.read_text())
        except (OSError, ValueError) as e:
            raise EventResolveError(f"cannot read perfmon file {f}: {e}") from None
        events = data.get("Events") if isinstance(data, dict) else data
        if not isinstance(events, list):
            raise EventResolveError(f"{f}: not a perfmon event file (expected a list or an object with 'Events')")
        for entry in events:
            if not isinstance(entry, dict):
                continue
            try:
                ev = encode_perfmon(entry)
            except EventResolveError:
                continue
            out.setdefault(ev.name.upper(), ev)
    return out


def resolve(spec: str, perfmon: dict[str, PerfmonEvent] | None = None) -> EventSpec:
    """Turn one configured event string into an :class:`EventSpec`; raises :class:`EventResolveError`."""
    text = spec.strip()
    key = ""
    if "=" in text:
        key, _, text = text.partition("=")
        key, text = key.strip(), text.strip()
        if key not in KNOWN_KEYS:
            raise EventResolveError(f"event {spec!r}: unknown metric {key!r} (one of {', '.join(KNOWN_KEYS)})")
    if not text:
        raise EventResolveError(f"event {spec!r} is empty")
    low = text.lower()
    if low in GENERIC:
        gkey, type_, config = GENERIC[low]
        return EventSpec(spec, key or gkey, type_, config)
    if low.startswith("r") and len(low) > 1 and all(c in "0123456789abcdef" for c in low[1:]):
        return EventSpec(spec, key, pe.PERF_TYPE_RAW, int(low[1:], 16))
    if perfmon is not None:
        ev = perfmon.get(text.upper())
        if ev is not None:
            return EventSpec(spec, key, pe.PERF_TYPE_RAW, ev.config, ev.config1)
        raise EventResolveError(f"event {text!r} is neither a generic name, an rNNNN raw code, "
                                "nor in the perfmon files")
    raise EventResolveError(f"event {text!r} is neither a generic name nor an rNNNN raw code "
                            "(set collectors.perf.perfmon_path to resolve perfmon names)")
