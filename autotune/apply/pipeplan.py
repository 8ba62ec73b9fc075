"""A pipelined plan as apply runs it: ``load_pipelined`` (the one loader and its checks: per stage its plan on
its submesh, its blocks, the placement the stream crosses each boundary in, ``sent``), the chunks a rank runs
(``Plan.chunk_ranges``) and the schedules (``SCHEDULES``, for any number of micro-batches m): 1f1b -> ``Schedule1F1B``
where m >= p, with fewer micro-batches Megatron's order (stage i runs min(p - i, m) forwards before its first
backward); gpipe -> ``ScheduleGPipe``; eager-1f1b (stage i runs 2(p - i) - 1 forwards before its first
backward); interleaved-1f1b -> ``ScheduleInterleaved1F1B`` over the rank's v chunks (Megatron-LM's virtual
pipeline stages; for m a multiple of p its order is the step model's, ``interleaved_orders``: a test checks).
The orders the library lacks run as the step model simulates them (``autotune.reshard.pipeline.SCHEDULES``) on
the library's schedule runtime (``_PipelineScheduleRuntime`` fed a compute-only action list, a private API
torchtitan's CSV schedules use too). Each schedule takes the rank's stages (one but under interleaved 1F1B)."""
from __future__ import annotations

from dataclasses import replace

from calibrate.errors import UserError

from autotune.apply.layers import HEAD, TAIL
from autotune.plan.file import load_plan
from autotune.plan.layouts import (TP_WEIGHTS, FullyShard, LocalPlan, context_axes, fsdp_dims, fully_shard_layout,
                                   local_stream, local_twin, tp_layout, twin_path)
from autotune.plan.typed import DIRECT, ROUTES, ApplyPath, ModelSpec, Plan, TypedPlan
from autotune.sbp.sbp import P, check_placement, is_split


def _runtime(order: str):
    """A schedule of the step model (``autotune.reshard.pipeline.SCHEDULES[order]``) on the library's schedule
    runtime: each stage's order of forwards and backwards as the step model simulates it, its communication
    added by the runtime."""
    def make(stages: list, n_microbatches: int, loss_fn=None):
        from torch.distributed.pipelining.schedules import _Action, _ComputationType, _PipelineScheduleRuntime

        from autotune.reshard.pipeline import SCHEDULES as ORDERS
        schedule = _PipelineScheduleRuntime(stages, n_microbatches, loss_fn=loss_fn)
        kinds = {"F": _ComputationType.FORWARD, "B": _ComputationType.FULL_BACKWARD}
        orders = ORDERS[order]().orders(stages[0].num_stages, n_microbatches)
        schedule._prepare_schedule_with_comms({s: [_Action(s, kinds[k], m) for k, m in order]
                                              for s, order in enumerate(orders)})
        return schedule
    return make


def _library(name: str, multi: bool = False):
    """The library's schedule ``name``: of the rank's one stage, or (``multi``) of all its stages."""
    def make(stages: list, n_microbatches: int, loss_fn=None):
        import torch.distributed.pipelining as pipelining
        return getattr(pipelining, name)(stages if multi else stages[0], n_microbatches, loss_fn=loss_fn)
    return make


def _one_f_one_b(stages: list, n_microbatches: int, loss_fn=None):
    """1F1B: the library's ``Schedule1F1B`` where every stage has a micro-batch in its steady state (m >= p);
    with fewer, Megatron's order (stage i runs min(p - i, m) forwards before its first backward), which the
    library's class refuses, on its runtime."""
    if n_microbatches >= stages[0].num_stages:
        return _library("Schedule1F1B")(stages, n_microbatches, loss_fn)
    return _runtime("1f1b")(stages, n_microbatches, loss_fn)


