"""Run a pipelined plan (``plan["best"]`` with ``stages``, ``autotune.pipeline.record``) on a user's nn.Module:

    import autotune
    pipe = autotune.apply_pipeline("out/plan.json", model)   # after init_process_group, every rank alike
    opt = torch.optim.AdamW(pipe.module.parameters())         # this rank's stage
    for ids, targets in loader:                               # the whole batch, the same on every rank
        loss = pipe.step(ids, targets)                        # the schedule over the plan's micro-batches
        opt.step(); opt.zero_grad()

``apply_pipeline(plan, model, mapping=None, loss_fn=None)``:

- The ranks: stage i runs on the i-th run of ``submesh.devices`` ranks (``autotune.pipeline.boundary``'s
  layout); one DeviceMesh (stages, *the stage's fine axes) over the world, its "pp" dimension the
  pipeline's process groups (rank j of every stage), the rest this stage's submesh.
- The cut (``CUTS``, recognised like ``autotune.plan.place.FAMILIES``): the project's reference modules
  (``models.modules``) and Hugging Face Llama-family models. The first stage holds the embedding (and a
  learned position table), each stage the blocks the plan's split gives it, the last the final norm and
  the logits; the stage's module names keep the model's, its blocks numbered from 0.
- Devices: the stage's module (its part of the model) is moved to this rank's device; nothing else is. Build
  the model on the CPU (as ``python -m autotune execute`` does) so that the other stages' weights never reach
  this rank's GPU: a model built on the GPU keeps them all there while the caller holds it.
- Each stage's module is placed on its submesh with its stage's plan (``convert(...,
  stage=True)``) by one of ``autotune.apply``'s paths (``autotune.plan.place``; ``stage_paths`` says which a
  plan asks for, ``Pipeline.paths`` which ran, ``python -m autotune execute`` records them):
  - "ddp" / "fully_shard", apply's local path, for a stage plan that is pure data parallelism
    (``data_parallel_plan``) or FSDP/HSDP/TP + FSDP-shaped (``fully_shard_layout``) and whose boundaries
    carry the stream as each rank's local piece (the plan's sent placement at each of its boundaries is
    ``local_stream``: split by the batch over the data axes, whole on a tensor-parallel axis);
    ``DistributedDataParallel`` over the stage's ranks, or torchtitan's ``parallelize_module`` +
    ``fully_shard`` on the stage's submesh; each rank runs its piece of every micro-batch (the first stage
    cuts the ids, the last the targets: ``DataSplit``), its loss that piece's, gradients averaged over the
    stage's data ranks; the boundary is the P2P of each rank's local piece to the rank at the same
    coordinates of the next stage, nothing redistributed. Also such a stage (DDP, or fully_shard without
    tensor parallelism) once layers it computes itself are read as data parallel (``local_twin``,
    ``LocalPlan``; the search's 2 x 2 plans of a 1.1 B Llama have both, on DDP or FSDP blocks):
    - a first stage's embedding split by features (``_column_lookup``: the table a DTensor of columns, Shard(1),
      that DDP / fully_shard leave alone; each device looks the whole micro-batch's ids up in its columns and
      hands its piece on by an all-to-all, the S1 -> S0 boxing the plan prices; the table's gradient, summed
      over the pieces' losses, scaled to their average);
    - a last stage's logits split by vocabulary with a vocabulary-parallel loss (``_vocab_logits``,
      ``_vocab_loss``; one data dimension: not HSDP): the weight's rows a DTensor, Shard(0), that DDP /
      fully_shard leave alone; per micro-batch each rank's piece of the stream all-gathered over the stage's
      data ranks to the whole micro-batch (the plan's S0 -> B before the logits), the local matmul against the
      rank's rows, Megatron-LM's vocabulary-parallel cross entropy (an all-reduce of the tokens' maxima, one of
      their sums of exponentials with the target logits: the plan prices these as one all-reduce of 2 fp32 a
      token) giving the whole micro-batch's mean loss on every rank (targets -100 left out, as torch's
      cross_entropy), and in the backward the stream's gradient reduce-scattered back to the pieces (the plan's
      reduce-scatter) and scaled by the number of pieces (the blocks' gradients, averaged over the data ranks,
      are of each piece's loss); the rows' gradient is whole for them, nothing synchronised.
    Where the modules cannot take these (a tied embedding and head, as the reference GPT's, whose splits differ;
    an embedding of several modules, e.g. learned positions; a head with a bias or not an ``nn.Linear``), or a
    ``loss_fn`` is given for vocabulary-parallel logits (the user's loss takes whole logits), the stage keeps
    the DTensor path. The communication is the step model's
    (``autotune.pipeline.stage``): DDP all-reduces once a step (``PipelineStage`` runs a DDP module under
    ``no_sync`` until the last micro-batch: ``sync_steps`` once a step); fully_shard runs torchtitan's PP + FSDP
    step: the ``FSDPModule`` is handed to ``PipelineStage``, which turns gradient sync and resharding after backward
    off until the last micro-batch. Per step and unit that holds parameters: a block's unit (resharded after each
    forward) is all-gathered by the stage's first forward and by every pass that follows a forward (the forward
    after a forward, the backward after a forward), m + 1 times for m micro-batches whatever the order (every
    forward but the last is followed by a pass, the stage ends on a backward); the root unit (the layers outside the
    blocks: fully_shard keeps it gathered from its forward) once; each unit's gradients accumulated unsharded and
    reduce-scattered once, in the last backward. The step model prices this (``autotune.pipeline.stage``: the
    gradients held unsharded, a block's weights gathered from its backward to the next forward; the tests count the
    collectives of a step, those of the vocabulary-parallel logits and loss too).
  - "dtensor": every other stage plan, as ``apply`` places a model by DTensor (parameters, per-layer hooks,
    recomputation; its stream at the boundaries below); next to a local-path stage, whose gradients are of
    each piece's loss (the number of pieces times those of the whole micro-batch's loss that the DTensor
    path computes), the gradient crossing the boundary is rescaled on the local side.
  - "none": a stage of one device, placed as it is.
- The stage boundary: the residual stream (without one, the last block layer's output) leaves stage i
  as this rank's local piece in stage i's stream placement (its residual's output), by the boundary's
  route (the plan record's ``boundary_route`` and ``boundary_sent``, ``autotune.pipeline.boundary``, which
  prices the same steps): ``direct`` sends that piece as it is; ``scatter`` (a partial-sum stream, e.g. a
  row-parallel projection's output) first redistributes it by DTensor on stage i's submesh to the placement
  ``boundary_sent`` (a reduce-scatter: each P axis split, Megatron's scatter-gather of pipeline tensors), so
  smaller pieces travel. Through ``torch.distributed.pipelining``'s P2P each rank's piece goes to the rank
  of stage i + 1 at the same mesh coordinates (the library sends each rank's own tensor: whole tensors, one
  per rank pair). There it is read in the sent placement on stage i + 1's submesh (the same shape) and
  redistributed by DTensor to the stage's own stream placement (its residual's input, as the stream enters
  block 0 in ``apply``), with the backward's gradients redistributed back on both sides (on the sender the
  gradient of the reduce-scatter, an all-gather). So a boundary between equal placements moves each tile
  once between paired devices, as the resharding plan's unit tasks do; between different placements the
  change runs as collectives inside the submeshes around the P2P (an all-gather for S -> B), where the
  resharding planner prices direct transfers between the two submeshes (and into the next stage's first
  layer's input placement, which apply's hook on that layer reaches from the stream's). Records without
  the route run the direct one.
- Schedules (``SCHEDULES``), for any number of micro-batches m: 1f1b -> ``Schedule1F1B`` where m >= p;
  with fewer micro-batches than stages (the 3-D plans the search seeds with, as Megatron-LM runs them;
  the library's class refuses them) Megatron's order, stage i running min(p - i, m) forwards before its
  first backward; gpipe -> ``ScheduleGPipe``; eager-1f1b (stage i runs 2(p - i) - 1 forwards before its
  first backward, to hide the boundary) has no class in the library. The orders the library lacks run as
  the step model simulates them (``autotune.reshard.pipeline.SCHEDULES``' orders, ``_runtime``) on the
  library's schedule runtime (``_PipelineScheduleRuntime`` fed a compute-only action list, to which it
  adds the sends and receives; a private API of torch.distributed.pipelining, which torchtitan's CSV
  schedules use too).
- Tied embedding and logits (first and last stage): each holds its own copy of the weight; after the
  backward their gradients are summed between the two stages (rank j of the first with rank j of the
  last, whole gradients), as Megatron does, so both copies take the same optimizer step.
- ``step(ids, targets)`` splits the batch into the plan's micro-batches along dimension 0, runs the
  schedule (gradients of the mean loss over the micro-batches) and returns the mean loss over the whole
  batch on every rank (a local-path last stage's pieces' losses averaged over its data ranks; with
  vocabulary-parallel logits every rank's loss is already the whole micro-batch's).
- Errors (not a pipelined plan, a world other than the plan's, a split that is not the model's blocks, a
  module apply cannot cut): one ``UserError`` naming the problem and the fix, alike on every rank, before
  any weight moves.
"""
from __future__ import annotations

