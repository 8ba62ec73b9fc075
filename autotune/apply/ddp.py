"""The data-parallel path: a pure data-parallel plan as users run it: recomputation as planned, then
``DistributedDataParallel`` (gradients averaged, all-reduced in buckets during the backward, each gradient a view
into its bucket: one copy of the gradients, as the plan's memory counts them). With several micro-batches run
all but the last under its ``no_sync()``: the plan prices one all-reduce a step. A pipeline's data-parallel stage
syncs its gradients once after the schedule instead (``sync_grads``: DDP's reducer expects each forward to be
followed by its backward, which GPipe's order is not)."""
from __future__ import annotations

from autotune.apply.batch import DataSplit
from autotune.apply.layers import Site, _recompute, torch
from autotune.plan.typed import TypedPlan

BUCKET_BYTES = 25 * 2 ** 20  # DDP's default bucket


def ddp_module(model, chain: list[Site], prefixes: dict, plan: TypedPlan, device: str, group=None):
    """``model`` recomputed as planned and wrapped in ``DistributedDataParallel`` over ``group`` (None: the
    world)."""
    from torch.nn.parallel import DistributedDataParallel
    _recompute(model, chain, prefixes, plan.recompute, plan.recompute_blocks)
    model.to(device)
    return DistributedDataParallel(model, device_ids=[torch.cuda.current_device()] if device == "cuda" else None,
                                   process_group=group, gradient_as_bucket_view=True)


def sync_grads(module, group) -> None:
    """The plain tensors' gradients of ``module`` averaged over ``group``, all-reduced in buckets of
    ``BUCKET_BYTES`` (a DTensor's gradient is its own placement's business)."""
    from torch.distributed.tensor import DTensor
    grads = [p.grad for p in module.parameters() if p.grad is not None and not isinstance(p, DTensor)]
    n = torch.distributed.get_world_size(group)
    bucket: list = []
    for i, g in enumerate(grads):
        bucket.append(g)
        if sum(x.numel() * x.element_size() for x in bucket) >= BUCKET_BYTES or i == len(grads) - 1:
            flat = torch.cat([x.reshape(-1) for x in bucket])
            torch.distributed.all_reduce(flat, group=group)
            flat /= n
            for x, y in zip(bucket, flat.split([x.numel() for x in bucket])):
                x.copy_(y.view_as(x))
            bucket = []


def place(job):
    """(the DDP module, this rank's ``DataSplit``)."""
    import torch.distributed as dist
    return ddp_module(job.model, job.chain, job.prefixes, job.plan, job.device), DataSplit(dist.get_rank(),
                                                                                           job.plan.world)
