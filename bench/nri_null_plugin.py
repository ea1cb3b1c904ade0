"""A do-nothing NRI plugin for bench/nri_bench.py: registers, subscribes to the same events as ``cri-resmgr nri``
and answers every request at once with an empty answer (no adjustment, no update).

A containerd with this plugin pays NRI's own cost per event (it builds the pod and container messages, makes the
ttrpc round trip and waits for the answer) and nothing of cri-resmgr's placement: against a containerd without
plugins it gives the runtime's inherent NRI overhead; cri-resmgr's plugin against it gives the plugin's own cost.
Uses the plugin's framing and ttrpc code (cri_resmgr.nri), so the wire side costs the same.

    .venv/bin/python bench/nri_null_plugin.py NRI_SOCKET
"""

from __future__ import annotations

import signal
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import FrameType

import _util  # noqa: F401  (puts the repo on sys.path)

from cri_resmgr.nri import convert
from cri_resmgr.nri.connection import Connection
from cri_resmgr.nri.plugin import EMPTY, SUBSCRIBED
from cri_resmgr.nri.proto import nri_pb2 as api
from cri_resmgr.nri.ttrpc import Call, Method

METHODS = ("Synchronize", "Shutdown", "CreateContainer", "UpdateContainer", "StopContainer", "StateChange",
           "RunPodSandbox", "StopPodSandbox", "RemovePodSandbox", "StartContainer", "RemoveContainer")


def configure(_raw: bytes, _call: Call) -> bytes:
    return api.ConfigureResponse(events=convert.events_mask(list(SUBSCRIBED))).SerializeToString()


def empty(_raw: bytes, _call: Call) -> bytes:
    return EMPTY


def main() -> int:
    stop = threading.Event()

    def on_term(_sig: int, _frm: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    methods = {"Configure": Method(configure, inline=True), **{m: Method(empty, inline=True) for m in METHODS}}
    with ThreadPoolExecutor(max_workers=1) as executor:
        conn = Connection(Path(sys.argv[1]), methods, executor, budget_seconds=1.5)
        conn.register("null", "10", timeout_seconds=10)
        print("registered", flush=True)
        while not stop.is_set() and not conn.closed.wait(0.5):
            pass
        conn.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
