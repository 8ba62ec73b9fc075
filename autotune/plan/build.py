"""The search's plan as a ``Plan``, built from the search's problem and assignment (``build``): each layer's
placements read from its chosen strategy, the collectives each layer and boxing issues, their predicted costs
and the step's (``autotune.sbp.cost``, ``autotune.sbp.steptime``), and the path ``apply`` places it by
(``autotune.plan.layouts.plan_path``), decided here once."""
from __future__ import annotations

import numpy as np

from autotune.plan.hostpace import occurrence_host
from autotune.plan.layouts import plan_path
from autotune.plan.typed import ApplyPath, Collective, Costs, Edge, FineMesh, LayerPlan, ModelSpec, Plan, WeightPlan
from autotune.sbp.boxing import Step, copy_seconds
from autotune.sbp.cost import Problem, edge_steps, internal_copy_seconds, internal_seconds, internal_steps, sync_steps
from autotune.sbp.layers import Strategy
from autotune.sbp.memory import OUTSIDE, RERUN, Mode
from autotune.sbp.modulecal import source as compute_source
from autotune.sbp.sbp import fine_of
from autotune.sbp.steptime import (fsdp_forward_exposed, fsdp_seconds, fsdp_steps, layer_seconds, optimizer_seconds,
                                   serial_fsdp_seconds)


def _comm(step: Step, problem: Problem, phase: str, tensor: str, direction: str, per: str) -> Collective:
    g = problem.cluster.group(step.axes)
    return Collective(phase, tensor, direction, per, step.op, tuple(step.axes), g.ranks, g.nodes, g.tier,
                      step.nbytes, problem.coster.step_time(step))


def _layer_clock(problem: Problem, v: int, op, s: Strategy, role: str, tied: bool) -> dict:
    """One occurrence's predicted forward and backward of one micro-batch (the op, with its own
    boxing and the local copies around it) and optimizer step, as ``autotune execute``'s layer
    clock measures them; the boxing into the layer is its in-edge's ``forward_s``/``backward_s``."""
    cl, cm, ab = problem.cluster, problem.compute, problem.act_bytes

    def clock(mode: Mode) -> np.ndarray:
        rec = mode.recompute
        t = dict(zip(("fwd", "bwd"), layer_seconds(op, s, cl, cm, ab, rec, role)))
        for direction, sec, copies in zip(("fwd", "bwd"), internal_seconds(op, s, cl, problem.coster, cm, ab),
                                          internal_copy_seconds(s, cl, cm)):
            sec += copies
            t[direction] += sec
            if direction == "fwd" and rec == "full" and role in RERUN:
                t["bwd"] += sec
        return np.array([t["fwd"], t["bwd"]])
    fwd, bwd = problem.rerun(v, clock)  # block recomputation: the share of its occurrences re-run
    return {"forward_s": float(fwd), "backward_s": float(bwd),
            "optimizer_s": optimizer_seconds(s, cl, cm, ab, problem.mode, tied)}


def placed(problem: Problem, assign: list[int], strategy: str = "") -> Plan:
    """``assign`` on ``problem`` as a plan without its costs and path: its layers and modes (cheap: the pipeline
    search reads a stage plan's path by it, ``autotune.pipeline.paths``)."""
    cl = problem.cluster

    def fine(t, s):
        return None if t is None else fine_of(t.sbp, s.mesh, cl) or ("B",)  # one device: one axis of size 1
    layers = []
    for op, s_i, count, choices in zip(problem.ops, assign, problem.counts, problem.choices):
        s = choices[s_i]
        layers.append(LayerPlan(op.layer.name, op.layer.kind, count, op.layer.all_dims(), s.signature,
                                fine(s.input, s), fine(s.output, s),
                                tuple(WeightPlan(w.name, tuple(w.shape), fine(w, s)) for w in s.weights),
                                {}, s.mesh.sizes))
    sharding = problem.mode.sharding
    config = {k: v for k, v in {"name": problem.graph.model, **problem.graph.config}.items() if k != "kind"}
    return Plan(ModelSpec(problem.graph.model, config), cl, FineMesh.of(cl), tuple(layers), problem.mb,
                problem.mode.recompute, sharding["mode"], tuple(sharding["axes"]), strategy,
                problem.coster.profile.name, recompute_blocks=problem.mode.blocks)


