"""``autotune.apply_pipeline(plan, model)``: this rank's stage of a pipelined plan, placed and scheduled:

    pipe = autotune.apply_pipeline("out/plan.json", model)   # the model built on the CPU; every rank alike
    opt = torch.optim.AdamW(autotune.param_groups(pipe.module))
    for ids, targets in loader:                               # the whole batch, the same on every rank
        loss = pipe.step(ids, targets)                        # the schedule over the plan's micro-batches
        opt.step(); opt.zero_grad()

Stage i runs on the i-th run of ``submesh.devices`` ranks, on one DeviceMesh (stages, *the stage's fine axes);
only this rank's stage moves to its device. Under interleaved 1F1B a rank's stage is its v chunks (virtual stages
i, i + p, ...: ``Plan.chunk_ranges``), each cut, placed by the stage's path and scheduled as its own ``PipelineStage``,
the stream of the last rank's chunk handed back to the first rank's next. A stage under ZeRO (its techniques'
``zero_stage``, Megatron-LM's distributed optimizer) runs on fully_shard over its data ranks (DDP's stage, or the
tensor path's mesh sharded where it replicated), its weights kept whole from the step's first forward to its last
backward (torchtitan's ZeRO-2 setting): one all-gather and one reduce-scatter a step, an all-reduce's traffic as
priced; ZeRO-1 runs so too (torch has no ZeRO-1 on fully_shard: its gradients sharded as well, at most the memory
priced). A tensor-path stage with sequence parallelism holds the stream as a DTensor of sequence shards
(``Shard(1)``) on its tensor axis, each rank's shard crossing the boundaries (beside a DTensor-path stage, which
splits it otherwise, one line). Stages with context parallelism (a Hugging Face model; every stage over the same size on
the DDP or fully_shard path, without tensor parallelism: ``CONTEXT_STAGE_PATHS``) run ``autotune.apply.context``'s: each
context group holds its piece of every micro-batch, each rank its two chunks of each sequence (the ids cut by the first
stage, the chunks' global positions given to every stage's blocks, the targets cut by the last), the chunks crossing the
boundaries. Each stage is placed on its submesh by one of apply's paths (``paths`` says which ran): "ddp" (gradients
averaged once after the schedule, ``autotune.apply.ddp.sync_grads``), "fully_shard" (the ``FSDPModule`` handed to
``PipelineStage``, torchtitan's PP + FSDP step) or "tensor" (torch's ParallelStyles on the tensor axes, fully_shard's
replicate mesh over the data axes: torchtitan's PP + TP) for a stage plan that is data parallel, fully_shard-shaped or
data x tensor parallel and whose boundaries carry each rank's local piece (each rank runs its piece of every
micro-batch, the first stage cutting the ids, the last the targets), also with the layers ``autotune.apply.vocab``
computes; else "dtensor" (``autotune.apply.dtensor``: the stream redistributed at the boundaries by the plan's route,
``autotune.apply.cuts``), "none" on one device. On every path the last stage's loss is of this rank's piece of the
micro-batch; logits split by vocabulary on a tensor axis (or the DTensor path's) stay a DTensor of columns, their cross
entropy run under ``loss_parallel`` (a ``loss_fn`` given takes them gathered). Tied embedding and logits: their
gradients summed between the first and the last stage after the backward, as Megatron does. ``step`` returns the
mean loss over the whole batch on every rank. Errors: one ``UserError`` naming the fix, before any weight moves
(among them a plan searched without the residual stream in placements that the module's residual adds cannot
take: ``autotune.apply.layers.check_stream``)."""
from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass, replace

from calibrate.errors import UserError, one_line_in_scripts

from autotune.apply import context
from autotune.apply.batch import DataSplit, scale_grad
from autotune.apply.cuts import WHOLE, _blocks, _cut_of, _install_stage_hooks, _mapping_for, _reshard_stream, _tied
from autotune.apply.ddp import sync_grads
from autotune.apply.dtensor import Ends, _place
from autotune.apply.grads import GradSync, no_sync, reduce_grads
from autotune.apply.fsdp import fully_shard_model
from autotune.apply.layers import (_check_shapes, _recompute, _world, check_allocator, check_stream, device_type,
                                   find_layers, torch)
