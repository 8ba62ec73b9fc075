"""Each layer kind's forward on local pieces, given the plan's placements.

A layer computes on its pieces and its output *is* what the plan says it is
(a matmul whose contracted dimension is split yields partial sums, declared
P); nothing checks or repairs it, so a wrong placement in a plan gives wrong
numbers (tests/autotune/test_execute_*.py shows it). Gradients follow the dual
placements (B <-> P), as the plan's backward boxings assume.

Conventions shared with ``reference.py``: a matmul computes ``x @ W`` with W
[k, n]; a layer norm's weight is [2, hidden] (scale, shift); the fused QKV
output is laid out head by head ([q k v] of head 0, then head 1, ...) so that
splitting it along heads keeps each head whole; attention is causal over each
sequence of the micro-batch, its probabilities kept for the backward pass
(``calibrate.attention``, as the plans' memory model counts); the loss is
softmax cross-entropy.
"""
from __future__ import annotations

from dataclasses import dataclass

from calibrate.attention import attention_layer
from calibrate.embedding import masked_embedding
from calibrate.errors import UserError

from autotune.execute.commlog import Call
from autotune.execute.layout import DTensor, Partial, Replicate, Shard, box, local_piece, local_range, torch
from autotune.execute.planread import LayerSpec
from autotune.sbp.sbp import B, P, is_split

F = torch.nn.functional
EPS = 1e-5


@dataclass
class Ctx:
    mesh: object
    coords: tuple[int, ...]
    axis_sizes: tuple[int, ...]
    dtype: object  # compute dtype of activations
    stat_dtype: object  # dtype of softmax / layer norm statistics
    log: object = None  # an autotune.execute.commlog.CommLog: the collectives issued, for their replay

    def piece(self, full, fine):
        return local_piece(full, fine, self.coords, self.axis_sizes)


def _internal(spec: LayerSpec, tensor: str):
    return next((i for i in spec.internal if i.tensor == tensor), None)


def _boxed(ctx: Ctx, spec: LayerSpec, tensor: str, x, fine):
    """``x`` after the layer's own boxing of ``tensor`` (SUMMA's panel gathers), and its placement."""
    it = _internal(spec, tensor)
    if it is None:
        return x, fine
    return box(x, ctx.mesh, it.shape, it.src, it.dst, log=ctx.log), it.dst


def matmul(ctx: Ctx, spec: LayerSpec, x, w, wfine):
    x, _ = _boxed(ctx, spec, "input", x, spec.input)
    w, _ = _boxed(ctx, spec, "weight", w, wfine)
    return x @ w


def embedding(ctx: Ctx, spec: LayerSpec, ids, w, wfine):
    """One-hot(ids) @ W with the vocabulary split as W's rows: rows held elsewhere contribute zero."""
    w, wfine = _boxed(ctx, spec, "weight", w, wfine)
    ids = ctx.piece(ids, tuple("S0" if p == "S0" else B for p in spec.output))
    off, _ = local_range(spec.layer.dim("k"), 0, wfine, ctx.coords, ctx.axis_sizes)
    return masked_embedding(torch, ids, w, off)


def layernorm(ctx: Ctx, spec: LayerSpec, x, w):
    if spec.signature != "layernorm-split":
        return F.layer_norm(x, (x.shape[1],), w[0], w[1], EPS)
    it = _internal(spec, "layernorm-stats")
    return split_layernorm(x, w, spec.layer.dim("hidden"), ctx.stat_dtype,
                           lambda stats: box(stats, ctx.mesh, it.shape, it.src, it.dst, log=ctx.log))


def split_layernorm(x, w, hidden: int, stat_dtype, reduce):
    """Layer norm of rows whose ``hidden`` features are split across devices: each device's row sums
    and sums of squares (in ``stat_dtype``), made whole by ``reduce`` (the plan's boxing), then the
    normalisation and the affine on the local features."""
    xs = x.to(stat_dtype)
    stats = reduce(torch.stack([xs.sum(1), (xs * xs).sum(1)], 1))
    mean = stats[:, 0] / hidden
    var = stats[:, 1] / hidden - mean * mean
    xhat = (xs - mean.unsqueeze(1)) * torch.rsqrt(var + EPS).unsqueeze(1)
    return (xhat.to(x.dtype) * w[0] + w[1])


def attention(ctx: Ctx, spec: LayerSpec, x):
    dims = spec.layer
    seq = dims.dim("tokens") // dims.dim("micro_batch")
    hd = dims.dim("hidden") // dims.dim("heads")
    return attention_layer(torch, x, seq, hd)


