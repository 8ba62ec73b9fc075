"""A single-stage plan's step at the host's pace on the path ``apply`` runs it by (``execute``'s way: DDP for a
data-parallel plan, fully_shard for an FSDP-shaped one, torch's tensor-parallel styles for data x tensor
parallelism, DTensor for every other plan of several devices).

Where the profile has host figures for that path (``compute.host_s``: ``autotune.execute.hostfit``), the host
issues a step of the model's n layer occurrences (``len(graph.chain)``) over m micro-batches in
m n h_pass + n h_step seconds, and the step lasts at least that long:

    step = max(the step model's step, m n h_pass + n h_step)

On the tensor path with data ranks (torchtitan's DDP + TP: ``parallelize_module`` and fully_shard over them),
h is the tensor path's figure plus fully_shard's beyond the plain module's (``"none"``, else DDP's): the hooks of
both; without data ranks the tensor path's alone (``autotune.apply.fsdp.place_tensor``). With sequence
parallelism the figures are the "sequence" path's (``host_path``).

(the pipeline's stages take the same floor per micro-batch: ``autotune.pipeline.paths``). Only transformer
plans that ``apply`` places (gpt, llama); the other models' plans, and every plan where the profile has no host
figures, keep their step.

``path_work`` first adds the device's work of the plan's path beyond its layers' (the DTensor path's logits
gradient pass).

``corrected``: where the profile has residuals of its path (``calibrate.residuals``: measured / predicted steps
of plans ``autotune tune`` ran on this machine; a pipelined plan's path "pipeline"; a recomputing plan's key of
its own, else its path's) fitted against this revision
of the step model (``STEP_MODEL``), the plan's step times that factor, recorded as ``costs.residual`` (and
``costs.step_uncorrected_s``, the step before it). Residuals of another revision divide predictions this model no
longer makes (2026-11-30: the pipelined step priced 10% faster, its residual 1.12; 2026-11-30b: torch's
vocabulary-parallel loss priced beyond the fused one, as measured; 2026-11-30c: the DTensor path's logits gradient
pass, ``path_work``; 2026-11-30d: fully_shard's all-gather input copies; 2026-11-30e: compute beside collectives
slowed by the user's module's own figure; 2026-11-30f: an unmeasured tensor width at the nearest measured width's
ratios; 2026-11-30g: FSDP's gathered weights whole, no key/value cache under recomputation, the DTensor path's
casts of gathered weights not cached, the loss's fp32 copy of the logits: memory only; 2026-11-30h: sequence
parallelism's copies around its collectives, ``sequence_copies_s``; 2026-11-30i: the DTensor path's FSDP collectives in
series with the compute, ``autotune.plan.build.dtensor_fsdp``; 2026-11-30j: FSDP with the embedding split by columns on
the fully_shard path, ``autotune.plan.layouts.column_twin``): they are left out.
"""
from __future__ import annotations

import math
from dataclasses import replace

from calibrate.compute import host_figure
from calibrate.residuals import PIPELINE, RECOMPUTED, key

from autotune.plan.layouts import logits_data_axes, sequence_axes, tp_layout
from autotune.plan.typed import ApplyPath, Plan
from autotune.sbp.cost import forward_factors

# The step model's revision, recorded with the residuals tune fits against its predictions. A change that moves
# predictions bumps it (tests/autotune/test_step_model_revision.py fails where predictions move and it does not).
STEP_MODEL = "2026-11-30j"

KINDS = ("gpt", "llama")  # the models apply places (the reference modules' kinds)


def path_work(plan: Plan, compute) -> Plan:
    """``plan`` (single-stage, priced by step) with its step plus the device's work of its apply path beyond its
    layers' (``costs.path_s``): on the DTensor path each micro-batch's logits gradient scaled to the whole batch's
    mean in a pass of its own (``autotune.apply.dtensor``'s logits hook: a read and a write of each local logit)
    where the data ranks hold their own pieces of the batch (DDP and fully_shard average inside their reductions;
    2 x H200, 2026-11-30: a per-layer plan otherwise DDP's ran 24 ms a step slower than DDP, priced 1 ms faster:
    reports/records/plans_h200x2.md, session 28); with sequence parallelism, the copies around its collectives
    (``sequence_copies_s``)."""
    if plan.stages or compute is None or plan.costs.step_s is None:
        return plan
    s = sequence_copies_s(plan, compute)
    if plan.apply_path == ApplyPath.DTENSOR and logits_data_axes(plan):  # (there the logits layer and output exist)
        lay = plan.layer("logits")
        split = math.prod(n for p, n in zip(lay.output, plan.mesh.sizes) if p in ("S0", "S1"))
        local = lay.dims["tokens"] * lay.dims["n"] / split
        s += plan.micro_batches * compute.op_seconds("elementwise", 2 * local * plan.model.get("act_bytes", 2))
    return replace(plan, costs=replace(plan.costs, path_s=s, step_s=plan.costs.step_s + s)) if s else plan


