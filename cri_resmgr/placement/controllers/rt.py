"""Real-time groups: ``cpu.rt_runtime_us`` for a container's cgroup and every parent that needs it.

Documentation/scheduler/sched-rt-group.rst: with CONFIG_RT_GROUP_SCHED each cgroup (v1 ``cpu``) may run
SCHED_FIFO/SCHED_RR tasks for ``cpu.rt_runtime_us`` per ``cpu.rt_period_us``; a group's children together
may not get more than the group itself has (section 2.3, "the sum of the runtimes of the children must not
exceed the runtime of the parent"), and the root group's runtime (``sched_rt_runtime_us``, 950000 of
1000000 by default) is the node's budget. A new cgroup starts at 0, where sched_setscheduler(SCHED_FIFO)
fails with EPERM. So a grant raises the parents top-down first and lowering goes bottom-up, and what other
groups already hold (siblings this controller does not manage) is left to them and counted against the
budget. Without CONFIG_RT_GROUP_SCHED there is no ``cpu.rt_runtime_us`` and every grant is refused.

What was granted outlives the process: the parents of a container that stopped while the front end was down
would keep their runtime for good and drain the node's budget. So the grants and every path written are kept in
a ledger file (``rt-grants.json`` in the state directory); at the first commit after a start, grants whose cgroup
is gone are given back and the parents lowered to what is left. Only paths in the ledger are touched.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ... import metrics as M
from ...config import RtControlConfig
from ..context import ContainerContext
from ..persist import write_whole
from .base import Applied, ControlError, ControlType, NoCgroupYet, Plan
from .cgroups import Hierarchy, describe, hierarchies, write_file

log = logging.getLogger(__name__)

RUNTIME, PERIOD = "cpu.rt_runtime_us", "cpu.rt_period_us"
LEDGER_VERSION = 1


@dataclass(frozen=True)
class Budget:
    period_us: int  # the root group's cpu.rt_period_us
    runtime_us: int  # the root group's cpu.rt_runtime_us: the node's budget


def _read_int(path: Path) -> int:
    return int(path.read_text().strip())


def ancestors(cgroup_path: str) -> list[str]:
    """``/a/b/c`` -> ``["a", "a/b", "a/b/c"]`` (top-down)."""
    parts = [p for p in cgroup_path.split("/") if p]
    return ["/".join(parts[: i + 1]) for i in range(len(parts))]


def needed_runtimes(grants: dict[str, int], managed: set[str], current: dict[str, int],
                    children: dict[str, list[str]]) -> dict[str, int]:
    """What every managed cgroup must have: a granted one its grant, any other the sum of its children's
    needs, where children nobody manages count at what they hold now (``current``). ``managed`` holds the
    granted paths, their ancestors and paths granted before (which drop back to what their children need).
    Pure: ``children`` lists each path's child cgroups ("" is the root)."""
    memo: dict[str, int] = {}

    def need(p: str) -> int:
        if p not in memo:
            memo[p] = grants[p] if p in grants else \
                sum(need(c) if c in managed else current.get(c, 0) for c in children.get(p, []))
        return memo[p]

    return {p: need(p) for p in managed}


