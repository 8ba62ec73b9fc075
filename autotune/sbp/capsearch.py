"""Memory-cap descent: exact dynamic programs under per-layer memory caps, moving memory between layers.

Where the memory limit binds, the Lagrangian relaxation (``autotune.sbp.dp``)
finds only the plans on the convex hull of (memory, cost): on GPT-3 175B at
4,096 GPUs under 80 GiB its best plan that fits is 2.2% above its bound,
the optimum somewhere between. Caps close much of that gap exactly: a plan that fits uses
some memory per layer, and every plan whose layers each use at most as much
fits too; the cheapest of those is one dynamic program (``LayerDP.solve``
with each layer's strategies above its cap dropped, which also makes it
cheap: a few ms). A *move* raises one layer's cap by the memory left under
the limit plus what another layer gives up by dropping ``d`` memory levels
(its distinct memory figures below its current one), and solves again; the
first move that finds a cheaper plan is taken and the caps re-read from it.
Memory levels are fine (75 to 78 per layer on GPT-3 175B), so a move of a
few levels rarely frees enough for a layer to take a much larger strategy;
a *paid* move raises a layer's cap to its ``k``-th level above and lowers
another layer's cap just as far as that needs (possibly many levels): on
GPT-3 175B at 2,048 GPUs under 64 GiB, k = 2 takes a plan from 93.47 to the
best known 91.66 s/step (one layer 7 -> 9.3 GiB, another 5.6 -> 2.8 GiB),
and under 96 GiB k = 4 takes 39.49 to 39.16. The descent stops when no move
with ``d`` up to ``DEPTH`` and no paid move with ``k`` up to ``up`` finds a
cheaper plan (converged) or the budget runs out. Each step's plan fits the limit and
costs no more than the last, and its cost is the problem's own (the step
objective's overlap term included), not the program's.

The relaxation's plans that fit can all lie far below the limit: between
the two multipliers where its plan just fits and where it just does not, the
convex hull jumps (on GPT-3 175B at 2,048 GPUs under 80 GiB, with the step
model before DTensor's local copies were costed: from a plan of 66 GiB at
76 s/step to one of 85 GiB at 45 s/step), and the descent from the plan
that fits stops 15% above the best known. ``repair`` starts on the
other side: from a plan *over* the limit, the caps are that plan's memory
per layer; each step lowers one layer's cap by one memory level, trying
every layer (one program each) and taking the one whose plan costs least
more per byte saved (the problem's own cost, the limit ignored), and the
caps are re-read from that plan, until the plan fits. Its plan then goes to
``cap_descent``. On that instance the repair of any of the relaxation's
plans over the limit followed by the descent reaches the best plan known.
"""
from __future__ import annotations

import numpy as np

from autotune.sbp.cost import Problem
from autotune.sbp.dp import LayerDP
from autotune.sbp.searchbase import Clock

DEPTH = 2
UP = 2
TOL = 1e-9


