"""Searching for a plan that fits with its workspace, and over recomputation and FSDP modes.

Workspace: a plan's peak holds, beyond the per-layer figures the searches add
up, a workspace that depends on the whole plan (``autotune.sbp.memory.peak_workspace``).
The searches constrain the per-layer sum to the device's limit less a
``Problem.reserve``; ``search_fitting`` starts the reserve at the workspace of the
warm start (none without one), searches, and while the searched plan
does not fit at its peak raises the reserve by what it overshot (at least to
its workspace) and searches again, a few rounds at most. So the plan it returns
fits by the same accounting as the baselines' (``Problem.fits_plan``).

Modes (``search_modes``): recomputation (none / selective / full) and FSDP
(none / over every axis) are ``Problem`` options (``Problem.with_mode``, strategies
and boxing tables shared). The driver searches the plain mode first, then FSDP
over every axis; recomputation modes only when the best plan so far is bound by
memory (it needs more than ``BINDING`` of the limit) or nothing fit, since
recomputation only adds work to a plan and pays off only by freeing memory for
a faster one. Selective recomputation only where some attention materialises its
probabilities (with flash attention it saves nothing), full only where the model
has blocks. A mode is skipped, too, when a lower bound on its every plan's cost,
with no memory limit (``lower_bound``: one dynamic program over the additive part
plus, under the step objective, the first layer's sync F, as max(S - W, F) >= F),
is no cheaper than the best plan so far. Every later mode starts from the best plan
so far (same strategy indices). The plan kept is the cheapest that fits.
"""
from __future__ import annotations

import math

from autotune.sbp.cost import Problem
from autotune.sbp.dp import CUT_WORK, LayerDP, applicable
from autotune.sbp.memory import Mode
from autotune.sbp.searchbase import SearchResult

ROUNDS = 4
BINDING = 0.9


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
    """A lower bound on the cost of every plan of ``problem``, the memory limit ignored; -inf where dynamic
    programming does not apply."""
    if applicable(problem) is not None:
        return -math.inf
    dp = LayerDP(problem)
    if dp.work > CUT_WORK:
        return -math.inf
    unary = list(problem.node)
    if problem.objective == "step":
        unary[problem.first] = unary[problem.first] + problem.node_sync[problem.first]
    value, _ = dp.solve(unary)
    return value


def recompute_modes(problem: Problem) -> list[str]:
    """The recomputation modes that can save memory on this model."""
    out = []
    if any(op.layer.kind == "attention" and not op.dims.get("flash", 0) for op in problem.ops):
        out.append("selective")
    if getattr(problem.graph, "blocks", None):
        out.append("full")
    return out


def all_axes(problem: Problem) -> tuple[int, ...]:
    return tuple(range(len(problem.cluster.axis_sizes)))


def search_modes(problem: Problem, run, start=None, progress=None, fsdp: bool = True):
    """The best plan over the modes (``run(problem, start)`` searches one): (problem of its mode, result), or
    (problem, None) where no mode fits."""
    best: tuple[Problem, object] | None = None
    fallback = None

    def better(pr, res):
        return res is not None and pr.fits_plan(res.assignment) and math.isfinite(res.cost) and (
            best is None or res.cost < best[1].cost)

    def attempt(mode: Mode):
        nonlocal best, fallback
        pr = problem if mode == problem.mode else problem.with_mode(mode)
        if not pr.fits:
            if progress:
                progress(f"mode {describe(mode)}: no plan fits")
            return
        if best is not None:
            bound = lower_bound(pr)
            if bound >= best[1].cost * (1 - 1e-9):
                if progress:
                    progress(f"mode {describe(mode)}: skipped, its plans cost at least {bound:.4g} s/step")
                return
        warm = best[1].assignment if best is not None else start
        res = search_fitting(pr, run, warm)
        if progress and res is not None:
            progress(f"mode {describe(mode)}: {res.cost:.4g} s/step, fits: {pr.fits_plan(res.assignment)}")
        if better(pr, res):
            best = (pr, res)
        elif fallback is None and res is not None:
            fallback = (pr, res)

    attempt(problem.mode)
    if fsdp:
        attempt(Mode(problem.mode.recompute, all_axes(problem)))
    binding = best is None or problem.device_limit is None or (
        best[0].peak_memory(best[1].assignment) > BINDING * problem.device_limit)
    if binding and problem.device_limit is not None:
        for rec in recompute_modes(problem):
            attempt(Mode(rec))
            if fsdp:
                attempt(Mode(rec, all_axes(problem)))
    if best is not None:
        return best
    return fallback if fallback is not None else (problem, None)


def describe(mode: Mode) -> str:
    sh = "no FSDP" if mode.fsdp_axes is None else f"FSDP over axes {list(mode.fsdp_axes)}"
    return f"recompute {mode.recompute}, {sh}"