from autotune.apply.pipeplan import (LOCAL, SCHEDULES, _stream, chunk_plan, load_pipelined, local_dims, local_plan,
                                     sent_at, sequence_stream, stage_layout, vocabulary_columns, zero_path)
from autotune.apply.place import path_of
from autotune.apply.vocab import _column_lookup, _column_module, _piece_loss, _vocab_logits, _vocab_loss, _vocab_module
from autotune.plan.layouts import CONTEXT_STAGE_PATHS, LocalPlan, context_size
from autotune.plan.typed import ApplyPath, Plan, TypedPlan

import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor  # noqa: E402
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset  # noqa: E402


# --- the pipeline ---------------------------------------------------------------------------------------------
def _cross_entropy(logits, targets):
    """The last stage's default loss, as transformers' own loss takes it: half-precision logits copied to fp32 first
    (what the memory model prices under loss_parallel: ``autotune.sbp.memory.LOSS_PARALLEL_KEPT``)."""
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _gathered(logits, targets, *, loss_fn):
    """A user's ``loss_fn`` of logits split by vocabulary: their columns gathered first (it takes them whole)."""
    return loss_fn(logits.full_tensor() if isinstance(logits, DTensor) else logits, targets)


def _stage_loss(loss_fn, split: DataSplit, vocabulary: bool):
    """A last stage's loss of this rank's piece of the micro-batch (``_piece_loss``): its logits split by
    vocabulary as a DTensor of columns (``vocabulary``) go to torch's cross entropy under ``loss_parallel``
    (``Pipeline.step``), or gathered to a user's ``loss_fn``."""
    loss = functools.partial(_gathered, loss_fn=loss_fn) if vocabulary and loss_fn else loss_fn or _cross_entropy
    return functools.partial(_piece_loss, loss_fn=loss, split=split)