class RtController(ControlType[RtControlConfig]):
    name = "rt"
    class_metric = M.CONTAINER_RT_CLASS

    def __init__(self, cgroup_root: Path, lower_patience_seconds: float = 2.0, ledger: Path | None = None):
        self.cgroup_root = Path(cgroup_root)
        self.lower_patience_seconds = lower_patience_seconds
        self.grants: dict[str, int] = {}  # container cgroup path (relative, no leading /) -> runtime_us
        self.touched: set[str] = set()  # every path this controller ever wrote (to lower them again)
        self.ledger = ledger  # where grants and touched paths survive a restart (None: not kept)
        self._saved: bytes | None = None
        self._recovered = ledger is None

    def hierarchy(self) -> Hierarchy | None:
        for h in hierarchies(self.cgroup_root, "cpu"):
            if h.version == 1:
                return h
        return None

    def budget(self) -> Budget | str:
        """The root group's budget, or why there is none."""
        h = self.hierarchy()
        if h is None:
            return (f"no cgroup v1 cpu hierarchy under {self.cgroup_root} (cgroup v2 has no RT group "
                    "runtime; sched-rt-group.rst)")
        if not (h.root / RUNTIME).exists():
            return f"the kernel lacks RT group scheduling (CONFIG_RT_GROUP_SCHED): no {RUNTIME} in {h.root}"
        try:
            period, runtime = _read_int(h.root / PERIOD), _read_int(h.root / RUNTIME)
            # sched_rt_runtime_us = -1 switches RT throttling off (sched-rt-group.rst 2.1): groups may then be
            # given up to the whole period.
            return Budget(period, period if runtime < 0 else runtime)
        except (OSError, ValueError) as e:
            return f"cannot read the root group's RT budget in {h.root}: {e}"

    def prepare(self, section: RtControlConfig) -> Plan[RtControlConfig] | list[str]:
        if not section.classes:
            return Plan(section, ())
        b = self.budget()
        if isinstance(b, str):
            return [f"{self.key('classes')}: {b}"]
        problems = []
        for name, c in section.classes.items():
            if c.runtime_us > b.runtime_us:
                problems.append(f"{self.key('classes', name, 'runtime_us')}: {c.runtime_us} µs exceeds the node's "
                                f"RT budget of {b.runtime_us} µs per {b.period_us} µs (root {RUNTIME})")
        return problems or Plan(section, tuple(section.classes), b)

    def commit(self, plan: Plan[RtControlConfig]) -> list[str]:
        """At the first commit after a start: give back what a previous run granted to containers whose cgroup
        is gone. Never a problem that stops the start: what cannot be lowered is logged and tried again later."""
        if not self._recovered:
            self._recovered = True
            self._recover()
        return []

    # -- the ledger -----------------------------------------------------------------------------------
    def _load_ledger(self) -> tuple[dict[str, int], set[str]]:
        assert self.ledger is not None
        try:
            doc = json.loads(self.ledger.read_bytes())
            if not isinstance(doc, dict) or doc.get("version") != LEDGER_VERSION:
                raise ValueError(f"not a version {LEDGER_VERSION} ledger")
            grants, touched = doc["grants"], doc["touched"]
            if not (isinstance(grants, dict) and all(isinstance(k, str) and type(v) is int and v >= 0
                                                     for k, v in grants.items())
                    and isinstance(touched, list) and all(isinstance(t, str) for t in touched)):
                raise ValueError("grants must map paths to runtimes, touched must list paths")
        except FileNotFoundError:
            return {}, set()
        except (OSError, ValueError, KeyError) as e:
            log.warning("rt: ignoring the grant ledger %s (%s): grants of an earlier run are not given back",
                        self.ledger, e)
            return {}, set()
        clean = {p.strip("/"): v for p, v in grants.items() if ".." not in p.split("/")}
        return clean, {t.strip("/") for t in touched if ".." not in t.split("/")}

    def _remember(self) -> None:
        if self.ledger is None:
            return
        data = json.dumps({"version": LEDGER_VERSION, "grants": self.grants, "touched": sorted(self.touched)},
                          sort_keys=True).encode()
        if data == self._saved:
            return
        try:
            write_whole(self.ledger, data)
            self._saved = data
        except OSError as e:  # the grant itself is done; only its memory across a restart is at risk
            log.warning("rt: cannot save the grant ledger %s: %s", self.ledger, describe(e))

    def _recover(self) -> None:
        grants, touched = self._load_ledger()
        h, b = self.hierarchy(), self.budget()
        if not (grants or touched) or h is None or isinstance(b, str):
            return
        live = {p: v for p, v in grants.items() if h.dir_of(p).is_dir()}
        self.grants, self.touched = live, touched | set(grants)
        try:
            self._apply(live, b)
        except ControlError as e:
            log.warning("rt: giving back the grants of stopped containers: %s", e)
        self._remember()
        gone = sorted(set(grants) - set(live))
        if gone:
            log.info("rt: gave back the RT runtime of %d stopped container(s): %s", len(gone), ", ".join(gone))

    # -- the tree -----------------------------------------------------------------------------------
    def _children(self, h: Hierarchy, paths: set[str]) -> dict[str, list[str]]:
        """Child cgroups of every path and parent of ``paths``. Managed paths count even when their directory
        has gone: a removed cgroup keeps its runtime in the kernel until it is freed."""
        out: dict[str, set[str]] = {}
        for p in {"", *{a.rpartition("/")[0] for a in paths}, *paths}:
            d = h.dir_of(p)
            try:
                out[p] = {f"{p}/{n}".lstrip("/") for n in os.listdir(d) if (d / n).is_dir()}
            except OSError:
                out[p] = set()
        for p in paths:
            out.setdefault(p.rpartition("/")[0], set()).add(p)
        return {p: sorted(c) for p, c in out.items()}

    def _current(self, h: Hierarchy, paths: list[str]) -> dict[str, int]:
        out = {}
        for p in paths:
            try:
                out[p] = _read_int(h.dir_of(p) / RUNTIME)
            except (OSError, ValueError):
                continue
        return out

    def _apply(self, grants: dict[str, int], budget: Budget) -> None:
        h = self.hierarchy()
        if h is None:
            raise ControlError(f"no cgroup v1 cpu hierarchy under {self.cgroup_root}")
        paths: set[str] = set(self.touched)
        for leaf in grants:
            paths.update(ancestors(leaf))
        children = self._children(h, paths)
        every = sorted({c for cs in children.values() for c in cs} | paths)
        current = self._current(h, every)
        need = needed_runtimes(grants, paths, current, children)
        top = {p for p in need if "/" not in p}
        used = sum(need.get(c, current.get(c, 0)) for c in children.get("", []))
        if used > budget.runtime_us:
            others = sum(current.get(c, 0) for c in children.get("", []) if c not in top)
            raise ControlError(f"over the node's RT budget: {used} µs per {budget.period_us} µs needed at the top "
                               f"level ({others} µs held by other groups), root {RUNTIME} is {budget.runtime_us}")
        # Lower first (bottom-up), then raise (top-down): each write then keeps every parent at or above the
        # sum of its children, which the kernel checks at every write.
        failed: list[str] = []
        for p in sorted(need, key=lambda x: -x.count("/")):
            if need[p] < current.get(p, 0) and h.dir_of(p).is_dir():
                try:
                    self._lower(h, p, need[p])
                except ControlError as e:
                    failed.append(str(e))
        if not failed:
            for p in sorted(need, key=lambda x: x.count("/")):
                if need[p] > current.get(p, 0) and h.dir_of(p).is_dir():
                    self._write(h, p, need[p])
        # A path that could not be lowered stays touched, so the next call tries again.
        self.touched = {p for p, v in need.items() if v > 0 or current.get(p, 0) > v}
        if failed:
            raise ControlError("; ".join(failed))

    def _lower(self, h: Hierarchy, p: str, v: int) -> None:
        # A removed child cgroup keeps its runtime in the kernel's task-group list until it is freed (after its
        # last task is reaped and an RCU grace period), and until then the parent cannot go below it (EINVAL,
        # sched-rt-group.rst 2.3). The container just stopped, so wait a little for that.
        deadline = time.monotonic() + self.lower_patience_seconds
        delay = 0.02
        while True:
            try:
                self._write(h, p, v)
                return
            except ControlError:
                if time.monotonic() + delay > deadline:
                    raise
                time.sleep(delay)
                delay = min(delay * 2, 0.25)

    def _write(self, h: Hierarchy, p: str, v: int) -> None:
        try:
            write_file(h.dir_of(p) / RUNTIME, str(v))
        except OSError as e:
            # EINVAL: the parent has too little (sched-rt-group.rst 2.3); EBUSY: lowering to 0 with RT tasks.
            raise ControlError(f"write {v} to {p or '<root>'}/{RUNTIME}: {describe(e)}") from None

    def enforce(self, ctx: ContainerContext, cls: str, plan: Plan[RtControlConfig]) -> dict[str, Any]:
        if not isinstance(plan.details, Budget):
            raise ControlError("RT classes are not usable on this node")
        path = ctx.cgroup_path.strip("/")
        h = self.hierarchy()
        if not path or h is None or not h.dir_of(path).is_dir():
            raise NoCgroupYet(f"no cpu cgroup {ctx.cgroup_path or '(unknown path)'} under {self.cgroup_root}")
        want = plan.section.classes[cls].runtime_us
        if self.grants.get(path) == want and self._current(h, [path]).get(path) == want:
            return {"cgroup": path, "runtime_us": want}  # unchanged (a reload): no walk of the tree
        # A granted cgroup that is gone (its container stopped unseen) needs nothing any more.
        grants = {p: v for p, v in self.grants.items() if h.dir_of(p).is_dir()}
        grants[path] = want
        try:
            self._apply(grants, plan.details)
        except ControlError:
            self._apply(self.grants, plan.details)  # put back what the others were granted
            self._remember()
            raise
        self.grants = grants
        self._remember()
        return {"cgroup": path, "runtime_us": grants[path]}

    def release(self, ctx: ContainerContext, applied: Applied, plan: Plan[RtControlConfig]) -> None:
        path = ctx.cgroup_path.strip("/")
        if path not in self.grants or not isinstance(plan.details, Budget):
            return
        grants = {p: v for p, v in self.grants.items() if p != path}
        self.grants = grants
        self.touched.add(path)
        try:
            self._apply(grants, plan.details)
        finally:
            self._remember()