import fnmatch
import functools
from dataclasses import dataclass, replace

from calibrate.errors import UserError
from calibrate.records import kind_of

from autotune.plan.layouts import LocalPlan, fsdp_dims, fully_shard_layout, local_stream, local_twin, twin_path
from autotune.plan.place import (FAMILIES, HEAD, TAIL, DataSplit, Site, _act, _check_shapes, _ddp, _fully_shard,
                                 _global_shape, _handoffs, _place, _post, _pre, _recompute, _redistribute, _world,
                                 contiguous_strides, find_layers, path_of, torch)
from autotune.plan.search import convert
from autotune.plan.typed import DIRECT, ROUTES, ModelSpec, TypedPlan, read_source
from autotune.sbp.mesh import Cluster
from autotune.sbp.sbp import B, P, check_placement, is_split

import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor  # noqa: E402
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset  # noqa: E402




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


# --- cutting the module --------------------------------------------------------------------------------------
def _reshard_stream(x, mesh, src: tuple | None, dst: tuple | None):
    """The stream's local piece in ``src`` redistributed to ``dst`` on ``mesh`` (a stage's submesh): before the
    send (this stage's stream placement to its route's) and after it (the route's to the next stage's); as is
    where the submesh is one device or the placements are equal."""
    if mesh is None or src is None or dst is None or tuple(src) == tuple(dst):
        return x
    placements, _ = _act(src, x, whole=False)
    shape = _global_shape(x, placements, mesh)
    X = DTensor.from_local(x, mesh, placements, run_check=False, shape=shape, stride=contiguous_strides(shape))
    want, grad = _act(dst, X)
    return _redistribute(X, mesh, want).to_local(grad_placements=grad)


