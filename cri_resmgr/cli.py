"""Command line: ``cri-resmgr run|relay|topology|config|demo|fixture``.

Exit status: 0 ok, 1 runtime failure (already running, cannot bind), 2 bad configuration or usage.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
from pathlib import Path

from . import __version__
from .config import ConfigError, load_config

log = logging.getLogger("cri_resmgr")

EXIT_OK, EXIT_FAIL, EXIT_CONFIG = 0, 1, 2


def _common_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=Path, help="YAML configuration file (see README, 'Configuration')")
    p.add_argument("--listen", help="HOST:PORT for HTTP (default 127.0.0.1:8891)")
    p.add_argument("--state-dir", type=Path, help="where the store checkpoint lives (default /var/lib/cri-resmgr)")
    p.add_argument("--run-dir", type=Path, help="lock and sockets (default /var/run/cri-resmgr)")
    p.add_argument("--node-name", help="node name for node_overrides (default $NODE_NAME, then hostname)")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    p.add_argument("--sysfs", type=Path, help="sysfs root (paths.sysfs)")


def _flags(args: argparse.Namespace) -> dict:
    flags: dict = {
        "listen": args.listen,
        "state_dir": str(args.state_dir) if args.state_dir else None,
        "run_dir": str(args.run_dir) if args.run_dir else None,
        "node_name": args.node_name,
        "log_level": args.log_level,
    }
    if args.sysfs:
        flags["paths"] = {"sysfs": str(args.sysfs)}
    return {k: v for k, v in flags.items() if v is not None}


def _load(args: argparse.Namespace):
    try:
        return load_config(args.config, flags=_flags(args))
    except ConfigError as e:
        print(e.render(), file=sys.stderr)
        raise SystemExit(EXIT_CONFIG) from None


def cmd_run(args: argparse.Namespace) -> int:
    cfg = _load(args)
    logging.basicConfig(level=cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import uvicorn

    from .agent import Agent, AlreadyRunning
    from .web.app import create_app

    agent = Agent(cfg, args.config, flags=_flags(args))
    try:
        agent.start()
    except AlreadyRunning as e:
        print(f"cri-resmgr: {e}", file=sys.stderr)
        return EXIT_FAIL
    except PermissionError as e:
        print(f"cri-resmgr: cannot create {e.filename}: {e.strerror}", file=sys.stderr)
        return EXIT_FAIL

    server: uvicorn.Server | None = None

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
    ucfg = uvicorn.Config(create_app(agent), host=host, port=port, log_level=cfg.log_level,
                          access_log=False, lifespan="off")
    server = uvicorn.Server(ucfg)
    log.info("cri-resmgr %s on node %s listening on http://%s:%d", __version__, cfg.node_name, host, port)
    try:
        server.run()
    finally:
        agent.stop()
    if not server.started:
        print(f"cri-resmgr: could not serve on {cfg.listen}", file=sys.stderr)
        return EXIT_FAIL
    return EXIT_OK


def cmd_topology(args: argparse.Namespace) -> int:
    cfg = _load(args)
    from .topology import discover
    from .topology.render import render_tree

    topo = discover(cfg.paths.sysfs)
    if not topo.cpus:
        print(f"cri-resmgr: no CPUs found under {cfg.paths.sysfs}/devices/system/cpu", file=sys.stderr)
        return EXIT_FAIL
    if args.json:
        from .web.app import topology_model

        print(json.dumps(topology_model(topo).model_dump(), indent=2))
    else:
        print(render_tree(topo))
    return EXIT_OK


def cmd_config(args: argparse.Namespace) -> int:
    cfg = _load(args)
    import yaml

    print(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False), end="")
    return EXIT_OK


def cmd_fixture(args: argparse.Namespace) -> int:
    from .topology.fixtures import MACHINES, build_sysfs

    if args.machine not in MACHINES:
        print(f"cri-resmgr: unknown machine {args.machine!r}; choose from {', '.join(MACHINES)}", file=sys.stderr)
        return EXIT_CONFIG
    out = build_sysfs(MACHINES[args.machine], args.dir)
    print(f"wrote sysfs tree for {args.machine} to {out}")
    return EXIT_OK


def cmd_relay(args: argparse.Namespace) -> int:
    cfg = _load(args)
    logging.basicConfig(level=cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from .relay.server import run

    return run(cfg)


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cri-resmgr", description=__doc__.splitlines()[0])
    p.add_argument("--version", action="version", version=f"cri-resmgr {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run the node agent")
    _common_config_args(r)
    r.set_defaults(fn=cmd_run)
    t = sub.add_parser("topology", help="print the CPU/cache/NUMA topology as a tree")
    _common_config_args(t)
    t.add_argument("--json", action="store_true", help="print JSON (the /api/v1/topology shape)")
    t.set_defaults(fn=cmd_topology)
    c = sub.add_parser("config", help="validate the configuration and print the effective result")
    _common_config_args(c)
    c.set_defaults(fn=cmd_config)
    rl = sub.add_parser("relay", help="run the CRI relay between kubelet and the runtime (docs/relay.md)")
    _common_config_args(rl)
    rl.set_defaults(fn=cmd_relay)
    dm = sub.add_parser("demo", help="the agent plus labelled sample workloads in their own cgroups (root)")
    _common_config_args(dm)
    from .demo import add_arguments as _demo_arguments

    _demo_arguments(dm)
    dm.set_defaults(fn=cmd_demo)
    f = sub.add_parser("fixture", help="write a fake sysfs tree for a known machine (tests, demos)")
    f.add_argument("machine", help="this-vm, xeon-2s-112c-snc2, epyc-1s-64c-8l3, small-offline-isolated")
    f.add_argument("dir", type=Path)
    f.set_defaults(fn=cmd_fixture)
    from .rebalancer.cli import add_parser as add_rebalance_parser

    add_rebalance_parser(sub, _common_config_args)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