def sequence_copies_s(plan: Plan, compute) -> float:
    """A step's copies around sequence parallelism's collectives on the tensor and fully_shard paths: torch's
    ``SequenceParallel`` splits a (batch, sequence, features) activation by its sequence, dimension 1, and DTensor's
    functional collectives gather and scatter along dimension 0, so each reduce-scatter of the stream is preceded by
    a concatenation of its chunks and each all-gather followed by one, where a rank holds more than one sequence
    (torch's view of one: ``torch._utils._maybe_view_chunk_cat``); each a read and a write of the whole tensor (on 2
    gloo ranks, 8 a block and micro-batch of 2 sequences, ``tests/autotune/test_apply_sequence_parallel.py``). The
    search's tokens are split along their dimension 0 (``copies_around``: none); the forward's run twice inside
    the blocks under full recomputation."""
    axes = set(sequence_axes(plan))
    if not axes:
        return 0.0
    graph = plan.model.graph()
    tp = math.prod(plan.mesh.sizes[a] for a in axes)
    gathers = graph.micro_batch * tp > math.prod(plan.mesh.sizes)  # a rank's sequences: more than one
    index = {layer.name: i for i, layer in enumerate(graph.layers)}
    again = forward_factors(graph, plan.recompute_blocks) if plan.recompute == "full" else {}
    s, seen = 0.0, set()
    for e in plan.edges:
        f = again.get((index.get(e.source), index.get(e.target)), 1.0)
        for c in e.collectives:
            moved = (e.source, c.direction, c.collective)  # a stream two layers read is redistributed once
            if c.phase == "boxing" and c.per == "micro-batch" and set(c.axes) <= axes and moved not in seen and \
                    (c.collective == "reducescatter" or c.collective == "allgather" and gathers):
                seen.add(moved)
                s += e.count * (f if c.direction == "fwd" else 1.0) * compute.memory_seconds(2 * c.nbytes)
    return plan.micro_batches * s


def host_priced(plan: Plan, compute) -> bool:
    """Whether ``plan`` is priced at the host's pace: a plan of a model apply places, priced by step, on a profile
    with host figures (single-stage plans here, ``paced``; pipelined ones in ``autotune.pipeline.paths``)."""
    return compute is not None and bool(compute.host_s) and plan.costs.step_s is not None \
        and plan.model.kind in KINDS


def paced(plan: Plan, compute) -> bool:
    """Whether the host's pace applies to ``plan`` here (module doc): a single-stage plan ``host_priced``."""
    return not plan.stages and host_priced(plan, compute)


def occurrence_host(graph, compute, module, path: str) -> list[tuple[float, float]] | None:
    """Per position of ``graph``'s chain, the host's (per micro-batch, per step) seconds to issue that layer occurrence
    on ``path``: the compute section's figure per occurrence, and inside the blocks, where ``module`` (the profile's
    module section) was measured on the model with a figure of the path, the block's own figure spread over its
    occurrences (the host's cost of the user's own block, not of the reference Llama's layers); outside the blocks,
    where the module section (else the compute section) has a figure of the path's whole outside
    (``host_outside_s``: the vocabulary-parallel embedding, head and loss of the tensor paths), that figure spread
    over those occurrences; None where the compute section has no figure of the path."""
    per = host_figure(compute.host_s, path) if compute is not None else None
    if per is None:
        return None
    out = [tuple(per)] * len(graph.chain)
    mine = module is not None and module.matches(graph.config)
    own = host_figure(module.host_s, path) if mine else None
    for start, end in (graph.blocks if own is not None else ()):
        out[start:end] = [(own[0] / (end - start), own[1] / (end - start))] * (end - start)
    whole = (host_figure(module.host_outside_s, path) if mine else None) or host_figure(compute.host_outside_s, path)
    inside = {p for start, end in (graph.blocks or ()) for p in range(start, end)}
    rest = [p for p in range(len(out)) if p not in inside]
    if whole is not None and inside and rest:  # the model outside its blocks at its measured pace, spread
        out = [o if p in inside else (whole[0] / len(rest), whole[1] / len(rest)) for p, o in enumerate(out)]
    return out


