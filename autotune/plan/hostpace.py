"""A single-stage plan's step at the host's pace on the path ``apply`` runs it by (``execute``'s way: DDP for a
data-parallel plan, fully_shard for an FSDP-shaped one, torch's tensor-parallel styles for data x tensor
parallelism, DTensor for every other plan of several devices).

Where the profile has host figures for that path (``compute.host_s``: ``autotune.execute.hostfit``), the host
issues a step of the model's n layer occurrences (``len(graph.chain)``) over m micro-batches in
m n h_pass + n h_step seconds, and the step lasts at least that long:

    step = max(the step model's step, m n h_pass + n h_step)

(the pipeline's stages take the same floor per micro-batch: ``autotune.pipeline.paths``). Only transformer
plans that ``apply`` places (gpt, llama); the other models' plans, and every plan where the profile has no host
figures, keep their step.

``corrected``: where the profile has residuals of its path (``calibrate.residuals``: measured / predicted steps
of plans ``autotune tune`` ran on this machine), the plan's step times that factor, recorded as
``totals.residual`` (and ``totals.step_uncorrected_s``, the step before it).
"""
from __future__ import annotations

from calibrate.compute import host_figure

from autotune.plan.layouts import plan_path
from autotune.plan.search import convert, model_graph

KINDS = ("gpt", "llama")  # the models apply places (the reference modules' kinds)


def at_host_pace(plan: dict, compute, module=None) -> dict:
    """``plan`` (a single-stage plan of ``build_plan``) with its step at the host's pace (module doc), its
    ``apply_path`` and ``totals.host_step_s``; ``plan`` itself where the floor does not apply. ``module``: the
    profile's module section (``calibrate.module``); where it was measured on the plan's model with host figures
    of the plan's path, its blocks are issued at the measured per-block pace (the host's cost of the user's own
    block, not of the reference Llama's layers), the layers outside the blocks at the compute section's."""
    totals = plan.get("totals") or {}
    model = plan.get("model") or {}
    if compute is None or not compute.host_s or "stages" in plan or "step_s" not in totals or \
            model.get("kind") not in KINDS:
        return plan
    typed = convert(plan, (), "plan")
    path = plan_path(typed)
    graph = model_graph(model)
    host = compute.host_seconds(path, len(graph.chain))
    own = host_figure(module.host_s, path) if module is not None and module.matches(graph.config) else None
    if own is not None and graph.blocks:
        inside = sum(end - start for start, end in graph.blocks)
        rest = compute.host_seconds(path, len(graph.chain) - inside) or (0.0, 0.0)
        host = (len(graph.blocks) * own[0] + rest[0], len(graph.blocks) * own[1] + rest[1])
    if host is None:
        return dict(plan, apply_path=path)
    per_pass, per_step = host
    step = typed.micro_batches * per_pass + per_step
    return dict(plan, apply_path=path, totals=dict(totals, host_step_s=step, step_s=max(totals["step_s"], step)))


def corrected(plan: dict, profile) -> dict:
    """``plan`` with its step corrected by the profile's residual of its apply path (module doc); ``plan`` itself
    where the profile has none for that path or the plan has no path (pipelined, other models)."""
    residuals = getattr(profile, "residuals", None)
    totals = plan.get("totals") or {}
    path = plan.get("apply_path")
    if residuals is None or path is None or path not in residuals.paths or "step_s" not in totals:
        return plan
    r = residuals.factor(path)
    return dict(plan, totals=dict(totals, step_uncorrected_s=totals["step_s"], residual=r, step_s=totals["step_s"] * r))
