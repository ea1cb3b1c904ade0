"""Command line: ``cri-resmgr run|relay|nri|topology|config|demo|fixture``.

Exit status: 0 ok, 1 runtime failure (already running, cannot bind), 2 bad configuration or usage.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from . import __version__
from .config import ConfigError, load_config
from .exitcode import ExitCode

# (not __doc__'s first line: ``python -OO``, which drops docstrings, is a way to run the agent in less memory)
DESCRIPTION = "Command line: ``cri-resmgr run|relay|nri|topology|config|demo|fixture``."


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
        raise SystemExit(ExitCode.CONFIG) from None


def cmd_run(args: argparse.Namespace) -> int:
    from .serve import serve

    return serve(_load(args), args.config, _flags(args))


def cmd_topology(args: argparse.Namespace) -> int:
    cfg = _load(args)
    from .topology import discover
    from .topology.render import render_tree

    topo = discover(cfg.paths.sysfs)
    if not topo.cpus:
        print(f"cri-resmgr: no CPUs found under {cfg.paths.sysfs}/devices/system/cpu", file=sys.stderr)
        return ExitCode.FAIL
    if args.json:
        from .web.app import topology_model

        print(json.dumps(topology_model(topo).model_dump(), indent=2))
    else:
        print(render_tree(topo))
    return ExitCode.OK


def cmd_config(args: argparse.Namespace) -> int:
    cfg = _load(args)
    import yaml

    print(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False), end="")
    return ExitCode.OK


def cmd_fixture(args: argparse.Namespace) -> int:
    from .topology.fixtures import MACHINES, build_sysfs

    if args.machine not in MACHINES:
        print(f"cri-resmgr: unknown machine {args.machine!r}; choose from {', '.join(MACHINES)}", file=sys.stderr)
        return ExitCode.CONFIG
    out = build_sysfs(MACHINES[args.machine], args.dir)
    print(f"wrote sysfs tree for {args.machine} to {out}")
    return ExitCode.OK


def cmd_relay(args: argparse.Namespace) -> int:
    cfg = _load(args)
    logging.basicConfig(level=cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from .relay.server import run

    return run(cfg, lambda: load_config(args.config, flags=_flags(args)))  # SIGHUP re-reads the file


def cmd_nri(args: argparse.Namespace) -> int:
    cfg = _load(args)
    logging.basicConfig(level=cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from .nri.server import run

    return run(cfg, lambda: load_config(args.config, flags=_flags(args)))  # SIGHUP re-reads the file


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(_load(args), args.config, _flags(args), cpu_quota=args.cpu_quota, clean=args.clean)


class _VersionAction(argparse.Action):
    """``--version``: the version and the optional parts this install has (cri_resmgr/parts.py)."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs) -> None:
        super().__init__(option_strings, dest, nargs=0, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *_args) -> None:
        from .parts import render

        print(render(__version__))
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cri-resmgr", description=DESCRIPTION)
    p.add_argument("--version", action=_VersionAction, help="print the version and which optional parts are present")
    sub = p.add_subparsers(dest="cmd", required=True)
    # Subcommands that read the configuration: name, help, handler.
    configured = [
        ("run", "run the node agent", cmd_run),
        ("topology", "print the CPU/cache/NUMA topology as a tree", cmd_topology),
        ("config", "validate the configuration and print the effective result", cmd_config),
        ("relay", "run the CRI relay between kubelet and the runtime (docs/relay.md)", cmd_relay),
        ("nri", "run as an NRI plugin of containerd >= 1.7 / CRI-O >= 1.26 (docs/nri.md)", cmd_nri),
        ("demo", "the agent plus labelled sample workloads in their own cgroups (root)", cmd_demo),
    ]
    subs: dict[str, argparse.ArgumentParser] = {}
    for name, help_text, handler in configured:
        subs[name] = sub.add_parser(name, help=help_text)
        _common_config_args(subs[name])
        subs[name].set_defaults(fn=handler)
    subs["topology"].add_argument("--json", action="store_true", help="print JSON (the /api/v1/topology shape)")
    from .demo import add_arguments as _demo_arguments

    _demo_arguments(subs["demo"])
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
