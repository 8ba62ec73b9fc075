"""Search algorithms behind one interface (AutoDDL §4.5, §4.6).

Each takes a ``Problem`` and a ``Budget`` (seconds and/or steps) and returns a
``SearchResult`` with the best assignment, its cost, the convergence trace
(elapsed seconds, best cost so far) and what stopped it.
"""
from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, field

import numpy as np

from calibrate.errors import UserError

from autotune.sbp.cost import Problem

EXHAUSTIVE_LIMIT = 10**12


@dataclass(frozen=True)
class Budget:
    seconds: float | None = None
    steps: int | None = None

    def __post_init__(self):
        if (self.seconds is not None and self.seconds <= 0) or (self.steps is not None and self.steps <= 0):
            raise UserError("--budget must be positive (seconds, or steps with a trailing 's' as in 500s... use e.g. 10 or 2000steps)")


@dataclass
class SearchResult:
    algorithm: str
    assignment: list[int]
    cost: float
    seconds: float
    steps: int
    stopped: str
    trace: list[tuple[float, float]] = field(default_factory=list)


class _Clock:
    def __init__(self, budget: Budget):
        self.budget, self.t0, self.steps = budget, time.perf_counter(), 0
        self.trace: list[tuple[float, float]] = []
        self.best = math.inf

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def out(self) -> str | None:
        if self.budget.steps is not None and self.steps >= self.budget.steps:
            return f"step budget ({self.budget.steps} steps)"
        if self.budget.seconds is not None and self.elapsed() >= self.budget.seconds:
            return f"time budget ({self.budget.seconds:g} s)"
        return None

    def offer(self, cost: float) -> bool:
        if cost < self.best:
            self.best = cost
            self.trace.append((self.elapsed(), cost))
            return True
        return False


class Search:
    name = ""

    def run(self, problem: Problem, budget: Budget, rng: np.random.Generator,
            start: list[int] | None = None) -> SearchResult:
        """``start``: an optional first plan (e.g. the best baseline) for the local searches."""
        raise NotImplementedError

    def _result(self, clock: _Clock, best: list[int], stopped: str) -> SearchResult:
        return SearchResult(self.name, list(best), clock.best, clock.elapsed(), clock.steps, stopped, clock.trace)


class Exhaustive(Search):
    """Every combination of the (tied) layers' strategies; the last three layers
    are enumerated as one numpy array per combination of the others."""

    name = "exhaustive"

    def run(self, problem, budget, rng, start=None):
        clock = _Clock(budget)
        sizes = problem.sizes
        total = math.prod(sizes)
        if total > EXHAUSTIVE_LIMIT:
            raise UserError(
                f"exhaustive search over {total:.2e} plans is out of reach: use --search cd or mh"
            )
        nv = len(sizes)
        inner = list(range(max(0, nv - 3), nv))
        outer = list(range(nv - len(inner)))
        shape = [sizes[v] for v in inner]
        # static part over the inner layers
        base = np.zeros(shape)
        mem = np.zeros(shape)
        for k, v in enumerate(inner):
            ax = [1] * len(inner)
            ax[k] = sizes[v]
            base = base + problem.node[v].reshape(ax)
            mem = mem + problem.mem[v].reshape(ax)
        cross = []  # edges with at least one outer end
        for (a, b), c in problem.edge_counts.items():
            if a in inner and b in inner:
                m = c * problem.edge_matrix(a, b)
                if a == b:
                    m = np.diag(m)
                    ax = [1] * len(inner)
                    ax[inner.index(a)] = sizes[a]
                    base = base + m.reshape(ax)
                else:
                    ia, ib = inner.index(a), inner.index(b)
                    ax = [1] * len(inner)
                    ax[ia], ax[ib] = sizes[a], sizes[b]
                    base = base + (m if ia < ib else m.T).reshape(ax)
            else:
                cross.append(((a, b), c, c * problem.edge_matrix(a, b)))
        best_assign, stopped = None, "searched every plan"
        for combo in itertools.product(*(range(sizes[v]) for v in outer)):
            reason = clock.out()
            if reason:
                stopped = reason
                break
            cost = base + sum(problem.node[v][s] for v, s in zip(outer, combo))
            m = mem + sum(problem.mem[v][s] for v, s in zip(outer, combo))
            fixed = dict(zip(outer, combo))
            for (a, b), c, mat in cross:
                if a in fixed and b in fixed:
                    cost = cost + mat[fixed[a], fixed[b]]
                else:
                    ax = [1] * len(inner)
                    if a in fixed:
                        ax[inner.index(b)] = sizes[b]
                        cost = cost + mat[fixed[a], :].reshape(ax)
                    else:
                        ax[inner.index(a)] = sizes[a]
                        cost = cost + mat[:, fixed[b]].reshape(ax)
            if problem.memory_limit is not None:
                cost = np.where(m <= problem.memory_limit, cost, np.inf)
            clock.steps += cost.size
            problem.evaluations += cost.size
            i = int(np.argmin(cost))
            if clock.offer(float(cost.flat[i])):
                best_assign = list(combo) + [int(x) for x in np.unravel_index(i, shape)]
        if best_assign is None:
            best_assign = problem.min_memory_assignment()
        return self._result(clock, best_assign, stopped)


