"""Background loops that cannot die silently: each runs under :func:`run_supervised`, which restarts it after
an exception (with a growing back-off), counts the restarts and keeps the last error for the API
(``/api/v1/loops``)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

BACKOFF_MIN_SECONDS = 1.0
BACKOFF_MAX_SECONDS = 60.0


@dataclass
class LoopStatus:
    name: str
    running: bool = False
    restarts_total: int = 0
    last_error: str | None = None
    last_error_time: float | None = None
    started: float | None = None


def run_supervised(status: LoopStatus, target: Callable[[], None], stop: threading.Event,
                   backoff_min: float = BACKOFF_MIN_SECONDS, backoff_max: float = BACKOFF_MAX_SECONDS) -> None:
    """Run ``target`` until it returns or ``stop`` is set; an exception is logged (its traceback the first
    time a message is seen), counted in ``status.restarts_total``, and the target started again after a
    back-off that doubles from ``backoff_min`` up to ``backoff_max`` (reset once a run lasts a minute)."""
    delay = backoff_min
    logged: str | None = None
    while not stop.is_set():
        status.running, status.started = True, time.time()
        try:
            target()
            return
        except Exception as e:  # the point of supervision: any failure of the loop body is survived
            msg = f"{type(e).__name__}: {e}"
            status.restarts_total += 1
            status.last_error, status.last_error_time = msg, time.time()
            if msg != logged:
                log.error("background loop %s failed, restarting in %.0fs: %s", status.name, delay, msg,
                          exc_info=True)
                logged = msg
            if time.time() - (status.started or 0) > 60:
                delay = backoff_min
        finally:
            status.running = False
        if stop.wait(delay):
            return
        delay = min(backoff_max, delay * 2)


def start_supervised(status: LoopStatus, target: Callable[[], None], stop: threading.Event) -> threading.Thread:
    t = threading.Thread(target=run_supervised, args=(status, target, stop), name=status.name, daemon=True)
    t.start()
    return t