@dataclass
class Pipeline:
    """This rank's stage of a pipelined plan, placed and scheduled (``apply_pipeline``)."""

    plan: Plan  # the pipelined plan
    stage: int
    module: nn.Module        # this rank's stage, its chunks in an nn.ModuleList (its parameters for the optimizer)
    schedule: object         # the torch.distributed.pipelining schedule
    pp_group: object         # rank j of every stage
    tied_group: object       # rank j of the first and the last stage, where the head is tied
    tied: tuple[str, ...]    # the stage module's parameters tied across the first and the last stage
    device: object
    mesh: object             # this stage's submesh (None: one device)
    paths: tuple = ()        # per stage, how it is placed: "fully_shard", "tensor", "ddp", "dtensor", "none"
    data_groups: tuple = ()  # a last stage's data-parallel process groups (its pieces' losses averaged over them)
    loss_parallel: bool = False  # its logits split by vocabulary, a DTensor: the schedule under ``loss_parallel``
    chunks: tuple = ()       # the rank's virtual stages' modules, in order (``module`` itself but under interleaving)

    @property
    def path(self) -> str:
        """How this rank's stage is placed (``paths``)."""
        return self.paths[self.stage]

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == len(self.plan.stages) - 1

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
        from torch.distributed.tensor.parallel import loss_parallel
        # gradients accumulated over the micro-batches, reduced over the data ranks once after the schedule
        with loss_parallel() if self.loss_parallel else contextlib.nullcontext(), contextlib.ExitStack() as held:
            for part in self.chunks:
                held.enter_context(no_sync(part))
            if self.first:
                self.schedule.step(ids, return_outputs=False)
            elif self.last:
                self.schedule.step(target=targets, losses=losses, return_outputs=False)
            else:
                self.schedule.step(return_outputs=False)
        if self.path == ApplyPath.DDP:  # once a step, after the schedule (``autotune.apply.ddp``)
            sync_grads(self.module, self.data_groups[0])
        elif self.path == ApplyPath.DTENSOR:
            reduce_grads(self.module)
        self._sum_tied()
        # under loss_parallel, each micro-batch's loss is a replicated DTensor
        loss = (torch.stack([(x.full_tensor() if isinstance(x, DTensor) else x).detach() for x in losses]).mean()
                if self.last
                else torch.zeros((), dtype=torch.float64, device=self.device))
        loss = loss.to(torch.float64)
        if self.last:  # the loss of this rank's piece: the mean over the stage's data ranks
            for group in self.data_groups:
                dist.all_reduce(loss, group=group)
                loss /= dist.get_world_size(group)
        dist.broadcast(loss, group_src=len(self.plan.stages) - 1, group=self.pp_group)
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
    one_line_in_scripts()
    pp = load_pipelined(plan)
    cls, default_mapping = _cut_of(model)
    world = _world()
    check_allocator(pp, os.environ)
    if pp.world != world:
        raise UserError(f"the plan is for {pp.cluster} = {pp.world} devices in {len(pp.stages)} stages but {world} "
                        f"processes run: launch {pp.world} (torchrun --nproc-per-node ...) or search a plan for "
                        f"{world}")
    mapping = dict(mapping if mapping is not None else default_mapping)
    p, S, split = len(pp.stages), pp.submesh.devices, pp.pipeline.split
    rank = dist.get_rank()
    stage, j = divmod(rank, S)
    typed = pp.stages[stage].plan
    blocks_have = len(_blocks(model, cls))
    if blocks_have != sum(split):
        raise UserError(f"the {type(model).__name__} has {blocks_have} blocks but the plan splits "
                        f"{sum(split)} ({list(split)}): apply a plan searched for a model of {blocks_have} "
                        f"layers")
    v = pp.virtual_stages
    for i, st in enumerate(pp.stages):  # every stage's, alike on every rank
        check_stream(st.plan, model, _stream(st.plan)[1] if i < p - 1 or v > 1 else None, f"its stage {i}")
    tied_ids = _tied(model, mapping)
    mine = range(stage, p * v, p)  # this rank's virtual stages: its chunks in order
    ranges = pp.chunk_ranges()
    parts = [cls(model, *ranges[s], s == 0, s == p * v - 1) for s in mine]
    module = parts[0] if v == 1 else nn.ModuleList(parts)
    tied = tuple(n for n, prm in module.named_parameters() if id(prm) in tied_ids)
    plans = [chunk_plan(typed, pp, s) for s in mine]
    sites = [find_layers(c, part, _mapping_for(c, mapping)) for c, part in zip(plans, parts)]
    for chain, _ in sites:
        _check_shapes(chain, typed)
    device = torch.device("cuda", torch.cuda.current_device()) if device_type() == "cuda" else torch.device("cpu")
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
    local = local_plan(pp, stage) if local else None
    columns = _column_module(sites[0][0], tied_ids) if local is not None and local.columns else None
    # a user's loss takes the whole logits: vocabulary-parallel ones are then gathered by the DTensor path
    head = _vocab_module(sites[-1][0], tied_ids) if local is not None and local.vocabulary and loss_fn is None \
        else None
    refused = local is not None and ((local.columns and columns is None) or (local.vocabulary and head is None))
    path = ApplyPath.NONE.value if mesh is None else ApplyPath.DTENSOR.value if local is None or refused else \
        path_of(local.plan, sites[0][0])
    path = zero_path(path if path in LOCAL + (ApplyPath.NONE.value,) else ApplyPath.DTENSOR.value,
                     pp.stages[stage].zero_stage)
    paths: list = [None] * world
    # alike on every rank: a stage whose modules refuse its plan's TP styles or column embedding takes DTensor's
    dist.all_gather_object(paths, path)
    paths = paths[::S]
    for i in range(p):  # alike on every rank, before any weight moves
        near = {paths[(i + k) % p] for k in (-1, 1) if 0 <= i + k < p or v > 1}
        if paths[i] in LOCAL and sequence_stream(pp, i) and ApplyPath.DTENSOR in near:
            raise UserError(f"stage {i} holds the stream split by the sequence (sequence parallelism) beside a stage "
                            f"on the DTensor path, which splits it otherwise: search the plan again, or run it "
                            f"without sequence parallelism")
        if pp.stages[i].zero_stage and paths[i] == ApplyPath.DTENSOR:
            raise UserError(f"stage {i}'s plan shards its optimizer states (ZeRO-{pp.stages[i].zero_stage}), which "
                            f"apply runs on fully_shard, but its placements take the DTensor path: search the plan "
                            f"again, or run it without ZeRO")
    meshes = {}
    for i in range(p):  # every rank makes every local-path stage's mesh, in the same order
        key = tuple(local_dims(local_plan(pp, i).plan, pp.stages[i].zero_stage).items()) if paths[i] in LOCAL else None
        if key is not None and key not in meshes:
            meshes[key] = init_device_mesh(device.type, (p, *(n for _, n in key)),
                                           mesh_dim_names=("pp", *(k for k, _ in key)))
    cp = _context(pp, paths, model, device.type)
    if cp is not None:
        context.attend_over(model, cp)
    at = _Placing(pp, paths, loss_fn, mesh, meshes, columns, head, cp)
    for s, part, c, site in zip(mine, parts, plans, sites):
        at.place(s, part, c, *site, local)
    from torch.distributed.pipelining import PipelineStage
    pstages = [PipelineStage(part, s, p * v, device, group=pp_group) for s, part in zip(mine, parts)]
    schedule = SCHEDULES[pp.pipeline.schedule](pstages, pp.micro_batches, loss_fn=at.loss)
    return Pipeline(pp, stage, module, schedule, pp_group, tied_group, tied, device, mesh, tuple(paths),
                    at.data_groups, at.vocabulary, tuple(parts))


