"""A pipelined plan as apply runs it: ``load_pipelined`` (the one loader and its checks: per stage its plan on
its submesh, its blocks, the placement the stream crosses each boundary in, ``sent``) and the schedules (``SCHEDULES``, for any
number of micro-batches m): 1f1b -> ``Schedule1F1B`` where m >= p, with fewer micro-batches Megatron's order
(stage i runs min(p - i, m) forwards before its first backward); gpipe -> ``ScheduleGPipe``; eager-1f1b (stage i
runs 2(p - i) - 1 forwards before its first backward). The orders the library lacks run as the step model
simulates them (``autotune.reshard.pipeline.SCHEDULES``) on the library's schedule runtime
(``_PipelineScheduleRuntime`` fed a compute-only action list, a private API torchtitan's CSV schedules use too)."""
from __future__ import annotations

from calibrate.errors import UserError

from autotune.apply.layers import HEAD, TAIL
from autotune.plan.file import load_plan
from autotune.plan.typed import DIRECT, ROUTES, Plan
from autotune.sbp.sbp import P, check_placement, is_split


def _runtime(order: str):
    """A schedule of the step model (``autotune.reshard.pipeline.SCHEDULES[order]``) on the library's schedule
    runtime: each stage's order of forwards and backwards as the step model simulates it, its communication
    added by the runtime."""
    def make(stage, n_microbatches: int, loss_fn=None):
        from torch.distributed.pipelining.schedules import _Action, _ComputationType, _PipelineScheduleRuntime

        from autotune.reshard.pipeline import SCHEDULES as ORDERS
        schedule = _PipelineScheduleRuntime([stage], n_microbatches, loss_fn=loss_fn)
        kinds = {"F": _ComputationType.FORWARD, "B": _ComputationType.FULL_BACKWARD}
        orders = ORDERS[order]().orders(stage.num_stages, n_microbatches)
        schedule._prepare_schedule_with_comms({s: [_Action(s, kinds[k], m) for k, m in order]
                                              for s, order in enumerate(orders)})
        return schedule
    return make


def _library(name: str):
    def make(stage, n_microbatches: int, loss_fn=None):
        import torch.distributed.pipelining as pipelining
        return getattr(pipelining, name)(stage, n_microbatches, loss_fn=loss_fn)
    return make


def _one_f_one_b(stage, n_microbatches: int, loss_fn=None):
    """1F1B: the library's ``Schedule1F1B`` where every stage has a micro-batch in its steady state (m >= p);
    with fewer, Megatron's order (stage i runs min(p - i, m) forwards before its first backward), which the
    library's class refuses, on its runtime."""
    if n_microbatches >= stage.num_stages:
        return _library("Schedule1F1B")(stage, n_microbatches, loss_fn)
    return _runtime("1f1b")(stage, n_microbatches, loss_fn)


# the plan's schedule: what builds it on this rank's PipelineStage
SCHEDULES = {"1f1b": _one_f_one_b, "gpipe": _library("ScheduleGPipe"), "eager-1f1b": _runtime("eager_1f1b")}