def build(problem: Problem, assign: list[int], strategy: str, search: dict | None = None, path: str | None = None) -> Plan:
    """The plan of ``assign`` on ``problem`` with its collectives and predicted costs; ``path``: the path
    ``apply`` places it by where the caller decided it (a pipeline stage's), else ``plan_path``'s."""
    cl, mb = problem.cluster, problem.mb
    plan = placed(problem, assign, strategy)
    layers, edges = [], []
    red_total = sync_total = comp_total = 0.0
    tied_saved = problem.tied_saved(assign)  # the tied logits' weight gradient synced with the embedding's
    for v, (lay, op, s_i, count) in enumerate(zip(plan.layers, problem.ops, assign, problem.counts)):
        s = problem.choices[v][s_i]
        comms = [_comm(st, problem, "internal", t, d, "micro-batch")
                 for t, d, steps in internal_steps(s, cl) for st in steps if st.collective]
        comms += [_comm(st, problem, "grad-sync", t, "bwd", "step")
                  for t, st in sync_steps(s, cl, problem.grad_bytes, problem.mode)]
        comms += [_comm(st, problem, "fsdp", t, d, "micro-batch") for t, d, st in fsdp_steps(s, cl, problem.mode)]
        red = float(problem.node_redist[v][s_i])
        sync = float(problem.node_sync[v][s_i])
        if tied_saved and v == problem.tied_pair[0]:
            sync -= tied_saved
            comms = [c for c in comms if not (c.phase == "grad-sync" and c.tensor == "weight")]
        comp = float(problem.node_compute[v][s_i]) if problem.node_compute is not None else None
        clock = _layer_clock(problem, v, op, s, problem.roles[v], problem.tied[v]) if comp is not None else {}
        comp_total += count * (comp or 0.0)
        red_total += count * red
        sync_total += count * sync
        costs = {"redistribution_s": red, "grad_sync_s": sync,
                 "memory_bytes": problem.layer_memory(v, s).total,
                 **({"compute_s": comp} if comp is not None else {}), **clock}
        layers.append(LayerPlan(lay.name, lay.kind, lay.count, lay.dims, lay.signature, lay.input, lay.output,
                                lay.weights, costs, lay.roles, tuple(comms),
                                compute_source(problem.module_cal, op, s, cl, problem.roles[v]) if comp is not None
                                else ""))
    for (a, b), count in problem.edge_counts.items():
        sa, sb = problem.choices[a][assign[a]], problem.choices[b][assign[b]]
        fwd, bwd = edge_steps(sa, sb, problem.ops[a].out_shape, cl, problem.tables.sizes(a, b))
        comms = tuple(_comm(st, problem, "boxing", problem.ops[a].layer.name, d, "micro-batch")
                      for d, steps in (("fwd", fwd), ("bwd", bwd)) for st in steps if st.collective)
        rerun = problem.tables.forward_factor.get((a, b), 1.0)  # full recomputation re-runs forward boxings
        t = mb * (rerun * problem.coster.time(fwd) + problem.coster.time(bwd))
        red_total += count * t
        copies = {}
        if problem.compute is not None:  # DTensor's local copies around the steps: compute time
            cf, cb = (copy_seconds(x, problem.compute.memory_seconds) for x in (fwd, bwd))
            copies = {"copy_s": mb * (rerun * cf + cb), "forward_s": problem.coster.time(fwd) + cf,
                      "backward_s": problem.coster.time(bwd) + cb}
            comp_total += count * copies["copy_s"]
        edges.append(Edge(problem.ops[a].layer.name, problem.ops[b].layer.name, count, comms,
                          {"redistribution_s": t, **copies}))
    step = {}
    decided, path = path is None, path if path is not None else plan_path(plan)  # read from the placements alone
    if problem.node_compute is not None:  # the step-time model (autotune.sbp.steptime)
        on = decided and problem.objective == "step"
        gathers = forward_gathers(problem, assign) if on and path == ApplyPath.FULLY_SHARD else None
        serial = dtensor_fsdp(problem, assign) if on and path == ApplyPath.DTENSOR else None
        exposed = red_total + problem.exposed_sync(assign) + sum(g[0] - g[1] for g in (gathers, serial) if g)
        step = {"compute_s": comp_total, "exposed_comm_s": exposed, "step_s": comp_total + exposed,
                **({"gather_exposed_s": gathers[0]} if gathers else {}),
                **({"fsdp_serial_s": serial[0]} if serial else {})}
    memory = problem.memory_breakdown(assign, cached_gathered=path != ApplyPath.DTENSOR)
    breakdown = memory.to_dict()
    held = ddp_gradient_copies(path, mb, breakdown, problem.recipe)
    extra = sum(held.values())
    peak = memory.total + extra
    fits = bool(problem.fits_plan(assign, peak)) and not (extra and problem.device_limit is not None and
                                                           peak > problem.device_limit)
    costs = Costs(red_total, sync_total, red_total + sync_total, peak, fits,
                  dict(breakdown, **held), **step)
    return Plan(plan.model, cl, plan.mesh, tuple(layers), mb, plan.recompute, plan.sharding_mode, plan.sharding_axes,
                strategy, plan.profile, costs, path, problem.objective, problem.device_limit, search or {},
                tuple(edges), recompute_blocks=plan.recompute_blocks)


