"""The search as a library call: ``autotune.search(model, cluster, profile, ...)`` returns the plan file
(``autotune.plan.file.PlanFile``: the chosen ``Plan``, the baselines, the convergence traces) that ``python -m
autotune`` writes as plan.json; the command parses its flags, calls this and prints.

    import autotune
    plans = autotune.search("gpt", Cluster(4, 8), "h200-nvlink+ib400", memory_limit=80 * 2**30)
    plans.best.costs.step_s, plans.best.apply_path, [b.strategy for b in plans.baselines]

Steps: the SBP search (warm-started from the best Megatron mesh; with ``modes="all"`` also under FSDP and
recomputation), the comparison searches (``compare``: the convergence plot), the baselines (data parallel,
Megatron, FSDP, HSDP, TP+FSDP, Megatron and TP+FSDP with sequence parallelism, SUMMA, S/B only), each plan at
its path's host pace, the floor (never a plan worse than a baseline users pick) and, with ``pipeline`` not
"off", the pipelined plans.
"""
from __future__ import annotations

import time
from dataclasses import replace

import numpy as np

from calibrate.cli import message
from calibrate.errors import OptionError, UserError
from calibrate.profile import Profile
from models import LayerGraph, load_model

from autotune.pipeline.record import pipeline_plans
from autotune.pipeline.search import PipelineConfig, check as check_pipeline, parse_stages
from autotune.pipeline.slicing import with_micro_batches
from autotune.plan.build import build
from autotune.plan.file import PlanFile
from autotune.plan.hostpace import at_host_pace, corrected, path_work
from autotune.plan.layouts import CONTEXT_PATHS, sequence_axes
from autotune.plan.typed import Plan
from autotune.sbp.baselines import (baseline_plans, best_mesh, context_problem, megatron_assignment,
                                    sequence_problem)
from autotune.sbp.boxing import Coster
from autotune.sbp.cost import Problem
from autotune.sbp.fit import scaled, search_fitting, search_modes
from autotune.sbp.memory import largest_block
from autotune.sbp.mesh import Cluster
from autotune.sbp.search import EXHAUSTIVE_LIMIT, SEARCHES, Budget, auto_budget, make_search
from autotune.sbp.steptime import require_overheads
from autotune.sbp.techniques import context_parallel as with_context, context_sizes

COMPARE = ("cd", "mh", "random")
FLOOR = ("data parallel", "Megatron", "FSDP", "HSDP", "TP+FSDP")  # baselines of the searched problem's family


def choose_objective(objective: str | None, search: str, profile: Profile, devices: int = 1) -> tuple[str, str]:
    """(the objective, a note saying why where it was not given): the step time where the profile has compute
    figures (and, for several ``devices``, the host's and overlap figures that step needs: never priced at zero),
    else the communication, which the per-layer searches (exhaustive, dp) always minimise. ``--objective step``
    on a profile without those figures is refused (``require_overheads``)."""
    if objective is None and search in ("exhaustive", "dp"):
        return "comm", (f"--search {search} sums per-layer costs, which only the communication objective does: "
                        f"minimising communication (--objective comm)")
    if objective is None and profile.compute is None:
        return "comm", (f"profile {profile.name!r} has no compute figures: minimising communication "
                        f"(--objective comm); add them with python -m calibrate compute")
    missing = profile.compute.missing_overheads() if objective is None and devices > 1 else []
    if missing:
        return "comm", (f"profile {profile.name!r} lacks {' and '.join(missing)}, which the step time of {devices} "
                        f"devices needs: minimising communication (--objective comm); measure them with python -m "
                        f"calibrate compute on the machine to plan by step time")
    return objective or "step", ""


def run_search(problem: Problem, name: str, budget: Budget | None, seed: int, progress, start=None):
    """``budget`` None: ``auto_budget`` (until converged, scaled with the problem)."""
    budget = budget or auto_budget(problem)
    progress(f"search {name} (budget {budget.describe()}"
             f"{', warm-started (the best Megatron plan, or the best plan of an earlier mode)' if start is not None else ''})")
    problem.forget_lazy()
    res = make_search(name, progress).run(problem, budget, np.random.default_rng(seed), start)
    progress(f"  {name}: best {res.cost:.4g} s/step after {res.seconds:.2f} s, {res.steps} steps; stopped: {res.stopped}")
    return res