def load_pipelined(source, origin: str = "the plan") -> Plan:
    """The one loader of a pipelined plan (a Plan, plan.json whose best is pipelined or its path), checked:
    its schedule, a split that gives every stage blocks and matches its stages' plans, the embedding on the first
    stage and the logits on the last, stages that make the cluster, boundaries each stage can send."""
    plan = load_plan(source)
    if not plan.stages:
        raise UserError(f"{origin} {plan.strategy!r} has no pipeline stages: place it with autotune.apply, or search "
                        f"with python -m autotune --pipeline N")
    pl, sub, p, fix = plan.pipeline, plan.submesh, len(plan.stages), "re-run python -m autotune --pipeline N"
    if pl.schedule not in SCHEDULES:
        raise UserError(f"{origin}: schedule {pl.schedule!r} is not one of {', '.join(SCHEDULES)}: {fix}")
    if p < 2 or any(k < 1 for k in pl.split):
        raise UserError(f"{origin}: {p} stages with the split {list(pl.split)}: a pipeline needs at least 2 stages, "
                        f"each with at least one block; {fix}")
    if sub.devices * p != plan.cluster.devices or any(s.plan.cluster != sub for s in plan.stages):
        raise UserError(f"{origin}: {p} stages of {sub} do not make the cluster {plan.cluster}: {fix}")
    if plan.model.get("layers") is not None and sum(pl.split) != plan.model.get("layers"):
        raise UserError(f"{origin}: the split {list(pl.split)} gives {sum(pl.split)} blocks but the model has "
                        f"{plan.model.get('layers')}: re-run the search for this model")
    for i, stage in enumerate(plan.stages):
        names = {lay.name for lay in stage.plan.layers}
        if (i == 0) != ("embedding" in names) or (i == p - 1) != ("logits" in names):
            raise UserError(f"{origin}: stage {i}'s plan {'lacks' if (i == 0) == ('embedding' not in names) else 'has'}"
                            f" the embedding or logits: the first stage holds the embedding, the last the logits; "
                            f"{fix}")
        counts = {lay.count for lay in stage.plan.layers if lay.name not in HEAD + TAIL and lay.kind != "residual"}
        if counts != {pl.split[i]}:
            raise UserError(f"{origin}: stage {i}'s plan repeats its block layers {sorted(counts)} times but the split "
                            f"{list(pl.split)} gives it {pl.split[i]} blocks: {fix} (a split must match its stages' "
                            f"plans)")
        if i < p - 1:
            sent(plan, i, origin)
    _check_sequences(plan, origin)
    return plan


def block_range(plan: Plan, i: int) -> tuple[int, int]:
    """The blocks of the model stage ``i`` runs, [lo, hi)."""
    lo = sum(plan.pipeline.split[:i])
    return lo, lo + plan.pipeline.split[i]


def _check_sequences(plan: Plan, origin: str) -> None:
    """The stream's token split must give each device whole sequences of a micro-batch (the modules' batch
    dimension is the plan's tokens)."""
    mb = plan.model.get("micro_batch")
    for i, stage in enumerate(plan.stages):
        typed = stage.plan
        for fine in _stream(typed) + ((sent(plan, i, origin),) if i < len(plan.stages) - 1 else ()):
            parts = 1
            for p, n in zip(fine or (), typed.mesh.sizes):
                parts *= n if p == "S0" else 1
            if mb is not None and mb % parts:
                raise UserError(f"{origin}: stage {i} splits the tokens of a micro-batch of {mb} sequences over "
                                f"{parts} devices: apply splits whole sequences; search with a larger micro-batch "
                                f"(--batch) or fewer micro-batches")


def sent(plan: Plan, i: int, origin: str = "the plan") -> tuple[str, ...] | None:
    """The placement the stream leaves stage ``i`` in, by its boundary's route (``boundary_route``,
    ``boundary_sent``; none recorded: direct): the stage's stream placement, or for ``scatter`` the same with
    each partial-sum axis split."""
    stage = plan.stages[i]
    out = _stream(stage.plan)[1]
    route = stage.boundary_route or DIRECT
    if route not in ROUTES:
        raise UserError(f"{origin}: stage {i}'s boundary route {route!r} is not one of {', '.join(ROUTES)}: re-run "
                        f"the search")
    if route == DIRECT or out is None:
        return out
    got = stage.boundary_sent
    try:
        placed = tuple(check_placement(str(x)) for x in got)
    except (TypeError, UserError):
        placed = None
    if placed is None or P not in out or len(placed) != len(out) or any(
            (s != o) if o != P else not is_split(s) for o, s in zip(out, placed)):
        raise UserError(f"{origin}: stage {i}'s boundary_sent {got!r} is not its stream's placement {list(out)} with "
                        f"each partial-sum axis split, as the scatter route sends it: re-run the search")
    return placed


def _stream(plan: Plan) -> tuple[tuple | None, tuple | None]:
    """(in, out): the placements the stream enters and leaves a stage in: the residual's input and output,
    else the first block layer's input and the last block layer's output."""
    residual = next((lay for lay in plan.layers if lay.kind == "residual"), None)
    if residual is not None:
        return residual.input, residual.output
    block = [lay for lay in plan.layers if lay.name not in HEAD + TAIL]
    return block[0].input, block[-1].output