def _context(pp: Plan, paths: list, model, device: str):
    """This rank's context group where the plan's stages run context parallelism (None: they do not), made alike
    on every rank; one line where the stages differ in its size (the stream crossing a boundary is each
    rank's chunks), or a stage runs it off ``CONTEXT_STAGE_PATHS``, beside a tensor axis, a column embedding or
    vocabulary-parallel logits."""
    sizes = [context_size(st.plan) for st in pp.stages]
    if max(sizes) == 1:
        return None
    twins = [local_plan(pp, i) for i in range(len(sizes))]
    if len(set(sizes)) > 1 or any(path not in CONTEXT_STAGE_PATHS or twin is None or twin.columns or twin.vocabulary
                                  or "tp" in local_dims(twin.plan) for path, twin in zip(paths, twins)):
        raise UserError(f"the plan's stages run context parallelism over {sizes} ranks on the {paths} paths, which "
                        f"apply_pipeline runs over one size on every stage, each data parallel or fully_shard-shaped "
                        f"without tensor parallelism: search with --context-parallel 1")
    context.check_model(model, sizes[0], pp.model.get("sequence"))
    return context.group(sizes[0], pp.submesh.devices, device, len(sizes))


def _sequence_shards(x, *, mesh, then=None):
    """The stream as it arrives at a sequence-parallel stage (this rank's sequence shard) as the DTensor its
    blocks add into (``Shard(1)`` on the tensor axis ``mesh``)."""
    return DTensor.from_local(then(x) if then else x, mesh, [Shard(1)], run_check=False)


def _local_shard(x, *, then=None):
    """The stream leaving a sequence-parallel stage: this rank's sequence shard."""
    x = x.to_local() if isinstance(x, DTensor) else x
    return then(x) if then else x


