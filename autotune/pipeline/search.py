"""The search over pipeline stages: how many stages, each stage's submesh, the micro-batch count, the split
of the blocks among the stages and, inside each stage, the SBP search of today on the stage's sub-graph
and submesh under the memory its schedule keeps in flight.

Candidates (``stage_choices``): p stages of whole nodes (p divides the node count) or of a slice of one
node (p = nodes x q, q dividing the GPUs per node), 2 <= p <= blocks. Micro-batch counts m: divisors
of the batch with p <= m <= 8p, and where none of these splits its micro-batch over the stage's nodes, those
from p / 2 that do (``fewest``; fewer than p run as Megatron's 1F1B runs them, stage i min(p - i, m)
forwards before its first backward, with a bubble of (p - 1) / m: where the batch is small against the
data-parallel group, the only counts whose micro-batch splits over the nodes); those whose micro-batch
splits over the stage's nodes first, the largest first (a smaller micro-batch shrinks the bubble
(p - 1) / m); the first ``micro_batch_choices`` whose stages can be laid out on the submesh (a micro-batch
too small to split over it has no strategy for some layer) are tried.

The search runs in two passes. First every (p, m) with the balanced split (the blocks as even as they
go, the remainder to the middle stages), ranked by the estimate of ``autotune.pipeline.split``; then the
``refine`` best (by the estimate plus the first stage's exposed sync and optimizer, which end the step) are
simulated on their balanced splits, and the ``split_dps`` fastest of them (1 by default: the DP of a candidate
that simulates slower on its balanced split found no faster plan in any benchmark case, at a third of the
main command's stage search; reports/records/pipeline.md, speed session 6) get the stage DP over splits within
``width`` blocks of the balanced share. Both passes search a stage only
where its lower bound (``StageSearch.bound``: the times of the searches under fewer micro-batches in flight)
leaves it a chance: the candidates are planned in the order of their estimates' bounds until a bound cannot
enter the ``refine`` best ranks, the stage DP times only the entries its optimum needs (``best_split``'s
bounds), and a candidate whose DP finds no estimate under the best step so far is not refined. Each
candidate that is kept is simulated (``autotune.reshard.pipeline.simulate``: the schedule's order, the
boundaries' transfers overlapped as it allows), and its step is

    step = max over stages i of (end of stage i's last backward + its exposed gradient sync + optimizer)

Stage problems are made once per (layer slice signature, submesh, micro-batches, mode): the middle stages of
a transformer are one problem, and all stage problems on a submesh share their strategies and boxing tables
(``autotune.sbp.cost.Catalogue``). A stage is searched first with one micro-batch in flight (the loosest
memory); a plan searched under k in flight serves every larger count it still fits (``StageSearch.rung``: a
tighter limit cannot find a cheaper plan), and every smaller count where it is cheaper than the plan searched
for that count (``StageSearch.plan``: the searches are not exact), and a count beyond every such plan's reach is searched itself:
plain, and under the recomputation and FSDP modes whose lower bound beats the plain plan (a plain plan squeezed
under a tight limit can cost many times a recomputed one) or where no plain plan fits
(``StageSearch._search_modes``); the plan records its mode.

The Megatron-style 3-D baseline is ``autotune.pipeline.threed``.
"""
from __future__ import annotations

import gc
import math
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import numpy as np

from calibrate.errors import OptionError, UserError
from models.graph import LayerGraph

from autotune.pipeline.boundary import BoundaryPricer
from autotune.pipeline.paths import dp_assignment
from autotune.pipeline.slicing import blocks, signature, stage_graph, stage_spans, with_micro_batches
from autotune.pipeline.split import best_split, estimate, window
from autotune.pipeline.stage import Layout, StageFigures, StageProblem, figures
from autotune.reshard.pipeline import INTERLEAVED, SCHEDULES, PipelineSpec, interleaved_warmup, simulate
from autotune.sbp.baselines import best_mesh, megatron_assignment
from autotune.sbp.boxing import Coster
from autotune.sbp.cost import Catalogue
from autotune.sbp.fit import (SHARE, fewest_blocks, lower_bound, recompute_modes, scaled, search_fitting,
                              sharding_modes)
from autotune.sbp.memory import NONE, Mode, largest_block
from autotune.sbp.mesh import Cluster
from autotune.sbp.search import CoordinateDescent, auto_budget, make_search
from autotune.sbp.searchbase import Budget

SCHEDULE_NAMES = {"1f1b": "1f1b", "gpipe": "gpipe", "eager-1f1b": "eager_1f1b", "interleaved-1f1b": INTERLEAVED}
GC_THRESHOLDS = (50_000, 20, 20)  # allocations before a young collection, young collections before an older one
PROGRESS_EVERY = 5.0  # seconds of stage searches without a progress line before ``StageSearch`` prints one


@contextmanager
def fewer_collections():
    """The cyclic garbage collector run less often while a search builds its many long-lived tables, strategies
    and plans (``GC_THRESHOLDS``, restored after): at Python's defaults (a collection every 700 allocations) its
    older collections traverse the growing heap again and again (the main command on Llama-3 405B, 2,048 x 8:
    about 5% of its CPU time, the same peak memory; reports/records/pipeline.md, speed session 5)."""
    old = gc.get_threshold()
    gc.set_threshold(*GC_THRESHOLDS)
    try:
        yield
    finally:
        gc.set_threshold(*old)


