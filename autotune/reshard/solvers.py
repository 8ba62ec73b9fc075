"""Load balance and scheduling of unit-task jobs (§3.2), behind one registry.

A solution is a global order of (job, option) pairs. Following the paper's
formulation (Eq. 1-3), a job starts as soon as every port it uses (its devices,
the send port of each host it sends from, the receive port of each host it
receives into) has finished the jobs placed before it in the order; the
makespan is the last end. Solvers:

- naive: every job from its lowest-indexed sender device, in task order;
- load_balance: jobs by decreasing duration, each to the sender whose host has
  the least send load so far (the classical greedy for Eq. 4), in that order;
- greedy_in_order: the paper's baselines (§5.1.2, Alpa): jobs in task order,
  each to the sender with the lowest load so far for the next data slice;
- dfs: depth-first search over the next job and its sender, pruned by a lower
  bound (port free time plus the work every remaining job must put on that
  port), within a time budget;
- randomized_greedy: rounds of random orders, each picking a set of jobs with
  disjoint ports; the set with most devices is scheduled next;
- ensemble: the best of the above (the paper runs DFS and randomized greedy).
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import numpy as np

from autotune.reshard.network import Network
from autotune.reshard.strategies import Job
from kernels.reshard.tasks import UnitTask

Order = list[tuple[int, int]]  # (job index, option index), in schedule order
EPS = 1e-12


@dataclass(frozen=True)
class SolverConfig:
    time_budget: float = 0.5   # seconds for dfs
    rounds: int = 16           # random orders per randomized-greedy iteration
    restarts: int = 4          # randomized-greedy restarts
    seed: int = 0


@dataclass(frozen=True)
class Slot:
    job: int
    option: int
    start: float
    end: float


def simulate(jobs: list[Job], order: Order) -> list[Slot]:
    free: dict = {}
    out = []
    for j, o in order:
        opt = jobs[j].options[o]
        start = max((free.get(p, 0.0) for p in opt.ports), default=0.0)
        end = start + opt.duration
        for p in opt.ports:
            free[p] = end
        out.append(Slot(j, o, start, end))
    return out


def makespan(slots: list[Slot]) -> float:
    return max((s.end for s in slots), default=0.0)


def port_load(jobs: list[Job], order: Order) -> float:
    """The busiest port's total work in this plan: a lower bound on its makespan."""
    load: dict = {}
    for j, o in order:
        opt = jobs[j].options[o]
        for p in opt.ports:
            load[p] = load.get(p, 0.0) + opt.duration
    return max(load.values(), default=0.0)


def lower_bound(units: list[UnitTask], net: Network) -> float:
    """A bound on any plan under the network model, whatever the strategy or order.

    Every slice must cross into each receiver host that holds no replica of it
    (receive-port bound); leave some host holding a replica whenever a receiver
    sits on another host (send-port bound, split fractionally over the hosts that
    could send it); and reach every receiver device that does not hold it
    (device bound). Each crossing costs at least one inter-host hop of the slice, on one of the host's
    ``Network.nics`` NICs (the port bounds shared by them).
    """
    recv: dict[int, float] = {}
    dev: dict[int, float] = {}
    sends: list[tuple[frozenset[int], float]] = []
    single = 0.0
    for u in units:
        shosts = {net.host(s) for s in u.senders}
        rhosts = {net.host(d) for d in u.receivers}
        t_inter = net.inter_hop(u.nbytes)
        for h in rhosts - shosts:
            recv[h] = recv.get(h, 0.0) + t_inter / net.nics
        for d in u.receivers:
            if d not in u.senders:
                dev[d] = dev.get(d, 0.0) + min(net.hop(u.nbytes, s, d) for s in u.senders)
        if all(rhosts - {net.host(s)} for s in u.senders):
            sends.append((frozenset(shosts), t_inter / net.nics))
            single = max(single, t_inter)
        else:
            single = max(single, min(max(net.hop(u.nbytes, s, d) for d in u.receivers) for s in u.senders))
    send = 0.0
    sets = sorted({s for s, _ in sends}, key=sorted)
    combos = (itertools.chain.from_iterable(itertools.combinations(sets, r) for r in range(1, len(sets) + 1))
              if len(sets) <= 10 else ([s] for s in sets + [frozenset().union(*sets)]))
    for combo in combos:
        union = frozenset().union(*combo)
        send = max(send, sum(t for s, t in sends if s <= union) / len(union))
    return max([single, send, *recv.values(), *dev.values()])


class Solver:
    name = ""

    def solve(self, jobs: list[Job], cfg: SolverConfig) -> Order:
        raise NotImplementedError


class Naive(Solver):
    name = "naive"

    def solve(self, jobs, cfg):
        return [(j, min(range(len(job.options)), key=lambda o: job.options[o].sender))
                for j, job in enumerate(jobs)]


class LoadBalance(Solver):
    name = "load_balance"

    def solve(self, jobs, cfg):
        host_load: dict = {}
        dev_load: dict = {}
        order = []
        for j in sorted(range(len(jobs)), key=lambda j: (-min(o.duration for o in jobs[j].options), j)):
            def key(o, job=jobs[j]):
                opt = job.options[o]
                hosts = [p for p in opt.ports if p[0] == "send"] or [("dev", opt.sender)]
                return (max(host_load.get(p, 0.0) for p in hosts) + opt.duration,
                        dev_load.get(opt.sender, 0.0) + opt.duration, opt.sender)
            o = min(range(len(jobs[j].options)), key=key)
            opt = jobs[j].options[o]
            for p in [p for p in opt.ports if p[0] == "send"] or [("dev", opt.sender)]:
                host_load[p] = host_load.get(p, 0.0) + opt.duration
            dev_load[opt.sender] = dev_load.get(opt.sender, 0.0) + opt.duration
            order.append((j, o))
        return order


