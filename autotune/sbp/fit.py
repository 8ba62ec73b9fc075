"""Searching for a plan that fits with its workspace, and over recomputation and FSDP modes.

Workspace: a plan's peak holds, beyond the per-layer figures the searches add
up, a workspace that depends on the whole plan (``autotune.sbp.memory.peak_workspace``).
The searches constrain the per-layer sum to the device's limit less a
``Problem.reserve``; ``search_fitting`` starts the reserve at the workspace of the
warm start (none without one), searches, and while the searched plan
does not fit at its peak raises the reserve by what it overshot (at least to
its workspace) and searches again, a few rounds at most. So the plan it returns
fits by the same accounting as the baselines' (``Problem.fits_plan``).

Modes (``search_modes``): recomputation (none / selective / full) and FSDP (none /
over every axis / over the intra-node axes, HSDP's / over the node axes, TP+FSDP's)
are ``Problem`` options (``Problem.with_mode``, strategies and boxing tables shared).
The driver searches the plain mode first on the full budget, then every other mode
that has a plan within the memory limit, cheapest lower bound first, on a
``SHARE`` of the budget and warm-started from the best plan so far (same strategy
indices); a mode is skipped when a lower bound on its every plan's cost is no
cheaper than the best plan so far (``lower_bound``: with no memory limit, one
dynamic program over the additive part plus, under the step objective, the first
layer's sync F, as max(S - W, F) >= F; where dynamic programming does not apply,
each layer's cheapest own cost, the boxing between layers being >= 0). Selective
recomputation only where some attention materialises its probabilities (with
flash attention it saves nothing), full only where the model has blocks. The plan
kept is the cheapest that fits.
"""
from __future__ import annotations

import math
from dataclasses import replace

from autotune.sbp.cost import Problem
from autotune.sbp.dp import CUT_WORK, LayerDP, applicable
from autotune.sbp.memory import Mode
from autotune.sbp.searchbase import Budget, SearchResult

ROUNDS = 4
SHARE = 1 / 6  # of the first search's time for each later mode


def search_fitting(problem: Problem, run, start=None, rounds: int = ROUNDS):
    """``run(problem, start)`` -> a search result (``assignment``, ``cost``); the result whose plan fits at
    its peak. The reserve never leaves the least-memory plan out; if no round's plan fits, that plan where
    it fits (its cost the problem's), else the last round's result (which does not fit; None if none ran)."""
    if start is not None and problem.device_limit is not None:  # the warm start's workspace
        problem.reserve = min(problem.memory_breakdown(start).workspace,
                              max(problem.device_limit - problem.min_memory, 0.0))
    res = None
    for _ in range(rounds):
        if not problem.fits:
            break
        res = run(problem, start)
        if problem.fits_plan(res.assignment):
            return res
        m = problem.memory_breakdown(res.assignment)
        reserve = min(max(problem.reserve + m.total - problem.device_limit, m.workspace),
                      problem.device_limit - problem.min_memory)
        if reserve <= problem.reserve:
            break
        problem.reserve, start = reserve, None
    least = problem.min_memory_assignment()
    if problem.device_limit is not None and problem.fits_plan(least):
        return SearchResult(res.algorithm if res else "least memory", least, problem.raw_cost(least),
                            res.seconds if res else 0.0, res.steps if res else 0,
                            "no searched plan fits with its workspace: the least-memory plan", list(res.trace) if res else [])
    return res


def lower_bound(problem: Problem) -> float:
    """A lower bound on the cost of every plan of ``problem``, the memory limit ignored."""
    unary = list(problem.node)
    if problem.objective == "step":
        unary[problem.first] = unary[problem.first] + problem.node_sync[problem.first]
    elif problem.tied_pair is not None:  # the most a choice of the tied logits can save with any embedding's
        t = problem.tied_pair[0]
        unary[t] = unary[t] - problem.tied_sync.max(axis=1)
    if applicable(problem) is None:
        dp = LayerDP(problem)
        if dp.work <= CUT_WORK:
            return dp.solve(unary)[0]
    return float(sum(u.min() for u in unary))


def recompute_modes(problem: Problem) -> list[str]:
    """The recomputation modes that can save memory on this model."""
    out = []
    if any(op.layer.kind == "attention" and not op.dims.get("flash", 0) for op in problem.ops):
        out.append("selective")
    if getattr(problem.graph, "blocks", None):
        out.append("full")
    return out


