"""``autotune.apply(plan, model)``: place a user's nn.Module (built on the CPU) as a plan says, for the user's
own training loop, by one of the paths of ``PATHS`` (one module each, one interface: whether it takes the plan,
and placing the module, which moves this rank's part to its device and returns this rank's ``DataSplit``; each
path syncs the gradients itself, in the backward, once a step under ``autotune.accumulate``: ``autotune.apply.grads``):

- "fully_shard" (``autotune.apply.fsdp``): FSDP, HSDP and TP + FSDP plans, torchtitan's composition, also with
  the embedding's table split by columns beside it (``autotune.plan.layouts.column_twin``);
- "tensor" (``autotune.apply.tensor``): a plan without FSDP, data parallel on its leading axes and tensor
  parallel on the others as ``parallelize_module``'s styles (DDP + TP);
- "ddp" (``autotune.apply.ddp``): pure data parallelism, ``DistributedDataParallel`` (apply returns it);
- "dtensor" (``autotune.apply.dtensor``): every other per-layer plan, one explicit redistribution where a
  layer's placement differs from its neighbour's.

Every path runs the step users run: each data-parallel rank feeds its own piece of every batch
(``autotune.data_piece(model, batch)``, or a sampler of ``autotune.data_world(model)``), and its loss is that
piece's; gradients are averaged over the data ranks. Logits split by vocabulary come out as a DTensor of
vocabulary columns: compute the loss (and its backward) under ``torch.distributed.tensor.parallel.loss_parallel()``
(Megatron's vocabulary-parallel cross entropy), the way torchtitan does; nothing gathers the logits or the batch.
``placement_path(plan, model)`` reports the path. Errors (a plan for another world or mesh, shapes that differ
from the plan's model, an unmapped layer, a batch that does not split, a plan searched without the residual
stream whose placements the module's residual adds cannot take: ``autotune.apply.layers.check_stream``): one
``UserError`` naming the fix, raised alike on every rank before any weight moves (a script that lets it end shows
it as one line on rank 0: ``calibrate.errors.one_line_in_scripts``). World size 1: no placement, shapes checked,
recomputation applied."""
from __future__ import annotations

import os
from dataclasses import dataclass

from calibrate.errors import UserError, one_line_in_scripts

from autotune.apply import ddp, dtensor, fsdp
from autotune.apply.batch import check_batch, stream_by_sequence
from autotune.apply.context import place as context_parallel
from autotune.apply.layers import (Site, _check_shapes, _recompute, _world, check_allocator, check_stream, device_type,
                                   find_layers)
from autotune.apply.tensor import tp_styles
from autotune.apply.vocab import chain_columns
from autotune.plan.layouts import (CONTEXT_PATHS, column_twin, context_axes, context_size, data_parallel_plan,
                                   fully_shard_layout, plan_path, sequence_axes, tp_layout)
from autotune.plan.file import load_plan
from autotune.plan.typed import ApplyPath, TypedPlan


@dataclass
class Job:
    """What a path places: the model, its chain of plan layers, the plan, the fine mesh (the DTensor path's)
    and the device type; ``layout`` is what the path's ``takes`` returned."""

    model: object
    chain: list
    prefixes: dict
    plan: TypedPlan
    mesh: object
    device: str
    layout: object = None


def _takes_tp(layout_of):
    def takes(plan: TypedPlan, chain: list[Site]):
        layout = layout_of(plan)
        return layout if layout is not None and (layout.tp is None or tp_styles(
            chain, layout.tp, getattr(layout, "stream", "B"), layout.sequence_parallel) is not None) else None
    return takes


def _unwrapped(place):
    def run(job: Job):
        return job.model, place(job)
    return run


def _takes_fully_shard(plan: TypedPlan, chain: list[Site]):
    """fully_shard's layout of ``plan``, or its ``column_twin`` where the chain's embedding can take the columns."""
    layout = _takes_tp(fully_shard_layout)(plan, chain)
    if layout is not None:
        return layout
    twin = column_twin(plan)
    return twin if twin is not None and chain_columns(chain) is not None else None


# name: (takes(plan, chain) -> a layout or None, place(job) -> (the module to call, this rank's DataSplit)); the
# plan's path is ``autotune.plan.layouts.plan_path``'s, taken where the modules take it (else the DTensor path)
PATHS = {
    ApplyPath.FULLY_SHARD.value: (_takes_fully_shard, _unwrapped(fsdp.place)),
    ApplyPath.TENSOR.value: (_takes_tp(tp_layout), _unwrapped(fsdp.place_tensor)),
    ApplyPath.DDP.value: (lambda plan, chain: data_parallel_plan(plan) or None, ddp.place),
    ApplyPath.DTENSOR.value: (lambda plan, chain: True, _unwrapped(dtensor.place)),
}
CHOICES = ("auto", ApplyPath.DTENSOR.value)  # apply's path=: its own choice, or the DTensor path for any plan


