"""A pipelined plan as apply runs it: ``load_pipelined`` (the one loader: per stage its typed plan on its
submesh, its blocks, the placement the stream crosses each boundary in) and the schedules (``SCHEDULES``, for any
number of micro-batches m): 1f1b -> ``Schedule1F1B`` where m >= p, with fewer micro-batches Megatron's order
(stage i runs min(p - i, m) forwards before its first backward); gpipe -> ``ScheduleGPipe``; eager-1f1b (stage i
runs 2(p - i) - 1 forwards before its first backward). The orders the library lacks run as the step model
simulates them (``autotune.reshard.pipeline.SCHEDULES``) on the library's schedule runtime
(``_PipelineScheduleRuntime`` fed a compute-only action list, a private API torchtitan's CSV schedules use too)."""
from __future__ import annotations

from dataclasses import dataclass, replace

from calibrate.errors import UserError
from calibrate.records import kind_of

from autotune.apply.layers import HEAD, TAIL
from autotune.plan.search import convert
from autotune.plan.typed import DIRECT, ROUTES, ModelSpec, TypedPlan, read_source
from autotune.sbp.mesh import Cluster
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
SEARCH_KIND = "commtune.sbp-plan"


# --- the pipelined plan -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class PipelinedPlan:
    """What a pipelined plan tells the executor: per stage its typed plan on its submesh and its blocks."""

    model: dict                      # the model's config with its kind
    cluster: Cluster
    submesh: Cluster
    schedule: str
    micro_batches: int
    split: tuple[int, ...]           # blocks per stage
    stages: tuple[TypedPlan, ...]
    sent: tuple[tuple[str, ...], ...]  # per boundary, the placement the stream crosses in (its route's)
    strategy: str = ""

    @property
    def world(self) -> int:
        return self.cluster.devices

    def block_range(self, i: int) -> tuple[int, int]:
        lo = sum(self.split[:i])
        return lo, lo + self.split[i]


def load_pipelined(source, origin: str | None = None) -> PipelinedPlan:
    """The one loader: a PipelinedPlan, plan.json of ``python -m autotune`` whose best is pipelined (a path
    or its dict), or one pipelined plan dict (``plan["best"]`` or a baseline with ``stages``)."""
    if isinstance(source, PipelinedPlan):
        return source
    source, origin = read_source(source, origin, "give a plan written by python -m autotune --pipeline N --out DIR")
    if not isinstance(source, dict):
        raise UserError(f"{origin}: a {type(source).__name__} is not a pipelined plan: give plan.json of "
                        f"python -m autotune --pipeline N, or its best plan")
    if kind_of(source) == SEARCH_KIND and "best" in source:
        from autotune.sbp.plan import PlanFile
        source = PlanFile.from_dict(source, origin).best
    if "stages" not in source or "pipeline" not in source:
        raise UserError(f"{origin}: the plan {source.get('strategy', '')!r} has no pipeline stages: place it with "
                        f"autotune.apply, or search with python -m autotune --pipeline N")
    pl, model = source["pipeline"], dict(source.get("model") or {})
    try:
        cluster = Cluster(int(source["cluster"]["nodes"]), int(source["cluster"]["gpus_per_node"]))
        sub = Cluster(int(pl["submesh"]["nodes"]), int(pl["submesh"]["gpus_per_node"]))
        schedule, m, split = str(pl["schedule"]), int(pl["micro_batches"]), tuple(int(k) for k in pl["split"])
        entries = [s["plan"] for s in source["stages"]]
    except (KeyError, TypeError, ValueError):
        raise UserError(f"{origin}: the pipeline section lacks schedule, micro_batches, split, submesh or the "
                        f"stages' plans: re-run python -m autotune --pipeline N") from None
    p = len(entries)
    if schedule not in SCHEDULES:
        raise UserError(f"{origin}: schedule {schedule!r} is not one of {', '.join(SCHEDULES)}: re-run the search")
    if p < 2 or len(split) != p or any(k < 1 for k in split):
        raise UserError(f"{origin}: {p} stages with the split {list(split)}: a pipeline needs at least 2 stages, "
                        f"each with at least one block; re-run the search")
    if sub.devices * p != cluster.devices:
        raise UserError(f"{origin}: {p} stages of {sub} do not make the cluster {cluster}: re-run the search")
    if model.get("layers") is not None and sum(split) != model["layers"]:
        raise UserError(f"{origin}: the split {list(split)} gives {sum(split)} blocks but the model has "
                        f"{model['layers']}: re-run the search for this model")
    stages = []
    for i, e in enumerate(entries):
        typed = convert(e, (), f"{origin}: stage {i}", stage=True)
        if typed.cluster != sub:
            raise UserError(f"{origin}: stage {i}'s plan is for {typed.cluster}, not the submesh {sub}: re-run "
                            f"the search")
        names = {lay.name for lay in typed.layers}
        if (i == 0) != ("embedding" in names) or (i == p - 1) != ("logits" in names):
            raise UserError(f"{origin}: stage {i}'s plan {'lacks' if (i == 0) == ('embedding' not in names) else 'has'}"
                            f" the embedding or logits: the first stage holds the embedding, the last the logits; "
                            f"re-run the search")
        counts = {lay.count for lay in typed.layers if lay.name not in HEAD + TAIL and lay.kind != "residual"}
        if counts != {split[i]}:
            raise UserError(f"{origin}: stage {i}'s plan repeats its block layers {sorted(counts)} times but the split "
                            f"{list(split)} gives it {split[i]} blocks: re-run the search (a split must match its "
                            f"stages' plans)")
        stages.append(replace(typed, model=ModelSpec(typed.model.kind, dict(typed.model.config, layers=split[i]))))
    sent = tuple(_sent(source["stages"][i], stages[i], i, origin) for i in range(p - 1))
    out = PipelinedPlan(model, cluster, sub, schedule, m, split, tuple(stages), sent, str(source.get("strategy", "")))
    _check_sequences(out, origin)
    return out


