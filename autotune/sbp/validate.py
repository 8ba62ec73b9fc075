"""The plans that ``autotune validate`` replays and the collectives each issues.

``candidate_plans``: the searched plan, data parallelism, Megatron and SUMMA
on every mesh, then random plans, until enough plans with distinct
predictions; ``plan_collectives``: (collective, mesh axes, bytes, times per
step) of a plan, as its record lists them. The command that replays them
through calibrate's backends is ``autotune/sbp/cli/validate.py``.
"""
from __future__ import annotations

import numpy as np

from calibrate.errors import UserError

from autotune.sbp.baselines import best_mesh, data_parallel, megatron_assignment, summa_assignment
from autotune.sbp.cost import Problem
from autotune.sbp.mesh import role_meshes
from autotune.sbp.plan import build_plan
from autotune.sbp.search import Budget, make_search

KIND = "commtune.sbp-validate"
VERSION = 1


def candidate_plans(problem: Problem, n: int, seed: int) -> list[dict]:
    """Distinct plans: searched, baselines on every mesh, S/B only, then random ones."""
    out, seen = [], set()

    def add(assign, label):
        if assign is None:
            return
        plan = build_plan(problem, assign, label)
        key = round(plan["totals"]["total_s"], 12)
        if key not in seen and plan["totals"]["total_s"] > 0:
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
            plan = build_plan(sp, a, f"SUMMA {mesh}")
            if round(plan["totals"]["total_s"], 12) not in seen:
                seen.add(round(plan["totals"]["total_s"], 12))
                out.append(plan)
    except UserError:
        pass
    rng = np.random.default_rng(seed)
    tries = 0
    while len(out) < n and tries < 50 * n:
        tries += 1
        add([int(rng.integers(k)) for k in problem.sizes], f"random #{tries}")
    return out[:max(n, 1)]


def plan_collectives(plan: dict) -> list[tuple[str, tuple[int, ...], int, float]]:
    """(collective, axes, nbytes, times per step) of every collective of a plan."""
    mb = plan["micro_batches"]
    out = []
    for layer in plan["layers"]:
        for c in layer["collectives"]:
            per = layer["count"] * (mb if c["per"] == "micro-batch" else 1)
            out.append((c["collective"], tuple(c["axes"]), int(c["nbytes"]), float(per)))
    for e in plan["edges"]:
        for c in e["collectives"]:
            out.append((c["collective"], tuple(c["axes"]), int(c["nbytes"]), float(e["count"] * mb)))
    return out
