"""Attention of one block of queries over blocks of keys, merged by their log-sum-exp (the flash / ring attention
way): ``attend(q, k, v, blocks, scale)``, ``blocks`` the (start, end, causal) key ranges the queries see, each a
dense block (every query sees every key) or a causal square (query r sees keys up to r). Context parallelism's
chunks (``autotune.apply.context``) see a dense prefix and a causal square, so every kernel call is one the fused
Hopper kernels run (torch's lower-right causal mask runs on FA2 only: 1.7x the ideal split on the H200,
``reports/records/context_parallel.md``). The backward of each block takes the merged output and log-sum-exp
(the softmax over all the blocks), its key gradients summed into the block's range.

Kernels: on CUDA torch's cuDNN attention ops (``_scaled_dot_product_cudnn_attention`` and its backward, every
tensor contiguous [batch, heads, tokens, head_dim]); on the CPU the same two steps in plain tensor algebra (what
the gloo tests run, in float64). Grouped-query K/V heads are expanded to the query heads inside the kernel call
(not saved), their gradients summed back."""
from __future__ import annotations

from autotune.apply.layers import torch


def _expand(t, heads: int):
    return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)


def _fold(g, kv_heads: int):
    """A gradient of expanded K/V heads summed back onto the ``kv_heads`` heads."""
    b, h, s, d = g.shape
    return g if h == kv_heads else g.view(b, kv_heads, h // kv_heads, s, d).sum(2)


class _Math:
    """The two steps in plain tensor algebra (any device, any dtype)."""

    @staticmethod
    def scores(q, k, causal: bool, scale: float):
        s = (q @ k.transpose(-1, -2)) * scale
        if causal:
            s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
        return s

    def forward(self, q, k, v, causal: bool, scale: float):
        s = self.scores(q, k, causal, scale)
        lse = torch.logsumexp(s, dim=-1)
        return torch.exp(s - lse.unsqueeze(-1)) @ v, lse, None

    def backward(self, do, q, k, v, out, lse, aux, causal: bool, scale: float):
        p = torch.exp(self.scores(q, k, causal, scale) - lse.unsqueeze(-1))
        ds = p * (do @ v.transpose(-1, -2) - (do * out).sum(-1, keepdim=True))
        return (ds @ k) * scale, (ds.transpose(-1, -2) @ q) * scale, p.transpose(-1, -2) @ do


class _Cudnn:
    """torch's cuDNN attention ops (the kernel ``scaled_dot_product_attention`` picks on Hopper)."""

    def forward(self, q, k, v, causal: bool, scale: float):
        o, lse, cq, ck, mq, mk, seed, offset, _ = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q, k, v, None, True, 0.0, causal, False, scale=scale)
        return o, lse.reshape(o.shape[:-1]).float(), (cq, ck, mq, mk, seed, offset, lse.shape)

    def backward(self, do, q, k, v, out, lse, aux, causal: bool, scale: float):
        cq, ck, mq, mk, seed, offset, shape = aux
        return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(  # None: no bias (an undefined tensor)
            do, q, k, v, out, lse.reshape(shape), seed, offset, None, cq, ck, mq, mk, 0.0, causal, scale=scale)


def kernel(device):
    return _Cudnn() if torch.device(device).type == "cuda" else _Math()


class _Attend(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, blocks: tuple, scale: float):
        ker, q = kernel(q.device), q.contiguous()
        parts = []
        for lo, hi, causal in blocks:
            kb, vb = (_expand(t[:, :, lo:hi], q.shape[1]).contiguous() for t in (k, v))
            parts.append(ker.forward(q, kb, vb, causal, scale))
        lse = torch.logsumexp(torch.stack([p[1] for p in parts]), dim=0)
        wide = torch.promote_types(q.dtype, torch.float32)  # the merge in float32 at least
        out = sum(o.to(wide) * torch.exp(b_lse - lse).unsqueeze(-1) for o, b_lse, _ in parts).to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.blocks, ctx.scale, ctx.aux = blocks, scale, [p[2] for p in parts]
        return out

    @staticmethod
    def backward(ctx, do):
        q, k, v, out, lse = ctx.saved_tensors
        ker, do = kernel(q.device), do.contiguous()
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for (lo, hi, causal), aux in zip(ctx.blocks, ctx.aux):
            kb, vb = (_expand(t[:, :, lo:hi], q.shape[1]).contiguous() for t in (k, v))
            gq, gk, gv = ker.backward(do, q, kb, vb, out, lse, aux, causal, ctx.scale)
            dq += gq
            dk[:, :, lo:hi] += _fold(gk, k.shape[1])
            dv[:, :, lo:hi] += _fold(gv, v.shape[1])
        return dq, dk, dv, None, None


def attend(q, k, v, blocks: tuple, scale: float):
    """[batch, heads, queries, head_dim] ``q`` over the key ranges ``blocks`` of ``k`` and ``v`` (the module doc)."""
    return _Attend.apply(q, k, v, tuple(blocks), scale)


def chunk_blocks(start: int, n: int) -> tuple:
    """The key blocks of the causal queries [start, start + n): the dense prefix before them and their square."""
    return ((0, start, False),) * (start > 0) + ((start, start + n, True),)