def floor(plan: Plan, baselines: list[Plan], objective: str) -> Plan:
    """The searched plan, or the cheapest baseline of ``FLOOR`` that fits where it is cheaper: the command
    never returns a plan worse than a baseline users pick."""
    fit = [b for b in baselines if b.strategy.startswith(FLOOR) and b.costs.fits_memory and
           b.costs.of(objective) is not None and b.costs.of(objective) < plan.costs.of(objective)]
    if not fit:
        return plan
    b = min(fit, key=lambda b: b.costs.of(objective))
    if not plan.costs.fits_memory:
        return b
    host = plan.costs.host_step_s  # the search's plan priced at its path's host pace, where it binds
    why = f" at the host's pace of the {plan.apply_path} path it takes" if host is not None and \
        host >= plan.costs.of(objective) else ""
    return replace(b, strategy=f"searched (the baseline {b.strategy} is cheaper than the search's plan{why})",
                   search=dict(plan.search, replaced_by=b.strategy))


def headroom_limit(memory_limit: float | None, profile: Profile, graph: LayerGraph, cluster: Cluster,
                   allocator: str = "default") -> float | None:
    """``memory_limit`` for the single-stage plans of ``graph``: under the default allocator, no higher than the
    device's usable memory (the profile's) less the step's largest single allocation (``memory.largest_block``),
    which that allocator needs beyond what it has reserved; ``memory_limit`` itself under expandable segments (they
    map a request into the segment they grow) or where the profile gives no usable memory. That allocation alone
    above the usable memory, where the micro-batch covers the devices, is one line naming it, before any search."""
    usable = profile.device.usable_bytes if profile.device is not None else None
    if memory_limit is None or not usable or allocator != "default":
        return memory_limit
    largest, mb, c = largest_block(graph, cluster.devices), graph.config.get("micro_batch", 1), graph.config
    if largest >= usable and mb >= cluster.devices:  # fewer: a vocabulary split may fit it
        raise OptionError("micro_batch", f"{mb} on {cluster.devices} device(s): the loss's fp32 copy of a device's "
                                         f"logits ({mb // cluster.devices} x {c['sequence']} x {c['vocabulary']}) takes "
                                         f"{largest / 2**30:.4g} GiB, more than the device's usable "
                                         f"{usable / 2**30:.4g} GiB: shrink it or add devices")
    return min(memory_limit, usable - largest)


