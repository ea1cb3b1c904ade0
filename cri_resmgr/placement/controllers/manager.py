"""The controllers behind the engine's one hook: class resolution, enforcement, reload, state and metrics.

:class:`ControlManager` implements the engine's ``Controller`` protocol (:mod:`..context`); the engine calls
it on its controllers thread. For each container and each enabled control it resolves the class
(:mod:`.classes`), asks the controller to enforce it, and keeps what happened (the class, or the error).

Configuration: :meth:`from_config` (start) and :meth:`reconfigure` (reload) first ``prepare`` every control
against the node; a single problem rejects the whole configuration and nothing changes (at start: exit 2;
on reload: the running classes stay). Accepted, each plan is committed and the engine's ``reload`` hook then
re-enforces every running container, so changed classes and class mappings reach containers that already
run (the ancestor applied them only to new containers).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from ... import metrics as M
from ...config import Config, ConfigError
from ...export.exposition import format_family
from ..api import ContainerView
from ..context import ContainerContext
from .base import Applied, ControlError, ControlType, NoCgroupYet, Plan
from .blockio import BlockioController
from .classes import DOMAIN, resolve_class
from .rdt import RdtController
from .rt import RtController

log = logging.getLogger(__name__)


def default_controllers(cfg: Config) -> list[ControlType[Any]]:
    """One per ``controls`` section; a new control type adds itself here and to config.ControlsConfig."""
    p = cfg.paths
    return [RdtController(p.resctrl, sysfs=p.sysfs, proc=p.proc, cgroup_root=p.cgroup),
            BlockioController(p.cgroup, dev_root=p.dev, sysfs=p.sysfs),
            RtController(p.cgroup, ledger=cfg.state_dir / "rt-grants.json")]


@dataclass(frozen=True)
class ControlStatus:
    cls: str
    error: str = ""


class ControlManager:
    name = "controls"

    def __init__(self, controllers: Sequence[ControlType[Any]], plans: dict[str, Plan[Any]]):
        self.controllers = {c.name: c for c in controllers}
        self.plans = plans  # control name -> current plan (absent: control disabled)
        self.retired: dict[str, Plan[Any]] = {}  # plans of controls a reload disabled, to release with
        self.lock = threading.RLock()
        self.applied: dict[str, dict[str, Applied]] = {}  # container id -> control -> what was done
        self.contexts: dict[str, ContainerContext] = {}
        self.errors_total: dict[str, int] = {c.name: 0 for c in controllers}

    # -- configuration ------------------------------------------------------------------------------
    @staticmethod
    def _prepare(controllers: Sequence[ControlType[Any]], cfg: Config) -> tuple[dict[str, Plan[Any]], list[str]]:
        plans: dict[str, Plan[Any]] = {}
        problems: list[str] = []
        for c in controllers:
            section: BaseModel = getattr(cfg.controls, c.name)
            if not getattr(section, "enabled", True):
                continue
            r = c.prepare(section)
            if isinstance(r, list):
                problems += r
            else:
                plans[c.name] = r
                for note in r.notes:
                    log.warning("%s: %s", c.key(), note)
        return plans, problems

    @classmethod
    def from_config(cls, cfg: Config, controllers: Sequence[ControlType[Any]] | None = None) -> ControlManager:
        """Check and commit ``cfg.controls``; raises :class:`ConfigError` naming the keys (exit status 2)."""
        ctrls = list(controllers) if controllers is not None else default_controllers(cfg)
        plans, problems = cls._prepare(ctrls, cfg)
        for name, plan in plans.items():
            if not problems:
                problems += next(c for c in ctrls if c.name == name).commit(plan)
        if problems:
            raise ConfigError(problems, source="controls")
        return cls(ctrls, plans)

    def reload_from(self, load_config: Callable[[], Config], reenforce: Callable[[], None]) -> bool:
        """SIGHUP in a front end: re-read the configuration; when the controllers accept it, ``reenforce``
        (the engine's ``reload_controllers``) applies it to running containers. A rejected reload is logged
        with its problems and changes nothing. Returns whether it was accepted."""
        try:
            cfg = load_config()
        except ConfigError as e:
            log.error("reload rejected: %s", "; ".join(e.problems))
            return False
        problems = self.reconfigure(cfg)
        if problems:
            log.error("reload rejected: %s", "; ".join(problems))
            return False
        log.info("configuration reloaded")
        reenforce()
        return True

    def reconfigure(self, cfg: Config) -> list[str]:
        """A reloaded config: [] when accepted (then call the engine's reload), else the problems; on
        problems the running plans stay as they were."""
        with self.lock:
            plans, problems = self._prepare(list(self.controllers.values()), cfg)
            if problems:
                return problems
            committed: list[str] = []
            for name, plan in plans.items():
                problems = self.controllers[name].commit(plan)
                if problems:
                    for back in committed:  # undo: the old plans become current again
                        old = self.plans.get(back)
                        if old is not None:
                            self.controllers[back].commit(old)
                    return problems
                committed.append(name)
            self.retired = {n: p for n, p in self.plans.items() if n not in plans}
            self.plans = plans
            return []

    # -- the engine's Controller hooks ---------------------------------------------------------------
    def wants(self, ctx: ContainerContext) -> bool:
        """Whether a container event (created, started, adopted, stopped) can change anything for ``ctx``: the
        engine does not wake its controllers thread for the others. False only when nothing is recorded for the
        container, no control has classes or defaults (so no class but one its annotations name, which is then
        reported as unknown) and its annotations name none."""
        with self.lock:
            if self.retired or ctx.id in self.applied:
                return True
            if any(p.classes or getattr(p.section, "defaults", None) for p in self.plans.values()):
                return True
        return any(f"class.{DOMAIN}/" in k for k in ctx.annotations)

    def started(self, ctx: ContainerContext) -> None:
        self.apply(ctx)

    def adopted(self, ctx: ContainerContext) -> None:
        self.apply(ctx)

    def created(self, ctx: ContainerContext) -> None:
        self.apply(ctx, early=True)

    def stopped(self, ctx: ContainerContext) -> None:
        with self.lock:
            done = self.applied.pop(ctx.id, {})
            self.contexts.pop(ctx.id, None)
            for name, a in done.items():
                self._release(name, ctx, a)

    def reload(self, running: Sequence[ContainerContext]) -> None:
        with self.lock:
            for ctx in running:
                # A "running" container without a cgroup has just exited (the engine learns it at its next
                # reconcile): not an enforcement error.
                self.apply(ctx, early=True)

    # -- enforcement --------------------------------------------------------------------------------
    def _release(self, name: str, ctx: ContainerContext, a: Applied) -> None:
        # Releases are idempotent: also after a failed re-enforcement, whatever an earlier one did.
        plan = self.plans.get(name) or self.retired.get(name)
        ctrl = self.controllers[name]
        if plan is None:
            return
        try:
            ctrl.release(ctx, a, plan)
        except (ControlError, OSError) as e:
            self.errors_total[name] += 1
            log.warning("%s: releasing %s/%s/%s: %s", name, ctx.pod_namespace, ctx.pod_name, ctx.name, e)

    def apply(self, ctx: ContainerContext, early: bool = False) -> dict[str, ControlStatus]:
        """Resolve and enforce every control for one container; returns what each control did. ``early``:
        a missing cgroup is expected (at creation it comes at start; at a reload the container just exited)
        and is not an error: what was done before stays recorded."""
        with self.lock:
            self.contexts[ctx.id] = ctx
            done = self.applied.setdefault(ctx.id, {})
            for name, ctrl in self.controllers.items():
                plan = self.plans.get(name)
                prev = done.get(name)
                section: Any = plan.section if plan is not None else None
                r = resolve_class(name, ctx.name, ctx.annotations, ctx.qos_class,
                                  section.defaults if section is not None else {})
                if plan is None or r.cls is None:
                    if prev is not None:  # class taken away (reload, control disabled): undo
                        self._release(name, ctx, prev)
                        del done[name]
                    continue
                if r.cls not in plan.classes:
                    if prev is not None:  # what an earlier class granted must not stay behind
                        self._release(name, ctx, prev)
                    a = Applied(r.cls, error=f"unknown {name} class {r.cls!r} (from {r.source})")
                else:
                    try:
                        a = Applied(r.cls, state=ctrl.enforce(ctx, r.cls, plan))
                    except NoCgroupYet as e:
                        if early:
                            continue  # enforced at start
                        a = Applied(r.cls, error=str(e))
                    except (ControlError, OSError) as e:
                        a = Applied(r.cls, error=str(e))
                if a.error:
                    self.errors_total[name] += 1
                    log.warning("%s: %s/%s/%s class %s: %s", name, ctx.pod_namespace, ctx.pod_name, ctx.name,
                                a.cls, a.error)
                else:
                    log.info("%s: %s/%s/%s in class %s (%s)", name, ctx.pod_namespace, ctx.pod_name, ctx.name,
                             a.cls, r.source)
                done[name] = a
            return {n: ControlStatus(a.cls, a.error) for n, a in done.items()}

    # -- state --------------------------------------------------------------------------------------
    def container_classes(self, container_id: str) -> dict[str, str]:
        with self.lock:
            return {n: a.cls for n, a in self.applied.get(container_id, {}).items()}

    def container_errors(self, container_id: str) -> dict[str, str]:
        with self.lock:
            return {n: a.error for n, a in self.applied.get(container_id, {}).items() if a.error}

    def decorate(self, view: ContainerView) -> None:
        """A front end's container view with this container's classes and errors (``/api/v1/containers``)."""
        view.controls = self.container_classes(view.id)
        view.control_errors = self.container_errors(view.id)

    def metrics_text(self) -> str:
        """Prometheus text exposition of the per-container classes, containers per class and errors."""
        with self.lock:
            per: dict[str, list[tuple[list[tuple[str, str]], float]]] = {}
            counts: dict[tuple[str, str], int] = {}
            for name, plan in self.plans.items():
                for c in plan.classes:
                    counts[(name, c)] = 0
            for cid, done in sorted(self.applied.items()):
                ctx = self.contexts.get(cid)
                if ctx is None:
                    continue
                base = [("namespace", ctx.pod_namespace), ("pod", ctx.pod_name), ("container", ctx.name),
                        ("container_id", cid), ("pod_uid", ctx.pod_uid), ("qos_class", ctx.qos_class)]
                for name, a in sorted(done.items()):
                    spec = self.controllers[name].class_metric
                    per.setdefault(spec.name, []).append(([*base, ("class", a.cls)], 0.0 if a.error else 1.0))
                    if not a.error:
                        counts[(name, a.cls)] = counts.get((name, a.cls), 0) + 1
            errors = dict(self.errors_total)
        out = [format_family(ctrl.class_metric, per.get(ctrl.class_metric.name, []))
               for ctrl in self.controllers.values()]
        out.append(format_family(M.CONTROL_CLASS_CONTAINERS,
                                 [([("control", n), ("class", c)], float(v)) for (n, c), v in sorted(counts.items())]))
        out.append(format_family(M.CONTROL_ERRORS, [([("control", n)], float(v)) for n, v in sorted(errors.items())]))
        return "".join(out)


__all__ = ["ControlManager", "ControlStatus", "default_controllers"]
