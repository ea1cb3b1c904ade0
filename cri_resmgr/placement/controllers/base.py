"""What every resource controller is: a config section, classes, and enforce/release per container.

A controller (one module: :mod:`.blockio`, :mod:`.rt`, :mod:`.rdt`) does two things:

- :meth:`ControlType.prepare` checks a config section against the node (devices exist, the RT budget,
  what resctrl offers) and returns a :class:`Plan` or the problems, each ``controls.<name>.<key>: <why>``;
  nothing on the node changes. :meth:`ControlType.commit` then makes the plan current (node-level state:
  RDT groups and schemata). Two phases, so that a reload with one bad section changes nothing anywhere.
- :meth:`ControlType.enforce` puts one container in a class; :meth:`ControlType.release` undoes what
  needs undoing when it stops. Both raise :class:`ControlError` with a reason a user can act on.

Which class a container gets is decided in one place, :mod:`.classes`, not by the controllers.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from pydantic import BaseModel

from ...metrics import MetricSpec
from ..context import ContainerContext

S = TypeVar("S", bound=BaseModel)


class ControlError(Exception):
    """Enforcement failed; the message says why (with the kernel's own words where it gives any)."""


class NoCgroupYet(ControlError):
    """The container's cgroup does not exist (yet): containerd's CRI creates the task, and with it the cgroup,
    only at StartContainer, so at CreateContainer this is normal; at start it is an error."""


@dataclass(frozen=True)
class Plan(Generic[S]):
    """A checked config section and whatever the controller derived from the node for it."""

    section: S
    classes: tuple[str, ...]
    details: Any = None  # controller-specific (e.g. resolved devices, computed schemata)
    notes: tuple[str, ...] = ()  # degradations worth a log line (an optional feature left out)


@dataclass
class Applied:
    """What a controller did for one container."""

    cls: str
    error: str = ""
    state: dict[str, Any] = field(default_factory=dict)  # controller-specific, e.g. the RT grant


class ControlType(ABC, Generic[S]):
    """Base of the controllers. ``name`` is the config key under ``controls`` and the annotation prefix
    (``<name>class.cri-resource-manager.intel.com/...``); ``class_metric`` is the per-container metric."""

    name: str
    class_metric: MetricSpec

    @abstractmethod
    def prepare(self, section: S) -> Plan[S] | list[str]:
        """Check ``section`` against the node; a plan, or problems (``controls.<name>...: ...``)."""

    def commit(self, plan: Plan[S]) -> list[str]:
        """Make ``plan`` current; problems when the node refused (then the old plan stays usable)."""
        return []

    @abstractmethod
    def enforce(self, ctx: ContainerContext, cls: str, plan: Plan[S]) -> dict[str, Any]:
        """Put the container in class ``cls``; returns state that :meth:`release` gets back."""

    def release(self, ctx: ContainerContext, applied: Applied, plan: Plan[S]) -> None:
        """The container stopped: undo what outlives it (default: nothing; its cgroup goes with it)."""

    def key(self, *parts: str | int) -> str:
        """``controls.<name>.<parts>`` for problem messages (list indices as ``[i]``)."""
        out = f"controls.{self.name}"
        for p in parts:
            out += f"[{p}]" if isinstance(p, int) else f".{p}"
        return out
