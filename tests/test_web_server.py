"""The agent's HTTP server (cri_resmgr/web/server.py): uvicorn with one housekeeping tick a second, a stop that does
not wait for the tick, and the Date header still refreshed. A real uvicorn on a loopback port."""

from __future__ import annotations

import asyncio
import email.utils
import os
import socket
import threading
import time
import urllib.request

import pytest

from cri_resmgr.web import server as web_server

_loops: list[str] = []  # the module of the event loop each request was served on


async def _app(scope, receive, send):
    if scope["type"] != "http":
        return
    _loops.append(type(asyncio.get_running_loop()).__module__)
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": b"ok"})


class _Counting(web_server.Server):
    ticks = 0

    async def on_tick(self, counter: int) -> bool:
        type(self).ticks += 1
        return await super().on_tick(counter)


@pytest.fixture
def running():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    _Counting.ticks = 0
    srv = _Counting(web_server.config(_app, "127.0.0.1", port, "warning"))
    th = threading.Thread(target=srv.run, daemon=True)
    th.start()
    deadline = time.monotonic() + 20
    while not srv.started:
        assert time.monotonic() < deadline and th.is_alive(), "uvicorn did not start"
        time.sleep(0.02)
    yield srv, th, port
    srv.should_exit = True
    th.join(timeout=10)


def _get(port: int):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5) as r:
        return r.status, r.headers.get("date"), r.read()


def test_the_server_ticks_once_a_second_not_ten_times(running):
    srv, _, port = running
    start = _Counting.ticks
    time.sleep(3.0)
    ticks = _Counting.ticks - start
    # uvicorn's own loop ticks every 0.1 s: ~30 here
    assert 2 <= ticks <= 4, ticks
    assert _get(port)[0] == 200


def test_a_stop_from_another_thread_does_not_wait_for_the_tick(running):
    srv, th, _ = running
    time.sleep(0.3)  # inside a tick's wait
    t = time.monotonic()
    srv.should_exit = True
    th.join(timeout=10)
    assert not th.is_alive()
    assert time.monotonic() - t < 0.6  # the tick is 1 s: a stop that waited for it would take up to 1 s


def test_the_date_header_is_refreshed_every_second(running):
    _, _, port = running
    status, first, body = _get(port)
    assert (status, body) == (200, b"ok")
    assert first is not None
    time.sleep(2.2)
    later = _get(port)[1]
    assert later is not None
    d0 = email.utils.parsedate_to_datetime(first)
    d1 = email.utils.parsedate_to_datetime(later)
    assert 1 <= (d1 - d0).total_seconds() <= 4
    assert abs(d1.timestamp() - time.time()) < 2.5


def _thread_names() -> list[str]:
    out = []
    for t in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{t}/comm") as f:
                out.append(f.read().strip())
        except OSError:  # the thread ended
            pass
    return out


def test_the_api_is_served_on_asyncios_loop_without_libuvs_thread_pool(running):
    # uvicorn would pick uvloop (installed for the relay); its address lookup starts libuv's four workers,
    # which stay for the life of the process (~2 MB of RSS with their arenas)
    pytest.importorskip("uvloop")
    _, _, port = running
    _loops.clear()
    assert _get(port)[0] == 200
    assert _loops == ["asyncio.unix_events"]
    assert "libuv-worker" not in _thread_names()