@dataclass(frozen=True)
class PipelineConfig:
    """``stages``: "auto" (every candidate count), or a count; ``schedule``: 1f1b | gpipe | eager-1f1b.
    ``width``, ``micro_batch_choices``, ``refine`` and ``budget_scale`` set how much of the space is
    searched (``reference`` scales them up for the 20x check); ``patience`` caps each stage search's restart
    patience (None: ``auto_budget``'s) and ``relax_rounds`` sets its relaxation's bisection steps (the cd
    search's ``CoordinateDescent.relax_rounds``, 8). The defaults, 3 and 2, with ``split_dps`` 1, took the main
    command on Llama-3 405B, 2,048 x 8 from 89.8 to 57.4 CPU s (side by side) at a plan 0.022% slower (12.9981
    against 12.9953 s/step) and left the benchmark's four cases' plans unchanged (reports/records/pipeline.md,
    speed session 6); ``reference`` and ``full_effort`` (patience None, relax_rounds 8, split_dps = refine)
    search at the full effort. ``budget_scale`` 3 (each stage search's seconds and patience; 1 before the dynamic
    program made its messages on their subtree's cut choices, 1.6x faster): on Llama-3 405B, 2,048 x 8 a plan 0.4%
    faster (13.45 against 13.51 s/step) in fewer CPU s (16.2 against 20.8), the other three cases' plans the same in
    0-4% more (reports/records/published.md, session 4, lead)."""

    stages: str | int = "auto"
    schedule: str = "1f1b"
    width: int = 1
    micro_batch_choices: int = 2
    refine: int = 2
    max_stage_nodes: int = 32
    budget_scale: float = 3.0
    search: str = "cd"
    seed: int = 0
    patience: int | None = 3
    relax_rounds: int = 2
    split_dps: int = 1
    virtual_stages: int = 2  # chunks a rank under interleaved-1f1b (Megatron-LM's virtual pipeline stages)
    recipe: str = "autocast"  # the precision recipe every stage is priced in (``autotune.sbp.memory.RECIPES``)
    # Megatron-LM's dropout (on the attention probabilities, on the hidden states), in its recipes only
    dropout: tuple[float, float] = (0.0, 0.0)
    overlap_grad_reduce: bool = True  # False: each stage's gradient sync exposed whole (``Techniques``)
    # the default caching allocator's room for the loss's fp32 logits on the last stage (``StageSearch.stage_limit``)
    loss_room: bool = False
    # a candidate of one stage priced as the single-stage step a user runs without a pipeline (FSDP reduce-scattering
    # each micro-batch, not torch's PipelineStage accumulating whole gradients): "1 stage" as a paper means it
    single_stage_plain: bool = False

    def full_effort(self) -> "PipelineConfig":
        """The same space searched at the stage searches' full effort: the split DP for every refined candidate,
        ``auto_budget``'s restart patience and the cd search's own relaxation rounds (the command's
        ``--pipeline-effort full``)."""
        return replace(self, patience=None, relax_rounds=CoordinateDescent.relax_rounds, split_dps=self.refine)

    def reference(self) -> "PipelineConfig":
        return replace(self, width=self.width + 2, micro_batch_choices=self.micro_batch_choices + 2,
                       refine=self.refine + 4, max_stage_nodes=self.max_stage_nodes * 2,
                       budget_scale=self.budget_scale * 20, patience=None,
                       relax_rounds=CoordinateDescent.relax_rounds, split_dps=self.refine + 4)


def schedule_name(name: str) -> str:
    if name not in SCHEDULE_NAMES:
        raise OptionError("schedule", f"{name!r} is not a pipeline schedule: use one of {', '.join(SCHEDULE_NAMES)}")
    return SCHEDULE_NAMES[name]


