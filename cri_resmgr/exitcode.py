"""Exit statuses of every ``cri-resmgr`` subcommand (one home, so the relay, demo and rebalancer agree)."""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    OK = 0
    FAIL = 1  # runtime failure: already running, cannot bind, cannot create a directory
    CONFIG = 2  # bad configuration or usage (argparse exits 2 too)