class RandomSearch(Search):
    name = "random"

    def run(self, problem, budget, rng, start=None):
        clock, best = _Clock(budget), None
        while (reason := clock.out()) is None:
            a = [int(rng.integers(n)) for n in problem.sizes]
            clock.steps += 1
            if clock.offer(problem.cost(a)):
                best = a
        return self._result(clock, best or problem.min_memory_assignment(), reason)


class MetropolisHastings(Search):
    """P(S) ~ exp(-beta * Cost(S)); a proposal changes one random layer. beta is
    set relative to the cost scale: 1 / (temperature * cost of the start)."""

    name = "mh"
    temperature = 0.02

    def run(self, problem, budget, rng, start=None):
        clock = _Clock(budget)
        cur = list(start) if start is not None else problem.min_memory_assignment()
        cur_cost = problem.cost(cur)
        best = list(cur)
        clock.offer(cur_cost)
        scale = self.temperature * (cur_cost if math.isfinite(cur_cost) and cur_cost > 0 else 1.0)
        while (reason := clock.out()) is None:
            v = int(rng.integers(len(cur)))
            prop = list(cur)
            prop[v] = int(rng.integers(problem.sizes[v]))
            cost = problem.cost(prop)
            clock.steps += 1
            if cost <= cur_cost or (math.isfinite(cost) and rng.random() < math.exp(-(cost - cur_cost) / scale)):
                cur, cur_cost = prop, cost
                if clock.offer(cost):
                    best = list(prop)
        return self._result(clock, best, reason)


class CoordinateDescent(Search):
    """Greedy line search along one layer at a time until a fixed point, then
    restart from a random plan (AutoDDL §4.6). The first start is ``start`` if
    given, else the least memory plan, which always fits."""

    name = "cd"

    def run(self, problem, budget, rng, start=None):
        clock = _Clock(budget)
        best = None
        start = list(start) if start is not None else problem.min_memory_assignment()
        reason = None
        while reason is None:
            cur = list(start)
            changed = True
            while changed and reason is None:
                changed = False
                for v in range(len(cur)):
                    cand = problem.candidates(cur, v)
                    clock.steps += 1
                    i = int(np.argmin(cand))
                    if cand[i] < cand[cur[v]]:
                        cur[v], changed = i, True
                    if clock.offer(float(cand[cur[v]])):
                        best = list(cur)
                    if (reason := clock.out()) is not None:
                        break
            if reason is None and budget.seconds is None and budget.steps is None:
                reason = "fixed point (no budget given)"
            start = problem.random_assignment(rng)
        return self._result(clock, best or problem.min_memory_assignment(), reason)


SEARCHES: dict[str, type[Search]] = {
    "exhaustive": Exhaustive,
    "random": RandomSearch,
    "mh": MetropolisHastings,
    "cd": CoordinateDescent,
}


def make_search(name: str) -> Search:
    cls = SEARCHES.get(name)
    if cls is None:
        raise UserError(f"unknown search {name!r}: use one of {', '.join(SEARCHES)}")
    return cls()