class _Placing:
    """Placing a rank's chunks (``place``, each a virtual stage) on the path its stage takes, and what they give
    the schedule and ``Pipeline``: the loss (the last virtual stage's), the data-parallel groups its pieces'
    losses average over, whether its logits are split by vocabulary."""

    def __init__(self, pp: Plan, paths: list, loss_fn, mesh, meshes: dict, columns, head, cp):
        self.pp, self.paths, self.loss_fn, self.mesh, self.meshes = pp, paths, loss_fn, mesh, meshes
        self.columns, self.head, self.cp = columns, head, cp
        self.loss, self.data_groups, self.vocabulary = loss_fn or _cross_entropy, (), False

    def place(self, s: int, module, typed: TypedPlan, chain, prefixes, local: LocalPlan | None) -> None:
        pp, paths = self.pp, self.paths
        p = len(pp.stages)
        stage, total = s % p, p * pp.virtual_stages
        first, last = s == 0, s == total - 1
        path = paths[stage]
        if path in LOCAL:  # apply's local path on the stage's submesh
            if pp.virtual_stages > 1:  # the chunk's blocks and block recomputation
                local = replace(local, plan=replace(local.plan, model=typed.model, recompute=typed.recompute,
                                                    recompute_blocks=typed.recompute_blocks))
            zero = pp.stages[stage].zero_stage
            dims = local_dims(local.plan, zero)
            local_mesh = self.meshes[tuple(dims.items())]
            columns, head = self.columns if first else None, self.head if last else None
            ignored = tuple(m.weight for m in (columns, head) if m is not None)  # placed below, by rows or columns
            if path != ApplyPath.DDP:  # fully_shard, or the tensor path on fully_shard's replicate mesh (PP + TP)
                layout = stage_layout(local.plan, path)
                # ZeRO: sharded over the data ranks, whole from the first forward to the last backward of a step
                split, data_mesh = fully_shard_model(module, chain, prefixes, local.plan, layout, local_mesh, ignored,
                                                     dims, reshard_after_forward=False if zero else None)
                self.data_groups = tuple(data_mesh.get_group(k) for k in range(data_mesh.ndim))
                vocabulary = last and vocabulary_columns(local.plan, layout.tp)
            else:
                layout = None
                split, data_mesh = DataSplit(local_mesh.get_local_rank("dp"), pp.submesh.devices), local_mesh["dp"]
                self.data_groups = (data_mesh.get_group(),)
                vocabulary = False
                # gradients synced after the schedule
                _recompute(module, chain, prefixes, local.plan.recompute, local.plan.recompute_blocks)
            if self.cp is not None:  # each context group's ranks hold its piece, each rank its chunks of it
                split = context.pieces(split, self.cp.size)
            if columns is not None:  # the whole micro-batch's ids looked up in this rank's columns, then its piece
                columns.weight = nn.Parameter(distribute_tensor(columns.weight.detach(), data_mesh,
                                                                [Shard(1)] * data_mesh.ndim))
                columns.forward = functools.partial(_column_lookup, module=columns, mesh=data_mesh,
                                                    factor=1 / split.world)
            elif first:
                split.cut_calls(module)
            if self.cp is not None:
                context.place_stage(module, self.cp, first)
            if head is not None:  # the whole micro-batch's logits in this rank's vocabulary rows, their loss
                rows = [Shard(0)] * data_mesh.ndim
                offset = compute_local_shape_and_global_offset(tuple(head.weight.shape), data_mesh, rows)[1][0]
                head.weight = nn.Parameter(distribute_tensor(head.weight.detach(), data_mesh, rows))
                head.forward = functools.partial(_vocab_logits, module=head, group=self.data_groups[0],
                                                 factor=split.world)
                self.loss = functools.partial(_vocab_loss, group=self.data_groups[0], offset=offset)
            elif last:
                self.loss = _stage_loss(self.loss_fn if self.cp is None else functools.partial(
                    context.chunk_loss, loss_fn=self.loss_fn or _cross_entropy, cp=self.cp), split, vocabulary)
            self.vocabulary = self.vocabulary or vocabulary
            # beside a DTensor-path stage (whose gradients are of the whole micro-batch's loss, not of each
            # piece's loss: 1 / pieces of them), the gradients crossing the boundary rescaled
            if not first and paths[(s - 1) % p] not in LOCAL:
                module.arrive = functools.partial(scale_grad, factor=1 / split.world)
            if not last and paths[(s + 1) % p] not in LOCAL:
                module.depart = functools.partial(scale_grad, factor=split.world)
            if getattr(layout, "sequence_parallel", False):  # inside the stage a DTensor of sequence shards
                if not first:
                    module.arrive = functools.partial(_sequence_shards, mesh=local_mesh["tp"], then=module.arrive)
                if not last:
                    module.depart = functools.partial(_local_shard, then=module.depart)
            return
        mesh = self.mesh
        if mesh is not None:
            _place(chain, typed, mesh, module, GradSync.of(module))
            s_in, s_out = _stream(typed)
            ends = Ends.of(typed) if last else WHOLE  # the logits of this rank's piece, by vocabulary: a DTensor
            _install_stage_hooks(chain, mesh, first, last, s_in, s_out, module, ends)
            if last:
                self.vocabulary = bool(ends.vocab)
                self.loss = _stage_loss(self.loss_fn, ends.split(mesh), self.vocabulary)
                self.data_groups = tuple(mesh.get_group(a) for a in ends.data)
            if not last:
                module.depart = functools.partial(_reshard_stream, mesh=mesh, src=s_out, dst=sent_at(pp, s))
            if not first:
                module.arrive = functools.partial(_reshard_stream, mesh=mesh, src=sent_at(pp, s - 1), dst=s_in)
        _recompute(module, chain, prefixes, typed.recompute, typed.recompute_blocks)
