"""What every collector is: a small object with probe() and collect(), roots injected."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..store import Columns, Sample


@dataclass(frozen=True)
class Probe:
    ok: bool
    reason: str = ""


class CollectorUnavailable(Exception):
    """Raised by collect() when the source vanished; the agent marks the collector down with this reason."""


class Collector:
    """Subclasses set ``name`` and implement :meth:`probe` and :meth:`collect`.

    ``collect`` returns fresh samples read from the source each time; it never touches the store
    itself, so it can be tested by calling it on fixture trees.
    """

    name: str = "base"
    cfg: Any = None  # the collector's section of Config.collectors (a Pydantic model), where it has one

    def reconfigure(self, cfg: Any) -> None:
        """Apply a reloaded configuration section (``Config.collectors.<name>``), from the reload thread. The
        default takes it as it is, read on the next run; a collector with state bound to its settings (open
        descriptors, a loaded program, a runtime connection) overrides this and rebuilds or defers what changed."""
        self.cfg = cfg

    def probe(self) -> Probe:
        return Probe(True)

    def collect(self, now: float) -> list[Sample]:
        raise NotImplementedError

    def collect_row(self, now: float) -> list[Sample] | Columns:
        """What the agent stores: :meth:`collect`'s samples, or the same row as :class:`Columns` from a
        collector of many series that keeps its series list between runs (see ``Store.append_columns``)."""
        return self.collect(now)

    def status(self) -> str | None:
        """What the last successful collect() found worth saying (whom it skipped, what failed); the agent
        shows it as the collector's reason. None: the probe's reason stands."""
        return None

    def close(self) -> None:
        """Release kernel resources (file descriptors, BPF links)."""
