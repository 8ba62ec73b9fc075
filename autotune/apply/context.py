"""Context parallelism as the plans price it (``autotune.sbp.layers.Attention``'s "attention-cp"; Megatron-LM's
``--context-parallel-size``, Llama 3's all-gather attention, Dubey et al. 2024, section 3.3.2), on a Hugging Face
model placed by the DDP, tensor or fully_shard path (``autotune.plan.layouts.CONTEXT_PATHS``): the ``c`` ranks
of a context group (``autotune.plan.layouts.context_axes``, the innermost data axes) hold the same whole
sequences (``data_piece`` cuts the batch over the groups only), and a forward pre-hook on the model cuts each
sequence into 2c chunks, rank i keeping the chunks i and 2c - 1 - i (the causal work balanced), with their
global positions (``position_ids``: rotary or learned positions as one process has them) and their labels
shifted over the whole sequence first (``shift_labels``, the loss normalised by the group's tokens:
``num_items_in_batch``). Every layer but the attention core is token-wise and runs on the local chunks; the core
(registered with transformers' ``AttentionInterface``) all-gathers K and V over the group (their gradients
reduce-scattered backward) and computes each local chunk's queries against the keys up to it (a dense prefix
and a causal square merged by their log-sum-exp: ``autotune.apply.blockattn``). The gradients are averaged over
all data ranks as without it: with the loss scaled by ``c`` over the group's tokens, each group's contribution
is its sequences' mean loss, as data parallelism over the groups gives it. In a pipeline's stages placed by DDP or
fully_shard (``autotune.apply_pipeline``; every stage over one size, ``group`` made alike on every rank) the same
groups and attention: the first stage cuts each micro-batch's ids into the rank's chunks (``place_stage``), every
stage gives its blocks their global positions (``HFStage.positions``), the stream crossing the boundaries is each
rank's chunks, and the last stage's loss is of the targets cut alike (``chunk_loss``)."""
from __future__ import annotations

import functools
from dataclasses import dataclass

from calibrate.errors import UserError

from autotune.apply.blockattn import attend, chunk_blocks
from autotune.apply.layers import torch

NAME = "autotune_context_parallel"
IGNORE = -100  # transformers' ignore index: the label after a sequence's last token


@dataclass(frozen=True)
class ContextGroup:
    """This rank's place in its context group: ``rank`` of ``size``, over the process ``group``."""

    rank: int
    size: int
    group: object

    def starts(self, seq: int) -> tuple[int, int]:
        """The first positions of this rank's two chunks of a sequence of ``seq``: the chunks ``rank`` and
        ``2 size - 1 - rank`` of 2 ``size``."""
        n = seq // (2 * self.size)
        return self.rank * n, (2 * self.size - 1 - self.rank) * n

    def positions(self, seq: int, device) -> "torch.Tensor":
        """The global positions of this rank's tokens of a sequence of ``seq``, in local order."""
        n = seq // (2 * self.size)
        return torch.cat([torch.arange(lo, lo + n, device=device) for lo in self.starts(seq)])

    def cut(self, t) -> "torch.Tensor":
        """A [batch, sequence, ...] tensor of whole sequences cut to this rank's chunks (dimension 1)."""
        seq = t.shape[1]
        if seq % (2 * self.size):
            raise UserError(f"context parallelism over {self.size}: a sequence of {seq} tokens does not split into "
                            f"{2 * self.size} equal chunks: use sequences of a multiple of {2 * self.size}")
        return t.index_select(1, self.positions(seq, t.device))

    def stream_positions(self, x) -> "torch.Tensor":
        """The global positions [batch, local tokens] of a pipeline stage's input ``x`` (the ids or the stream of
        this rank's chunks, dimension 1: a ``size``-th of each sequence)."""
        return self.positions(x.shape[1] * self.size, x.device).unsqueeze(0).expand(x.shape[0], -1)

    def order(self, pieces: list) -> "torch.Tensor":
        """Every rank's local pieces (dimension 2: [chunk i, chunk 2c - 1 - i]) in the sequence's order."""
        first = [p.chunk(2, dim=2)[0] for p in pieces]
        last = [p.chunk(2, dim=2)[1] for p in reversed(pieces)]
        return torch.cat(first + last, dim=2)

    def pieces(self, whole) -> "torch.Tensor":
        """``order``'s inverse: [size, *local shape], rank j's local piece of ``whole`` at j."""
        chunks = whole.chunk(2 * self.size, dim=2)
        return torch.stack([torch.cat([chunks[j], chunks[2 * self.size - 1 - j]], dim=2) for j in range(self.size)])


