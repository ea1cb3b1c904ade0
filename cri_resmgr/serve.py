"""Run the node agent with its HTTP server until SIGINT/SIGTERM: what ``cri-resmgr run`` and ``cri-resmgr demo`` do
once they have a configuration. SIGHUP reloads the configuration file (Agent.reload)."""

from __future__ import annotations

import logging
import signal
import sys
from pathlib import Path

from . import __version__
from .config import Config
from .exitcode import ExitCode

log = logging.getLogger("cri_resmgr")


def serve(cfg: Config, config_path: Path | None, flags: dict) -> ExitCode:
    """Start the agent, serve HTTP on ``cfg.listen``, stop the agent (checkpoint included) on the way out."""
    logging.basicConfig(level=cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from .agent import Agent
    from .runfiles import AlreadyRunning
    from .web.app import create_app
    from .web.server import Server, config

    agent = Agent(cfg, config_path, flags=flags)
    try:
        agent.start()
    except AlreadyRunning as e:
        print(f"cri-resmgr: {e}", file=sys.stderr)
        return ExitCode.FAIL
    except PermissionError as e:
        print(f"cri-resmgr: cannot create {e.filename}: {e.strerror}", file=sys.stderr)
        return ExitCode.FAIL

    server: Server | None = None

    def on_hup(_sig, _frm):
        agent.reload()

    def on_term(_sig, _frm):
        # uvicorn installs its own handler while serving and re-raises the signal after shutdown;
        # this handler then only makes sure the server stops, so the checkpoint below still runs.
        if server is not None:
            server.should_exit = True

    signal.signal(signal.SIGHUP, on_hup)
    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    host, port = cfg.listen_address()
    # Heavy queries run in worker threads and hold the GIL in turns; the event loop that answers /healthz and
    # /metrics waits for each turn. Shorter turns (default 5 ms) keep it answering under load (issue 12).
    sys.setswitchinterval(0.001)
    server = Server(config(create_app(agent, check_host=True), host, port, cfg.log_level))
    log.info("cri-resmgr %s on node %s listening on http://%s:%d", __version__, cfg.node_name, host, port)
    try:
        server.run()
    finally:
        agent.stop()
    if not server.started:
        print(f"cri-resmgr: could not serve on {cfg.listen}", file=sys.stderr)
        return ExitCode.FAIL
    return ExitCode.OK
