"""The fully_shard path: FSDP, HSDP and TP + FSDP (and DDP + TP: a replicate mesh) as torchtitan composes them:
``parallelize_module`` on the tensor-parallel axis (``autotune.apply.tensor``), then ``fully_shard`` on each block
and on the whole model over the data axes, a (replicate, shard) mesh for HSDP. Each rank computes its piece of
the batch; fully_shard averages the gradients over the data ranks (torchtitan's step)."""
from __future__ import annotations

import math

from autotune.apply.batch import DataSplit
from autotune.apply.layers import Site, _recompute
from autotune.apply.tensor import parallelize
from autotune.apply.vocab import chain_columns, place_columns
from autotune.plan.layouts import FullyShard, LocalPlan, fsdp_dims, fully_shard_layout
from autotune.plan.typed import TypedPlan


def fully_shard_model(model, chain: list[Site], prefixes: dict, plan: TypedPlan, layout: FullyShard, world_mesh,
                      ignored: tuple = (), dims: dict | None = None, reshard_after_forward: bool | None = None):
    """torchtitan's composition on ``world_mesh`` (a DeviceMesh with ``dims``' dimensions, default
    ``fsdp_dims``', and any others, e.g. a pipeline's). Returns (this rank's ``DataSplit``, the data mesh).
    ``ignored``: parameters fully_shard leaves as they are (placed by the caller); ``reshard_after_forward``
    fully_shard's (None: its default, the root's weights kept whole after the forward, the others' freed); False:
    every unit's kept whole from a step's first forward to its last backward (ZeRO-2's traffic)."""
    from torch.distributed import get_backend
    from torch.distributed.fsdp import fully_shard
    dims = dims or fsdp_dims(plan, layout)
    data = tuple(k for k in dims if k != "tp")
    parts = math.prod(dims[k] for k in data)
    if layout.tp is not None:
        parallelize(model, chain, layout, world_mesh["tp"])
    _recompute(model, chain, prefixes, plan.recompute, plan.recompute_blocks)
    mesh = world_mesh[data]
    names = dict(model.named_modules())
    units = [names[prefix] for prefix in prefixes.values()] + [model]
    for unit in units:
        fully_shard(unit, mesh=mesh, ignored_params=set(ignored) or None, reshard_after_forward=reshard_after_forward)
    if get_backend(mesh.get_group(0)) == "gloo":  # gloo has neither the pre-multiplied sum nor the average
        for unit in units:
            unit.set_force_sum_reduction_for_comms(True)
    rank = 0
    for k in data:  # row-major over the data dimensions, as DTensor's Shard(0) on each in turn
        rank = rank * dims[k] + world_mesh.get_local_rank(k)
    return DataSplit(rank, parts), mesh


def place(job) -> DataSplit:
    """fully_shard's composition; for a plan whose embedding is split by columns (``job.layout`` its
    ``column_twin``), on the twin, the table placed beside fully_shard (``autotune.apply.vocab.place_columns``)."""
    from torch.distributed.device_mesh import init_device_mesh
    twin = job.layout if isinstance(job.layout, LocalPlan) else None
    plan = twin.plan if twin is not None else job.plan
    layout = fully_shard_layout(plan) if twin is not None else job.layout
    dims = fsdp_dims(plan, layout)
    mesh = init_device_mesh(job.device, tuple(dims.values()), mesh_dim_names=tuple(dims))
    columns = chain_columns(job.chain) if twin is not None else None
    split, data = fully_shard_model(job.model, job.chain, job.prefixes, plan, layout, mesh,
                                    (columns.weight,) if columns is not None else ())
    if columns is not None:
        place_columns(columns, data, split)
    return split


def place_tensor(job):
    """The tensor path (``autotune.apply.tensor``'s layout): fully_shard's composition on its data x tensor mesh,
    as torchtitan runs DDP + TP; without data ranks (every device on the tensor axes) ``parallelize_module``
    alone, as torchtitan applies no FSDP at data degree 1: fully_shard over one device averages nothing and costs
    its hooks' host time and its copies (2 x H200, 2026-11-29: Megatron t=2 issued 16.5 ms a block and
    micro-batch with it, where the tensor styles alone measure 13.7)."""
    from torch.distributed.device_mesh import init_device_mesh

    dims = job.layout.dims(job.plan)
    mesh = init_device_mesh(job.device, tuple(dims.values()), mesh_dim_names=tuple(dims))
    if dims["replicate"] == 1:  # no data ranks (``autotune.plan.hostpace.data_ranks``: what its host pace reads)
        parallelize(job.model, job.chain, job.layout, mesh["tp"])
        _recompute(job.model, job.chain, job.prefixes, job.plan.recompute, job.plan.recompute_blocks)
        job.model.to(job.device)  # what the styles left where it was built (norms, buffers), as fully_shard moves it
        return DataSplit(0, 1)
    return fully_shard_model(job.model, job.chain, job.prefixes, job.plan, job.layout, mesh, dims=dims)[0]
