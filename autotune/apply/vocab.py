"""A pipeline stage's layers computed outside DDP / fully_shard (``autotune.plan.layouts.local_twin``): a first
stage's embedding split by features (``_column_lookup``: each device looks the whole micro-batch up in its
columns and hands its piece on by an all-to-all, the S1 -> S0 boxing the plan prices; also a single-stage FSDP
plan's, ``place_columns``) and a last stage's logits
split by vocabulary with Megatron-LM's vocabulary-parallel cross entropy (``_vocab_logits``, ``_vocab_loss``:
the stream all-gathered over the stage's data ranks, the local matmul against the rank's rows, the tokens' maxima
and sums of exponentials all-reduced; the stream's gradient reduce-scattered back). Modules that cannot take these
(a tied embedding and head, an embedding of several modules, a head with a bias) keep the DTensor path."""
from __future__ import annotations

import functools
from collections import Counter

from autotune.apply.batch import DataSplit, scale_grad
from autotune.apply.dtensor import _global_shape
from autotune.apply.layers import Site, contiguous_strides, torch

import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.tensor import DTensor, Shard, distribute_tensor  # noqa: E402


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
    out = scale_grad(nn.functional.embedding(ids, module.weight.to_local(), module.padding_idx), factor=factor)
    placements = [Shard(out.dim() - 1)] * mesh.ndim
    shape = _global_shape(out, placements, mesh)
    x = DTensor.from_local(out, mesh, placements, run_check=False, shape=shape, stride=contiguous_strides(shape))
    return x.redistribute(mesh, [Shard(0)] * mesh.ndim).to_local()


def chain_columns(chain: list[Site]):
    """The embedding module of a single-stage plan's ``column_twin`` (``_column_module``), its table shared with no
    other module of ``chain``; None: the plan takes the DTensor path."""
    ids = Counter(id(p) for site in chain for _, m in site.modules for p in m.parameters(recurse=False))
    return _column_module(chain, {i for i, n in ids.items() if n > 1})


def place_columns(module, mesh, split: DataSplit) -> None:
    """``module``'s table split by columns over the data ``mesh`` beside fully_shard (a single-stage plan's
    ``column_twin``): each rank's ids gathered over the mesh (row-major, as ``split`` orders the pieces), looked up
    by ``_column_lookup``, which hands each rank its piece back."""
    module.weight = nn.Parameter(distribute_tensor(module.weight.detach(), mesh, [Shard(1)] * mesh.ndim))
    module.forward = functools.partial(_piece_lookup, module=module, mesh=mesh, factor=1 / split.world)


def _piece_lookup(ids, *, module, mesh, factor: float):
    whole = DTensor.from_local(ids, mesh, [Shard(0)] * mesh.ndim, run_check=False).full_tensor()
    return _column_lookup(whole, module=module, mesh=mesh, factor=factor)


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
    return nn.functional.linear(_GatherStream.apply(scale_grad(x, factor=factor), group), module.weight.to_local())


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


def _piece_loss(x, target, *, loss_fn, split: DataSplit):
    """The loss of this rank's piece: its outputs against its piece of the micro-batch's targets."""
    return loss_fn(x, split.piece(target, "the targets"))
