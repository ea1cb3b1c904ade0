"""Rebalancer benchmark: plan quality against three baselines and plan time, measured in one run.

Quality is the objective the planner minimises, ``J = amortization_seconds × interference + migration``
(docs/rebalancer.md), of the placement each method leaves, on the simulator's families:

- **nothing**: no move (J0);
- **ancestor**: the ancestor project's AVX512 affinity heuristic — AVX512 containers attract each other
  (+5), repel the others (−5), contributions decaying by 0.75 per level of the topology tree between
  the candidate node and the other container's node; each container (in id order) moves to its
  best-scoring node with room (mean CPU load ≤ 1 after the move) if that beats where it is;
- **planner**: this planner, one round, default hysteresis, moves per round not limited;
- **optimum**: the exact optimum of the same cost model over the same decision space (HiGHS MILP via
  highspy, ``pip install '.[bench]'``), on instances of up to 24 containers.

The gap is ``(J_planner − J_opt) / J_opt``; "captured" is the share of the achievable improvement
``(J0 − J_planner) / (J0 − J_opt)``. Plan time: 500 containers on the 224-CPU ``xeon-2s-112c-snc2``
fixture (default configuration, and with 20 moves per round), median of repeated runs.

    python bench/rebalancer_bench.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cri_resmgr.config import RebalancerConfig
from cri_resmgr.rebalancer.model import CostModel
from cri_resmgr.rebalancer.planner import Planner
from cri_resmgr.rebalancer.problem import AVX, DEMAND, Problem, State
from cri_resmgr.rebalancer.simulator import FAMILIES, generate
from cri_resmgr.sysfs import parse_cpulist
from cri_resmgr.topology.fixtures import MachineSpec

MID = MachineSpec("bench-1s-2d-6c-snc2", packages=1, dies_per_package=2, cores_per_die=6, threads_per_core=2,
                  numa_per_package=2, l3_per_die=1, l3_kib_per_domain=16384)
SMALL = MachineSpec("bench-2s-4c-snc2-sstbf", packages=2, dies_per_package=1, cores_per_die=4, threads_per_core=2,
                    numa_per_package=2, l3_per_die=1, l3_kib_per_domain=16384, base_frequency_khz=2000000,
                    base_frequency_overrides_khz={c: 2600000 for c in (0, 4, 8, 12)})


# -- the ancestor's heuristic ------------------------------------------------------------------------
def ancestor_heuristic(prob: Problem) -> tuple[np.ndarray, dict[int, int]]:
    cand = prob.cands
    st = State(prob)
    n = prob.n
    avx = prob.X[:, AVX] > 0
    # Node of each container: the smallest candidate whose interval holds its cpuset.
    lo, hi = cand.lo, cand.hi

    def node_of(row: np.ndarray) -> int:
        pos = np.flatnonzero(row > 0)
        fits = np.flatnonzero((lo <= pos.min()) & (hi > pos.max()))
        return int(fits[np.argmax(hi[fits] - lo[fits] == (hi[fits] - lo[fits]).min())]) if len(fits) else 0

    # Depth of the lowest common ancestor of two candidates (the deepest candidate containing both).
    contains = (lo[:, None] <= lo[None, :]) & (hi[:, None] >= hi[None, :])  # a contains b
    depth = cand.depth
    lca = np.zeros((cand.n, cand.n))
    for a in range(cand.n):
        both = contains[:, a][:, None] & contains  # c contains a and b
        lca[a] = np.where(both, depth[:, None], -1).max(axis=0)
    decay = 0.75 ** (depth[:, None] - lca)  # candidate c vs other's node m: levels up from c to the LCA
    nodes = np.array([node_of(st.S[i]) for i in range(n)])
    choice: dict[int, int] = {}
    for i in range(n):
        if not prob.movable[i]:
            continue
        aff = np.where(avx[i], np.where(avx, 5.0, -5.0), np.where(avx, -5.0, 0.0))
        aff[i] = 0.0
        if not aff.any():
            continue
        score = decay[:, nodes] @ aff
        load = cand.mean(st.F[:, DEMAND])
        d = prob.X[i, DEMAND]
        own = (st.S[i] * d) @ cand.rows.T  # this container's current share of each candidate's load
        room = load - own + d / cand.size <= 1.0
        room &= cand.size >= prob.need[i]
        if not room.any():
            continue
        c = int(np.flatnonzero(room)[np.argmax(score[room])])
        if score[c] > score[nodes[i]] + 1e-9 and c != prob.current[i]:
            st.set_row(i, cand.row(c))
            nodes[i] = c
            choice[i] = c
    return st.S, choice


def objective(prob: Problem, model: CostModel, rows: np.ndarray, choice: dict[int, int],
              migration_factor: float = 1.0) -> float:
    from cri_resmgr.rebalancer.exact import objective_of

    return objective_of(prob, model, rows, choice, migration_factor)


# -- runs --------------------------------------------------------------------------------------------
def instance(fam: str, machine: MachineSpec | str, n: int, seed: int, budget: int, milp: bool,
             limit_s: float) -> dict:
    """One instance: the default planner against the MILP of its own objective (migration × (1 +
    gain_margin), the hysteresis), and the planner without hysteresis against the plain MILP."""
    sc = generate(fam, machine, n, seed=seed, numa_bandwidth_bytes_per_second=20e9,
                  rebalancer={"max_moves_per_round": budget})
    cfg = sc.config()
    node = sc.node_model(cfg)
    prob = Problem.build(node, sc.inputs(), cfg, now=0.0)
    model = CostModel(cfg)
    plan = Planner(cfg, model).plan(prob)
    cfg0 = cfg.model_copy(update={"gain_margin": 0.0, "min_net_gain": 1e-6})
    prob0 = Problem.build(node, sc.inputs(), cfg0, now=0.0)
    plan0 = Planner(cfg0, CostModel(cfg0)).plan(prob0)
    hs, hc = ancestor_heuristic(prob)
    factor = 1.0 + cfg.gain_margin
    j_plan = objective(prob, model, *rows_of(prob, plan), factor)
    r = dict(n=n, family=fam, seed=seed, budget=budget, machine=machine if isinstance(machine, str) else machine.name,
             j0=plan.objective_before, heur=objective(prob, model, hs, hc), heur_moves=len(hc),
             plan=j_plan, plan_moves=len(plan.moves), plan_ms=plan.duration_seconds * 1e3,
             plan0=plan0.objective_after, plan0_moves=len(plan0.moves), plan0_ms=plan0.duration_seconds * 1e3)
    if milp:
        from cri_resmgr.rebalancer.exact import optimum

        ex = optimum(prob, model, limit_s, migration_factor=factor)
        ex0 = optimum(prob0, CostModel(cfg0), limit_s)
        r.update(opt=ex.objective, opt_moves=len(ex.choice), opt_s=ex.seconds + ex0.seconds,
                 status=ex.status if ex.status != "Optimal" else ex0.status, opt0=ex0.objective,
                 opt0_moves=len(ex0.choice))
    return r


def rows_of(prob: Problem, plan) -> tuple[np.ndarray, dict[int, int]]:
    """The placement a plan leaves, as share rows and the candidate each moved container took."""
    index = {c.id: i for i, c in enumerate(prob.containers)}
    rows = prob.S0.copy()
    choice = {}
    for m in plan.moves:
        i = index[m.container_id]
        c = prob.cands.index_of(prob.node.positions(parse_cpulist(m.to_cpus)))
        rows[i] = prob.cands.row(c)
        choice[i] = c
    return rows, choice


def quality(sizes: list[int], seeds: list[int], milp: bool, limit_s: float, budget: int | None = None,
            families: list[str] | None = None, out: Path | None = None) -> list[dict]:
    rows = []
    for n in sizes:
        for fam in families or FAMILIES:
            for seed in seeds:
                r = instance(fam, SMALL, n, seed, budget or n, milp, limit_s)
                rows.append(r)
                print_row(r, out, "unlimited" if budget is None else "budget")
    return rows


def random_instances(count: int, milp: bool, limit_s: float, first: int = 0, out: Path | None = None) -> list[dict]:
    """Instances ``first`` … ``first + count − 1`` of one fixed sequence across families, machines, sizes and
    move budgets (a part of the sequence is the same instances as in a whole run); every parameter printed."""
    rng = np.random.default_rng(20261203)
    fams = list(FAMILIES)
    rows = []
    for k in range(first + count):
        fam = fams[k % len(fams)]
        machine = (SMALL, MID)[int(rng.integers(2))]
        n = int(rng.choice([8, 12, 16, 24]))
        budget = int(rng.choice([2, 3, 4, 6, n]))
        if k < first:
            continue
        r = instance(fam, machine, n, 100 + k, budget, milp, limit_s)
        rows.append(r)
        print_row(r, out, "random")
    return rows


def print_header(milp: bool) -> None:
    cols = (f"{'machine':22s} {'n':>3} {'mv':>3} {'family':17s} {'seed':>4} {'nothing':>9} {'ancestor':>9} {'mv':>3} "
            f"{'planner':>9} {'mv':>3} {'ms':>6}")
    cols += f" {'no-hyst':>9} {'mv':>3}"
    if milp:
        cols += f" {'optimum':>9} {'mv':>3} {'solve s':>7} {'gap %':>6} {'gap0 %':>6} {'captured':>8}"
    print(cols)


def print_row(r: dict, out: Path | None = None, table: str = "") -> None:
    line = (f"{r['machine']:22s} {r['n']:3d} {r['budget']:3d} {r['family']:17s} {r['seed']:4d} {r['j0']:9.1f} "
            f"{r['heur']:9.1f} {r['heur_moves']:3d} "
            f"{r['plan']:9.1f} {r['plan_moves']:3d} {r['plan_ms']:6.1f} {r['plan0']:9.1f} {r['plan0_moves']:3d}")
    if "opt" in r:
        def gap_of(j):
            return (j - r["opt"]) / r["opt"] * 100 if r["opt"] > 1e-9 else 0.0
        gap = gap_of(r["plan"])
        gap0 = (r["plan0"] - r["opt0"]) / r["opt0"] * 100 if r["opt0"] > 1e-9 else 0.0
        cap = (r["j0"] - r["plan"]) / (r["j0"] - r["opt"]) * 100 if r["j0"] - r["opt"] > 1e-9 else 100.0
        r["gap"], r["gap0"], r["captured"] = gap, gap0, cap
        flag = "" if r["status"] == "Optimal" else f" ({r['status']})"
        line += f" {r['opt']:9.1f} {r['opt_moves']:3d} {r['opt_s']:7.1f} {gap:6.1f} {gap0:6.1f} {cap:7.1f}%{flag}"
    print(line, flush=True)
    if out is not None:
        with out.open("a") as f:
            f.write(json.dumps({"table": table, **r}) + "\n")


def summary(rows: list[dict], milp: bool) -> None:
    print("\nsummary per family (mean over instances)")
    extra = (f" {'gap %':>6} {'max gap':>7} {'gap0 %':>6} {'max gap0':>8} {'captured':>8} {'mv plan':>7} "
             f"{'mv opt':>6}") if milp else ""
    print(f"{'family':17s} {'ancestor/J0':>11} {'planner/J0':>10}" + extra)
    for fam in list(FAMILIES) + ["all"]:
        rs = [r for r in rows if fam in ("all", r["family"])]
        if not rs:
            continue
        h = statistics.mean(r["heur"] / r["j0"] if r["j0"] > 0 else 1.0 for r in rs)
        p = statistics.mean(r["plan"] / r["j0"] if r["j0"] > 0 else 1.0 for r in rs)
        line = f"{fam:17s} {h:11.3f} {p:10.3f}"
        if milp:
            line += (f" {statistics.mean(r['gap'] for r in rs):6.1f} {max(r['gap'] for r in rs):7.1f} "
                     f"{statistics.mean(r['gap0'] for r in rs):6.1f} {max(r['gap0'] for r in rs):8.1f} "
                     f"{statistics.mean(r['captured'] for r in rs):7.1f}% "
                     f"{sum(r['plan_moves'] for r in rs):7d} {sum(r['opt_moves'] for r in rs):6d}")
        print(line)
    if milp:
        within = sum(r["gap"] <= 5.0 for r in rows)
        within0 = sum(r["gap0"] <= 5.0 for r in rows)
        fewer = sum(r["plan_moves"] <= r["opt_moves"] for r in rows)
        fewer0 = sum(r["plan0_moves"] <= r["opt0_moves"] for r in rows)
        print(f"\nwithin 5% of the optimum: default {within}/{len(rows)}, "
              f"no hysteresis {within0}/{len(rows)} instances; "
              f"no more moves than the optimum: default {fewer}/{len(rows)}, no hysteresis {fewer0}/{len(rows)}")


def summarize(path: Path) -> int:
    """The summaries of rows appended by parts of a run (--jsonl), one per table; the last row of an
    instance counts (a part run again replaces its rows)."""
    latest: dict[tuple, dict] = {}
    for line in path.read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            latest[(r["table"], r["machine"], r["n"], r["budget"], r["family"], r["seed"])] = r
    for table in ("unlimited", "budget", "random"):
        rows = [r for k, r in latest.items() if k[0] == table]
        if rows:
            print(f"\n{table}: {len(rows)} instances")
            print_header("opt" in rows[0])
            for r in rows:
                print_row(r)
            summary(rows, "opt" in rows[0])
    return 0


def big_machine(limit_s: float, milp: bool, plain: bool = False) -> None:
    """24 containers on the 224-CPU fixture, 4 moves: the planner against the MILP (symmetry rows on, the
    planner's placement as its start); with ``plain``, also the first encoding of the AVX-512 products
    (McCormick on the whole product) as the same-run baseline of the solve time."""
    print(f"\n24 containers on xeon-2s-112c-snc2 (224 CPUs), 4 moves per round, seed 3; MILP limit {limit_s:.0f} s")
    print(f"{'family':17s} {'nothing':>9} {'planner':>9} {'mv':>3} {'plan ms':>7} {'optimum':>9} {'mv':>3} "
          f"{'solve s':>7} {'sym rows':>8} {'gap %':>6} status" + ("  | plain products" if plain else ""))
    for fam in FAMILIES:
        sc = generate(fam, "xeon-2s-112c-snc2", 24, seed=3, rebalancer={"max_moves_per_round": 4})
        cfg = sc.config()
        prob = Problem.build(sc.node_model(cfg), sc.inputs(), cfg, now=0.0)
        model = CostModel(cfg)
        plan = Planner(cfg, model).plan(prob)
        factor = 1.0 + cfg.gain_margin
        j = objective(prob, model, *rows_of(prob, plan), factor)
        ms = plan.duration_seconds * 1e3
        line = f"{fam:17s} {plan.objective_before:9.1f} {j:9.1f} {len(plan.moves):3d} {ms:7.0f}"
        if milp:
            from cri_resmgr.rebalancer.exact import Encoder

            # The planner's placement is the first incumbent (a MIP start): what remains is the proof.
            enc = Encoder(prob, model, factor)
            ex = enc.solve(limit_s, start=rows_of(prob, plan)[1])
            gap = (j - ex.objective) / ex.objective * 100 if ex.objective > 1e-9 else 0.0
            line += (f" {ex.objective:9.1f} {len(ex.choice):3d} {ex.seconds:7.1f} {enc.symmetry_rows:8d} {gap:6.1f} "
                     f"{ex.status}")
            if plain:
                ref = Encoder(prob, model, factor, products="plain").solve(limit_s, start=rows_of(prob, plan)[1])
                line += f"  | {ref.seconds:7.1f} {ref.status} ({ref.objective:.1f})"
        print(line, flush=True)


def scale_quality(n: int) -> None:
    print(f"\nquality at scale: {n} containers on xeon-2s-112c-snc2 (no exact optimum), J relative to doing nothing")
    print(f"{'family':17s} {'nothing':>10} {'ancestor':>9} {'mv':>4} {'planner(4)':>10} {'mv':>3} "
          f"{'planner(20)':>11} {'mv':>3}")
    for fam in FAMILIES:
        sc = generate(fam, "xeon-2s-112c-snc2", n, seed=1)
        out = []
        for limit in (4, 20):
            cfg = sc.config(RebalancerConfig(max_moves_per_round=limit))
            prob = Problem.build(sc.node_model(cfg), sc.inputs(), cfg, now=0.0)
            out.append(Planner(cfg).plan(prob))
        cfg = sc.config()
        prob = Problem.build(sc.node_model(cfg), sc.inputs(), cfg, now=0.0)
        hs, hc = ancestor_heuristic(prob)
        j0 = out[0].objective_before
        print(f"{fam:17s} {j0:10.1f} {objective(prob, CostModel(cfg), hs, hc) / j0:9.3f} {len(hc):4d} "
              f"{out[0].objective_after / j0:10.3f} {len(out[0].moves):3d} {out[1].objective_after / j0:11.3f} "
              f"{len(out[1].moves):3d}")


def plan_time(n: int = 500, repeats: int = 7) -> None:
    print(f"\nplan time: {n} containers on xeon-2s-112c-snc2 (224 CPUs); build = inputs -> model, plan = search")
    print("(ms: wall-clock medians; cpu ms: process CPU time, less sensitive to a loaded machine)")
    print(f"{'family':17s} {'moves/round':>11} {'build ms':>9} {'plan ms':>8} {'total ms':>9} {'max ms':>7} "
          f"{'cold ms':>8} {'cpu ms':>7} {'moves':>5}")
    for fam in FAMILIES:
        sc = generate(fam, "xeon-2s-112c-snc2", n, seed=1)
        inputs = sc.inputs()
        for limit in (4, 20):
            cfg = sc.config(RebalancerConfig(max_moves_per_round=limit))
            node = sc.node_model(cfg)
            builds, plans, totals, cpus = [], [], [], []
            cold = None
            for _ in range(repeats):
                c0 = time.process_time()
                t0 = time.perf_counter()
                prob = Problem.build(node, inputs, cfg, now=0.0)
                t1 = time.perf_counter()
                plan = Planner(cfg).plan(prob)
                t2 = time.perf_counter()
                cpus.append((time.process_time() - c0) * 1e3)
                if cold is None:
                    cold = (t2 - t0) * 1e3
                builds.append((t1 - t0) * 1e3)
                plans.append((t2 - t1) * 1e3)
                totals.append((t2 - t0) * 1e3)
            print(f"{fam:17s} {limit:11d} {statistics.median(builds):9.1f} {statistics.median(plans):8.1f} "
                  f"{statistics.median(totals):9.1f} {max(totals):7.1f} {cold:8.1f} {statistics.median(cpus):7.1f} "
                  f"{len(plan.moves):5d}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer instances (12 containers, one seed)")
    ap.add_argument("--time-limit", type=float, default=120.0, help="MILP time limit per instance, seconds")
    ap.add_argument("--budget", type=int, default=4, help="moves per round for the binding-budget table")
    ap.add_argument("--random", type=int, default=60, help="random instances (families, machines, sizes, budgets)")
    ap.add_argument("--only", choices=("quality", "random", "big", "scale", "time"), help="run one part")
    # A whole quality or random table takes longer than a quiet machine can be held: run it in parts
    # (each part is the same instances as in a whole run), each appending its rows to one --jsonl file,
    # and print the tables' summaries from the file with --summarize.
    ap.add_argument("--families", help="quality: comma-separated families (default: all)")
    ap.add_argument("--sizes", help="quality: comma-separated container counts (default: 12,24)")
    ap.add_argument("--seeds", help="quality: comma-separated seeds (default: 0,1)")
    ap.add_argument("--tables", default="unlimited,budget",
                    help="quality: comma-separated tables, unlimited (moves not limited) and/or budget (--budget)")
    ap.add_argument("--random-from", type=int, default=0, help="random: index of the first instance run")
    ap.add_argument("--jsonl", type=Path, help="append every instance's row to this file (JSON lines)")
    ap.add_argument("--summarize", type=Path, help="print the summaries of the rows in this file and exit")
    ap.add_argument("--plain-products", action="store_true",
                    help="big machine: also solve with the first (plain McCormick) product encoding")
    args = ap.parse_args()
    try:
        import highspy  # noqa: F401

        milp = True
    except ImportError:
        print("highspy is not installed (pip install '.[bench]'): no exact optimum column")
        milp = False
    if args.summarize:
        return summarize(args.summarize)
    sizes, seeds = ([12], [0]) if args.quick else ([12, 24], [0, 1])
    if args.sizes:
        sizes = [int(v) for v in args.sizes.split(",")]
    if args.seeds:
        seeds = [int(v) for v in args.seeds.split(",")]
    families = args.families.split(",") if args.families else None
    for f in families or []:
        if f not in FAMILIES:
            ap.error(f"--families: unknown family {f!r}; choose from {', '.join(FAMILIES)}")
    tables = args.tables.split(",")
    if args.only in (None, "quality"):
        for budget in (None, args.budget):
            if ("unlimited" if budget is None else "budget") not in tables:
                continue
            what = "moves not limited" if budget is None else f"binding budget: {budget} moves per round"
            print(f"\nplan quality on {SMALL.name} ({SMALL.cpus} CPUs, 4 NUMA nodes, SST-BF), {what}; "
                  "J = H×I + M, lower is better")
            print_header(milp)
            summary(quality(sizes, seeds, milp, args.time_limit, budget, families, args.jsonl), milp)
    if args.only in (None, "random"):
        count = 12 if args.quick else args.random
        last = args.random_from + count - 1
        print(f"\nrandom instances {args.random_from}-{last} ({SMALL.name}, {MID.name}; 8-24 containers; budgets 2-n)")
        print_header(milp)
        summary(random_instances(count, milp, args.time_limit, args.random_from, args.jsonl), milp)
    if args.only in (None, "big"):
        big_machine(min(args.time_limit, 60.0), milp, args.plain_products)
    if args.only in (None, "scale"):
        scale_quality(200)
    if args.only in (None, "time"):
        plan_time()
    return 0


if __name__ == "__main__":
    sys.exit(main())
