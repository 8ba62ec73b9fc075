"""The plans that ``autotune validate`` replays and the collectives each issues.

``candidate_plans``: the searched plan, data parallelism, Megatron and SUMMA
on every mesh, then random plans, until enough plans with distinct
predictions; ``plan_collectives``: (collective, mesh axes, bytes, times per
step) of a plan, as its record lists them; ``collective_rows``: every distinct
collective the plans issue, with its group, the profile's prediction and the
time measured, so that a plan's error can be traced to the group and tier that
make it. The command that replays them through calibrate's backends is
``autotune/cli/validate.py``.
"""
from __future__ import annotations

import numpy as np

from calibrate.errors import UserError

from autotune.plan.build import build
from autotune.plan.typed import Collective, Plan
from autotune.sbp.baselines import best_mesh, data_parallel, megatron_assignment, summa_assignment
from autotune.sbp.cost import Problem
from autotune.sbp.mesh import role_meshes
from autotune.sbp.search import Budget, make_search

KIND = "commtune.sbp-validate"
VERSION = 1


def candidate_plans(problem: Problem, n: int, seed: int) -> list[Plan]:
    """Distinct plans: searched, baselines on every mesh, S/B only, then random ones."""
    out, seen = [], set()

    def add(assign, label):
        if assign is None:
            return
        plan = build(problem, assign, label)
        key = round(plan.costs.total_s, 12)
        if key not in seen and plan.costs.total_s > 0:
            seen.add(key)
            out.append(plan)

    res = make_search("cd").run(problem, Budget(steps=200), np.random.default_rng(seed))
    add(res.assignment, "searched (cd)")
    add(data_parallel(problem), "data parallel")
    for m in role_meshes(problem.cluster, 2):
        add(megatron_assignment(problem, *m.sizes), f"Megatron d={m.sizes[0]} t={m.sizes[1]}")
    try:
        sp = Problem(problem.graph, problem.coster, problem.memory_limit, signatures=("summa",))
        a, _, mesh = best_mesh(sp, summa_assignment)
        if a is not None:
            plan = build(sp, a, f"SUMMA {mesh}")
            if round(plan.costs.total_s, 12) not in seen:
                seen.add(round(plan.costs.total_s, 12))
                out.append(plan)
    except UserError:
        pass
    rng = np.random.default_rng(seed)
    tries = 0
    while len(out) < n and tries < 50 * n:
        tries += 1
        add([int(rng.integers(k)) for k in problem.sizes], f"random #{tries}")
    return out[:max(n, 1)]


def plan_comms(plan: Plan) -> list[tuple[Collective, float]]:
    """Every collective of a plan (its layers' and edges') with how often the plan issues it per step."""
    mb = plan.micro_batches
    out = [(c, float(layer.count * (mb if c.per == "micro-batch" else 1)))
           for layer in plan.layers for c in layer.collectives]
    out += [(c, float(e.count * mb)) for e in plan.edges for c in e.collectives]
    return out


def _key(c: Collective) -> tuple[str, tuple[int, ...], int]:
    return c.collective, tuple(c.axes), int(c.nbytes)


def plan_collectives(plan: Plan) -> list[tuple[str, tuple[int, ...], int, float]]:
    """(collective, axes, nbytes, times per step) of every collective of a plan."""
    return [(*_key(c), per) for c, per in plan_comms(plan)]


def tier_split(plan: Plan, measured: dict) -> dict[str, dict[str, float]]:
    """A plan's predicted and ``measured`` communication seconds per step, by the tier of each group."""
    out: dict[str, dict[str, float]] = {}
    for c, per in plan_comms(plan):
        t = out.setdefault(c.tier, {"predicted_s": 0.0, "measured_s": 0.0})
        t["predicted_s"] += per * float(c.seconds)
        t["measured_s"] += per * float(measured[_key(c)])
    return out


def collective_rows(plans: list[Plan], measured: dict) -> list[dict]:
    """One row per distinct (collective, axes, bytes) of ``plans``: its group (ranks, nodes, tier), the
    profile's predicted seconds (as the plans' records cost it), the ``measured`` seconds, and the seconds
    it adds to the plans' predicted and measured communication summed over every plan (its weight)."""
    rows: dict = {}
    for plan in plans:
        for c, per in plan_comms(plan):
            key = _key(c)
            row = rows.setdefault(key, {"collective": key[0], "axes": list(key[1]), "nbytes": key[2],
                                        "ranks": c.ranks, "nodes": c.nodes, "tier": c.tier,
                                        "predicted_s": float(c.seconds), "measured_s": float(measured[key]),
                                        "plans_predicted_s": 0.0, "plans_measured_s": 0.0})
            row["plans_predicted_s"] += per * row["predicted_s"]
            row["plans_measured_s"] += per * row["measured_s"]
    return [rows[k] for k in sorted(rows)]