class ReferenceStage(nn.Module):
    """A stage of ``models.modules.Transformer``: its forward is the model's, cut."""

    def __init__(self, model, lo: int, hi: int, first: bool, last: bool):
        super().__init__()
        self.embedding = model.embedding if first else None
        self.positions = model.positions if first else None
        self.blocks = nn.ModuleList(list(model.blocks)[lo:hi])
        self.ln_f = model.ln_f if last else None
        self.logits = model.logits if last else None
        self.recompute = model.recompute
        self.arrive = None
        self.depart = None

    def forward(self, x):
        if self.embedding is not None:
            ids = x
            x = self.embedding(ids)
            if self.positions is not None:
                x = x + self.positions(torch.arange(ids.shape[1], device=ids.device))
        elif self.arrive is not None:
            x = self.arrive(x)
        for block in self.blocks:
            if self.recompute == "full" and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        if self.logits is not None:
            return self.logits(self.ln_f(x))
        return self.depart(x) if self.depart is not None else x


class HFStage(nn.Module):
    """A stage of a Hugging Face causal LM (Llama family): its base model with the stage's decoder layers,
    run from the embedding (first) or from ``inputs_embeds`` (later stages); the final norm and the head in
    the last."""

    def __init__(self, model, lo: int, hi: int, first: bool, last: bool):
        super().__init__()
        base = model.model
        base.layers = nn.ModuleList(list(base.layers)[lo:hi])
        if not first:
            base.embed_tokens = None
        if not last:
            base.norm = nn.Identity()
        self.model = base
        self.lm_head = model.lm_head if last else None
        self.first = first
        self.arrive = None
        self.depart = None

    def forward(self, x):
        if self.first:
            h = self.model(input_ids=x, use_cache=False).last_hidden_state
        else:
            h = self.model(inputs_embeds=self.arrive(x) if self.arrive is not None else x,
                           use_cache=False).last_hidden_state
        if self.lm_head is not None:
            return self.lm_head(h)
        return self.depart(h) if self.depart is not None else h


def _is_reference(model) -> bool:
    return type(model).__name__ == "Transformer" and type(model).__module__ == "models.modules"


