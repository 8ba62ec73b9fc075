"""Search algorithms behind one interface (AutoDDL §4.5, §4.6).

Each takes a ``Problem`` and a ``Budget`` (CPU seconds, steps, patience) and returns a
``SearchResult`` with the best assignment, its cost, the convergence trace
(elapsed seconds, best cost so far) and what stopped it.
"""
from __future__ import annotations

import itertools
import math

import numpy as np

from calibrate.errors import UserError

from autotune.sbp.cost import Problem
from autotune.sbp.capsearch import UP, cap_descent, repair
from autotune.sbp.dp import DynamicProgramming, Relaxed, applicable, relax
from autotune.sbp.searchbase import Budget, Clock, Search, SearchResult, require_additive

__all__ = ["Budget", "SearchResult", "auto_budget", "make_search", "SEARCHES", "EXHAUSTIVE_LIMIT"]

EXHAUSTIVE_LIMIT = 10**12


def auto_budget(problem: Problem) -> Budget:
    """The default budget, scaled with the problem: coordinate descent stops when restarts in a row find
    nothing cheaper (converged), 10 per distinct layer, fewer where a restart reads large tables (times
    1,000 / strategies above 1,000 strategies, at least 3: 120 for the default GPT on 4 x 8 GPUs, 16 for
    GPT-3 175B on 4,096 GPUs); at the latest after 1 s plus
    1.5 ms of CPU per strategy, between 2 and 20 s (12.4 s for GPT-3 175B on 4,096 GPUs)."""
    strategies = sum(problem.sizes)
    patience = max(3, round(10 * len(problem.sizes) * min(1.0, 1000 / strategies)))
    return Budget(seconds=min(20.0, max(2.0, 1.0 + 1.5e-3 * strategies)), patience=patience)


class Exhaustive(Search):
    """Every combination of the (tied) layers' strategies; the last three layers
    are enumerated as one numpy array per combination of the others."""

    name = "exhaustive"

    def run(self, problem, budget, rng, start=None):
        require_additive(problem, self.name)
        clock = Clock(budget, self.progress, self.name)
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
            if a == b:  # a repeated layer feeding itself: both ends take the same strategy
                if a in inner:
                    ax = [1] * len(inner)
                    ax[inner.index(a)] = sizes[a]
                    base = base + (c * problem.tables.diagonal(a)).reshape(ax)
                else:
                    cross.append(((a, b), c, np.diag(c * problem.tables.diagonal(a))))
            elif a in inner and b in inner:
                m = c * problem.edge_matrix(a, b)
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
        clock, best = Clock(budget, self.progress, self.name), None
        while (reason := clock.out()) is None:
            a = [int(rng.integers(n)) for n in problem.sizes]
            clock.steps += 1
            if clock.offer(problem.cost(a)):
                best = a
        return self._result(clock, best or problem.min_memory_assignment(), reason)


