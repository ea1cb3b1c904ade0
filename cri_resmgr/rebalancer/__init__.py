"""Rebalancer: a cost model of interference between containers, a planner that proposes moves whose
gain pays for their migration, a simulator of scenarios, and an executor (off / advise / enforce).

See docs/rebalancer.md. Modules: :mod:`.model` (inputs, node model, cost aggregation, migration cost),
:mod:`.terms` (the interference terms), :mod:`.planner`, :mod:`.scenario`, :mod:`.simulator`,
:mod:`.signals` (model input from the store), :mod:`.executor`, :mod:`.service` (agent loop),
:mod:`.exact` (the exact MILP optimum of the same model, for benchmarks).
"""
