"""Memory-cap descent: exact dynamic programs under per-layer memory caps, moving memory between layers.

Where the memory limit binds, the Lagrangian relaxation (``autotune.sbp.dp``)
finds only the plans on the convex hull of (memory, cost): on GPT-3 175B at
4,096 GPUs its best plan that fits is 6% above its bound, the optimum
somewhere between. Caps close much of that gap exactly: a plan that fits uses
some memory per layer, and every plan whose layers each use at most as much
fits too; the cheapest of those is one dynamic program (``LayerDP.solve``
with each layer's strategies above its cap dropped, which also makes it
cheap: a few ms). A *move* raises one layer's cap by the memory left under
the limit plus what another layer gives up by dropping ``d`` memory levels
(its distinct memory figures below its current one), and solves again; the
first move that finds a cheaper plan is taken and the caps re-read from it.
The descent stops when no move with ``d`` up to ``DEPTH`` finds a cheaper
plan (converged) or the budget runs out. Each step's plan fits the limit and
costs no more than the last, and its cost is the problem's own (the step
objective's overlap term included), not the program's.
"""
from __future__ import annotations

import numpy as np

from autotune.sbp.cost import Problem
from autotune.sbp.dp import LayerDP
from autotune.sbp.searchbase import Clock

DEPTH = 2
TOL = 1e-9


def cap_descent(problem: Problem, dp: LayerDP, unary: list[np.ndarray], plan: list[int], cost: float,
                clock: Clock) -> tuple[float, list[int], bool]:
    """From ``plan`` (fits the limit; ``cost`` its cost), the descent over memory caps with the
    program's ``unary`` costs; (cost, plan, converged)."""
    limit = problem.memory_limit
    n = len(plan)
    levels = [np.unique(m) for m in problem.mem]

    def solve(caps):
        _, y = dp.solve([np.where(problem.mem[v] <= caps[v] * (1 + 1e-12), unary[v], np.inf) for v in range(n)])
        clock.steps += 1
        c = problem.cost(y)
        clock.offer(c)
        return c, y

    def moves(caps, slack, d):
        for u in range(n):
            for v in ([None] if d == 1 else []) + [w for w in range(n) if w != u]:
                c = list(caps)
                if v is not None:
                    lower = levels[v][levels[v] < caps[v]]
                    if len(lower) < d:
                        continue
                    c[v] = float(lower[-d])
                c[u] = caps[u] + slack + (caps[v] - c[v] if v is not None else 0.0)
                if ((levels[u] > caps[u]) & (levels[u] <= c[u] * (1 + 1e-12))).any():
                    yield c

    while True:
        caps = [float(problem.mem[v][plan[v]]) for v in range(n)]
        slack = limit - sum(caps)
        found = None
        for d in range(1, DEPTH + 1):
            for c in moves(caps, slack, d):
                if clock.out() is not None:
                    return cost, plan, False
                y_cost, y = solve(c)
                if y_cost < cost * (1 - TOL):
                    found = (y_cost, y)
                    break
            if found:
                break
        if found is None:
            return cost, plan, True
        cost, plan = found