def _is_hf_llama(model) -> bool:
    return FAMILIES["llama"][0](model) and hasattr(model, "model") and hasattr(model, "lm_head")


# name: (recognise, the stage module's class, the mapping of plan layers to module names)
CUTS = {
    "reference": (_is_reference, ReferenceStage, lambda m: m.plan_mapping),
    "hf-llama": (_is_hf_llama, HFStage, lambda m: FAMILIES["llama"][1]),
}


def _cut_of(model):
    for name, (match, cls, mapping) in CUTS.items():
        if match(model):
            return cls, mapping(model)
    raise UserError(f"apply_pipeline cuts the reference modules (models.modules) and Hugging Face Llama-family "
                    f"models, not a {type(model).__name__}: use one of those, or a single-stage plan with "
                    f"autotune.apply")


def _tied(model, mapping: dict) -> set[int]:
    """The ids of the parameters shared between the embedding's modules and the logits' (a tied head)."""
    names = dict(model.named_modules())

    def params(layer):
        pats = mapping.get(layer, [])
        pats = [pats] if isinstance(pats, str) else list(pats)
        return {id(p) for n, m in names.items() if n and any(fnmatch.fnmatchcase(n, pat) for pat in pats)
                for p in m.parameters()}
    return params("embedding") & params("logits")


# --- placing a stage -----------------------------------------------------------------------------------------
def _stream(plan: TypedPlan) -> tuple[tuple | None, tuple | None]:
    """(in, out): the placements the stream enters and leaves a stage in: the residual's input and output,
    else the first block layer's input and the last block layer's output."""
    residual = next((lay for lay in plan.layers if lay.kind == "residual"), None)
    if residual is not None:
        return residual.input, residual.output
    block = [lay for lay in plan.layers if lay.name not in HEAD + TAIL]
    return block[0].input, block[-1].output


def _install_stage_hooks(chain: list[Site], mesh, first: bool, last: bool, stream_in, stream_out) -> None:
    """``apply``'s hooks on a stage: the first module of a later stage takes the stream as it arrives
    (``stream_in``), the last module of an earlier stage hands on what its chain expects next (the stream's
    placement where the chain ends in a module)."""
    arrive = _handoffs(chain)
    mods = [i for i, s in enumerate(chain) if s.modules]
    if not first:
        arrive[mods[0]] = stream_in
    for i in mods:
        site = chain[i]
        if i != mods[-1]:
            leave = arrive[i + 1]
        elif last:
            leave = None
        else:
            leave = arrive[i + 1] if i + 1 < len(chain) else stream_out
        for name, module in site.modules:
            module.register_forward_pre_hook(
                functools.partial(_pre, mesh=mesh, arrive=arrive[i], want=site.layer.input, where=name),
                with_kwargs=True)
            module.register_forward_hook(functools.partial(_post, mesh=mesh, leave=leave))


def _mapping_for(plan: TypedPlan, mapping: dict) -> dict:
    names = {lay.name for lay in plan.layers}
    return {k: v for k, v in mapping.items() if k in names}


def _local_plan(pp: PipelinedPlan, stage: int) -> LocalPlan | None:
    """How stage ``stage`` is placed on apply's local path, from the plan alone (so alike on every rank, which
    must all make every local stage's mesh): its plan where it is data parallel or fully_shard-shaped
    (``data_parallel_plan``, ``fully_shard_layout``: apply's predicates), or its ``local_twin`` (an embedding
    by features, logits by vocabulary), and each of its boundaries carries each rank's local piece
    (``local_stream``); None: the DTensor path."""
    typed = pp.stages[stage]
    if typed.world == 1:
        return None
    local = local_twin(typed)
    if local is None:
        return None
    want = local_stream(local.plan)
    ends = ([pp.sent[stage - 1]] if stage > 0 else []) + ([pp.sent[stage]] if stage < len(pp.split) - 1 else [])
    if any(end is None or tuple(end) != want for end in ends):
        return None
    return local


def _local_dims(typed: TypedPlan) -> dict[str, int]:
    """The mesh dimensions of a local-path stage plan: fully_shard's (``fsdp_dims``) or DDP's ("dp")."""
    layout = fully_shard_layout(typed)
    return fsdp_dims(typed, layout) if layout is not None else {"dp": typed.world}