def forward_gathers(problem: Problem, assign: list[int]) -> tuple[float, float] | None:
    """A single-stage plan on the fully_shard path: (its forward all-gathers' exposed seconds a step under FSDP2's
    implicit prefetch at the host's pace, ``steptime.fsdp_forward_exposed``; the per-layer rule's forward part,
    max(0, all-gather - forward) per layer, which ``fsdp_seconds`` priced into the redistribution and this
    replaces); None where the plan gathers nothing or the profile has no host figure of the path (the per-layer
    rule stays). A pipeline stage's plan (its path given) keeps the stage's own rule (``pipelined_fsdp_seconds``)."""
    figures = gather_figures(problem, assign)
    if figures is None:
        return None
    fwd, bwd, gather, scatter, host = figures
    graph = problem.graph
    new = fsdp_forward_exposed(graph.chain, graph.blocks, problem.mb, fwd, bwd, gather, host, scatter)
    old = problem.mb * sum(n * max(0.0, g - f) for n, g, f in zip(problem.counts, gather, fwd))
    return new, old


def dtensor_fsdp(problem: Problem, assign: list[int]) -> tuple[float, float] | None:
    """A single-stage plan on the DTensor path: (its FSDP collectives a step in series with the compute,
    ``steptime.serial_fsdp_seconds``, the backward's gathers where the layer's forward re-runs under full
    recomputation; what the per-layer rule ``fsdp_seconds`` priced into the redistribution, which this replaces);
    None where the plan shards nothing. A pipeline stage's plan (its path given) keeps the stage's own rule."""
    if problem.node_fwd is None:
        return None
    cl, mode, coster = problem.cluster, problem.mode, problem.coster
    new = old = 0.0
    for v, (i, n) in enumerate(zip(assign, problem.counts)):
        s = problem.choices[v][i]
        if not fsdp_steps(s, cl, mode):
            continue
        rerun = mode.recompute == "full" and problem.roles[v] != OUTSIDE
        new += n * serial_fsdp_seconds(s, cl, coster, mode, rerun)
        old += n * fsdp_seconds(s, cl, coster, mode, float(problem.node_fwd[v][i]), float(problem.node_bwd[v][i]))
    return (problem.mb * new, problem.mb * old) if new else None


def gather_figures(problem: Problem, assign: list[int]) -> tuple[list, list, list, list, list] | None:
    """What ``steptime.fsdp_forward_exposed`` reads of ``assign`` under ``problem``'s FSDP mode: per distinct layer
    its forward and backward compute, forward all-gathers and reduce-scatters (seconds per occurrence and
    micro-batch, as priced), per chain position the host's seconds per micro-batch on the fully_shard path
    (``hostpace.occurrence_host``); None where nothing is gathered or the profile has no host figure of the path."""
    profile = problem.coster.profile
    host = occurrence_host(problem.graph, problem.compute, getattr(profile, "module", None), ApplyPath.FULLY_SHARD)
    cl, mode = problem.cluster, problem.mode
    chosen = [choices[i] for choices, i in zip(problem.choices, assign)]
    steps = [fsdp_steps(s, cl, mode) for s in chosen]
    gather = [sum(problem.coster.step_time(st) for _, d, st in ss if d == "fwd") for ss in steps]
    if host is None or not any(gather):
        return None
    scatter = [sum(problem.coster.step_time(st) for _, _, st in ss if st.op == "reducescatter") for ss in steps]
    return ([float(problem.node_fwd[v][i]) for v, i in enumerate(assign)],
            [float(problem.node_bwd[v][i]) for v, i in enumerate(assign)], gather, scatter, [h[0] for h in host])


def ddp_gradient_copies(path: str, micro_batches: int, breakdown: dict, recipe: str) -> dict:
    """The gradient copies DDP holds beyond the buckets the memory model counts, each the gradients' bytes (one H200,
    ``tests/gpu/ddp_buckets.py``, 2026-11-29): ``ddp_accumulation_bytes``, with gradient accumulation: the
    micro-batches run under ``no_sync()`` accumulate into gradients of their own until the last one's backward
    copies them into the buckets (each gradient a view into its bucket with ``gradient_as_bucket_view``);
    ``ddp_rebuilt_buckets_bytes``: in the second step DDP rebuilds its buckets in the order the first step's
    gradients arrived, and the first step's buckets stay allocated beside the new ones until that step's backward
    has run, through its peak (with and without accumulation; Python's collector does not free them sooner). The
    plan's peak is the second step's. None on the other paths and under AutoDDL's recipe (no DDP)."""
    if path != ApplyPath.DDP or recipe != "autocast":
        return {}
    grads = float(breakdown.get("gradients_bytes", 0.0))
    return {"ddp_rebuilt_buckets_bytes": grads, **({"ddp_accumulation_bytes": grads} if micro_batches > 1 else {})}