INTERLEAVED_PLAN = "interleaved-1f1b"  # as a plan names it (the simulator's: autotune.reshard.pipeline.INTERLEAVED)
# the plan's schedule: what builds it on this rank's PipelineStages
SCHEDULES = {"1f1b": _one_f_one_b, "gpipe": _library("ScheduleGPipe"), "eager-1f1b": _runtime("eager_1f1b"),
             INTERLEAVED_PLAN: _library("ScheduleInterleaved1F1B", multi=True)}


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
    v = {st.virtual_stages for st in plan.stages}
    v = v.pop() if len(v) == 1 else v
    if type(v) is not int or v < 1 or (v > 1) != (pl.schedule == INTERLEAVED_PLAN):
        raise UserError(f"{origin}: {v} chunks a rank under {pl.schedule}: interleaved 1F1B runs 2 or more on every "
                        f"rank, the other schedules 1; {fix}")
    if p < 2 or any(k < v for k in pl.split):
        raise UserError(f"{origin}: {p} stages with the split {list(pl.split)}: a pipeline needs at least 2 stages, "
                        f"each with at least one block a chunk ({v} chunks a rank); {fix}")
    for i, st in enumerate(plan.stages):
        zero = st.zero_stage
        if zero not in (0, 1, 2) or type(zero) is not int or zero and st.plan.sharding_mode != "none":
            raise UserError(f"{origin}: stage {i}'s ZeRO stage {zero!r} with sharding {st.plan.sharding_mode!r}: ZeRO "
                            f"is 0, 1 or 2 on a plan without FSDP (FSDP shards everything already); {fix}")
    if v > 1 and plan.micro_batches % p:
        raise UserError(f"{origin}: interleaved 1F1B runs micro-batches in groups of the {p} stages, not "
                        f"{plan.micro_batches}: {fix} with a batch of a multiple of {p} micro-batches")
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


def sent_at(plan: Plan, s: int) -> tuple | None:
    """The placement the stream leaves virtual stage ``s`` in: its rank's boundary's (``sent``), or from the
    last rank back to the first (interleaved 1F1B's next chunk) the last stage's stream as it is."""
    p = len(plan.stages)
    return sent(plan, s % p) if s % p < p - 1 else _stream(plan.stages[-1].plan)[1]


def _check_sequences(plan: Plan, origin: str) -> None:
    """The stream's token split must give each device whole sequences of a micro-batch (the modules' batch
    dimension is the plan's tokens), but over the context axes (``context_axes``: each rank its chunks of them)."""
    mb = plan.model.get("micro_batch")
    for i, stage in enumerate(plan.stages):
        typed = stage.plan
        for fine in _stream(typed) + ((sent(plan, i, origin),) if i < len(plan.stages) - 1 else ()):
            parts = 1
            for a, (p, n) in enumerate(zip(fine or (), typed.mesh.sizes)):
                parts *= n if p == "S0" and a not in context_axes(typed) else 1
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


# --- each stage on apply's paths (read from the plan alone, alike on every rank) -------------------------------
def local_plan(pp: Plan, stage: int) -> LocalPlan | None:
    """How stage ``stage`` is placed on apply's local path, from the plan alone (so alike on every rank, which
    must all make every local stage's mesh): its plan where it is data parallel or fully_shard-shaped
    (``data_parallel_plan``, ``fully_shard_layout``: apply's predicates), or its ``local_twin`` (an embedding
    by features, logits by vocabulary), and each of its boundaries (those of each of its chunks under
    interleaved 1F1B) carries each rank's local piece (``local_stream``); None: the DTensor path."""
    typed = pp.stages[stage].plan
    if typed.world == 1:
        return None
    local = local_twin(typed)
    if local is None:
        return None
    want, total = local_stream(local.plan), len(pp.stages) * pp.virtual_stages
    mine = range(stage, total, len(pp.stages))
    ends = [sent_at(pp, s - 1) for s in mine if s > 0] + [sent_at(pp, s) for s in mine if s < total - 1]
    if any(end is None or tuple(end) != want for end in ends):
        return None
    return local