def submesh(cluster: Cluster, stages: int) -> Cluster:
    """Each stage's submesh: whole nodes, or a slice of one node; a UserError if it does not divide."""
    if cluster.nodes % stages == 0:
        return Cluster(cluster.nodes // stages, cluster.gpus_per_node)
    if stages % cluster.nodes == 0 and cluster.gpus_per_node % (stages // cluster.nodes) == 0:
        return Cluster(1, cluster.gpus_per_node // (stages // cluster.nodes))
    raise OptionError("pipeline", f"{stages} stages do not divide the cluster {cluster} into equal submeshes: use a "
                                f"divisor of the {cluster.nodes} nodes, or the nodes times a divisor of "
                                f"{cluster.gpus_per_node} GPUs per node")


def stage_choices(graph: LayerGraph, cluster: Cluster, stages: str | int,
                  max_nodes: int | None = None) -> list[tuple[int, Cluster]]:
    """The stage counts and submeshes to try: the one given, or every count whose submesh has at most
    ``max_nodes`` nodes (bigger stages pay for tensor-parallel traffic across nodes, which is what stages
    are for; their SBP problems are the costliest to build), at least the two with the smallest submeshes;
    a count is a candidate when it divides the cluster and the batch has at least that many micro-batches."""
    nb = len(blocks(graph))
    if stages != "auto":
        p = int(stages)
        if p < 1:
            raise OptionError("pipeline", f"{p} must be at least 1 (1: no pipeline)")
        if p > nb:
            raise OptionError("pipeline", f"{p} stages for {nb} blocks: use at most {nb}, a stage needs a block")
        if p > cluster.devices:
            raise OptionError("pipeline", f"{p} stages on {cluster.devices} devices: use at most {cluster.devices}")
        return [(p, submesh(cluster, p))]
    feasible = []
    for p in range(2, min(nb, cluster.devices) + 1):
        try:
            sub = submesh(cluster, p)
        except UserError:
            continue
        if micro_batch_choices(graph, p, sub, 0):
            feasible.append((p, sub))
    out = [(p, sub) for p, sub in feasible if max_nodes is None or sub.nodes <= max_nodes]
    return out if len(out) >= 2 else sorted(feasible, key=lambda x: x[1].devices)[:2]


def fewest(stages: int) -> int:
    """The fewest micro-batches the search gives p stages: p / 2 (rounded up). Fewer than p run (Megatron's
    1F1B order, ``autotune.apply.pipeline``), at a bubble of (p - 1) / m of the compute; below p / 2 the bubble is
    about twice the compute or more."""
    return -(-stages // 2)


def micro_batch_choices(graph: LayerGraph, stages: int, sub: Cluster, count: int) -> list[int]:
    """Up to ``count`` (0: all) micro-batch counts m, p <= m <= 8p dividing the batch, and where none of these
    splits its micro-batch over the stage's nodes (data parallel across nodes, Megatron's way) those from
    ``fewest(p)`` below p that do (each count is another set of stage searches: only where the counts from p
    leave data parallelism across nodes out); those that split first, the largest first, then the others, the
    fewest first (the largest micro-batches: on Llama 3 405B, 2,048 x 8, 64 on 32 stages, where 256 had been tried
    first, found the 20x-budget reference's plan in the same CPU time, the other benchmark cases' plans unchanged;
    reports/records/published.md, session 27)."""
    def splits(m):
        return (graph.batch // m) % sub.nodes == 0
    ms = [m for m in range(stages, 8 * stages + 1) if graph.batch % m == 0]
    if not any(splits(m) for m in ms):
        ms += [m for m in range(fewest(stages), stages) if graph.batch % m == 0 and splits(m)]
    ms.sort(key=lambda m: (not splits(m), -m if splits(m) else m))
    return ms[:count] if count else ms


def inflight(schedule: str, stage: int, stages: int, micro_batches: int, virtual: int = 1) -> int:
    """Micro-batches whose activations stage ``stage`` keeps at the schedule's peak (its warm-up); interleaved
    1F1B keeps its warm-up's chunks and the first steady forward's, each 1/``virtual`` of the stage's layers."""
    if schedule == INTERLEAVED:
        chunks = interleaved_warmup(stage, stages, virtual, micro_batches) + 1
        return min(max(-(-chunks // virtual), 1), micro_batches)
    return min(max(SCHEDULES[schedule]().warmup(stage, stages, micro_batches), 1), micro_batches)


@dataclass
class StagePlan:
    problem: StageProblem
    assign: list[int]
    fig: StageFigures
    search: dict


@dataclass
class Rung:
    """Stage plans for in-flight counts ``first`` to ``last``: ``plan``, searched under ``first``."""

    first: int
    last: float
    plan: StagePlan


@dataclass
class Candidate:
    stages: int
    sub: Cluster
    micro_batches: int
    split: list[int]
    plans: list[StagePlan]
    estimate: float
    spans: list[tuple[int, int]] = field(default_factory=list)
    boundaries: list[tuple[float, float]] = field(default_factory=list)
    result: object = None
    step: float = math.inf
    ends: list[float] = field(default_factory=list)
    exposed: list[float] = field(default_factory=list)  # per stage: its gradient sync not hidden (``finish``)
    name: str = ""
    tensor: int = 0  # the Megatron baseline's tensor-parallel degree
    virtual: int = 1  # chunks a rank (interleaved 1F1B)

    @property
    def floor(self) -> float:
        """A lower bound on the step ``PipelineSearch.finish`` simulates, under any schedule and boundaries: stage
        j cannot start before micro-batch 1's forwards through the stages before it, it runs m (forward +
        backward), and stage 0's last backward waits for the backwards of the stages before j after it; stage 0's
        exposed sync and optimizer follow. So step >= max_j (sum_{i<j} T_i / v + m T_j) + stage 0's exposed sync and
        optimizer, v the chunks a rank (interleaved: micro-batch 1's first chunk reaches stage j after 1/v of each
        earlier stage; the estimate itself is not a bound where an early stage is the slowest)."""
        lead, most = 0.0, 0.0
        for x in self.plans:
            t = _time(x)
            most, lead = max(most, lead + self.micro_batches * t), lead + t / self.virtual
        return most + self.plans[0].fig.exposed_sync + self.plans[0].fig.optimizer

    @property
    def rank(self) -> float:
        """The estimate plus the first stage's exposed gradient sync and optimizer (it ends the step)."""
        return self.estimate + self.plans[0].fig.exposed_sync + self.plans[0].fig.optimizer


class StageSearch:
    """SBP plans of stages, cached; one per (slice signature, submesh, micro-batches, in-flight count)."""

    def __init__(self, graph: LayerGraph, profile, memory_limit: float, cfg: PipelineConfig, progress=None):
        self.graph, self.profile, self.limit, self.cfg = graph, profile, memory_limit, cfg
        self.progress = progress
        self._graphs: dict[int, LayerGraph] = {}
        self._problems: dict = {}
        self._plans: dict = {}
        self._catalogues: dict = {}  # per submesh: strategies and boxing tables its stage problems share
        self._rungs: dict = {}
        self._signatures: dict = {}  # (m, span) -> the number of the slice's signature
        self._numbers: dict = {}  # signature -> its number
        self._bounds: dict = {}  # (signature, sub, m) -> f -> ``bound``, until that slice's next rung is searched
        self._costs: dict = {}  # (signature, sub, m) -> mode -> [(in flight, cost of the plan its search found)]
        self._layouts: dict = {}  # (signature, sub, m) -> ``Layout``
        self._fixed: dict = {}  # (signature, sub, m, mesh, mode) -> (Megatron's problem, its plan) or None
        self.searches = 0
        self._said = time.perf_counter()  # when the last line about the stage searches was printed

    def _report(self, m: int, span, sub: Cluster, k: int, plan: StagePlan) -> None:
        """A progress line after a stage search where ``PROGRESS_EVERY`` seconds passed without one (the phases
        between the candidates' lines: their bounds, the split DP, search many stages)."""
        now = time.perf_counter()
        if self.progress is None or now - self._said < PROGRESS_EVERY:
            return
        self._said = now
        inside = [i for i, (a, b) in enumerate(blocks(self.graph_for(m))) if span[0] <= a and b <= span[1]]
        what = "no block" if not inside else f"block {inside[0]}" if len(inside) == 1 else \
            f"blocks {inside[0]}-{inside[-1]}"
        self.progress(f"pipeline: {self.searches} stage searches so far; the last: {what} on {sub}, {m} "
                      f"micro-batches, {k} in flight: {_time(plan):.4g} s a micro-batch")

    def stage_limit(self, m: int, span, sub: Cluster) -> float | None:
        """The memory limit of the stage at ``span`` on ``sub``: the search's, and on the last stage (the loss's)
        with ``cfg.loss_room``, no higher than the device's usable memory less the loss's fp32 copy of a device's
        logits, which the default allocator needs beyond what it has reserved (``planner.headroom_limit``: the
        single-stage plans' room, here of the stage's micro-batch over the stage's devices)."""
        usable = self.profile.device.usable_bytes if self.profile.device is not None else None
        g = self.graph_for(m)
        if not self.cfg.loss_room or self.limit is None or not usable or span[1] != len(g.chain):
            return self.limit
        return min(self.limit, usable - largest_block(g, sub.devices))

    def graph_for(self, m: int) -> LayerGraph:
        if m not in self._graphs:
            self._graphs[m] = with_micro_batches(self.graph, m)
        return self._graphs[m]

    def signature(self, m: int, span) -> int:
        """The slice's signature as a number (equal signatures, equal numbers; a tuple of layers is slow to hash)."""
        key = (m, span)
        if key not in self._signatures:
            self._signatures[key] = self._numbers.setdefault(signature(self.graph_for(m), *span), len(self._numbers))
        return self._signatures[key]

    def catalogue(self, sub: Cluster) -> Catalogue:
        cat = self._catalogues.get(sub)
        if cat is None:
            cat = self._catalogues[sub] = Catalogue(Coster(self.profile, sub), self.cfg.recipe, self.cfg.dropout)
        return cat

    def layout(self, m: int, span, sub: Cluster, runnable: bool = True, megatron: bool = False) -> Layout:
        """The stage's layers and strategies on ``sub``, unpriced (``runnable``: only those apply runs;
        ``megatron``: only the meshes Megatron's layouts use, ``Layout``)."""
        key = (self.signature(m, span), sub, m, runnable, megatron)
        if key not in self._layouts:
            self._layouts[key] = Layout(stage_graph(self.graph_for(m), *span), self.catalogue(sub), runnable,
                                        megatron)
        return self._layouts[key]

    def megatron(self, m: int, span, sub: Cluster, f: int, mesh: tuple,
                 mode: Mode = NONE, sequence_parallel: bool = False) -> tuple[StageProblem, list[int]] | None:
        """Megatron's plan of the stage on ``mesh`` (d, t), or (d, t, context) with context parallelism
        (``megatron_assignment``), under ``f`` in flight and ``mode``, on a problem that prices that plan's
        strategies alone (``Layout.fixed``; the 3-D baseline needs no other, and its figures are the full
        problem's: tested): (problem, plan), None where a layer cannot take it."""
        key = (self.signature(m, span), sub, m, mesh, mode, sequence_parallel)
        if key not in self._fixed:
            if mode != NONE:
                plain = self.megatron(m, span, sub, 1, mesh, sequence_parallel=sequence_parallel)
                self._fixed[key] = None if plain is None else (plain[0].with_mode(mode), plain[1])
            else:
                # Megatron's sequence parallelism splits each sequence over t: priced (the 3-D baseline, the
                # published runs); apply runs it in a plan of one stage (torch's SequenceParallel, the tensor
                # path), not in a pipeline's stages; context parallelism is run by apply in a plan of one stage and
                # in a pipeline's stages placed by DDP or fully_shard (``threed.applies``)
                d, t, *context = mesh
                kw = dict(sequence_parallel=sequence_parallel, context=context[0] if context else None)
                lay = self.layout(m, span, sub, runnable=not sequence_parallel and not context, megatron=True)
                a = megatron_assignment(lay, d, t, **kw)
                prob = None if a is None else lay.fixed(a, self.stage_limit(m, span, sub))
                a = None if prob is None else megatron_assignment(prob, d, t, **kw)
                self._fixed[key] = None if a is None else (prob, a)
        found = self._fixed[key]
        return None if found is None else (found[0].in_flight(f), found[1])

    def problem(self, m: int, span, sub: Cluster, f: int, mode: Mode = NONE) -> StageProblem:
        """The stage problem under ``f`` in flight and ``mode`` (a mode's problem made from the plain one:
        ``Problem.with_mode``, per-strategy figures shared)."""
        key = (self.signature(m, span), sub, m, mode)
        base = self._problems.get(key)
        if base is None:
            if mode != NONE:
                base = self.problem(m, span, sub, 1).with_mode(mode)
            else:
                cat = self.catalogue(sub)
                whole = self.cfg.single_stage_plain and tuple(span) == (0, len(self.graph_for(m).chain))
                base = StageProblem(stage_graph(self.graph_for(m), *span), cat.coster, self.stage_limit(m, span, sub),
                                    catalogue=cat, pipelined=not whole)
            self._problems[key] = base
        return base.in_flight(f)

    def _search(self, problem: StageProblem, share: float = 1.0, start=None, others=()):
        """The SBP search of one stage problem (from the best Megatron plan unless ``start``, and from ``others``:
        the plans of the slice's searches under other counts in flight, which a cd search descends from too),
        ``share`` of its budget: (plan, cost, search info)."""
        if start is None:
            mega, mega_cost, _ = best_mesh(problem, megatron_assignment)
            start = mega if mega is not None and math.isfinite(mega_cost) else None
        b = scaled(auto_budget(problem), share)
        patience = b.patience if self.cfg.patience is None else min(b.patience, self.cfg.patience)
        budget = Budget(seconds=b.seconds * self.cfg.budget_scale,
                        patience=max(1, round(patience * self.cfg.budget_scale)))
        problem.forget_lazy()
        search = make_search(self.cfg.search)
        if isinstance(search, CoordinateDescent):
            search.relax_rounds = self.cfg.relax_rounds
        more = {"others": others} if isinstance(search, CoordinateDescent) else {}
        res = search_fitting(problem, lambda p, s: search.run(p, budget, np.random.default_rng(self.cfg.seed), s,
                                                              **more), start)
        problem.reserve = 0.0  # the workspace's reserve was the search's; plans are judged at their peak
        self.searches += 1
        return list(res.assignment), res.cost, {"algorithm": res.algorithm, "seconds": res.seconds, "steps": res.steps,
                                                "stopped": res.stopped, "recompute": problem.mode.recompute,
                                                "sharding": problem.mode.sharding}

    def _search_modes(self, m: int, span, sub: Cluster, k: int):
        """The stage's plan under ``k`` in flight over the modes (as ``autotune.sbp.fit.search_modes``): the plain
        mode first on the full budget where its plans can fit, then the modes (recomputation, FSDP) under which
        a plan fits (at its peak, workspace included), cheapest lower bound first
        (``autotune.sbp.fit.lower_bound``), the first searched on the full budget, each later one on ``SHARE`` of
        it from the best plan so far, skipped where its bound is no cheaper than that plan (a plain plan squeezed
        under a tight limit is dearer than a recomputed one): (problem, plan, info) of the cheapest, None if no
        mode has a plan that fits.

        Where the stage was searched under fewer in flight (an earlier rung), a mode's bound is also the cost
        its search found there (a tighter limit cannot find a cheaper plan, as ``rung`` takes it); the modes then
        go cheapest bound first, plain included (on the full budget wherever it is searched), so a plain plan
        that a recomputed one beat under a looser limit is not searched again under a tighter one."""
        plain = self.problem(m, span, sub, k)
        history = self._costs.setdefault((self.signature(m, span), sub, m), {})
        modes = [Mode(rec, sh) for rec in ["none"] + recompute_modes(plain) for sh in sharding_modes(plain)]
        probs = [pr for pr in (self.problem(m, span, sub, k, mode) for mode in modes if mode != NONE) if pr.fits]
        order = sorted(((_lower_bound(pr), pr) for pr in probs), key=lambda x: x[0])
        if plain.fits:
            order = [(-math.inf, plain)] + order
        if any(kk < k for costs in history.values() for kk, _ in costs):
            order = sorted(((max([bound if pr is not plain else _lower_bound(pr)]
                                 + [c for kk, c in history.get(pr.mode, []) if kk < k]), pr) for bound, pr in order),
                           key=lambda x: x[0])
        others = [r.plan.assign for r in self._rungs_of(m, span, sub).values()]  # the other counts' plans: starts
        best = None
        for bound, pr in order:
            if best is not None and bound >= best[1] * (1 - 1e-9):
                continue
            full = best is None or pr is plain
            a, cost, info = self._search(pr, 1.0 if full else SHARE, None if full else best[2], others)
            if pr.fits_plan(a):
                history.setdefault(pr.mode, []).append((k, cost))
                if best is None or cost < best[1]:
                    best = (pr, cost, a, info)
        if best is None:
            return None
        pr, a, info = _at_host_pace((best[0], best[2], best[3]), [plain] + probs)
        blocks = fewest_blocks(pr, a, lambda mode: self.problem(m, span, sub, k, mode))
        if blocks:  # Megatron-LM's block recomputation: the plan re-running only the blocks it needs to fit
            return self.problem(m, span, sub, k, replace(pr.mode, blocks=blocks)), a, dict(info, recompute_blocks=blocks)
        return pr, a, info

    def plan(self, m: int, span, sub: Cluster, f: int) -> StagePlan:
        """The stage's plan under ``f`` micro-batches in flight: the cheapest (``_stage_cost``) of the plans of the
        searches whose reach covers ``f`` (``rung``): the nearest under fewer or as many in flight, or a search
        under ``f``, and every search under more in flight (its plan fits the looser limit too: a stage searched
        under 11 in flight for one stage of a pipeline serves the stages after it that keep fewer, where the search
        under 6 had found a dearer plan). Made again once the slice has another rung (``rung``)."""
        key = (self.signature(m, span), sub, m)
        made = self._plans.setdefault(key, {})
        hit = made.get(f)
        if hit is not None:
            return hit
        own = self.rung(m, span, sub, f)
        made = self._plans.setdefault(key, {})  # ``rung`` may have searched and dropped the slice's plans
        out = None
        for r in sorted(self._rungs_of(m, span, sub).values(), key=lambda r: r is not own):
            if f > r.last:
                continue
            if r.first == f:
                x = r.plan
            else:
                prob = self.problem(m, span, sub, f, r.plan.problem.mode)
                x = StagePlan(prob, r.plan.assign, figures(prob, r.plan.assign),
                              dict(r.plan.search, inflight_reused=r.first))
            if out is None or _stage_cost(x) < _stage_cost(out):
                out = x
        made[f] = out
        return out

    def rung(self, m: int, span, sub: Cluster, f: int) -> "Rung":
        """The search whose plan serves ``f`` in flight. A stage is searched first under one micro-batch in
        flight (the loosest memory). A plan searched under k in flight fits every count up to its
        ``StageProblem.max_inflight``: the rung with the largest k <= ``f`` serves ``f`` where ``f`` is within
        its reach (a tighter limit only takes plans away, so an exact search under ``f`` cannot find a cheaper plan
        than the looser one did, which fits; ``plan`` takes a later rung's plan where it is cheaper), else ``f`` is searched, plain and under the modes whose bound can beat
        the plain plan (``_search_modes``; the rung's counts then take its mode). Where no plan fits under k in
        any mode, none fits a larger count: that rung holds the least-memory plain plan from k on."""
        rungs = self._rungs_of(m, span, sub)
        for k in ((1, f) if f != 1 else (1,)):
            below = max((r for r in rungs.values() if r.first <= k), key=lambda r: r.first, default=None)
            if below is not None and k <= below.last:
                continue
            prob = self.problem(m, span, sub, k)
            found = self._search_modes(m, span, sub, k)
            if found is not None:
                prob, a, info = found
                last = max(prob.max_inflight(a), k)
            else:
                a, info, last = prob.min_memory_assignment(), {"note": "no plan fits"}, math.inf
            rungs[k] = Rung(k, last, StagePlan(prob, a, figures(prob, a), info))
            self._report(m, span, sub, k, rungs[k].plan)
            self._bounds.pop((self.signature(m, span), sub, m), None)  # the other slices' bounds stand
            self._plans.pop((self.signature(m, span), sub, m), None)  # the new plan may serve fewer in flight
        return max((r for r in rungs.values() if r.first <= f), key=lambda r: r.first)

    def bound(self, m: int, span, sub: Cluster, f: int) -> float:
        """A lower bound on the time per micro-batch of the stage's plan under ``f`` in flight, searching at most
        the one-in-flight rung: the plan's time where a rung's reach covers ``f`` (``plan`` would take it), else
        the largest time of the rungs searched under fewer in flight (a tighter limit cannot find a cheaper plan,
        as ``rung`` takes it; the searches are not exact, so a later rung's plan can still serve ``f`` cheaper,
        ``plan``: the slice's bounds are made again with each rung)."""
        key = (self.signature(m, span), sub, m)
        known = self._bounds.get(key)
        if known is not None and f in known:
            return known[f]
        value = self._bound(m, span, sub, f)  # may search the slice's first rung, which drops its bounds
        self._bounds.setdefault(key, {})[f] = value
        return value

    def _bound(self, m: int, span, sub: Cluster, f: int) -> float:
        below = [r for r in self._rungs_of(m, span, sub).values() if r.first <= f]
        if not below:
            self.rung(m, span, sub, 1)
            below = [r for r in self._rungs_of(m, span, sub).values() if r.first <= f]
        top = max(below, key=lambda r: r.first)
        if f <= top.last:
            return _time(self.plan(m, span, sub, f))
        return max(_time(r.plan) for r in below)

    def _rungs_of(self, m: int, span, sub: Cluster) -> dict:
        return self._rungs.setdefault((self.signature(m, span), sub, m), {})


def _at_host_pace(found, problems):
    """Where the profile has host figures (``autotune.pipeline.paths``): the searched plan ``found`` (problem,
    plan, info) against the data-parallel plan of each of ``problems`` (the stage's modes), apply's local paths,
    by the stage's time a step at the host's pace (m (forward + backward) + exposed sync + optimizer, each with
    its path's floor): the faster, by more than rounding (a host-bound stage prices every mode's plan alike: the
    searched plan's mode is kept, not a recomputed one that only ties it). The SBP search prices the devices
    alone, so a plan only the DTensor path runs can win there and lose here (a small model's stage: the DTensor
    path's host issues a layer's pass in milliseconds)."""
    prob, a, info = found
    if prob.compute is None or not prob.compute.host_s:
        return found

    def step(pr, assign):
        fig = figures(pr, assign)
        return pr.mb * (fig.forward + fig.backward) + fig.exposed_sync + fig.optimizer if fig.fits else math.inf

    best = (step(prob, a), found)
    for pr in problems:
        dp = dp_assignment(pr)
        if dp is None or not pr.fits_plan(dp):
            continue
        t = step(pr, dp)
        if t < best[0] * (1 - 1e-9):
            best = (t, (pr, dp, {"algorithm": "data parallel (apply's local path: faster than the searched plan at "
                                              "the host's pace)", "recompute": pr.mode.recompute,
                                 "sharding": pr.mode.sharding}))
    return best[1]


def _lower_bound(problem: StageProblem) -> float:
    """``autotune.sbp.fit.lower_bound`` of the stage problem, made once per mode: it leaves the memory limit out,
    so every in-flight copy of the problem (``StageProblem.in_flight``, which shares ``shared``) has the same, but
    in FSDP mode, whose gathers a step the in-flight count sets (``StageProblem.shared_key``)."""
    return problem.shared(problem.shared_key(("lower bound", problem.mode)), lambda: lower_bound(problem))


def _time(plan: StagePlan) -> float:
    return plan.fig.forward + plan.fig.backward if plan.fig.fits else math.inf


def _stage_cost(plan: StagePlan) -> float:
    """The stage's time a step, as its search prices it: m (forward + backward) + exposed sync + optimizer."""
    fig = plan.fig
    return plan.problem.mb * (fig.forward + fig.backward) + fig.exposed_sync + fig.optimizer if fig.fits else math.inf


class PipelineSearch:
    def __init__(self, graph: LayerGraph, cluster: Cluster, profile, memory_limit: float,
                 cfg: PipelineConfig = PipelineConfig(), progress=None):
        if profile.compute is None:
            raise UserError(f"profile {profile.name!r} has no compute figures, which pipeline stages are timed "
                            f"by: add them with python -m calibrate compute, or turn the pipeline off")
        self.graph, self.cluster, self.profile, self.cfg = graph, cluster, profile, cfg
        self.schedule = schedule_name(cfg.schedule)
        self.virtual = cfg.virtual_stages if self.schedule == INTERLEAVED else 1
        if self.virtual < 1 or self.schedule == INTERLEAVED and self.virtual < 2:
            raise OptionError("virtual-stages", f"{cfg.virtual_stages}: interleaved 1F1B needs at least 2 chunks a rank")
        self.progress = progress or (lambda msg: None)
        self.stages = StageSearch(graph, profile, memory_limit, cfg, progress)
        self.pricer = BoundaryPricer(profile, cluster.gpus_per_node, graph.act_bytes)
        self.nblocks = len(blocks(graph))

    def _plans(self, p, sub, m, split) -> list[StagePlan]:
        spans = stage_spans(self.graph_for(m), split)
        # the last stage first: it keeps the fewest micro-batches in flight, its plan may serve the others' counts;
        # then each stage's plan again, now that every search under more in flight has its plan (``plan``)
        for i in reversed(range(p)):
            self.stages.plan(m, spans[i], sub, self.inflight(i, p, m))
        return [self.stages.plan(m, spans[i], sub, self.inflight(i, p, m)) for i in range(p)]

    def graph_for(self, m):
        return self.stages.graph_for(m)

    def inflight(self, stage: int, stages: int, m: int) -> int:
        return inflight(self.schedule, stage, stages, m, self.virtual)

    def runs(self, p: int, m: int) -> bool:
        """Whether the schedule runs p stages on m micro-batches (interleaved: p >= 2, m a multiple of p)."""
        return self.schedule != INTERLEAVED or p >= 2 and m % p == 0

    def balanced(self, p: int) -> list[int]:
        base, extra = divmod(self.nblocks, p)
        mid = list(range(1, p - 1)) or list(range(p))
        return [base + (1 if i in mid[:extra] else 0) for i in range(p)] if extra <= len(mid) else \
            [base + (1 if i < extra else 0) for i in range(p)]

    def bound(self, p, sub, m, split) -> float:
        """A lower bound on the estimate (and the rank) of the candidate with ``split``
        (``StageSearch.bound`` per stage)."""
        spans = stage_spans(self.graph_for(m), split)
        return estimate([self.stages.bound(m, spans[i], sub, self.inflight(i, p, m)) for i in range(p)], m)

    def candidate(self, p, sub, m, split, plans=None, name="") -> Candidate:
        plans = plans or self._plans(p, sub, m, split)
        return Candidate(p, sub, m, split, plans, estimate([_time(x) for x in plans], m), name=name,
                         virtual=self.virtual)

    def refine(self, c: Candidate, width: int, cutoff: float = math.inf) -> Candidate | None:
        """The candidate with its best split within ``width`` blocks of the balanced share (``best_split``);
        None where no split's estimate is under ``cutoff`` (a step is never under its estimate: the schedule's
        makespan without transfers is the estimate, and the sync and optimizer come after it)."""
        g, m, p = self.graph_for(c.micro_batches), c.micro_batches, c.stages
        if self.virtual > 1:  # the 1F1B estimate is no lower bound on an interleaved step: nothing cut off
            cutoff = math.inf
        bl = blocks(g)
        lo, hi = window(self.nblocks, p, width)
        lo = max(lo, self.virtual)  # a block for each of a rank's chunks

        counts = [self.inflight(i, p, m) for i in range(p)]  # once: the DP asks for bounds many times

        def span(i, b, k):
            return 0 if i == 0 else bl[b][0], len(g.chain) if i == p - 1 else bl[b + k - 1][1]

        def t(i, b, k):
            return _time(self.stages.plan(m, span(i, b, k), c.sub, counts[i]))

        def lower(i, b, k):
            return self.stages.bound(m, span(i, b, k), c.sub, counts[i])

        found = best_split(self.nblocks, p, t, m, lo, hi, lower, cutoff)
        if found is None:
            return None if c.estimate >= cutoff else c
        if found[1] >= c.estimate:
            return c
        return self.candidate(p, c.sub, m, found[0], name=c.name)

    def finish(self, c: Candidate) -> Candidate:
        """Boundaries priced, the schedule simulated, the step."""
        g = self.graph_for(c.micro_batches)
        c.spans = stage_spans(g, c.split)
        c.boundaries = []
        for i in range(c.stages - 1):
            a, b = c.plans[i], c.plans[i + 1]
            pa, pb = a.problem, b.problem
            last, first = pa.graph.chain[-1], pb.graph.chain[0]
            sa, sb = pa.choices[last][a.assign[last]], pb.choices[first][b.assign[first]]
            c.boundaries.append(self.pricer.boundary(pa.ops[last].out_shape, sa.fine_out, sb.fine_in,
                                                     sb.fine_grad_in, c.sub, c.sub, i))
        v, p = self.virtual, c.stages
        # interleaved: each rank's layers in v equal chunks, virtual stage s on rank s mod p; the boundary from
        # rank p - 1 back to rank 0 (the next chunk) priced as the last one (the same activation, sender and shapes)
        bounds = [c.boundaries[s % p] if s % p < p - 1 else c.boundaries[-1] for s in range(p * v - 1)]
        spec = PipelineSpec(c.name or "pipeline", c.micro_batches,
                            tuple(x.fig.forward / v for _ in range(v) for x in c.plans),
                            tuple(x.fig.backward / v for _ in range(v) for x in c.plans), tuple(f for f, _ in bounds),
                            tuple(b for _, b in bounds), tuple(0.0 for _ in range(p * v)))
        c.result = simulate(spec, self.schedule, ranks=p)
        c.ends = [max(iv.end for iv in c.result.intervals if iv.lane == f"stage {i}") for i in range(c.stages)]
        fits = all(x.fig.fits for x in c.plans)
        exposed = [x.fig.exposed_sync for x in c.plans]
        if v > 1:  # each chunk's gradients synced from its own last backward on (``chunked_exposed``)
            last = {}
            for iv in c.result.intervals:
                if iv.kind == "B":
                    last[iv.stage] = max(last.get(iv.stage, 0.0), iv.end)
            exposed = [chunked_exposed([last[j * p + i] for j in range(v)], *x.problem.sync_parts(x.assign),
                                       x.problem.sync_slowdown) for i, x in enumerate(c.plans)]
        if not self.cfg.overlap_grad_reduce:  # reduced after the last backward: nothing hides it
            exposed = [x.fig.grad_sync for x in c.plans]
        c.exposed = exposed
        c.step = max(e + s + x.fig.optimizer for e, s, x in zip(c.ends, exposed, c.plans)) if fits else math.inf
        return c

    def run(self) -> Candidate | None:
        """The best pipelined plan found, or None where no candidate fits."""
        with fewer_collections():
            return self._run()

    def _run(self) -> Candidate | None:
        t0 = time.perf_counter()
        bounds = []
        for p, sub in stage_choices(self.graph, self.cluster, self.cfg.stages, self.cfg.max_stage_nodes):
            kept = 0
            for m in micro_batch_choices(self.graph, p, sub, 0):
                if kept == self.cfg.micro_batch_choices:
                    break
                # a block for each of a rank's chunks, as apply runs them (the 3-D plans, ``threed``, may leave an
                # end rank's last chunk the embedding or the head alone, as Llama 3 ran: priced, not applied)
                if not self.runs(p, m) or self.nblocks < p * self.virtual:
                    continue
                try:
                    bounds.append((self.bound(p, sub, m, self.balanced(p)), p, sub, m))
                except UserError as e:  # a stage with no strategy on its submesh (sizes do not divide)
                    self.progress(f"pipeline: {p} stages x {m} micro-batches skipped ({e})")
                    continue
                kept += 1
        # the candidates' plans, in the order of their bounds, until no bound can enter the ``refine`` best ranks
        cands: list[Candidate] = []
        for n, (bound, p, sub, m) in enumerate(sorted(bounds, key=lambda x: x[0])):
            ranks = sorted(c.rank for c in cands)
            if not math.isfinite(bound) or (len(ranks) >= self.cfg.refine and bound >= ranks[self.cfg.refine - 1]):
                self.progress(f"pipeline: {len(bounds) - n} candidates skipped: their estimates are at least "
                              f"{bound:.4g} s")
                break
            c = self.candidate(p, sub, m, self.balanced(p), name=f"{p} stages")
            self.progress(f"pipeline: {p} stages of {sub}, {m} micro-batches, split {_short(c.split)}: "
                          f"estimate {c.estimate:.4g} s")
            if math.isfinite(c.estimate):
                cands.append(c)
        cands.sort(key=lambda c: c.rank)
        # the ``refine`` best simulated on their balanced splits; the split DP for the ``split_dps`` fastest of them
        balanced = sorted((self.finish(c) for c in cands[:self.cfg.refine]), key=lambda c: c.step)
        for c in balanced:
            self.progress(f"pipeline: {c.stages} stages, {c.micro_batches} micro-batches, split {_short(c.split)}: "
                          f"step {c.step:.4g} s (simulated {self.cfg.schedule})")
        best = balanced[0] if balanced else None
        for c in balanced[:self.cfg.split_dps]:
            r = self.refine(c, self.cfg.width, best.step)
            if r is None or r is c:
                self.progress(f"pipeline: {c.stages} stages, {c.micro_batches} micro-batches: no other split's "
                              f"estimate is under the best step {best.step:.4g} s")
                continue
            r = self.finish(r)
            self.progress(f"pipeline: {r.stages} stages, {r.micro_batches} micro-batches, split {_short(r.split)}: "
                          f"step {r.step:.4g} s (simulated {self.cfg.schedule})")
            if r.step < best.step:
                best = r
        self.seconds = time.perf_counter() - t0
        return best if best is not None and math.isfinite(best.step) else None


def chunked_exposed(ends: list[float], S: float, W: float, F: float, slowdown: float = 1.0) -> float:
    """The gradient sync a rank leaves exposed after its last backward when it holds v = len(``ends``) model chunks
    (interleaved 1F1B) whose last backwards end at ``ends``: each chunk's sync (S / v) starts once its own last
    backward is under way, hidden behind it as the one-chunk rule hides S behind W (``steptime``: from W / v
    before its end), the chunks' syncs one after another on the network, and the first layer's (F) only after
    the rank's last backward; as Megatron-LM's --overlap-grad-reduce reduces each chunk's buckets and FSDP each
    unit's gradients. With one chunk: max(S - W, F), ``steptime.overlapped``'s; the compute that ran beside the
    hidden part slowed as there."""
    v, end, tau = len(ends), max(ends), -math.inf
    for e in sorted(ends):
        tau = max(tau, e - W / v) + S / v
    exposed = max(tau - end, F, 0.0)
    return exposed + (slowdown - 1.0) * max(S - exposed, 0.0)


def _short(split: list[int]) -> str:
    out, i = [], 0
    while i < len(split):
        j = i
        while j < len(split) and split[j] == split[i]:
            j += 1
        out.append(f"{split[i]}x{j - i}" if j - i > 1 else str(split[i]))
        i = j
    return "[" + ", ".join(out) + "]"


def parse_stages(text: str) -> str | int:
    """``auto`` | ``off`` | a count (1 is off)."""
    t = str(text).strip().lower()
    if t in ("auto", "off"):
        return t
    try:
        n = int(t)
    except ValueError:
        raise OptionError("pipeline", f"{text!r} is not auto, off or a stage count: give e.g. auto or 16") from None
    if n < 1:
        raise OptionError("pipeline", f"{n} stages: give at least 1 (1 or off: no pipeline), or auto")
    return "off" if n == 1 else n


def check(graph: LayerGraph, cluster: Cluster, stages: str | int, schedule: str, virtual: int = 2) -> None:
    """Bad input found before any work: a schedule that does not exist, fewer than 2 chunks a rank under
    interleaved 1F1B, more stages (or chunks) than blocks or devices, a submesh that does not divide the cluster,
    too few micro-batches (``micro_batch_choices``)."""
    interleaved = schedule_name(schedule) == INTERLEAVED
    if interleaved and (type(virtual) is not int or virtual < 2):
        raise OptionError("virtual-stages", f"{virtual}: interleaved 1F1B runs at least 2 chunks a rank")
    if stages in ("auto", "off"):
        return
    [(p, sub)] = stage_choices(graph, cluster, stages)
    if interleaved and p * virtual > len(blocks(graph)):
        raise OptionError("virtual-stages", f"{virtual}: {p} stages of {virtual} chunks need {p * virtual} blocks, "
                                            f"the model has {len(blocks(graph))}: use fewer stages or chunks")
    if not micro_batch_choices(graph, p, sub, 0):
        raise OptionError("pipeline", f"{p} stages need at least {p} micro-batches for {schedule}, or {fewest(p)} "
                                    f"whose micro-batch splits over a stage's {sub.nodes} node(s), but the batch "
                                    f"{graph.batch} has no such micro-batch count up to {8 * p}: use fewer stages "
                                    f"or a batch with such a divisor")
