"""The agent's HTTP server: uvicorn's, with its housekeeping tick once a second instead of ten times.

uvicorn's ``Server.main_loop`` wakes every 0.1 s to see whether it should stop (and, every tenth wake-up, to
refresh the ``Date`` header). On an idle agent those wake-ups are the HTTP side's whole cost: measured here (an
idle uvicorn, switch interval 1 ms as serve.py sets it, 20 s) 0.19 % of a core against 0.03 % at one tick a
second, out of the agent's budget of 1 % at 1,000 containers (docs/hardware-collectors.md). A stop no longer
waits for the next tick: setting ``should_exit`` (uvicorn's signal handler, serve.py's) wakes the loop at once.
The ``Date`` header is still refreshed every second (``on_tick`` refreshes it when ``counter % 10 == 0``).

:func:`config` is how the agent's app is served (serve.py, and the benches that measure it): on asyncio's own
event loop, not uvloop (uvicorn's choice when uvloop is installed, as it is for the relay). uvloop resolves the
listen address in libuv's thread pool, which starts four threads for that one lookup and keeps them; with their
malloc arenas and uvloop's pages that is ~2 MB of the agent's RSS (measured here: 69.7 against 67.6 MB, the
agent served and scraped), for an API answered a few times a minute.
"""

from __future__ import annotations

import asyncio
import contextlib

import uvicorn

TICK_SECONDS = 1.0
LOOP = "asyncio"  # the API's event loop (see above); the relay picks its own (relay/server.py)


def config(app, host: str, port: int, log_level: str = "info") -> uvicorn.Config:
    """uvicorn's configuration for serving the agent's app (no access log, no lifespan: the agent starts and
    stops outside the app)."""
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False, lifespan="off",
                          loop=LOOP)


class Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config) -> None:
        self._exit_event: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._should_exit = False
        super().__init__(config)

    @property
    def should_exit(self) -> bool:
        return self._should_exit

    @should_exit.setter
    def should_exit(self, value: bool) -> None:
        self._should_exit = value
        loop, event = self._loop, self._exit_event
        if value and loop is not None and event is not None and not loop.is_closed():
            loop.call_soon_threadsafe(event.set)  # from a signal handler or another thread

    async def main_loop(self) -> None:
        self._exit_event = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        counter = 0
        should_exit = await self.on_tick(counter)
        while not should_exit:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._exit_event.wait(), TICK_SECONDS)
            counter = (counter + 10) % 864000  # each tick is a second: on_tick's "every tenth" is every tick
            should_exit = await self.on_tick(counter)