def host_path(plan: Plan) -> str:
    """The path whose host figure and residual price ``plan``: its apply path, "sequence" for the tensor path with
    sequence parallelism (``calibrate.compute.HOST_PATHS``)."""
    layout = tp_layout(plan) if plan.apply_path == ApplyPath.TENSOR else None
    return "sequence" if layout is not None and layout.sequence_parallel else str(plan.apply_path)


def residual_path(plan: Plan) -> str:
    """The key of ``plan``'s residual (``calibrate.residuals.key``): "pipeline" for a pipelined plan, else
    ``host_path``; with its recomputation where it recomputes (a pipelined plan's: the most any stage does)."""
    if not plan.stages:
        return key(host_path(plan), plan.recompute)
    modes = {st.plan.recompute for st in plan.stages}
    return key(PIPELINE, next((m for m in reversed(RECOMPUTED) if m in modes), "none"))


def data_ranks(plan: Plan) -> int:
    """The data ranks of a plan on the tensor path (``autotune.apply.fsdp.place_tensor`` wraps it in fully_shard
    over them where there are more than one); 1 for any other plan."""
    layout = tp_layout(plan)
    return layout.dims(plan)["replicate"] if layout is not None else 1


def at_host_pace(plan: Plan, compute, module=None) -> Plan:
    """``plan`` (a single-stage plan of ``autotune.plan.build``) with its step at the host's pace of its
    ``apply_path`` (module doc) and ``costs.host_step_s``; ``plan`` itself where the floor does not apply.
    ``module``: the profile's module section (``calibrate.module``), its blocks issued at their measured pace
    (``occurrence_host``)."""
    if not paced(plan, compute):
        return plan
    costs, graph = plan.costs, plan.model.graph()
    host = occurrence_host(graph, compute, module, host_path(plan))
    if host is None:
        return plan
    if plan.apply_path == ApplyPath.TENSOR and data_ranks(plan) > 1:  # fully_shard's hooks on top (autotune.apply.fsdp)
        fs = occurrence_host(graph, compute, module, ApplyPath.FULLY_SHARD)
        # the plain module's figure; a profile without it (H100's) by DDP's, the plain module and its bucket hooks
        # (H200, 2026-11-29: 445 against 410 us a layer occurrence and micro-batch)
        none = occurrence_host(graph, compute, module, "none") or occurrence_host(graph, compute, module,
                                                                                    ApplyPath.DDP)
        if fs is not None and none is not None:
            host = [(t[0] + max(f[0] - n[0], 0.0), t[1] + max(f[1] - n[1], 0.0)) for t, f, n in zip(host, fs, none)]
    step = plan.micro_batches * sum(h[0] for h in host) + sum(h[1] for h in host)
    return replace(plan, costs=replace(costs, host_step_s=step, step_s=max(costs.step_s, step)))


def corrected(plan: Plan, profile) -> Plan:
    """``plan`` with its step corrected by the profile's residual of its path (``residual_path``; module doc);
    ``plan`` itself where the profile has none for that path or the plan is not priced at the host's pace
    (``host_priced``)."""
    residuals = current_residuals(profile)
    r = residuals.lookup(residual_path(plan)) if residuals is not None else None
    if r is None or not host_priced(plan, getattr(profile, "compute", None)):
        return plan
    costs = plan.costs
    return replace(plan, costs=replace(costs, step_uncorrected_s=costs.step_s, residual=r, step_s=costs.step_s * r))


def current_residuals(profile):
    """The profile's residuals where fitted against this revision of the step model (``STEP_MODEL``), else None."""
    residuals = getattr(profile, "residuals", None)
    return residuals if residuals is not None and residuals.model == STEP_MODEL else None
