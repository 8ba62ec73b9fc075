"""The split of a model's blocks among pipeline stages (the stage DP).

Stage i of p takes k_i >= 1 consecutive blocks (sum L); its time per micro-batch T(i, b, k) (forward
plus backward, b the blocks before it) comes from its SBP plan. The pipeline's makespan with m
micro-batches is estimated as

    sum_i T_i + (m - 1) max_i T_i

(exact for 1F1B and GPipe when the boundaries cost nothing: the first micro-batch crosses every stage,
the bottleneck stage runs the other m - 1 back to back). ``best_split`` minimises it exactly over the
splits whose stages take between ``lo`` and ``hi`` blocks: for every candidate bottleneck tau (each T
value), a DP over (stage, blocks used) minimises sum T under T_i <= tau; the best tau gives the optimum.

Each T is a stage SBP search, so ``best_split`` takes a cheap lower bound on T (``bound``) and times only
what the optimum needs: the DP runs on the bounds (T where timed), the last entry of its best split that is
not timed yet is timed, and it runs again until its best split is made of timed entries. The estimate
does not decrease when a T grows, so that split is the optimum of the DP over every T. The last stage first:
a pipeline's later stages keep fewer micro-batches in flight, and a plan searched under fewer serves the
counts it still fits (``autotune.pipeline.search.StageSearch``), which tightens the others' bounds.
"""
from __future__ import annotations

import math
from typing import Callable


def window(blocks: int, stages: int, width: int) -> tuple[int, int]:
    """Blocks a stage may take: within ``width`` of the balanced share."""
    return max(1, blocks // stages - width), -(-blocks // stages) + width


def estimate(times: list[float], micro_batches: int) -> float:
    """The 1F1B makespan without transfers: every stage's time once and the slowest's m - 1 more; inf where a
    stage does not fit (inf), one micro-batch included (not 0 x inf)."""
    worst = max(times)
    return math.inf if math.isinf(worst) else sum(times) + (micro_batches - 1) * worst


def best_split(blocks: int, stages: int, time: Callable[[int, int, int], float], micro_batches: int,
               lo: int, hi: int, bound: Callable[[int, int, int], float] | None = None,
               cutoff: float = math.inf) -> tuple[list[int], float] | None:
    """The split minimising ``estimate`` with lo <= k_i <= hi, or None if there is none under ``cutoff``;
    ``time(i, b, k)`` is stage i's time with k blocks after the first b (inf: the stage does not fit);
    ``bound(i, b, k)`` a lower bound on it (default: ``time`` itself, every entry timed)."""
    entries = [(i, b, k) for i in range(stages)
               for b in range(i * lo, min(i * hi, blocks - (stages - i) * lo) + 1)
               for k in range(lo, hi + 1) if (stages - i - 1) * lo <= blocks - b - k <= (stages - i - 1) * hi]
    timed: dict[tuple[int, int, int], float] = {}
    if bound is None:
        timed = {e: time(*e) for e in entries}
    while True:
        table = {e: timed[e] if e in timed else bound(*e) for e in entries}
        found = _solve(table, blocks, stages, micro_batches, cutoff)
        if found is None:
            return None
        split, b, todo = found[0], 0, []
        for i, k in enumerate(split):
            if (i, b, k) not in timed:
                todo.append((i, b, k))
            b += k
        if not todo:
            return found
        timed[todo[-1]] = time(*todo[-1])


def _solve(table: dict[tuple[int, int, int], float], blocks: int, stages: int, micro_batches: int,
           cutoff: float = math.inf) -> tuple[list[int], float] | None:
    """The exact DP over the entries' times ``table``: (split, estimate), None if no split fits under ``cutoff``."""
    by_stage: list[list[tuple[int, int, float]]] = [[] for _ in range(stages)]
    for (i, b, k), t in table.items():
        by_stage[i].append((b, k, t))

    def least(tau: float) -> dict[tuple[int, int], tuple[float, int]]:
        """DP backwards: cost[(i, b)] = least sum of T over stages i.. with b blocks used before stage i, each T
        at most ``tau``."""
        cost: dict[tuple[int, int], tuple[float, int]] = {(stages, blocks): (0.0, 0)}
        for i in range(stages - 1, -1, -1):
            for b, k, t in by_stage[i]:
                if t > tau or (i + 1, b + k) not in cost:
                    continue
                c = t + cost[(i + 1, b + k)][0]
                if (i, b) not in cost or c < cost[(i, b)][0]:
                    cost[(i, b)] = (c, k)
        return cost

    # the least sum of T of any split: no bottleneck tau gives a smaller one, so a tau whose
    # least + (m - 1) tau is no better than the best split so far (or the cutoff) ends the search
    floor = least(math.inf).get((0, 0), (math.inf, 0))[0]
    best: tuple[float, list[int]] | None = None
    for tau in sorted({t for t in table.values() if math.isfinite(t)}):
        if floor + (micro_batches - 1) * tau >= (best[0] if best is not None else cutoff):
            break  # every later bottleneck costs more than the best split already
        cost = least(tau)
        if (0, 0) not in cost:
            continue
        total = cost[(0, 0)][0] + (micro_batches - 1) * tau
        if total < (best[0] if best is not None else cutoff):
            split, b = [], 0
            for i in range(stages):
                k = cost[(i, b)][1]
                split.append(k)
                b += k
            best = (total, split)
    return None if best is None else (best[1], best[0])
