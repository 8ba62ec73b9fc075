"""Exact dynamic programming over the layer graph, and its Lagrangian relaxation for what is not additive.

The additive part of a plan's cost is a sum of per-layer terms (its unary
costs) and per-edge terms (the boxing tables). Its minimum over all plans is
found exactly by dynamic programming when the graph of distinct layers is a
forest: messages from the leaves up, one (min, +) product with an edge's
table each, then the choices back down (Viterbi on a chain). Tied repeated
blocks make a cycle (a transformer's fc2 feeds the next block's ln1): the
cycle is cut by *conditioning* on a layer of few strategies (the attention
core, 12 on 4,096 GPUs): every choice of it is tried at once, as one more
array axis; only the messages that pass through the cut depend on it.

Two things are not additive. The memory limit (a sum over layers bounded by
the limit) and, with the step objective, the exposed gradient sync
max(S - W, F) (``autotune.sbp.steptime``). Both are relaxed with multipliers:
for lambda in [0, 1] and mu >= 0,

    g(lambda, mu) = min over plans of  A + lambda (S - W) + (1 - lambda) F + mu (M - limit)

is at most the optimum (max(x, y) >= lambda x + (1 - lambda) y, and mu (M - limit)
<= 0 for a plan that fits), and each g is one dynamic program. So every
solve gives a lower bound on the optimum and a plan; the plans that fit are
candidates, their true cost an upper bound. ``relax`` searches lambda (on the
sign of S - W - F) and mu (on whether the plan fits) by bisection. When the
objective is additive and the unconstrained optimum fits, the first solve is
the exact optimum. Otherwise the gap between the best candidate and the best
bound says how far from optimal it can be at most.

Work per solve: per message, (the cut choices of its subtree) x (its table's
entries), in numpy: a message whose subtree touches one of two cut layers is
made for that layer's choices alone and spread over the other's (a Llama
block's two cycles: 19x less than every cut choice for every message on
Llama 3 405B's stage problems); about 0.1 s for GPT-3 175B on 4,096 GPUs.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field

import numpy as np

from calibrate.errors import OptionError

from autotune.sbp.cost import Problem
from autotune.sbp.searchbase import Clock, Search

CUT_WORK = 2 * 10**8  # the most table entries times cut choices one solve may touch
PAIRS_LIMIT = 2 * 10**7  # the most boxing-table entries the graph's edges may hold for dynamic programming
BATCH = 2**16  # about the most entries of a message's min-plus product made at once (whole cut choices a call)


class LayerDP:
    """The layer graph prepared for dynamic programming: its cut layers, the forest left, and one table
    per pair of adjacent layers (both directions and repetitions summed)."""

    def __init__(self, problem: Problem):
        self.problem = problem
        n = len(problem.sizes)
        self.diag = [np.zeros(s) for s in problem.sizes]
        self.W: dict[tuple[int, int], np.ndarray] = {}
        for (a, b), c in problem.edge_counts.items():
            if a == b:
                self.diag[a] = self.diag[a] + c * problem.tables.diagonal(a)
                continue
            u, v = min(a, b), max(a, b)
            t = c * (problem.edge_matrix(a, b) if a == u else problem.edge_matrix(a, b).T)
            self.W[(u, v)] = self.W[(u, v)] + t if (u, v) in self.W else t
        self.nbrs: dict[int, set[int]] = {v: set() for v in range(n)}
        for u, v in self.W:
            self.nbrs[u].add(v)
            self.nbrs[v].add(u)
        self.cut = self._cut()
        self.Q = math.prod(problem.sizes[k] for k in self.cut)
        self._plan_forest()

    def table(self, u: int, v: int) -> np.ndarray:
        """Rows u's strategies, columns v's."""
        return self.W[(u, v)] if u < v else self.W[(v, u)].T

    def _cut(self) -> list[int]:
        """Layers whose removal leaves a forest: repeatedly, the layer of fewest strategies on a cycle (the
        2-core: what is left after peeling off layers with at most one neighbour)."""
        cut: list[int] = []
        sizes = self.problem.sizes
        while True:
            alive = {v for v in self.nbrs if v not in cut}
            deg = {v: len(self.nbrs[v] & alive) for v in alive}
            leaves = [v for v in alive if deg[v] <= 1]
            while leaves:
                v = leaves.pop()
                if v not in alive:
                    continue
                alive.discard(v)
                for u in self.nbrs[v] & alive:
                    deg[u] -= 1
                    if deg[u] == 1:
                        leaves.append(u)
            if not alive:
                return cut
            cut.append(min(alive, key=lambda v: (sizes[v], -deg[v], v)))

    def _plan_forest(self) -> None:
        """Root each tree of the forest; ``order``: (layer, parent) children before parents; ``varies``:
        whose message depends on the cut's choice (a cut neighbour in its subtree)."""
        cut = set(self.cut)
        self.order: list[tuple[int, int | None]] = []
        self.roots: list[int] = []
        seen: set[int] = set()
        # root a tree at a neighbour of the cut where it has one (the messages that vary are then few)
        candidates = sorted((v for v in self.nbrs if v not in cut),
                            key=lambda v: (not (self.nbrs[v] & cut), v))
        for r in candidates:
            if r in seen:
                continue
            self.roots.append(r)
            seen.add(r)
            stack, visit = [(r, None)], []
            while stack:
                v, p = stack.pop()
                visit.append((v, p))
                for u in sorted(self.nbrs[v] - cut):
                    if u not in seen:
                        seen.add(u)
                        stack.append((u, v))
            self.order += reversed(visit)
        self.varies = {v: bool(self.nbrs[v] & cut) for v in self.nbrs if v not in cut}
        self.children: dict[int, list[int]] = {v: [] for v in self.varies}
        # ``rel``: the cut layers (positions in ``cut``) a layer's subtree touches, whose choices its message depends on
        pos = {k: i for i, k in enumerate(self.cut)}
        rel: dict[int, set[int]] = {v: {pos[k] for k in self.nbrs[v] & cut} for v in self.varies}
        for v, p in self.order:
            if p is not None:
                self.children[p].append(v)
                self.varies[p] = self.varies[p] or self.varies[v]
                rel[p] |= rel[v]
        self.rel = {v: tuple(sorted(r)) for v, r in rel.items()}
        self._memo: dict[int, tuple] = {}

    @property
    def work(self) -> int:
        """Table entries times cut choices one solve touches at most (each message takes only the cut choices of
        its subtree: often far fewer)."""
        return sum(w.size * (self.Q if self.varies.get(u, False) or self.varies.get(v, False) else 1)
                   for (u, v), w in self.W.items())

    def solve(self, unary: list[np.ndarray]) -> tuple[float, list[int]]:
        """The minimum of sum(unary) + the diagonal (self-edge) costs + the edge tables, and its plan
        (inf and the least-memory plan if every plan costs inf). Strategies whose unary cost is inf
        (excluded, e.g. by a memory cap) are dropped before the tables are read. A subtree whose costs
        are those of the last solve sends the same message: it is reused (a search that changes a few
        layers at a time recomputes only the messages on their way to the root)."""
        own = [u + d for u, d in zip(unary, self.diag)]
        keep = [np.flatnonzero(np.isfinite(o)) for o in own]
        if any(len(k) == 0 for k in keep):
            return math.inf, self.problem.min_memory_assignment()
        cut = self.cut
        cutset = set(cut)
        pos = {k: i for i, k in enumerate(cut)}
        sig = [hash(o.tobytes()) for o in own]
        dims = tuple(len(keep[k]) for k in cut)
        full = tuple(range(len(cut)))
        grids: dict[tuple, np.ndarray] = {}

        def grid(r: tuple) -> np.ndarray:
            """The choices of the cut layers at positions ``r``, one row each (their kept strategies' local
            indices, the first slowest: ``itertools.product``'s order)."""
            if r not in grids:
                sizes = [dims[i] for i in r]
                grids[r] = np.indices(sizes).reshape(len(r), -1).T if r else np.zeros((1, 0), dtype=np.int64)
            return grids[r]

        def rows_of(r: tuple, sub: tuple) -> np.ndarray:
            """For each row of ``grid(r)``, its row of ``grid(sub)`` (``sub`` within ``r``)."""
            g = grid(r)
            if not sub:
                return np.zeros(len(g), dtype=np.int64)
            return np.ravel_multi_index(tuple(g[:, r.index(i)] for i in sub), tuple(dims[i] for i in sub))

        combos = grid(full)
        const = np.zeros(len(combos))
        for i, k in enumerate(cut):
            const += own[k][keep[k][combos[:, i]]]
            for k2 in self.nbrs[k] & cutset:
                if k < k2:
                    const += self.table(k, k2)[keep[k][combos[:, i]], keep[k2][combos[:, pos[k2]]]]
        U: dict[int, np.ndarray] = {}
        sub: dict[int, np.ndarray] = {}
        tree_sig: dict[int, tuple] = {}
        msgs: dict[int, list[tuple]] = {v: [] for v in self.varies}
        for v, p in self.order:  # messages up, children before parents
            r = self.rel[v]
            tree_sig[v] = (sig[v], tuple(sig[cut[i]] for i in r), tuple(tree_sig[c] for c in self.children[v]))
            key = (tree_sig[v], None if p is None else hash(keep[p].tobytes()))  # the message's columns: p's kept
            hit = self._memo.get(v)
            if hit is not None and hit[0] == key:
                _, U[v], sub[v], msg = hit
            else:
                base = own[v][keep[v]][None, :]
                for k in self.nbrs[v] & cutset:
                    base = base + self.table(k, v)[keep[k][grid(r)[:, r.index(pos[k])]]][:, keep[v]]
                for m, mr in msgs[v]:  # a child's message on its own cut choices, spread over this layer's
                    base = base + (m if mr == r or not mr else m[rows_of(r, mr)])
                U[v] = base
                msg = None
                if p is not None:
                    W = sub[v] = self.table(v, p)[np.ix_(keep[v], keep[p])]
                    rows = U[v].shape[0]
                    step = max(1, BATCH // max(W.size, 1))  # cut choices a call: about BATCH entries at once
                    msg = np.empty((rows, W.shape[1]))
                    buf = np.empty((min(step, rows), *W.shape))
                    for a in range(0, rows, step):
                        b = min(a + step, rows)
                        np.add(U[v][a:b, :, None], W[None, :, :], out=buf[:b - a])
                        np.minimum.reduce(buf[:b - a], axis=1, out=msg[a:b])
                self._memo[v] = (key, U[v], sub.get(v), msg)
            if p is not None:
                msgs[p].append((msg, r))
        total = const + sum(U[x].min(axis=1)[rows_of(full, self.rel[x])] for x in self.roots)
        q = int(np.argmin(total))
        if not math.isfinite(total[q]):
            return math.inf, self.problem.min_memory_assignment()
        assign = [0] * len(unary)
        local = {}
        for i, k in enumerate(cut):
            assign[k] = int(keep[k][combos[q, i]])
        for v, p in reversed(self.order):  # choices down, parents before children
            r = self.rel[v]
            row = U[v][int(np.ravel_multi_index(tuple(combos[q, i] for i in r), tuple(dims[i] for i in r))) if r else 0]
            local[v] = int(np.argmin(row if p is None else row + sub[v][:, local[p]]))
            assign[v] = int(keep[v][local[v]])
        return float(total[q]), assign


def applicable(problem: Problem) -> str | None:
    """Why dynamic programming cannot be used on ``problem`` (None: it can)."""
    pairs = sum(problem.sizes[a] * problem.sizes[b] for a, b in problem.edge_counts if a != b)
    if not problem.tables.precomputed and pairs > PAIRS_LIMIT:
        return f"its boxing tables hold {pairs:.3g} entries, above {PAIRS_LIMIT:.0e}"
    return None


@dataclass
class Relaxed:
    """What ``relax`` found: the plans that fit (cost, plan; cheapest first), the best lower bound on the
    optimum, whether the cheapest plan is proven optimal, and how many dynamic programs it solved."""

    plans: list[tuple[float, list[int]]] = field(default_factory=list)
    over: list[list[int]] = field(default_factory=list)  # the programs' plans over the memory limit
    bound: float = -math.inf
    exact: bool = False
    solves: int = 0
    dp: LayerDP | None = None
    unary: list[np.ndarray] = field(default_factory=list)  # the program's costs at the last lambda, mu = 0

    @property
    def best(self) -> float:
        return self.plans[0][0] if self.plans else math.inf


def relax(problem: Problem, clock: Clock | None = None, rounds: int = 8) -> Relaxed:
    """Lagrangian relaxation of the memory limit and the step objective's exposed sync, each
    ``LayerDP.solve`` a lower bound and a plan; ``rounds`` bisection steps per multiplier."""
    dp = LayerDP(problem)
    if dp.work > CUT_WORK:
        raise OptionError("search", f"dp would touch {dp.work:.3g} table entries per solve (the layer graph's "
                                    f"cycles cut at {len(dp.cut)} layers): use cd or mh")
    out, seen = Relaxed(), set()
    step = problem.objective == "step"
    first = problem.first
    limit = problem.memory_limit
    if step:
        D = [problem.sync_tot[v] - problem.bwd_tot[v] for v in range(len(problem.sizes))]
        F = [problem.node_sync[v] if v == first else 0.0 for v in range(len(problem.sizes))]

    free = problem.shared(("relaxation without memory", problem.mode), dict)

    def solve(lam: float, mu: float) -> tuple[list[int], float, float]:
        """(plan, S - W - F of it, memory over the limit). Without the memory term (mu 0) the program is the same
        for every copy of the problem that differs in its memory alone (a pipeline stage's in-flight copies,
        which share ``shared``): solved once for them all, keyed by a digest of its costs."""
        unary = [problem.node[v] + (lam * D[v] + (1 - lam) * F[v] if step else 0.0)
                 + (mu * problem.mem[v] if mu else 0.0) for v in range(len(problem.sizes))]
        if mu:
            value, plan = dp.solve(unary)
        else:
            digest = hashlib.blake2b(digest_size=20)
            for u in unary:
                digest.update(u.tobytes())
            key = digest.digest()
            if key in free:
                value, plan = free[key][0], list(free[key][1])
            else:
                value, plan = dp.solve(unary)
                if math.isfinite(value):  # an infinite one answers with the copy's own least-memory plan
                    free[key] = (value, list(plan))
        out.solves += 1
        if clock is not None:
            clock.steps += 1
        problem.evaluations += dp.work
        out.bound = max(out.bound, value - (mu * limit if mu else 0.0))
        cost = problem.cost(plan)
        if tuple(plan) not in seen:
            seen.add(tuple(plan))
            if math.isfinite(cost):
                out.plans.append((cost, plan))
            elif limit is not None and problem.memory_of(plan) > limit:
                out.over.append(plan)
        over = problem.memory_of(plan) - limit if limit is not None else -1.0
        slack = (sum(D[v][i] for v, i in enumerate(plan)) - F[first][plan[first]]) if step else 0.0
        return plan, slack, over

    def best_lambda(mu: float) -> tuple[float, float]:
        """lambda where S - W - F changes sign at this mu (1 or 0 if it does not); (lambda, over)."""
        _, slack, over = solve(1.0, mu)
        if not step or slack >= 0:
            return 1.0, over
        _, slack0, over0 = solve(0.0, mu)
        if slack0 <= 0:
            return 0.0, over0
        lo, hi = 0.0, 1.0  # slack > 0 at lo, < 0 at hi
        for _ in range(rounds):
            mid = (lo + hi) / 2
            _, s, over = solve(mid, mu)
            lo, hi = (mid, hi) if s > 0 else (lo, mid)
        return lo, over

    out.dp = dp
    lam, over = best_lambda(0.0)
    if over > 0:  # the memory limit binds: find mu where the plan just fits
        scale = max(abs(c) for c, _ in out.plans) if out.plans else float(sum(n.min() for n in problem.node))
        lo, hi = 0.0, max(scale, 1e-12) / limit * 1e-3
        for _ in range(60):
            _, _, over = solve(lam, hi)
            if over <= 0:
                break
            lo, hi = hi, hi * 4
        for _ in range(rounds):
            mid = (lo + hi) / 2
            _, _, over = solve(lam, mid)
            lo, hi = (mid, hi) if over > 0 else (lo, mid)
        if step:
            lam, _ = best_lambda(hi)
    out.unary = [problem.node[v] + (lam * D[v] + (1 - lam) * F[v] if step else 0.0) for v in range(len(problem.sizes))]
    out.plans.sort(key=lambda x: x[0])
    out.exact = bool(out.plans) and out.plans[0][0] <= out.bound * (1 + 1e-12)
    return out


class DynamicProgramming(Search):
    """Exact optimum by dynamic programming over the layer graph (cycles of tied blocks cut by
    conditioning), where the objective is additive and the optimum fits; otherwise the cheapest plan that
    fits among the Lagrangian relaxation's, with its lower bound (``relax``)."""

    name = "dp"

    def run(self, problem, budget, rng, start=None):
        why = applicable(problem)
        if why:
            raise OptionError("search", f"dp needs every boxing table, but {why}: use cd or mh")
        clock = Clock(budget, self.progress, self.name)
        rel = relax(problem, clock)
        if not rel.plans:
            raise OptionError("search", "dp found no plan under the memory limit: use cd or mh")
        cost, plan = rel.plans[0]
        clock.offer(cost)
        gap = cost / rel.bound - 1 if rel.bound > 0 else math.inf
        stopped = ("exact (dynamic programming over the layer graph)" if rel.exact else
                   f"Lagrangian relaxation: within {gap:.2%} of its lower bound {rel.bound:.4g}")
        res = self._result(clock, plan, stopped)
        res.bound = rel.bound
        return res