class _GatherSequence(torch.autograd.Function):
    """The group's local pieces all-gathered into the whole sequence; backward, the whole gradient's pieces
    summed over the group, each rank its own (a reduce-scatter; an all-reduce on gloo, which has none)."""

    @staticmethod
    def forward(ctx, x, cp: ContextGroup):
        ctx.cp = cp
        out = torch.empty((cp.size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        torch.distributed.all_gather_into_tensor(out, x.contiguous(), group=cp.group)
        return cp.order(list(out.chunk(cp.size)))

    @staticmethod
    def backward(ctx, g):
        cp = ctx.cp
        stacked = cp.pieces(g).contiguous()
        if torch.distributed.get_backend(cp.group) == "gloo":
            torch.distributed.all_reduce(stacked, group=cp.group)
            return stacked[cp.rank].contiguous(), None
        out = torch.empty_like(stacked[0])
        torch.distributed.reduce_scatter_tensor(out, stacked.flatten(0, 1), group=cp.group)
        return out, None


def attention(module, query, key, value, _attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """transformers' attention interface: [batch, heads, local tokens, head_dim] in, [batch, local tokens, heads,
    head_dim] out; each local chunk's queries against the whole sequence's keys up to it, a dense prefix and a
    causal square merged by their log-sum-exp (``autotune.apply.blockattn``; the attention mask: none is made for
    this implementation, the causal one is the chunks')."""
    if dropout:
        raise UserError(f"context parallelism: attention dropout {dropout:g} is not taken: set the model's "
                        f"attention_dropout to 0")
    cp: ContextGroup = module._autotune_context
    kv = _GatherSequence.apply(torch.cat([key, value], dim=-1), cp)
    key, value = kv.split([key.shape[-1], value.shape[-1]], dim=-1)
    n = query.shape[2] // 2
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    out = [attend(q, key, value, chunk_blocks(start, n), scale)
           for q, start in zip(query.split(n, dim=2), cp.starts(key.shape[2]))]
    return torch.cat(out, dim=2).transpose(1, 2).contiguous(), None


def _cut(module, args, kwargs, *, cp: ContextGroup):
    """The model's forward pre-hook: the call's [batch, sequence] tensors cut to this rank's chunks (``labels``
    shifted first), and its positions and the loss's normaliser added (the module doc)."""
    ids = kwargs.get("input_ids", args[0] if args else None)
    if ids is None or ids.dim() != 2:
        raise UserError("context parallelism: the model is called without input_ids of [batch, sequence]: call it "
                        "with input_ids=")
    seq = ids.shape[1]
    mask = kwargs.pop("attention_mask", None)
    if mask is not None and not bool(mask.all()):
        raise UserError("context parallelism: an attention mask with padding is not taken (each rank holds chunks of "
                        "the sequences): pack the sequences to the full length, or search without it")
    labels = kwargs.get("labels")
    if labels is not None:
        shifted = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=IGNORE)
        kwargs["labels"] = kwargs["shift_labels"] = cp.cut(shifted)
        kwargs["num_items_in_batch"] = max(int((shifted != IGNORE).sum()), 1) / cp.size

    def cut(t):  # a [batch, sequence, ...] tensor to this rank's chunks
        return cp.cut(t) if hasattr(t, "dim") and t.dim() >= 2 and t.shape[1] == seq else t
    kwargs = {k: v if k in ("labels", "shift_labels") else cut(v) for k, v in kwargs.items()}
    args = tuple(cut(a) for a in args)
    kwargs.setdefault("position_ids", cp.positions(seq, ids.device).unsqueeze(0).expand(ids.shape[0], -1))
    return args, kwargs


def check_model(model, size: int, sequence: int | None) -> None:
    """A model context parallelism runs on: a transformers model whose attention goes through its attention
    interface and sees the whole sequence (no sliding window shorter than it); one line naming the fix."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "_attn_implementation"):
        raise UserError(f"the plan runs context parallelism over {size} ranks, which takes a Hugging Face "
                        f"transformers model (its attention interface): search without it (--context-parallel 1)")
    window = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None
    if window is not None and sequence is not None and window < sequence:
        raise UserError(f"the model attends over a sliding window of {window} tokens, shorter than the plan's "
                        f"sequence of {sequence}, which context parallelism does not take: search with "
                        f"--context-parallel 1")


def group(size: int, data: int, device: str, stages: int = 1) -> ContextGroup:
    """This rank's context group of ``size``, the innermost of its stage's ``data`` data ranks (the tensor ranks
    inside them), on a mesh every rank makes alike: (``stages``, groups, context, tp)."""
    from torch.distributed.device_mesh import init_device_mesh
    tensor = torch.distributed.get_world_size() // (stages * data)
    mesh = init_device_mesh(device, (stages, data // size, size, tensor),
                            mesh_dim_names=("pp", "groups", "context", "tp"))
    return ContextGroup(mesh.get_local_rank("context"), size, mesh.get_group("context"))


def attend_over(model, cp: ContextGroup) -> None:
    """``model``'s attention (its modules, a pipeline stage's among them) all-gathering K and V over ``cp``."""
    from transformers import AttentionInterface
    AttentionInterface.register(NAME, attention)
    model.config._attn_implementation = NAME
    for m in model.modules():
        m._autotune_context = cp


def pieces(split, size: int):
    """``split`` (this rank's piece over the data ranks) over the context groups: the groups' pieces."""
    return type(split)(split.rank // size, split.world // size)


def place(model, size: int, split, device: str, sequence: int | None = None):
    """``model`` (placed by its path, ``split`` this rank's piece of the batch over the data ranks) runs context
    parallelism over ``size`` ranks, the innermost of its data ranks; returns this rank's piece over the groups."""
    check_model(model, size, sequence)
    cp = group(size, split.world, device)
    attend_over(model, cp)
    model.register_forward_pre_hook(functools.partial(_cut, cp=cp), with_kwargs=True, prepend=True)
    return pieces(split, size)


def _cut_ids(module, args, *, cp: ContextGroup):
    """A pipeline's first stage's forward pre-hook: its ids (its piece of the micro-batch, [batch, sequence]) cut to
    this rank's chunks."""
    return tuple(cp.cut(a) for a in args)


def place_stage(module, cp: ContextGroup, first: bool) -> None:
    """A pipeline's stage (``autotune.apply.cuts.HFStage``, its data split's hook placed) run on this rank's chunks:
    the first stage cuts its ids, every stage gives its blocks the chunks' global positions (rotary positions in
    every stage, a learned table in the first); the stream crossing the boundaries is each rank's chunks."""
    if first:
        module.register_forward_pre_hook(functools.partial(_cut_ids, cp=cp))
    module.positions = cp.stream_positions


def chunk_loss(x, target, *, loss_fn, cp: ContextGroup):
    """A pipeline's last stage's loss of this rank's chunks: ``target`` (its piece of the micro-batch's targets,
    shifted over the whole sequences by the caller) cut as the ids were; ``loss_fn``'s mean over the rank's tokens
    is their sum over the group's tokens / c (each rank holds a c-th of them), the one-stage normaliser
    (``num_items_in_batch``), and so the gradients averaged over the data ranks are one process's."""
    return loss_fn(x, cp.cut(target))

