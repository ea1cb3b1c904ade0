"""``cri-resmgr rebalance``: plans for a scenario file without a running agent, scenario generation,
and the scenario JSON schema.

    cri-resmgr rebalance --scenario FILE [--rounds N] [--config FILE]
    cri-resmgr rebalance --generate FAMILY [--machine NAME] [--containers N] [--seed N]
    cri-resmgr rebalance --schema
    cri-resmgr rebalance --calibrate [--seconds 12] [--array-mib 256] [--hog read|copy] [--hog-duty 0.5]
                                     [--second-hog-duty 0.75] [--peak-first hog|probe]
    cri-resmgr rebalance --calibration-pool REPORT.json [REPORT.json ...]

With one round the output is the plan (moves, cost before/after, migration cost); with ``--rounds N``
each round's plan is applied before the next and the output is ``{"rounds": [plan, ...]}``. The
configuration's ``rebalancer`` section (``--config``) is the base the scenario's own ``rebalancer``
overrides. Exit status 2 for an invalid scenario or configuration, with every problem on stderr.
``--calibrate`` exits 0 when it measured (the report says whether the model is within ±25 %), 1 when
it could not: a worker failed, or too few rounds were clean (the report is printed, without figures).
``--calibration-pool`` prints one report over the rounds of several ``--calibrate`` reports with the same
settings (exit 0 / 1 likewise; 2 for an unreadable report or different settings).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..config import Config

EXIT_OK, EXIT_CONFIG = 0, 2


def add_parser(sub, common_args) -> None:
    p = sub.add_parser("rebalance", help="plan moves for a scenario file, or generate scenarios (docs/rebalancer.md)")
    common_args(p)
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--scenario", type=Path, help="scenario JSON file")
    g.add_argument("--generate", metavar="FAMILY", help="print a generated scenario of this family")
    g.add_argument("--schema", action="store_true", help="print the scenario JSON schema")
    g.add_argument("--calibrate", action="store_true",
                   help="measure a memory-bandwidth hog beside a memory-bound probe on this machine and compare "
                        "the model's predicted slowdown with the measured one")
    g.add_argument("--calibration-pool", nargs="+", type=Path, metavar="REPORT",
                   help="one calibration report over the rounds of several --calibrate reports (same settings)")
    p.add_argument("--seconds", type=float, default=12.0,
                   help="--calibrate: seconds of clean rounds per phase (nine phases; at most 4x as many rounds, "
                        "150 s)")
    p.add_argument("--array-mib", type=int, default=256, help="--calibrate: MiB per streamed array")
    p.add_argument("--hog", choices=("read", "copy"), default="read",
                   help="--calibrate: the hog's kernel (read: the probe's own, one unit for the model)")
    p.add_argument("--peak-first", choices=("hog", "probe"), default="hog",
                   help="--calibrate: what streams on the probe's CPU in the peak phase (probe: an experiment, "
                        "docs/rebalancer.md)")
    p.add_argument("--hog-duty", type=float, default=0.5,
                   help="--calibrate: the throttled hog's share of time streaming (the first held-out point)")
    p.add_argument("--second-hog-duty", type=float, default=0.75,
                   help="--calibrate: the second throttled hog's share of time streaming (the second held-out point)")
    p.add_argument("--rounds", type=int, default=1, help="plan, apply and plan again this many times")
    p.add_argument("--machine", default="xeon-2s-112c-snc2", help="fixture machine for --generate")
    p.add_argument("--containers", type=int, default=50, help="containers for --generate")
    p.add_argument("--seed", type=int, default=0, help="random seed for --generate")
    p.set_defaults(fn=cmd_rebalance)


def cmd_rebalance(args: argparse.Namespace) -> int:
    from ..config import ConfigError, load_config
    from .scenario import Scenario, ScenarioError, load_scenario
    from .simulator import FAMILIES, generate, simulate

    if args.schema:
        print(json.dumps(Scenario.model_json_schema(), indent=2))
        return EXIT_OK
    if args.calibrate:
        return cmd_calibrate(args)
    if args.calibration_pool:
        return cmd_calibration_pool(args)
    if args.generate:
        from ..topology.fixtures import MACHINES

        if args.generate not in FAMILIES:
            print(f"cri-resmgr: unknown family {args.generate!r}; choose from {', '.join(FAMILIES)}", file=sys.stderr)
            return EXIT_CONFIG
        if args.machine not in MACHINES:
            print(f"cri-resmgr: unknown machine {args.machine!r}; choose from {', '.join(MACHINES)}", file=sys.stderr)
            return EXIT_CONFIG
        sc = generate(args.generate, args.machine, args.containers, args.seed)
        print(sc.model_dump_json(indent=2, exclude_defaults=True))
        return EXIT_OK
    if args.rounds < 1:
        print("cri-resmgr: --rounds must be at least 1", file=sys.stderr)
        return EXIT_CONFIG
    try:
        base = load_config(args.config, env={}).rebalancer if args.config else None
    except ConfigError as e:
        print(e.render(), file=sys.stderr)
        return EXIT_CONFIG
    try:
        sc = load_scenario(args.scenario)
        results = simulate(sc, base, rounds=args.rounds)
    except ScenarioError as e:
        print(e.render(), file=sys.stderr)
        return EXIT_CONFIG
    plans = [r.plan.model_dump(mode="json") for r in results]
    print(dumps_finite(plans[0] if args.rounds == 1 else {"rounds": plans}))
    return EXIT_OK


def _config(args: argparse.Namespace) -> Config | None:
    """The agent config of ``--config`` (defaults without one); None, with the problems printed, when invalid."""
    from ..config import ConfigError, load_config

    try:
        return load_config(args.config, env={})
    except ConfigError as e:
        print(e.render(), file=sys.stderr)
        return None


def cmd_calibrate(args: argparse.Namespace) -> int:
    from ..topology import discover
    from .calibrate import MIN_CLEAN_ROUNDS, SLICE_SECONDS, CalibrationError, calibrate

    if (not MIN_CLEAN_ROUNDS * SLICE_SECONDS <= args.seconds <= 60 or not 16 <= args.array_mib <= 4096
            or not 0.1 <= args.hog_duty <= 0.9 or not 0.1 <= args.second_hog_duty <= 0.9):
        print(f"cri-resmgr: --seconds must be in [{MIN_CLEAN_ROUNDS * SLICE_SECONDS:g}, 60] (enough clean rounds "
              "to measure), --array-mib in [16, 4096], --hog-duty and --second-hog-duty in [0.1, 0.9]",
              file=sys.stderr)
        return EXIT_CONFIG
    cfg = _config(args)
    if cfg is None:
        return EXIT_CONFIG
    try:
        result = calibrate(discover(cfg.paths.sysfs), args.seconds, args.array_mib,
                           weight=cfg.rebalancer.weights.memory_bandwidth, hog=args.hog, proc=cfg.paths.proc,
                           duty=args.hog_duty, peak_first=args.peak_first, second_duty=args.second_hog_duty)
    except (ValueError, CalibrationError, OSError) as e:
        print(f"cri-resmgr: calibration failed: {e}", file=sys.stderr)
        return 1
    print(dumps_finite(result.as_dict()))
    if not result.conclusive:  # the report (every round) is printed, but no measured figure: exit 1
        print(f"cri-resmgr: calibration: {result.verdict}; the machine was too busy to measure", file=sys.stderr)
        return 1
    return EXIT_OK


def cmd_calibration_pool(args: argparse.Namespace) -> int:
    from .calibrate import CalibrationError, pool

    cfg = _config(args)
    if cfg is None:
        return EXIT_CONFIG
    try:
        reports = [json.loads(p.read_text()) for p in args.calibration_pool]
        result = pool(reports, weight=cfg.rebalancer.weights.memory_bandwidth)
    except (OSError, ValueError, CalibrationError) as e:  # json.JSONDecodeError is a ValueError
        print(f"cri-resmgr: --calibration-pool: {e}", file=sys.stderr)
        return EXIT_CONFIG
    print(dumps_finite(result.as_dict()))
    if not result.conclusive:
        print(f"cri-resmgr: calibration: {result.verdict}", file=sys.stderr)
        return 1
    return EXIT_OK


def finite(value: Any) -> Any:
    """``value`` with every non-finite float as null: JSON has no Infinity or NaN (RFC 8259 §6)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def dumps_finite(value: Any) -> str:
    return json.dumps(finite(value), indent=2, allow_nan=False)