def local_dims(typed: TypedPlan, zero: int = 0) -> dict[str, int]:
    """The mesh dimensions of a local-path stage plan: fully_shard's (``fsdp_dims``), the tensor path's
    (``TensorParallel.dims``) or DDP's ("dp"); under ZeRO (``zero``) fully_shard's "shard" over the data ranks
    where DDP's or the tensor path's replicate dimension was."""
    layout = fully_shard_layout(typed)
    if layout is not None:
        return fsdp_dims(typed, layout)
    tensor = tp_layout(typed)
    dims = tensor.dims(typed) if tensor is not None else {"dp": typed.world}
    if not zero:
        return dims
    tp = dims.get("tp", 1)
    return {"shard": typed.world // tp, **({"tp": tp} if tensor is not None else {})}


def stage_layout(typed: TypedPlan, path: str):
    """The layout ``fully_shard_model`` places a stage plan of ``path`` by: the tensor path's, fully_shard's, or
    for a data-parallel plan under ZeRO every axis a data axis, sharded."""
    if path == ApplyPath.TENSOR:
        return tp_layout(typed)
    axes = tuple(range(len(typed.mesh.sizes)))
    return fully_shard_layout(typed) or FullyShard(axes, axes, None)


def sequence_stream(pp: Plan, stage: int) -> bool:
    """Whether stage ``stage`` on apply's local path holds the stream split by the sequence on its tensor axis
    (Megatron's sequence parallelism: a DTensor of sequence shards inside the stage, its local shard crossing
    the boundaries)."""
    local = local_plan(pp, stage)
    layout = None if local is None else fully_shard_layout(local.plan) or tp_layout(local.plan)
    return bool(layout is not None and layout.sequence_parallel)


def zero_path(path: str, zero: int) -> str:
    """A data-parallel stage under ZeRO runs on fully_shard (its optimizer states and gradients sharded)."""
    return ApplyPath.FULLY_SHARD.value if zero and path == ApplyPath.DDP else path


def stage_paths(pp: Plan) -> list[str]:
    """Per stage, the path its plan asks for (``apply_pipeline`` may still place a stage by DTensor where its
    modules cannot take the tensor-parallel styles, the column embedding or the vocabulary-parallel logits, or
    a ``loss_fn`` is given for vocabulary-parallel logits: ``Pipeline.paths`` says what ran): "fully_shard",
    "tensor", "ddp", "dtensor", or "none" for a stage of one device."""
    out = []
    for i, stage in enumerate(pp.stages):
        out.append(ApplyPath.NONE.value if stage.plan.world == 1 else
                   zero_path(twin_path(local_plan(pp, i)), stage.zero_stage))
    return out


LOCAL = (ApplyPath.FULLY_SHARD.value, ApplyPath.TENSOR.value, ApplyPath.DDP.value)  # apply's local paths


def vocabulary_columns(typed: TypedPlan, tp: int | None) -> bool:
    """Whether the tensor-parallel axis ``tp`` splits ``typed``'s logits by vocabulary: their style there is
    ``ColwiseParallel`` (``TP_WEIGHTS``, as ``autotune.apply.tensor`` places them)."""
    logits = typed.layer("logits")
    return tp is not None and logits is not None and \
        TP_WEIGHTS["logits"].get(logits.weight("weight").placements[tp]) == "colwise"


def chunk_plan(typed: TypedPlan, pp: Plan, s: int) -> TypedPlan:
    """Stage plan ``typed`` as virtual stage ``s`` runs it: its chunk's blocks, the embedding in the first
    virtual stage alone and the logits in the last, and of the rank's first ``recompute_blocks`` (Megatron-LM's
    block recomputation) those in this chunk (the rank's blocks counted in chunk order)."""
    p, ranges = len(pp.stages), pp.chunk_ranges()
    lo, hi = ranges[s]
    if len(ranges) == p:
        return typed
    layers = tuple(lay for lay in typed.layers
                   if (lay.name not in HEAD or s == 0) and (lay.name not in TAIL or s == len(ranges) - 1))
    rerun, how = typed.recompute_blocks, typed.recompute
    if rerun:
        before = sum(b - a for a, b in ranges[s % p:s:p])  # the rank's blocks in its earlier chunks
        rerun = min(max(rerun - before, 0), hi - lo)
        how, rerun = ("none", 0) if rerun == 0 else (how, 0 if rerun == hi - lo else rerun)
    return replace(typed, model=ModelSpec(typed.model.kind, dict(typed.model.config, layers=hi - lo)), recompute=how,
                   recompute_blocks=rerun, layers=layers, edges=())