class MetropolisHastings(Search):
    """Samples plans with P(S) ~ exp(-beta * Cost(S)) (AutoDDL §4.6): each step
    changes one random block: a layer, or (where the boxing tables are
    precomputed) two adjacent layers jointly. The proposal is the heat-bath
    (Gibbs) one: the block's new strategies are drawn from P restricted to the
    block, the others fixed, i.e. ~ exp(-beta * local cost), read off the
    layer's row or column of each incident boxing table (for a pair, the table
    between them). With that proposal the Metropolis-Hastings acceptance
    min(1, P(S') q(S|S') / (P(S) q(S'|S))) is exactly 1, so every proposal is
    taken; plans over the memory limit have P = 0. beta is set relative to the
    cost scale, 1 / (temperature * best cost so far), so the chain cools as it
    finds cheaper plans. Joint moves cross the ridges between plans that differ
    in two coupled layers, which single-layer moves at a low temperature
    cross only rarely (the 4-layer MLP at 128 nodes has such a local minimum at
    1.023 x the optimum)."""

    name = "mh"
    temperature = 0.005
    CUTOFF = 30.0  # choices whose weight is below exp(-30) of the most likely one are never drawn

    def run(self, problem, budget, rng, start=None):
        clock = Clock(budget, self.progress, self.name)
        cur = list(start) if start is not None else problem.min_memory_assignment()
        cur_cost = problem.cost(cur)
        best = list(cur)
        clock.offer(cur_cost)
        n = len(cur)
        pairs = problem.pairs if problem.tables.precomputed else []
        blocks, draws, k, step = n + len(pairs), np.empty(0), 0, 0
        while (reason := clock.out()) is None:
            if k + 2 > len(draws):  # uniform draws in blocks: one Generator call per 512 steps
                draws, k = rng.random(1024), 0
            quench = step < blocks  # the first sweep, every block in turn, at temperature 0
            b, u = step if quench else min(int(draws[k] * blocks), blocks - 1), draws[k + 1]
            k, step = k + 2, step + 1
            if b < n:
                vs = (b,)
                loc = problem.local(cur, b)
                mask = problem.memory_mask(cur, b)
                if mask is not None:
                    loc = np.where(mask, loc, math.inf)
            else:
                vs = pairs[b - n]
                loc = problem.pair_local(cur, *vs)
            clock.steps += 1
            problem.evaluations += loc.size
            low = loc.min()
            if not math.isfinite(low):
                continue
            old = tuple(cur[v] for v in vs)
            if quench:
                new = np.unravel_index(int(np.argmin(loc)), loc.shape)
                if loc[new] >= loc[old]:
                    continue
            else:
                ref = clock.best if math.isfinite(clock.best) and clock.best > 0 else max(low, 1e-30)
                scale = self.temperature * ref
                d = loc.ravel() - low
                near = np.flatnonzero(d <= self.CUTOFF * scale)  # weights below exp(-CUTOFF) of the top one: dropped
                cdf = np.cumsum(np.exp(-d[near] / scale))
                new = np.unravel_index(int(near[min(int(cdf.searchsorted(u * cdf[-1], side="right")), len(cdf) - 1)]),
                                       loc.shape)
            if new == old:
                continue
            for v, s in zip(vs, new):
                cur[v] = int(s)
            cur_cost = cur_cost + (loc[new] - loc[old]) if math.isfinite(cur_cost) and math.isfinite(loc[old]) \
                else problem.cost(cur)
            if clock.offer(cur_cost):
                best = list(cur)
        res = self._result(clock, best, reason)
        res.cost = problem.cost(best)  # exact, free of the running sum's rounding
        return res