def path_of(plan: TypedPlan, chain: list[Site], path: str = "auto") -> str:
    """The path ``plan`` (of several devices) takes on the modules of ``chain`` (``path`` "dtensor": that one): the
    plan's own (``plan_path``, the one decider the search prices by) where the modules take its styles, else the
    DTensor path (e.g. GPT-2's fused ``Conv1D`` projections under a tensor-parallel plan)."""
    if path not in CHOICES:
        raise UserError(f"path={path!r} is unknown: use one of {', '.join(CHOICES)}")
    if path == ApplyPath.DTENSOR:
        return path
    name = plan_path(plan)
    return name if PATHS[name][0](plan, chain) else ApplyPath.DTENSOR.value


def one_stage(plan) -> TypedPlan:
    """``plan`` (a Plan, plan.json or its path) loaded; a pipelined one pointed to ``apply_pipeline``."""
    plan = load_plan(plan)
    if plan.stages:
        raise UserError(f"the plan is pipelined ({len(plan.stages)} stages), and autotune.apply places a plan of one "
                        f"stage: place it with autotune.apply_pipeline(plan, model) (or search with --pipeline off)")
    return plan


def placement_path(plan, model, mapping: dict | None = None, path: str = "auto") -> str:
    """The path ``apply(plan, model, path=path)`` places ``model`` by ("none" on one device)."""
    plan = one_stage(plan)
    return ApplyPath.NONE.value if plan.world == 1 else path_of(plan, find_layers(plan, model, mapping)[0], path)


def apply(plan, model, mesh=None, mapping: dict | None = None, path: str = "auto"):
    """Place ``model`` as ``plan`` says; returns the module to call (the module doc)."""
    one_line_in_scripts()
    plan = one_stage(plan)
    world = _world()
    if plan.world != world:
        raise UserError(f"the plan is for {plan.cluster} = {plan.world} devices but {world} processes run: launch "
                        f"{plan.world} (torchrun --nproc-per-node ...) or apply a plan searched for {world}")
    check_allocator(plan, os.environ, mesh.device_type if mesh is not None else None)
    if mesh is not None and tuple(mesh.shape) != plan.mesh.sizes:
        raise UserError(f"the mesh given is {list(mesh.shape)} but the plan's fine mesh is {list(plan.mesh.sizes)}: "
                        f"pass mesh=None (apply builds it) or a mesh of that shape")
    chain, prefixes = find_layers(plan, model, mapping)
    _check_shapes(chain, plan)
    check_stream(plan, model)
    context = context_axes(plan)
    check_batch(plan, skip=context)
    name = path_of(plan, chain, path) if world > 1 else ApplyPath.NONE.value
    if context and name not in CONTEXT_PATHS:
        raise UserError(f"the plan runs context parallelism, which apply runs on the {', '.join(CONTEXT_PATHS)} "
                        f"paths, not the {name} path: search with --context-parallel 1, or apply with path='auto'")
    # torch's SequenceParallel takes the sequence split of a plan with sequence parallelism on its tensor axes, the
    # context-parallel hook its chunks
    pieces = stream_by_sequence(plan, context + (sequence_axes(plan) if name in (ApplyPath.TENSOR,
                                                                                 ApplyPath.FULLY_SHARD) else ()))
    if world > 1 and hasattr(model, "config") and pieces > 1:
        raise UserError(f"the plan splits each sequence of its residual stream over {pieces} "
                        f"devices (a micro-batch of {plan.model.get('micro_batch')}), which a Hugging Face model "
                        f"cannot take on the {name} path (it reads the sequence length from the embedding's output): "
                        f"search with a micro-batch that the data-parallel devices divide")
    if world == 1:
        _recompute(model, chain, prefixes, plan.recompute, plan.recompute_blocks)
        return model
    device = mesh.device_type if mesh is not None else device_type()
    if name == ApplyPath.DTENSOR and mesh is None:
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh(device, plan.mesh.sizes, mesh_dim_names=plan.mesh.names)
    takes, place = PATHS[name]
    placed, split = place(Job(model, chain, prefixes, plan, mesh, device, takes(plan, chain)))
    if context:
        split = context_parallel(model, context_size(plan), split, device, plan.model.get("sequence"))
    if name == ApplyPath.DTENSOR:
        _recompute(model, chain, prefixes, plan.recompute, plan.recompute_blocks)
    placed._autotune_path = name
    return split.mark(placed)
