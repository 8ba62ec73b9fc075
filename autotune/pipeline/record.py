"""A pipelined plan as a ``Plan`` (``autotune.plan.typed``): its ``stages`` (per stage its plan of the layers it
runs on its submesh, built by ``autotune.plan.build``, its chain range and layers, in-flight micro-batches, forward
and backward seconds per micro-batch, the boundary to the next stage each way as it executes, by the route
direct or scatter whose tiles cross in ``boundary_sent``, and as the resharding planner would move it,
``autotune.pipeline.boundary``, memory and its simulated timeline), ``pipeline`` (schedule, split, makespan)
and the costs over the pipeline.

Costs: ``step_s`` the simulated step; ``compute_s``, ``redistribution_s`` and ``grad_sync_s`` those of the
busiest stage (per step, on its devices); ``boundary_s`` the boundary transfers of one micro-batch summed over
the boundaries, both ways (``boundary_planned_s`` the same by the resharding planner); ``bubble_s`` the step
less the busiest stage's work; ``memory_bytes`` the largest stage's peak (``memory_stage``).
"""
from __future__ import annotations

import time
from dataclasses import asdict, replace

from autotune.pipeline.paths import stage_path
from autotune.pipeline.search import Candidate, PipelineConfig, PipelineSearch, StagePlan
from autotune.pipeline.threed import seeded
from autotune.plan.build import build
from autotune.plan.typed import ApplyPath, Costs, FineMesh, ModelSpec, Pipeline, Plan, Stage
from autotune.sbp.techniques import Techniques


def stream(a: StagePlan, b: StagePlan) -> tuple:
    """(shape, out, in, grad) of the boundary from stage plan ``a`` to the next, ``b``: the last layer's output
    shape and placement, the first layer's input placement and its gradient's (as ``PipelineSearch.finish``)."""
    pa, pb = a.problem, b.problem
    last, first = pa.graph.chain[-1], pb.graph.chain[0]
    sa, sb = pa.choices[last][a.assign[last]], pb.choices[first][b.assign[first]]
    return pa.ops[last].out_shape, sa.fine_out, sb.fine_in, sb.fine_grad_in


def pipeline_plan(search: PipelineSearch, c: Candidate, strategy: str, info: dict | None = None) -> Plan:
    g = search.graph_for(c.micro_batches)
    stages = []
    planned = [search.pricer.planned(*stream(c.plans[i], c.plans[i + 1]), c.sub, c.sub, i) for i in range(c.stages - 1)]
    routes = [search.pricer.route(*stream(c.plans[i], c.plans[i + 1]), c.sub, c.sub, i) for i in range(c.stages - 1)]
    for i, (sp, span) in enumerate(zip(c.plans, c.spans)):
        plan = build(sp.problem, sp.assign, f"stage {i}", sp.search, sp.fig.path or stage_path(sp.problem, sp.assign))
        plan = replace(plan, model=ModelSpec(plan.model.kind, dict(plan.model.config, layers=c.split[i])))
        fwd, bwd = c.boundaries[i] if i < len(c.boundaries) else (0.0, 0.0)
        pf, pb = planned[i] if i < len(planned) else (0.0, 0.0)
        route = routes[i] if i < len(routes) else None
        mode = sp.problem.mode
        stages.append(Stage(
            plan, tuple(span), c.split[i], g.layers[g.chain[span[0]]].name, g.layers[g.chain[span[1] - 1]].name,
            sp.problem.inflight, sp.fig.forward, sp.fig.backward, fwd, bwd, pf, pb, sp.fig.grad_sync,
            sp.fig.exposed_sync, sp.fig.optimizer, c.ends[i], sp.fig.memory, sp.fig.fits,
            route.name if route else None, tuple(route.sent) if route else None, sp.fig.host if sp.fig.path else None,
            tuple((iv.kind, iv.micro_batch, iv.start, iv.end) for iv in c.result.intervals if iv.lane == f"stage {i}"),
            Techniques(mode.recompute, search.cfg.schedule, c.virtual, bool(sp.search.get("sequence_parallel")),
                       mode.zero, recompute_blocks=mode.blocks).to_dict()))
    busiest = max(range(c.stages), key=lambda i: c.plans[i].fig.compute + c.plans[i].fig.redistribution)
    bf = c.plans[busiest].fig
    binding = max(range(c.stages), key=lambda i: c.plans[i].fig.memory)  # the stage whose memory binds
    work = c.micro_batches * (bf.forward + bf.backward) + bf.exposed_sync + bf.optimizer
    costs = Costs(bf.redistribution, bf.grad_sync, bf.redistribution + bf.grad_sync, c.plans[binding].fig.memory,
                  all(x.fig.fits for x in c.plans), stages[binding].plan.costs.memory, compute_s=bf.compute,
                  exposed_comm_s=c.step - bf.compute, step_s=c.step, boundary_s=sum(f + b for f, b in c.boundaries),
                  boundary_planned_s=sum(f + b for f, b in planned), bubble_s=max(0.0, c.step - work),
                  memory_stage=binding)
    config = {k: v for k, v in {"name": g.model, **g.config}.items() if k != "kind"}
    return Plan(ModelSpec(g.model, config), search.cluster, FineMesh.of(search.cluster), (), c.micro_batches,
                strategy=strategy, profile=search.profile.name, costs=costs, apply_path=ApplyPath.PIPELINE.value,
                objective="step", memory_limit_bytes=search.stages.limit,
                search={**(info or {}), "config": {k: list(v) if isinstance(v, tuple) else v  # as plan.json holds it
                                                    for k, v in asdict(search.cfg).items()}},
                pipeline=Pipeline(search.cfg.schedule, tuple(c.split), c.result.makespan,
                                  tuple(c.result.peak_activations), tuple(c.result.steady)),
                stages=tuple(stages))


def pipeline_plans(graph, cluster, profile, memory_limit: float, cfg: PipelineConfig, progress=None):
    """(the best pipelined plan, the best Megatron-style 3-D plan), each a ``Plan`` or None where no
    candidate fits; the pipelined plan is the 3-D one where the stage search finds none faster
    (``autotune.pipeline.threed.seeded``)."""
    t0 = time.perf_counter()
    search = PipelineSearch(graph, cluster, profile, memory_limit, cfg, progress)
    best, mega, same = seeded(search, runnable=True)
    info = {"algorithm": f"pipeline stages + {cfg.search}", "seconds": time.perf_counter() - t0,
            "stage_searches": search.stages.searches, "seeded_by_3d": same}
    note = "; the Megatron 3-D plan: no searched plan is faster" if same else ""
    out = pipeline_plan(search, best, f"pipelined ({best.stages} stages, {cfg.schedule}, {best.micro_batches} "
                                      f"micro-batches{note})", info) if best is not None else None
    base = pipeline_plan(search, mega, mega.name, {"algorithm": "megatron"}) if mega is not None else None
    return out, base