def _sole_module(chain: list[Site], name: str, tied_ids: set, takes):
    """The one module that plan layer ``name`` maps to where ``takes(module)`` and its weight is not tied to
    another layer's; None: the stage keeps the DTensor path."""
    site = next((s for s in chain if s.layer.name == name), None)
    if site is None or len(site.modules) != 1:
        return None
    module = site.modules[0][1]
    return module if takes(module) and id(module.weight) not in tied_ids else None


def _column_module(chain: list[Site], tied_ids: set):
    """The embedding module ``_column_lookup`` can place (one plain ``nn.Embedding``, its table not tied to the
    logits); None: the stage keeps the DTensor path."""
    return _sole_module(chain, "embedding", tied_ids,
                        lambda m: type(m) is nn.Embedding and m.max_norm is None)


def _column_lookup(ids, *, module, mesh, factor: float):
    """The embedding's lookup with its table split by columns over the stage's data mesh (a DTensor, Shard(1)):
    every device looks the whole micro-batch up in its columns, and the output goes to this rank's piece of the
    micro-batch with all features (DTensor's Shard(2) -> Shard(0): an all-to-all, the S1 -> S0 boxing the step
    model prices). Its gradient, summed over the pieces' losses, is scaled by ``factor`` (1 / pieces) to the
    average fully_shard takes for the others."""
    out = _scale_grad(nn.functional.embedding(ids, module.weight.to_local(), module.padding_idx), factor=factor)
    placements = [Shard(out.dim() - 1)] * mesh.ndim
    shape = _global_shape(out, placements, mesh)
    x = DTensor.from_local(out, mesh, placements, run_check=False, shape=shape, stride=contiguous_strides(shape))
    return x.redistribute(mesh, [Shard(0)] * mesh.ndim).to_local()


def _vocab_module(chain: list[Site], tied_ids: set):
    """The logits module ``_vocab_logits`` can place (one plain ``nn.Linear`` without bias, its weight not tied
    to the embedding: a tied head whose split differs from the embedding's, as the reference GPT's, keeps the
    DTensor path); None: the stage keeps the DTensor path."""
    return _sole_module(chain, "logits", tied_ids, lambda m: type(m) is nn.Linear and m.bias is None)