class CoordinateDescent(Search):
    """Greedy line search along one layer at a time until a fixed point, then
    restart (AutoDDL §4.6). The first start is ``start`` if given, else the
    least memory plan, which always fits. A line search is the layer's local
    cost vector (its own costs plus one row or column of each incident boxing
    table) and an argmin. At a fixed point of the single-layer line searches,
    where the boxing tables are precomputed, a line search over each pair of
    adjacent layers jointly (block coordinate descent: an argmin over the
    table between them plus their other incident lines) is tried before
    restarting; an improvement there resumes the single-layer sweeps. The cost
    decreases monotonically between restarts.

    Restarts (iterated local search): most perturb the best plan found, giving
    ``kick`` random layers a random strategy, and descend from there, which
    keeps the rest of a good plan and reuses its boxing lines; every
    ``RANDOM_EVERY``-th restart is a random plan (the paper's). On GPT-3 175B at
    4,096 GPUs perturbed restarts reach a 2% better plan in half the time of
    random ones. ``budget.patience``: stop after that many restarts in a row
    find nothing cheaper (by more than ``TOL``).

    With ``relaxation`` (the default), where dynamic programming applies
    (``autotune.sbp.dp``), the first descents start from the Lagrangian
    relaxation's plans that fit (up to ``SEEDS``), its plans over the memory
    limit repaired from above (up to ``REPAIRS``, the nearest to the limit;
    ``capsearch.repair``) and ``start``, cheapest first, and alternate the
    memory-cap descent (``autotune.sbp.capsearch``: exact programs under
    per-layer memory caps) with line searches until neither improves; then
    the best plan once more with paid cap moves up to ``POLISH_UP`` levels
    (about 220 programs, 0.8 s on GPT-3 175B at 4,096 GPUs: too many for
    every start); restarts then use line searches only (cheap and diverse). The
    relaxation's lower bound stops the search as soon as the best plan is
    within ``TOL`` of it (proven optimal). The two kinds of first start
    approach the limit from both sides, so the result does not hang on the
    restarts' luck: on GPT-3 175B at 2,048 GPUs under 80 GiB (the step model
    without local copies) the only plan of the relaxation that fits uses 66
    GiB and its descent stops 15% above the best plan known (55.25 s/step);
    with restarts until 19 in a row found nothing cheaper, seeds 0, 1 and 2
    ended at 63.78, 63.78 and 55.77; from the repaired plans every seed
    reaches 55.25 within 2 s. The paid cap moves make the result the same for
    every seed at 2,048 GPUs under 64 and 96 GiB too, where seeds 0 and 1
    had ended 2% apart (``reports/records/sbp_bench.md``)."""

    name = "cd"
    kick = 2
    RANDOM_EVERY = 8
    TOL = 1e-6
    SEEDS = 4
    REPAIRS = 2
    POLISH_UP = 8
    relaxation = True
    relax_rounds = 8  # bisection steps per multiplier of the relaxation (``dp.relax``'s rounds)

    def _perturb(self, problem, best, rng):
        cur = list(best)
        for v in rng.choice(len(cur), size=min(self.kick, len(cur)), replace=False):
            for _ in range(20):
                cur[v] = int(rng.integers(problem.sizes[v]))
                if problem.feasible(cur):
                    break
            else:
                cur[v] = best[v]
        return cur

    def _seeds(self, problem, start, clock, others=()) -> tuple[list[list[int]], Relaxed | None]:
        """The first starts, cheapest first: the relaxation's plans that fit (where it applies; a plan
        differing from a cheaper one in one layer only is left out, its descent would repeat that one's),
        its ``REPAIRS`` plans over the memory limit nearest to it, repaired (``capsearch.repair``), and
        ``start`` and ``others`` (plans of a neighbouring problem, e.g. a pipeline stage's under another
        micro-batch count in flight; one over the memory limit descends under it by the line searches' memory
        masks); the least-memory plan if there is none of these."""
        given = [list(start)] if start is not None else []
        rel = None
        if self.relaxation and applicable(problem) is None:
            try:
                rel = relax(problem, clock, self.relax_rounds)
            except UserError:  # the layer graph's cycles cost too much to cut: no relaxation
                rel = None
        given += [list(p) for p in others if list(p) not in given]
        if rel is None:
            return sorted(given, key=problem.cost) or [problem.min_memory_assignment()], rel
        clock.bound = rel.bound
        seeds: list[list[int]] = []
        for _, p in rel.plans:
            if len(seeds) < self.SEEDS and all(sum(a != b for a, b in zip(p, q)) > 1 for q in seeds):
                seeds.append(p)
        if not rel.exact:
            for p in sorted(rel.over, key=problem.memory_of)[:self.REPAIRS]:
                fixed = repair(problem, rel.dp, rel.unary, list(p), clock)
                if fixed is not None and fixed[1] not in seeds:
                    seeds.append(fixed[1])
        return sorted(seeds + given, key=problem.cost) or [problem.min_memory_assignment()], rel

    def _descend(self, problem, cur, total, clock, pairs, ends: dict | None = None) -> tuple[float, str | None]:
        """Line searches from ``cur`` (changed in place) to a fixed point: (its running cost, what stopped
        the search if the budget did). ``ends``: the plan each sweep of an earlier descent on this problem
        started from -> the fixed point that descent ended at, kept between calls. A descent is a function of
        the plan its sweep starts from, so one that reaches such a plan ends at that fixed point without
        sweeping again (restarts mostly descend back to the best plan, whose pair searches then run once)."""
        starts: list[tuple] = []
        changed = True
        while changed:
            here = tuple(cur)
            if ends is not None and here in ends:
                cur[:] = ends[here]
                break
            starts.append(here)
            changed = False
            for v in range(len(cur)):
                loc = problem.local(cur, v)
                mask = problem.memory_mask(cur, v)
                if mask is not None:
                    loc = np.where(mask, loc, math.inf)
                clock.steps += 1
                problem.evaluations += len(loc)
                i = int(np.argmin(loc))
                if loc[i] < loc[cur[v]]:
                    old = loc[cur[v]]
                    cur[v], changed = i, True
                    total = total + (loc[i] - old) if math.isfinite(total) and math.isfinite(old) \
                        else problem.cost(cur)
                    clock.offer(total)
                if (reason := clock.out()) is not None:
                    return total, reason
            for u, v in pairs if not changed else ():
                loc = problem.pair_local(cur, u, v)
                clock.steps += 1
                problem.evaluations += loc.size
                i, j = np.unravel_index(int(np.argmin(loc)), loc.shape)
                old = loc[cur[u], cur[v]]
                if loc[i, j] < old:
                    cur[u], cur[v], changed = int(i), int(j), True
                    total = total + (loc[i, j] - old) if math.isfinite(total) and math.isfinite(old) \
                        else problem.cost(cur)
                    clock.offer(total)
                if (reason := clock.out()) is not None:
                    return total, reason
                if changed:
                    break
        if ends is not None:
            end = tuple(cur)
            ends.update((x, end) for x in starts)
        return total, None

    def run(self, problem, budget, rng, start=None, others=()):
        """``others``: more first starts (``_seeds``)."""
        clock = Clock(budget, self.progress, self.name)
        seeds, rel = self._seeds(problem, start, clock, others)
        caps = rel is not None and not rel.exact and problem.memory_limit is not None
        first_starts = len(seeds) + caps  # with caps, the last: the best plan again, with deeper cap moves
        pairs = problem.pairs if problem.tables.precomputed else []
        best, best_cost = None, math.inf
        reason = None
        restarts = stale = 0
        solved: dict = {}  # the cap descents' programs (capsearch.cap_descent's memo)
        ends: dict = {}  # the descents' sweep starts -> their fixed points (``_descend``)
        while reason is None:
            deep = caps and restarts == first_starts - 1
            cur = (list(best) if best is not None else problem.min_memory_assignment()) if deep else seeds.pop(0)
            total = problem.cost(cur)
            before = clock.best
            clock.offer(total)
            # from a first start: memory caps, then line searches, until neither improves; restarts: line searches
            while caps and restarts < first_starts and math.isfinite(total):
                total, plan, _ = cap_descent(problem, rel.dp, rel.unary, cur, total, clock,
                                             self.POLISH_UP if deep else UP, solved)
                cur[:] = plan
                before_lines = total
                total, reason = self._descend(problem, cur, total, clock, pairs, ends)
                total = problem.cost(cur)
                if reason is not None or total >= before_lines * (1 - self.TOL):
                    break
            else:
                total, reason = self._descend(problem, cur, total, clock, pairs, ends)
            cost = problem.cost(cur)
            if cost < best_cost:
                best, best_cost = list(cur), cost
            if reason is None and budget.seconds is None and budget.steps is None and budget.patience is None:
                reason = "fixed point (no budget given)"
            if restarts >= first_starts:  # the descents from the first starts are not restarts
                stale = 0 if clock.best < before * (1 - self.TOL) else stale + 1
            if reason is None and budget.patience is not None and stale >= budget.patience:
                reason = f"converged ({stale} restarts in a row found nothing cheaper)"
            if reason is None and clock.best <= clock.bound * (1 + self.TOL):
                reason = f"optimal (the relaxation's lower bound {clock.bound:.6g} reached)"
            restarts += 1
            if seeds or restarts < first_starts:
                continue
            if best is None or restarts % self.RANDOM_EVERY == 0:
                seeds.append(problem.random_assignment(rng))
            else:
                seeds.append(self._perturb(problem, best, rng))
        best = best or problem.min_memory_assignment()
        res = self._result(clock, best, reason)
        res.cost = problem.cost(best)  # exact, free of the running sum's rounding
        res.bound = clock.bound
        return res


SEARCHES: dict[str, type[Search]] = {
    "exhaustive": Exhaustive,
    "random": RandomSearch,
    "mh": MetropolisHastings,
    "cd": CoordinateDescent,
    "dp": DynamicProgramming,
}


def make_search(name: str, progress=None) -> Search:
    cls = SEARCHES.get(name)
    if cls is None:
        raise UserError(f"unknown search {name!r}: use one of {', '.join(SEARCHES)}")
    out = cls()
    out.progress = progress
    return out