def scaled(budget: Budget, share: float) -> Budget:
    """``share`` of a budget (each limit it sets; patience at least 3)."""
    if share >= 1:
        return budget
    return Budget(seconds=budget.seconds * share if budget.seconds else None,
                  steps=max(1, round(budget.steps * share)) if budget.steps else None,
                  patience=max(3, round(budget.patience * share)) if budget.patience else None)


def sharding_modes(problem: Problem) -> list[tuple[int, ...] | None]:
    """FSDP's choices: none, every axis, the intra-node axes (HSDP), the node axes (TP+FSDP's); on one device
    none only (sharding over no axis is no FSDP, priced apart: a pipeline's one-GPU stage took it on a tie)."""
    cl = problem.cluster
    nodes = tuple(range(len(cl.node_axes)))
    gpus = tuple(range(len(cl.node_axes), len(cl.axis_sizes)))
    return [None, *dict.fromkeys(a for a in (nodes + gpus, gpus, nodes) if a)]


def fewest_blocks(problem: Problem, assign, problem_of=None) -> int:
    """Megatron-LM's block recomputation of plan ``assign`` found under full recomputation (``problem``'s mode
    re-runs every block, without FSDP): the fewest of the blocks re-run under which the plan still fits at its
    peak, each block fewer one forward fewer (memory falls as the count grows: a binary search); 0 where none
    fewer than all fits or the mode is another. ``problem_of(mode)``: the problem under a mode (default
    ``problem.with_mode``)."""
    mode, n = problem.mode, len(getattr(problem.graph, "blocks", None) or [])
    if not mode.takes_blocks or n < 2 or problem.device_limit is None:
        return 0
    problem_of = problem_of or problem.with_mode
    return least_count(n - 1, lambda b: problem_of(replace(mode, blocks=b)).fits_plan(assign))


def least_count(most: int, fits) -> int:
    """The least k in 1..``most`` for which ``fits(k)`` holds, where it holds for every k above one that does (a
    binary search); 0 where it does not hold at ``most``."""
    lo, hi = 1, most
    if most < 1 or not fits(hi):
        return 0
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(mid) else (mid + 1, hi)
    return hi


def search_modes(problem: Problem, run, start=None, progress=None, fsdp: bool = True):
    """The best plan over the modes (``run(problem, start, share)`` searches one, ``share`` of its default
    budget): (problem of its mode, result), or (problem, the search's result that does not fit) where no mode
    has a plan that fits, or (problem, None) where no mode has one within the memory limit at all."""
    best: tuple[Problem, object] | None = None
    fallback = None
    modes = [m for m in (Mode(rec, sh) for rec in ["none"] + recompute_modes(problem)
                         for sh in (sharding_modes(problem) if fsdp else [None])) if m != problem.mode]

    def attempt(pr: Problem, share: float, warm):
        nonlocal best, fallback
        res = search_fitting(pr, lambda p, s: run(p, s, share), warm)
        if res is None:
            return
        fits = pr.fits_plan(res.assignment) and math.isfinite(res.cost)
        if progress:
            progress(f"mode {describe(pr.mode)}: {res.cost:.4g} s/step, fits: {fits}")
        if fits and (best is None or res.cost < best[1].cost):
            best = (pr, res)
        elif fallback is None:
            fallback = (pr, res)

    if problem.fits:
        attempt(problem, 1.0, start)
    others = []
    for mode in modes:
        pr = problem.with_mode(mode)
        if not pr.fits:
            if progress:
                progress(f"mode {describe(mode)}: no plan fits")
            continue
        others.append((lower_bound(pr), pr))
    for bound, pr in sorted(others, key=lambda x: x[0]):
        if best is not None and bound >= best[1].cost * (1 - 1e-9):
            if progress:
                progress(f"mode {describe(pr.mode)}: skipped, its plans cost at least {bound:.4g} s/step")
            continue
        attempt(pr, SHARE if best is not None else 1.0, best[1].assignment if best is not None else start)
    if best is not None:
        pr, res = best
        blocks = fewest_blocks(pr, res.assignment)
        if blocks:
            pr = pr.with_mode(replace(pr.mode, blocks=blocks))
            res = replace(res, cost=pr.raw_cost(res.assignment))
            if progress:
                progress(f"mode {describe(pr.mode)}: {res.cost:.4g} s/step")
        return pr, res
    return fallback if fallback is not None else (problem, None)


def describe(mode: Mode) -> str:
    sh = "no FSDP" if mode.fsdp_axes is None else f"FSDP over axes {list(mode.fsdp_axes)}"
    blocks = f" (the first {mode.blocks} blocks)" if mode.blocks else ""
    return f"recompute {mode.recompute}{blocks}, {sh}"
