"""A pipelined plan as the plan record's ``best`` (or a baseline): the fields of a single-stage plan
(``autotune.sbp.plan.build_plan``) with totals over the pipeline, plus ``pipeline`` (schedule, stages,
micro-batches, makespan, bubble) and ``stages``: per stage its chain-position range and layer names,
submesh, in-flight micro-batches, forward and backward seconds per micro-batch, the boundary to the next
stage (seconds per micro-batch each way, as it executes, ``boundary_forward_s`` and ``boundary_backward_s``, by
the route ``boundary_route``, direct or scatter, whose tiles cross in the fine-axis placement ``boundary_sent``;
both None on the last stage; ``boundary_planned_*`` as the resharding planner would move it,
``autotune.pipeline.boundary``), memory, its timeline (the simulated intervals) and its SBP
plan (``layers``, ``edges``, ``totals`` as today). ``layers`` and ``edges`` of the whole are the
stages' in order, each with its ``stage``.

Totals: ``step_s`` the simulated step; ``compute_s``, ``redistribution_s`` and ``grad_sync_s`` those of
the busiest stage (per step, on its devices); ``boundary_s`` the boundary transfers of one micro-batch
summed over the boundaries, both ways (``boundary_planned_s`` the same by the resharding planner);
``bubble_s`` the step less the busiest stage's work;
``memory_bytes`` the largest stage's peak.
"""
from __future__ import annotations

import time
from dataclasses import asdict

from calibrate.records import header

from autotune.pipeline.search import Candidate, PipelineConfig, PipelineSearch, StagePlan
from autotune.pipeline.threed import seeded
from autotune.sbp.plan import KIND, VERSION, build_plan
from autotune.sbp.techniques import Techniques


def stream(a: StagePlan, b: StagePlan) -> tuple:
    """(shape, out, in, grad) of the boundary from stage plan ``a`` to the next, ``b``: the last layer's output
    shape and placement, the first layer's input placement and its gradient's (as ``PipelineSearch.finish``)."""
    pa, pb = a.problem, b.problem
    last, first = pa.graph.chain[-1], pb.graph.chain[0]
    sa, sb = pa.choices[last][a.assign[last]], pb.choices[first][b.assign[first]]
    return pa.ops[last].out_shape, sa.fine_out, sb.fine_in, sb.fine_grad_in