class _GatherStream(torch.autograd.Function):
    """The stream's pieces (split by the batch over ``group``, in its rank order) gathered whole on every rank
    (all-gather, S0 -> B); the backward reduce-scatters the gradient (``_reduce_scatter``): every rank's
    vocabulary rows contribute to the gradient of every piece."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = x.new_empty((dist.get_world_size(group) * x.shape[0], *x.shape[1:]))
        dist.all_gather_into_tensor(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, g):
        return _reduce_scatter(g, ctx.group), None


def _reduce_scatter(g, group):
    """``g`` (whole on every rank of ``group``) summed over the group, this rank's piece of dimension 0 kept."""
    out = g.new_empty((g.shape[0] // dist.get_world_size(group), *g.shape[1:]))
    dist.reduce_scatter_tensor(out, g.contiguous(), group=group)
    return out


def _vocab_logits(x, *, module, group, factor: float):
    """The logits of the whole micro-batch in this rank's vocabulary rows (``module.weight`` a DTensor of rows,
    Shard(0), over the stage's data mesh): this rank's piece of the stream gathered over ``group`` (the S0 -> B
    all-gather the plan prices before the logits), times the local rows. Backward: the stream's gradient
    reduce-scattered back to the pieces (the plan's reduce-scatter) and scaled by ``factor`` (the number of
    pieces): the loss is the whole micro-batch's, the blocks' gradients are averaged over the data ranks (DDP,
    fully_shard) as gradients of each piece's own loss, ``factor`` times those of the whole micro-batch's."""
    return nn.functional.linear(_GatherStream.apply(_scale_grad(x, factor=factor), group), module.weight.to_local())


IGNORE_INDEX = -100  # torch's cross_entropy default: targets left out of the mean


class _VocabCrossEntropy(torch.autograd.Function):
    """Cross entropy of logits split by vocabulary over ``group`` (each rank its columns ``offset`` ..., of every
    token), as Megatron-LM's vocabulary-parallel cross entropy: the tokens' maxima all-reduced (MAX), then their
    sums of exponentials and target logits in one all-reduce (SUM); the mean over the targets that are not
    ``IGNORE_INDEX``, on every rank. Backward: local (softmax minus the target's one-hot in this rank's columns),
    no communication. Half-precision logits are computed in float32, their loss a float32 (as torch's
    cross_entropy under autocast)."""

    @staticmethod
    def forward(ctx, logits, targets, group, offset: int):
        x = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
        top = x.detach().amax(-1)
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        local = targets - offset
        mine = (local >= 0) & (local < x.shape[-1])
        idx = local.masked_fill(~mine, 0)
        soft = (x.detach() - top.unsqueeze(-1)).exp_()
        picked = (x.detach().gather(-1, idx.unsqueeze(-1)).squeeze(-1) - top).masked_fill(~mine, 0)
        stats = torch.stack([soft.sum(-1), picked], -1)
        dist.all_reduce(stats, group=group)
        valid = targets != IGNORE_INDEX
        count = valid.sum()
        loss = (stats[:, 0].log() - stats[:, 1]).masked_fill(~valid, 0).sum() / count
        soft /= stats[:, :1]
        ctx.save_for_backward(soft, idx, mine, valid, count)
        ctx.dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, g):
        soft, idx, mine, valid, count = ctx.saved_tensors
        grad = soft.scatter_add_(-1, idx.unsqueeze(-1), -mine.unsqueeze(-1).to(soft.dtype))  # in place: once
        grad *= (valid.to(soft.dtype) * (g / count)).unsqueeze(-1)
        return grad.to(ctx.dtype), None, None, None


def _vocab_loss(logits, targets, *, group, offset: int):
    """The whole micro-batch's mean cross entropy from this rank's vocabulary columns of its logits
    (``_VocabCrossEntropy``), the same on every rank of the stage."""
    return _VocabCrossEntropy.apply(logits.flatten(0, -2), targets.flatten(), group, offset)


def stage_paths(pp: PipelinedPlan) -> list[str]:
    """Per stage, the path its plan asks for (``apply_pipeline`` may still place a stage by DTensor where its
    modules cannot take the tensor-parallel styles, the column embedding or the vocabulary-parallel logits, or
    a ``loss_fn`` is given for vocabulary-parallel logits: ``Pipeline.paths`` says what ran): "fully_shard",
    "ddp", "dtensor", or "none" for a stage of one device."""
    out = []
    for i, typed in enumerate(pp.stages):
        out.append("none" if typed.world == 1 else twin_path(_local_plan(pp, i)))
    return out


LOCAL = ("fully_shard", "ddp")  # apply's local paths


class _ScaleGrad(torch.autograd.Function):
    """The identity whose backward multiplies the gradient by ``factor``."""

    @staticmethod
    def forward(ctx, x, factor: float):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * ctx.factor, None


def _scale_grad(x, *, factor: float):
    return _ScaleGrad.apply(x, factor)


def _piece_loss(x, target, *, loss_fn, split: DataSplit):
    """The loss of this rank's piece: its outputs against its piece of the micro-batch's targets."""
    return loss_fn(x, split.piece(target, "the targets"))


# --- the pipeline ---------------------------------------------------------------------------------------------
def _cross_entropy(logits, targets):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


@dataclass
class Pipeline:
    """This rank's stage of a pipelined plan, placed and scheduled (``apply_pipeline``)."""

    plan: PipelinedPlan
    stage: int
    module: nn.Module        # this rank's stage (its parameters for the optimizer)
    schedule: object         # the torch.distributed.pipelining schedule
    pp_group: object         # rank j of every stage
    tied_group: object       # rank j of the first and the last stage, where the head is tied
    tied: tuple[str, ...]    # the stage module's parameters tied across the first and the last stage
    device: object
    mesh: object             # this stage's submesh (None: one device)
    paths: tuple = ()        # per stage, how it is placed: "fully_shard", "ddp", "dtensor", "none" (one device)
    data_groups: tuple = ()  # a local-path stage's data-parallel process groups (its loss averaged over them)

    @property
    def path(self) -> str:
        """How this rank's stage is placed (``paths``)."""
        return self.paths[self.stage]

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == len(self.plan.split) - 1

    def step(self, ids, targets):
        """One forward and backward of the whole batch over the plan's micro-batches (gradients of the mean
        loss; no optimizer step); returns that mean loss (a 0-d tensor) on every rank."""
        m = self.plan.micro_batches
        if ids.shape[0] % m:
            raise UserError(f"a batch of {ids.shape[0]} does not split into the plan's {m} micro-batches: use a "
                            f"batch that {m} divides")
        losses: list = []
        # return_outputs=False: the last stage would otherwise keep every micro-batch's logits until the step
        # ends (torch's output_chunks: m logit tensors where 1F1B keeps one micro-batch in flight there)
        if self.first:
            self.schedule.step(ids, return_outputs=False)
        elif self.last:
            self.schedule.step(target=targets, losses=losses, return_outputs=False)
        else:
            self.schedule.step(return_outputs=False)
        self._sum_tied()
        loss = (torch.stack([x.detach() for x in losses]).mean() if self.last
                else torch.zeros((), dtype=torch.float64, device=self.device))
        loss = loss.to(torch.float64)
        if self.last:  # a local path's loss is of this rank's piece: the mean over the stage's data ranks
            for group in self.data_groups:
                dist.all_reduce(loss, group=group)
                loss /= dist.get_world_size(group)
        dist.broadcast(loss, group_src=len(self.plan.split) - 1, group=self.pp_group)
        return loss

    def _sum_tied(self) -> None:
        """The tied embedding's and logits' gradients summed between the first and the last stage."""
        for name in self.tied:
            p = self.module.get_parameter(name)
            g = p.grad
            if g is None:
                g = torch.zeros_like(p)
            whole = g.full_tensor() if isinstance(g, DTensor) else g.clone()
            dist.all_reduce(whole, group=self.tied_group)
            if isinstance(p, DTensor):
                whole = DTensor.from_local(whole, p.device_mesh, [Replicate()] * p.device_mesh.ndim,
                                           run_check=False).redistribute(p.device_mesh, p.placements)
            p.grad = whole


def apply_pipeline(plan, model, mapping: dict | None = None, loss_fn=None, local: bool = True) -> Pipeline:
    """This rank's stage of ``model`` placed and scheduled as the pipelined ``plan`` says (module doc);
    ``local`` False: every stage of several devices on the DTensor path (the same plan on the other path, for
    the host's cost of each: ``autotune.execute.hostfit``)."""
    pp = load_pipelined(plan)
    cls, default_mapping = _cut_of(model)
    world = _world()
    if pp.world != world:
        raise UserError(f"the plan is for {pp.cluster} = {pp.world} devices in {len(pp.split)} stages but {world} "
                        f"processes run: launch {pp.world} (torchrun --nproc-per-node ...) or search a plan for "
                        f"{world}")
    mapping = dict(mapping if mapping is not None else default_mapping)
    p, S = len(pp.split), pp.submesh.devices
    rank = dist.get_rank()
    stage, j = divmod(rank, S)
    first, last = stage == 0, stage == p - 1
    typed = pp.stages[stage]
    blocks_have = len(_blocks(model, cls))
    if blocks_have != sum(pp.split):
        raise UserError(f"the {type(model).__name__} has {blocks_have} blocks but the plan splits "
                        f"{sum(pp.split)} ({list(pp.split)}): apply a plan searched for a model of {blocks_have} "
                        f"layers")
    tied_ids = _tied(model, mapping)
    lo, hi = pp.block_range(stage)
    module = cls(model, lo, hi, first, last)
    tied = tuple(n for n, prm in module.named_parameters() if id(prm) in tied_ids)
    chain, prefixes = find_layers(typed, module, _mapping_for(typed, mapping))
    _check_shapes(chain, typed)
    backend = dist.get_backend()
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    module.to(device)  # this stage's part alone
    from torch.distributed.device_mesh import init_device_mesh
    world_mesh = init_device_mesh(device.type, (p, *typed.mesh.sizes), mesh_dim_names=("pp", *typed.mesh.names))
    mesh = world_mesh[typed.mesh.names] if S > 1 else None
    pp_group = world_mesh["pp"].get_group()
    tied_group = None
    for k in range(S):  # every rank makes every pair's group, in the same order
        g = dist.new_group([k, (p - 1) * S + k]) if tied_ids else None
        if k == j:
            tied_group = g
    local = _local_plan(pp, stage) if local else None
    columns = _column_module(chain, tied_ids) if local is not None and local.columns else None
    # a user's loss takes the whole logits: vocabulary-parallel ones are then gathered by the DTensor path
    head = _vocab_module(chain, tied_ids) if local is not None and local.vocabulary and loss_fn is None else None
    refused = local is not None and ((local.columns and columns is None) or (local.vocabulary and head is None))
    path = "none" if mesh is None else "dtensor" if local is None or refused else path_of(local.plan, chain, "local")
    paths: list = [None] * world
    # alike on every rank: a stage whose modules refuse its plan's TP styles or column embedding takes DTensor's
    dist.all_gather_object(paths, path)
    paths = paths[::S]
    meshes = {}
    for i in range(p):  # every rank makes every local-path stage's mesh, in the same order
        key = tuple(_local_dims(_local_plan(pp, i).plan).items()) if paths[i] in LOCAL else None
        if key is not None and key not in meshes:
            meshes[key] = init_device_mesh(device.type, (p, *(n for _, n in key)),
                                           mesh_dim_names=("pp", *(k for k, _ in key)))
    runs, data_groups, loss = module, (), loss_fn or _cross_entropy
    if path in LOCAL:  # apply's local path on the stage's submesh
        local_mesh = meshes[tuple(_local_dims(local.plan).items())]
        ignored = tuple(m.weight for m in (columns, head) if m is not None)  # placed below, by rows or columns
        if path == "fully_shard":
            split, data_mesh = _fully_shard(module, chain, prefixes, local.plan, fully_shard_layout(local.plan),
                                            local_mesh, "local", ignored)
            data_groups = tuple(data_mesh.get_group(k) for k in range(data_mesh.ndim))
        else:
            split, data_mesh = DataSplit(local_mesh.get_local_rank("dp"), S), local_mesh["dp"]
            data_groups = (data_mesh.get_group(),)
            runs = _ddp(module, chain, prefixes, local.plan, device.type, split, data_groups[0], ignored)
        if columns is not None:  # the whole micro-batch's ids looked up in this rank's columns, then its piece
            columns.weight = nn.Parameter(distribute_tensor(columns.weight.detach(), data_mesh,
                                                            [Shard(1)] * data_mesh.ndim))
            columns.forward = functools.partial(_column_lookup, module=columns, mesh=data_mesh,
                                                factor=1 / split.world)
        elif first:
            split.cut_calls(module)
        if head is not None:  # the whole micro-batch's logits in this rank's vocabulary rows, their loss
            rows = [Shard(0)] * data_mesh.ndim
            offset = compute_local_shape_and_global_offset(tuple(head.weight.shape), data_mesh, rows)[1][0]
            head.weight = nn.Parameter(distribute_tensor(head.weight.detach(), data_mesh, rows))
            head.forward = functools.partial(_vocab_logits, module=head, group=data_groups[0], factor=split.world)
            loss = functools.partial(_vocab_loss, group=data_groups[0], offset=offset)
        elif last:
            loss = functools.partial(_piece_loss, loss_fn=loss, split=split)
        # beside a DTensor-path stage (whose gradients are of the whole micro-batch's loss, not of each piece's
        # loss: 1 / pieces of them), the gradients crossing the boundary rescaled
        if not first and paths[stage - 1] not in LOCAL:
            module.arrive = functools.partial(_scale_grad, factor=1 / split.world)
        if not last and paths[stage + 1] not in LOCAL:
            module.depart = functools.partial(_scale_grad, factor=split.world)
    else:
        if mesh is not None:
            _place(chain, typed, mesh, module)
            s_in, s_out = _stream(typed)
            _install_stage_hooks(chain, mesh, first, last, s_in, s_out)
            if not last:
                module.depart = functools.partial(_reshard_stream, mesh=mesh, src=s_out, dst=pp.sent[stage])
            if not first:
                module.arrive = functools.partial(_reshard_stream, mesh=mesh, src=pp.sent[stage - 1], dst=s_in)
        _recompute(module, chain, prefixes, typed.recompute)
    from torch.distributed.pipelining import PipelineStage
    pstage = PipelineStage(runs, stage, p, device, group=pp_group)
    schedule = SCHEDULES[pp.schedule](pstage, pp.micro_batches, loss_fn=loss)
    return Pipeline(pp, stage, module, schedule, pp_group, tied_group, tied, device, mesh, tuple(paths),
                    data_groups)


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


def _blocks(model, cls) -> list:
    return list(model.blocks) if cls is ReferenceStage else list(model.model.layers)


__all__ = ["PipelinedPlan", "Pipeline", "apply_pipeline", "load_pipelined", "stage_paths", "local_stream", "CUTS",
           "SCHEDULES"]