def _check_sequences(pp: PipelinedPlan, origin: str) -> None:
    """The stream's token split must give each device whole sequences of a micro-batch (the modules' batch
    dimension is the plan's tokens)."""
    mb = pp.model.get("micro_batch")
    for i, typed in enumerate(pp.stages):
        for fine in _stream(typed) + pp.sent[i:i + 1]:
            parts = 1
            for p, n in zip(fine or (), typed.mesh.sizes):
                parts *= n if p == "S0" else 1
            if mb is not None and mb % parts:
                raise UserError(f"{origin}: stage {i} splits the tokens of a micro-batch of {mb} sequences over "
                                f"{parts} devices: apply splits whole sequences; search with a larger micro-batch "
                                f"(--batch) or fewer micro-batches")


def _sent(entry: dict, typed: TypedPlan, i: int, origin: str) -> tuple[str, ...] | None:
    """The placement the stream leaves stage ``i`` in, by its boundary's route (``boundary_route``,
    ``boundary_sent``; none recorded: direct): the stage's stream placement, or for ``scatter`` the same with
    each partial-sum axis split."""
    out = _stream(typed)[1]
    route = entry.get("boundary_route") or DIRECT
    if route not in ROUTES:
        raise UserError(f"{origin}: stage {i}'s boundary route {route!r} is not one of {', '.join(ROUTES)}: re-run "
                        f"the search")
    if route == DIRECT or out is None:
        return out
    got = entry.get("boundary_sent")
    try:
        sent = tuple(check_placement(str(x)) for x in got)
    except (TypeError, UserError):
        sent = None
    if sent is None or P not in out or len(sent) != len(out) or any(
            (s != o) if o != P else not is_split(s) for o, s in zip(out, sent)):
        raise UserError(f"{origin}: stage {i}'s boundary_sent {got!r} is not its stream's placement {list(out)} with "
                        f"each partial-sum axis split, as the scatter route sends it: re-run the search")
    return sent


def _stream(plan: TypedPlan) -> tuple[tuple | None, tuple | None]:
    """(in, out): the placements the stream enters and leaves a stage in: the residual's input and output,
    else the first block layer's input and the last block layer's output."""
    residual = next((lay for lay in plan.layers if lay.kind == "residual"), None)
    if residual is not None:
        return residual.input, residual.output
    block = [lay for lay in plan.layers if lay.name not in HEAD + TAIL]
    return block[0].input, block[-1].output