def cap_descent(problem: Problem, dp: LayerDP, unary: list[np.ndarray], plan: list[int], cost: float,
                clock: Clock, up: int = UP, memo: dict | None = None) -> tuple[float, list[int], bool]:
    """From ``plan`` (fits the limit; ``cost`` its cost), the descent over memory caps with the
    program's ``unary`` costs, paid moves up to ``up`` levels; (cost, plan, converged). Moves are tried
    from the layer whose move last succeeded on (most of those before it failed the last time).
    ``memo``: caps -> (cost, plan) of programs already solved with these ``unary`` costs, kept between
    calls (descents from several starts often end at the same plan and try the same moves there); its key is
    the number of each layer's memory levels under its cap (``_levels_under``), which fixes the program: caps
    that differ but keep the same strategies are one program."""
    limit = problem.memory_limit
    n = len(plan)
    levels = [np.unique(m) for m in problem.mem]
    memo = {} if memo is None else memo

    def solve(caps):
        key = _levels_under(levels, caps)
        if key not in memo:
            _, y = dp.solve(_capped(problem, unary, caps))
            clock.steps += 1
            memo[key] = (problem.cost(y), y)
        return memo[key]

    def moves(caps, slack, d, first):
        for u in ((first + i) % n for i in range(n)):
            for v in ([None] if d == 1 else []) + [w for w in range(n) if w != u]:
                c = list(caps)
                if v is not None:
                    lower = levels[v][levels[v] < caps[v]]
                    if len(lower) < d:
                        continue
                    c[v] = float(lower[-d])
                c[u] = caps[u] + slack + (caps[v] - c[v] if v is not None else 0.0)
                if ((levels[u] > caps[u]) & (levels[u] <= c[u] * (1 + 1e-12))).any():
                    yield u, c

    def paid(caps, slack, k, first):
        """u raised to its k-th memory level above its cap, v lowered just as far as that needs."""
        for u in ((first + i) % n for i in range(n)):
            higher = levels[u][levels[u] > caps[u] * (1 + 1e-12)]
            if len(higher) < k:
                continue
            need = float(higher[k - 1]) - caps[u] - slack
            if need <= 0:
                continue
            for v in range(n):
                lower = levels[v][levels[v] <= caps[v] - need]
                if v == u or len(lower) == 0:
                    continue
                c = list(caps)
                c[v] = float(lower[-1])
                c[u] = caps[u] + slack + (caps[v] - c[v])
                yield u, c

    families = [lambda caps, slack, first, d=d: moves(caps, slack, d, first) for d in range(1, DEPTH + 1)]
    families += [lambda caps, slack, first, k=k: paid(caps, slack, k, first) for k in range(1, up + 1)]
    first = 0
    while True:
        caps = [float(problem.mem[v][plan[v]]) for v in range(n)]
        slack = limit - sum(caps)
        found = None
        for family in families:
            for u, c in family(caps, slack, first):
                if clock.out() is not None:
                    return cost, plan, False
                y_cost, y = solve(c)
                clock.offer(y_cost)
                if y_cost < cost * (1 - TOL):
                    found, first = (y_cost, y), u
                    break
            if found:
                break
        if found is None:
            return cost, plan, True
        cost, plan = found


def _levels_under(levels: list[np.ndarray], caps) -> tuple[int, ...]:
    """How many of each layer's distinct memory figures (``levels``, ascending) ``_capped`` keeps under ``caps``:
    equal tuples, the same strategies kept, the same program."""
    return tuple(int(np.searchsorted(lv, c * (1 + 1e-12), side="right")) for lv, c in zip(levels, caps))


def _capped(problem: Problem, unary: list[np.ndarray], caps) -> list[np.ndarray]:
    """The program's unary costs with every strategy above its layer's cap excluded (inf)."""
    return [np.where(problem.mem[v] <= caps[v] * (1 + 1e-12), unary[v], np.inf) for v in range(len(caps))]


def repair(problem: Problem, dp: LayerDP, unary: list[np.ndarray], plan: list[int],
           clock: Clock) -> tuple[float, list[int]] | None:
    """From ``plan`` over the memory limit, caps lowered one memory level of one layer at a time (the
    cheapest per byte saved) until the program's plan fits: (its cost, the plan); None if the budget ran
    out or no cap can be lowered (no plan fits)."""
    limit = problem.memory_limit
    n = len(plan)
    levels = [np.unique(m) for m in problem.mem]
    cost = problem.raw_cost(plan)
    while problem.memory_of(plan) > limit:
        caps = [float(problem.mem[v][plan[v]]) for v in range(n)]
        used = sum(caps)
        best = None
        for u in range(n):
            lower = levels[u][levels[u] < caps[u]]
            if len(lower) == 0:
                continue
            if clock.out() is not None:
                return None
            c = list(caps)
            c[u] = float(lower[-1])
            _, y = dp.solve(_capped(problem, unary, c))
            clock.steps += 1
            y_cost = problem.raw_cost(y)
            saved = used - problem.memory_of(y)
            if saved > 0 and (best is None or (y_cost - cost) / saved < best[0]):
                best = ((y_cost - cost) / saved, y_cost, y)
        if best is None:
            return None
        _, cost, plan = best
    clock.offer(cost)
    return cost, plan