def accumulation_choices(graph: LayerGraph, devices: int, most: int = 8) -> tuple[int, ...]:
    """Micro-batch counts of a step (gradient accumulation) for ``graph`` on ``devices``: those whose micro-batch is
    1, 2, 4 ... ``most`` sequences a device, as far as they divide the batch (the counts a user of a config.json who
    left the micro-batch open would try)."""
    return tuple(graph.batch // (k * devices) for k in (1, 2, 4, 8) if k <= most and graph.batch % (k * devices) == 0)


def _optional(what: str, progress, make):
    """``make()``, or None with the line "``what`` unavailable: why" where it has no plan (a ``UserError``)."""
    try:
        return make()
    except UserError as e:
        progress(f"{what} unavailable: {message(e)}")
        return None


def _fastest(a: Plan, b: Plan, objective: str) -> Plan:
    """The plan that fits, of the two, and is cheaper."""
    return min((a, b), key=lambda p: (not p.costs.fits_memory, p.costs.of(objective) or float("inf")))


def _at_counts(plan: Plan, base: list[Plan], others: list[PlanFile], objective: str) -> tuple[Plan, list[Plan]]:
    """The searched plan and each baseline at the fastest of the micro-batch counts searched (``others``: the plan
    files of the other counts), a plan of another count than the model's named with its count; the floor again over
    them (a baseline at one count may beat the search's plan at every count)."""
    def named(p: Plan) -> Plan:
        return replace(p, strategy=f"{p.strategy}, {p.micro_batches} micro-batches")

    def kind(p: Plan) -> str:  # a baseline at its best recomputation is one kind whatever that is (``baselines._name``)
        return p.strategy.removesuffix(f", recompute {p.recompute}")
    kinds = {kind(b): b for b in base}
    for pf in others:
        plan = _fastest(plan, named(pf.best), objective)
        for b in pf.baselines:
            kinds[kind(b)] = _fastest(kinds[kind(b)], named(b), objective) if kind(b) in kinds else named(b)
    return floor(plan, list(kinds.values()), objective), list(kinds.values())


def search(model: LayerGraph | str, cluster: Cluster, profile: Profile | str, *, memory_limit: float | None,
           algorithm: str = "cd", budget: Budget | None = None, modes: str = "all", objective: str | None = None,
           seed: int = 0, pipeline: str | int = "auto", schedule: str = "1f1b", pipeline_effort: str = "default",
           compare=COMPARE, allocator: str = "default", micro_batches: tuple[int, ...] = (),
           virtual_stages: int = PipelineConfig.virtual_stages, context_parallel: tuple[int, ...] | None = None,
           progress=None) -> PlanFile:
    """The plans for ``model`` (a layer graph, or a model kind or file for ``models.load_model``) on
    ``cluster`` under ``profile`` (a ``Profile`` or its name or file), ``memory_limit`` bytes a device (None:
    none): the plan file ``python -m autotune`` writes. ``budget`` None: each search until it converges;
    ``compare``: the searches run again cold for the convergence plot; ``pipeline``: "auto", "off" or a stage
    count; ``virtual_stages``: chunks a rank under the interleaved-1f1b ``schedule``; ``allocator``
    (``calibrate.allocator.ALLOCATORS``): the allocator whose allowance ``memory_limit`` left, recorded in every
    plan (``apply`` checks the job runs under it); ``micro_batches``: other micro-batch counts a step to search the
    single-stage plans at (``accumulation_choices``), each plan kept at its fastest that fits;
    ``context_parallel``: the context-parallel sizes of the Megatron and FSDP baselines with it (None: those
    ``autotune.sbp.techniques.context_sizes`` tries for a long sequence; (): none); ``progress``: called with a
    line per step. A module section measured on the model prices its compute beside collectives
    (``Profile.for_model``)."""
    progress = progress or (lambda line: None)
    graph = load_model(model, devices=cluster.devices) if isinstance(model, str) else model
    profile = (Profile.load(profile) if isinstance(profile, str) else profile).for_model(graph.config)
    compare = list(compare)
    for name in [algorithm, *compare]:
        if name not in SEARCHES:
            raise UserError(f"unknown search {name!r}: use one of {', '.join(SEARCHES)}")
    stages = parse_stages(str(pipeline))
    check_pipeline(graph, cluster, stages, schedule, virtual_stages)
    objective, _ = choose_objective(objective, algorithm, profile, cluster.devices)
    if stages != "off" and objective != "step":
        if stages != "auto":
            raise UserError("pipeline stages are timed by the step objective: use --objective step with a profile "
                            "that has compute figures, or --pipeline off")
        stages = "off"
    t0 = time.perf_counter()
    if objective == "step":
        require_overheads(profile, cluster.devices)
    coster = Coster(profile, cluster)
    limit = headroom_limit(memory_limit, profile, graph, cluster, allocator)
    problem = plain = Problem(graph, coster, limit, progress=progress, objective=objective, require_fit=False)
    mega, mega_cost, _ = best_mesh(problem, megatron_assignment)
    warm = mega if mega is not None and np.isfinite(mega_cost) else None

    def run(pr, start, share=1.0):
        return run_search(pr, algorithm, scaled(budget or auto_budget(pr), share), seed, progress, start)
    if modes == "all":
        problem, best = search_modes(problem, run, warm, progress)
    else:
        problem.require_fit()
        best = search_fitting(problem, run, warm)
    if best is None or not problem.fits_plan(best.assignment):
        least = min(p.min_memory for p in plain.mode_problems())
        raise OptionError("memory_limit", f"{limit / 2**30:.4g} GiB per device"
                                          + (" (the limit less room for the loss's largest tensor)"
                                             if limit != memory_limit else "") + ": no plan fits it with its "
                                          f"workspace under any recomputation or FSDP, the smallest needs "
                                          f"{least / 2**30:.4g} GiB before its workspace; raise it, add devices or "
                                          f"shrink the micro-batch")
    traces = {best.algorithm: best.trace}
    space = float(np.prod([float(n) for n in problem.sizes]))
    if space <= 1e8 and "exhaustive" not in compare and objective == "comm":
        compare.append("exhaustive")
    for name in compare:
        if name == algorithm:
            continue
        if name in ("exhaustive", "dp") and (space > EXHAUSTIVE_LIMIT or objective != "comm"):
            progress(f"skip {name}: {space:.2e} plans" if objective == "comm" else
                     f"skip {name}: it sums per-layer costs, which the step objective is not")
            continue
        # cold start, for the convergence plot; by default on the main search's time (at most 3 s)
        other = run_search(problem, name, budget or Budget(seconds=min(3.0, max(best.seconds, 0.1))), seed, progress)
        traces[other.algorithm] = other.trace
        if other.cost < best.cost and problem.fits_plan(other.assignment):
            progress(f"  {name} found a cheaper plan than {best.algorithm}; keeping it")
            best = other
    # each baseline's own problem, None (with a line) where some layer has no placement under its restriction
    sb_problem = _optional("S/B only baseline", progress, lambda: Problem(  # no partial sums: e.g. an odd vocabulary
        graph, coster, limit, allow_partial=False, require_fit=False, objective=objective))
    summa_problem = _optional("SUMMA baseline", progress, lambda: Problem(
        graph, coster, limit, signatures=("summa",), require_fit=False, objective=objective))
    sp_problem = None
    if cluster.devices > 1:  # the sequence-parallel baselines' strategies (norms split by tokens over t)
        sp_problem = _optional("sequence-parallel baselines", progress,
                               lambda: sequence_problem(graph, coster, limit, objective))
    context = {}  # the context-parallel baselines' problems, by size
    for c in context_sizes(graph, cluster.devices, context_parallel):
        try:
            context[c] = context_problem(with_context(graph, c), coster, limit, objective)
        except UserError as e:
            if context_parallel is not None:
                raise
            progress(f"no context parallelism over {c}: {message(e)}")
    progress("baselines: data parallel, Megatron (every mesh), FSDP, HSDP, TP+FSDP (each at its best recomputation; "
             "Megatron and TP+FSDP also with sequence parallelism"
             + (f", Megatron and FSDP with context parallelism over {', '.join(map(str, context))}" if context else "")
             + "), SUMMA (every mesh), S/B only")
    plan = build(problem, best.assignment, f"searched ({best.algorithm})",
                 {"algorithm": best.algorithm, "seconds": best.seconds, "steps": best.steps, "stopped": best.stopped})
    skipped: list[str] = []
    base = [build(*found) for found in baseline_plans(plain, summa_problem, sb_problem,
                                                      lambda p: run_search(p, algorithm, budget, seed, progress),
                                                      skipped, sp_problem, context)]
    def runs(b: Plan) -> bool:  # a sequence-parallel baseline apply runs by torch's styles only (its tokens split
        # by the sequence there), a context-parallel one on the paths that run it (``autotune.apply.context``)
        return (not b.search.get("sequence_parallel") or bool(sequence_axes(b))) and \
            (not b.search.get("context_parallel") or b.apply_path in CONTEXT_PATHS)
    skipped += [b.strategy for b in base if not runs(b)]
    base = [b for b in base if runs(b)]
    if objective == "step":  # each plan's step at the host's pace of its path, where the profile says it
        def paced(p: Plan) -> Plan:  # with its path's own device work first (``path_work``)
            return at_host_pace(path_work(p, profile.compute), profile.compute, profile.module)
        plan, base = paced(plan), [paced(b) for b in base]
        # and corrected by what autotune tune measured on this machine, per path (the profile's residuals)
        plan, base = corrected(plan, profile), [corrected(b, profile) for b in base]
    plan = floor(plan, base, objective)
    others = []
    for count in (c for c in micro_batches if c != graph.micro_batches):
        progress(f"the single-stage plans at {count} micro-batches a step")
        try:
            others.append(search(with_micro_batches(graph, count), cluster, profile, memory_limit=memory_limit,
                                 algorithm=algorithm, budget=budget, modes=modes, objective=objective, seed=seed,
                                 pipeline="off", compare=(), allocator=allocator, context_parallel=context_parallel,
                                 progress=progress))
        except UserError as e:  # no plan fits at that count
            progress(f"  none at {count} micro-batches: {message(e)}")
    if others:
        plan, base = _at_counts(plan, base, others, objective)
    if stages != "off":
        progress(f"pipeline stages ({'every stage count' if stages == 'auto' else stages}, {schedule})")
        cfg = PipelineConfig(stages, schedule, search=algorithm, seed=seed, loss_room=allocator == "default",
                             virtual_stages=virtual_stages)
        piped, mega3d = pipeline_plans(graph, cluster, profile, memory_limit,
                                       cfg.full_effort() if pipeline_effort == "full" else cfg, progress)
        if objective == "step":  # the pipelined plans corrected as the single-stage ones above
            piped, mega3d = (None if x is None else corrected(x, profile) for x in (piped, mega3d))
        base += [x for x in (mega3d,) if x is not None]
        fits = piped is not None and piped.costs.fits_memory and (
            memory_limit is None or piped.costs.memory_bytes <= memory_limit)
        if fits and (not plan.costs.fits_memory or piped.costs.step_s < plan.costs.step_s):
            base.insert(0, replace(plan, strategy=f"best single-stage: {plan.strategy}"))
            plan = piped
        elif piped is not None:
            base.append(piped)
    plan, base = replace(plan, allocator=allocator), [replace(b, allocator=allocator) for b in base]
    return PlanFile(plan, base, {k: [list(x) for x in v] for k, v in traces.items()},
                    {"wall_s": time.perf_counter() - t0, "objective": objective,
                     **({"skipped": skipped} if skipped else {})})