class GreedyInOrder(Solver):
    name = "greedy_in_order"

    def solve(self, jobs, cfg):
        load: dict = {}
        order = []
        for j, job in enumerate(jobs):
            def key(o, job=job):
                opt = job.options[o]
                hosts = [p for p in opt.ports if p[0] == "send"] or [("dev", opt.sender)]
                return (max(load.get(p, 0.0) for p in hosts), opt.sender)
            o = min(range(len(job.options)), key=key)
            opt = job.options[o]
            for p in [p for p in opt.ports if p[0] == "send"] or [("dev", opt.sender)]:
                load[p] = load.get(p, 0.0) + opt.duration
            order.append((j, o))
        return order


class _Timeout(Exception):
    pass


class DFS(Solver):
    name = "dfs"

    def __init__(self, incumbent: Order | None = None):
        self.incumbent = incumbent

    def solve(self, jobs, cfg):
        best_order = self.incumbent or LoadBalance().solve(jobs, cfg)
        best = [makespan(simulate(jobs, best_order)), list(best_order)]
        sig = [tuple((o.duration, tuple(sorted(o.ports))) for o in job.options) for job in jobs]
        common = []
        for job in jobs:
            ports = frozenset.intersection(*(o.ports for o in job.options))
            common.append((ports, min(o.duration for o in job.options)))
        rem_load: dict = {}
        for ports, d in common:
            for p in ports:
                rem_load[p] = rem_load.get(p, 0.0) + d
        free: dict = {}
        remaining = set(range(len(jobs)))
        order: Order = []
        deadline = time.monotonic() + cfg.time_budget
        nodes = [0]

        def rec(cur: float):
            nodes[0] += 1
            if nodes[0] % 256 == 0 and time.monotonic() > deadline:
                raise _Timeout
            if not remaining:
                if cur < best[0] - EPS:
                    best[0], best[1] = cur, list(order)
                return
            bound = max([cur] + [free.get(p, 0.0) + w for p, w in rem_load.items()])
            if bound >= best[0] - EPS:
                return
            seen, cands = set(), []
            for j in sorted(remaining):
                if sig[j] in seen:
                    continue
                seen.add(sig[j])
                for o, opt in enumerate(jobs[j].options):
                    start = max((free.get(p, 0.0) for p in opt.ports), default=0.0)
                    cands.append((start + opt.duration, start, j, o))
            cands.sort()
            for end, _, j, o in cands:
                opt = jobs[j].options[o]
                saved = {p: free.get(p, 0.0) for p in opt.ports}
                for p in opt.ports:
                    free[p] = end
                ports, d = common[j]
                for p in ports:
                    rem_load[p] -= d
                remaining.discard(j)
                order.append((j, o))
                try:
                    rec(max(cur, end))
                finally:
                    order.pop()
                    remaining.add(j)
                    for p in ports:
                        rem_load[p] += d
                    free.update(saved)

        try:
            rec(0.0)
        except _Timeout:
            pass
        return best[1]


class RandomizedGreedy(Solver):
    name = "randomized_greedy"

    def solve(self, jobs, cfg):
        rng = np.random.default_rng(cfg.seed)
        best: tuple[float, Order] | None = None
        for _ in range(max(cfg.restarts, 1)):
            order = self._one(jobs, cfg, rng)
            ms = makespan(simulate(jobs, order))
            if best is None or ms < best[0] - EPS:
                best = (ms, order)
        return best[1] if best else []

    @staticmethod
    def _one(jobs, cfg, rng) -> Order:
        remaining = list(range(len(jobs)))
        free: dict = {}
        order: Order = []
        while remaining:
            best_set, best_score = None, None
            for _ in range(max(cfg.rounds, 1)):
                used: set = set()
                chosen = []
                for i in rng.permutation(len(remaining)):
                    j = remaining[i]
                    fits = [(max((free.get(p, 0.0) for p in opt.ports), default=0.0) + opt.duration, o)
                            for o, opt in enumerate(jobs[j].options) if not (opt.ports & used)]
                    if fits:
                        _, o = min(fits)
                        chosen.append((j, o))
                        used |= jobs[j].options[o].ports
                score = (sum(1 for p in used if p[0] == "dev"),
                         sum(jobs[j].options[o].duration for j, o in chosen))
                if best_score is None or score > best_score:
                    best_set, best_score = chosen, score
            best_set.sort(key=lambda jo: -jobs[jo[0]].options[jo[1]].duration)
            for j, o in best_set:
                opt = jobs[j].options[o]
                end = max((free.get(p, 0.0) for p in opt.ports), default=0.0) + opt.duration
                for p in opt.ports:
                    free[p] = end
            order.extend(best_set)
            taken = {j for j, _ in best_set}
            remaining = [j for j in remaining if j not in taken]
        return order


class Ensemble(Solver):
    name = "ensemble"

    def solve(self, jobs, cfg):
        candidates = [LoadBalance().solve(jobs, cfg), RandomizedGreedy().solve(jobs, cfg)]
        incumbent = min(candidates, key=lambda o: makespan(simulate(jobs, o)))
        candidates.append(DFS(incumbent).solve(jobs, cfg))
        return min(candidates, key=lambda o: makespan(simulate(jobs, o)))


SOLVERS: dict[str, type[Solver]] = {
    cls.name: cls for cls in (Naive, LoadBalance, GreedyInOrder, DFS, RandomizedGreedy, Ensemble)
}