def pipeline_plan(search: PipelineSearch, c: Candidate, strategy: str, info: dict | None = None) -> dict:
    g = search.graph_for(c.micro_batches)
    stages, layers, edges = [], [], []
    planned = [search.pricer.planned(*stream(c.plans[i], c.plans[i + 1]), c.sub, c.sub, i) for i in range(c.stages - 1)]
    routes = [search.pricer.route(*stream(c.plans[i], c.plans[i + 1]), c.sub, c.sub, i) for i in range(c.stages - 1)]
    for i, (sp, span) in enumerate(zip(c.plans, c.spans)):
        plan = build_plan(sp.problem, sp.assign, f"stage {i}", sp.search)
        for x in plan["layers"]:
            layers.append(dict(x, stage=i))
        for x in plan["edges"]:
            edges.append(dict(x, stage=i))
        fwd, bwd = c.boundaries[i] if i < len(c.boundaries) else (0.0, 0.0)
        pf, pb = planned[i] if i < len(planned) else (0.0, 0.0)
        route = routes[i] if i < len(routes) else None
        stages.append({
            "stage": i, "chain": list(span), "blocks": c.split[i],
            "first_layer": g.layers[g.chain[span[0]]].name, "last_layer": g.layers[g.chain[span[1] - 1]].name,
            "submesh": {"nodes": c.sub.nodes, "gpus_per_node": c.sub.gpus_per_node},
            "inflight": sp.problem.inflight, "forward_s": sp.fig.forward, "backward_s": sp.fig.backward,
            "boundary_forward_s": fwd, "boundary_backward_s": bwd,
            "boundary_route": route.name if route else None, "boundary_sent": list(route.sent) if route else None,
            "boundary_planned_forward_s": pf, "boundary_planned_backward_s": pb,
            "grad_sync_s": sp.fig.grad_sync, "exposed_sync_s": sp.fig.exposed_sync, "optimizer_s": sp.fig.optimizer,
            **({"apply_path": sp.fig.path, "host_pass_s": sp.fig.host} if sp.fig.path else {}),
            "end_s": c.ends[i], "memory_bytes": sp.fig.memory, "fits_memory": sp.fig.fits,
            "timeline": [[iv.kind, iv.micro_batch, iv.start, iv.end] for iv in c.result.intervals
                         if iv.lane == f"stage {i}"],
            "plan": plan,
        })
    busiest = max(range(c.stages), key=lambda i: c.plans[i].fig.compute + c.plans[i].fig.redistribution)
    bf = c.plans[busiest].fig
    binding = max(range(c.stages), key=lambda i: c.plans[i].fig.memory)  # the stage whose memory binds
    work = c.micro_batches * (bf.forward + bf.backward) + bf.exposed_sync + bf.optimizer
    totals = {"step_s": c.step, "compute_s": bf.compute, "redistribution_s": bf.redistribution,
              "grad_sync_s": bf.grad_sync, "total_s": bf.redistribution + bf.grad_sync,
              "exposed_comm_s": c.step - bf.compute,
              "boundary_s": sum(f + b for f, b in c.boundaries),
              "boundary_planned_s": sum(f + b for f, b in planned), "bubble_s": max(0.0, c.step - work),
              "memory_bytes": c.plans[binding].fig.memory, "memory_stage": binding,
              "memory": stages[binding]["plan"]["totals"]["memory"],
              "fits_memory": all(x.fig.fits for x in c.plans)}
    return {
        **header(KIND, VERSION), "strategy": strategy,
        "model": {"name": g.model, **g.config, "kind": g.model},
        "cluster": {"nodes": search.cluster.nodes, "gpus_per_node": search.cluster.gpus_per_node},
        "profile": search.profile.name, "micro_batches": c.micro_batches,
        "memory_limit_bytes": search.stages.limit, "search": {**(info or {}), "config": asdict(search.cfg)}, "assignment": [],
        "objective": "step", "totals": totals, "layers": layers, "edges": edges,
        "pipeline": {"schedule": search.cfg.schedule, "stages": c.stages, "micro_batches": c.micro_batches,
                     "split": list(c.split), "makespan_s": c.result.makespan,
                     "peak_activations": list(c.result.peak_activations),
                     "submesh": {"nodes": c.sub.nodes, "gpus_per_node": c.sub.gpus_per_node},
                     "steady": list(c.result.steady)},
        "stages": stages,
        "stage_modes": [{"recompute": x.problem.mode.recompute, "sharding": x.problem.mode.sharding,
                         "techniques": Techniques(x.problem.mode.recompute, search.cfg.schedule, c.virtual,
                                                  bool(x.search.get("sequence_parallel")),
                                                  x.problem.mode.zero).to_dict()} for x in c.plans],
    }


def pipeline_plans(graph, cluster, profile, memory_limit: float, cfg: PipelineConfig, progress=None):
    """(the best pipelined plan, the best Megatron-style 3-D plan), each a plan dict or None where no
    candidate fits; the pipelined plan is the 3-D one where the stage search finds none faster
    (``autotune.pipeline.threed.seeded``)."""
    t0 = time.perf_counter()
    search = PipelineSearch(graph, cluster, profile, memory_limit, cfg, progress)
    best, mega, same = seeded(search)
    info = {"algorithm": f"pipeline stages + {cfg.search}", "seconds": time.perf_counter() - t0,
            "stage_searches": search.stages.searches, "seeded_by_3d": same}
    note = "; the Megatron 3-D plan: no searched plan is faster" if same else ""
    out = pipeline_plan(search, best, f"pipelined ({best.stages} stages, {cfg.schedule}, {best.micro_batches} "
                                      f"micro-batches{note})", info) if best is not None else None
    base = pipeline_plan(search, mega, mega.name, {"algorithm": "megatron"}) if mega is not None else None
    return out, base