def loss(ctx: Ctx, spec: LayerSpec, logits, targets, scale: float):
    """This device's share of the loss: sum over its tokens of log-sum-exp minus the
    target logit, times ``scale`` (``_CrossEntropy``). With the vocabulary split, the
    row max and the (sum of exp, target logit) pair are all-reduced over the vocabulary
    axes. With the vocabulary whole ("loss-replicated"), the devices along those axes
    compute the same share and each returns the whole gradient (B, as the plan says)."""
    fine = spec.input
    off, n = local_range(spec.layer.dim("vocabulary"), 1, fine, ctx.coords, ctx.axis_sizes)
    tgt = ctx.piece(targets, tuple("S0" if p == "S0" else B for p in fine))
    split = tuple(P if is_split(p) and p != "S0" else p for p in fine)
    return _CrossEntropy.apply(logits, tgt, off, n, scale, ctx, split, spec.layer.dim("tokens"))


class _CrossEntropy(torch.autograd.Function):
    """Softmax cross-entropy over a vocabulary split across devices, as Megatron-LM's
    vocab-parallel cross-entropy does it: forward in the statistics dtype (fp32 for
    16-bit logits), one copy of the local logits turned in place into the softmax
    probabilities, which is the one tensor kept for the backward pass (4 bytes per
    local logit: ``autotune.sbp.memory``); backward (probabilities - one-hot) x the
    loss gradient, in place, cast to the logits' dtype. No communication backward:
    the probabilities are already normalised over the whole vocabulary."""

    @staticmethod
    def forward(fctx, logits, tgt, off, n, scale, ctx, split, tokens):
        whole = tuple(B if p == P else p for p in split)
        z = logits.to(ctx.stat_dtype, copy=True)
        top = z.max(1, keepdim=True).values
        if split != whole:
            top = _max_over(ctx, top, split)
        z.sub_(top)
        mine = (tgt >= off) & (tgt < off + n)
        idx = (tgt - off).clamp(0, n - 1).unsqueeze(1)
        picked = z.gather(1, idx).squeeze(1) * mine.to(z.dtype)
        z.exp_()
        pair = torch.stack([z.sum(1), picked], 1)
        if split != whole:
            pair = box(pair, ctx.mesh, (tokens, 2), split, whole, log=ctx.log)
        z.div_(pair[:, :1])
        fctx.save_for_backward(z, idx, mine)
        fctx.scale, fctx.dtype = scale, logits.dtype
        return (torch.log(pair[:, 0]) - pair[:, 1]).sum() * scale

    @staticmethod
    def backward(fctx, g):
        probs, idx, mine = fctx.saved_tensors
        k = g.to(probs.dtype) * fctx.scale
        probs.mul_(k)
        probs.scatter_add_(1, idx, -(k * mine.to(probs.dtype)).expand(idx.shape[0]).unsqueeze(1))
        return probs.to(fctx.dtype), None, None, None, None, None, None, None


def _max_over(ctx: Ctx, m, split):
    """The max over the vocabulary axes (a max all-reduce, no gradient)."""
    if ctx.log is not None:
        ctx.log.add(Call("max", tuple(m.shape), m.dtype, (), tuple(split)))
    return max_over(ctx.mesh, ctx.axis_sizes, m, split)


def max_over(mesh, axis_sizes, m, split):
    """The row maxima ``m`` (rows split as S0) all-reduced by max over the axes where ``split`` is P."""
    pl = tuple(Partial("max") if p == P else Shard(0) if p == "S0" else Replicate() for p in split)
    shape = (m.shape[0] * _splits(split, "S0", axis_sizes), 1)
    d = DTensor.from_local(m.contiguous(), mesh, pl, run_check=False, shape=shape, stride=(1, 1))
    return d.redistribute(mesh, tuple(Replicate() if p == P else q for p, q in zip(split, pl))).to_local()


def _splits(fine, p, sizes) -> int:
    out = 1
    for q, n in zip(fine, sizes):
        if q == p:
            out *= n
    return out


def pointwise(ctx: Ctx, spec: LayerSpec, x):
    return F.gelu(x)


def forward(ctx: Ctx, spec: LayerSpec, x, weights: dict, data: dict, loss_scale: float):
    """The layer's local output (the loss layer: this device's share of the loss)."""
    kind = spec.kind
    if kind == "embedding":
        return embedding(ctx, spec, data["ids"], weights["weight"], spec.weights[0][2])
    if kind == "matmul":
        return matmul(ctx, spec, x, weights["weight"], spec.weights[0][2])
    if kind == "layernorm":
        return layernorm(ctx, spec, x, weights["weight"])
    if kind == "attention":
        return attention(ctx, spec, x)
    if kind == "pointwise":
        return pointwise(ctx, spec, x)
    if kind == "loss":
        return loss(ctx, spec, x, data["targets"], loss_scale)
    raise UserError(f"layer {spec.layer.name}: execute cannot run {kind} layers; run a gpt or mlp plan")
