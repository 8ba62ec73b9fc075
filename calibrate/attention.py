"""The attention core as the plans account for it: causal softmax(Q K^T / sqrt(d)) V
with the probabilities kept for the backward pass (no flash attention, no
recomputation: autotune.sbp.memory counts them), and the layer around it (the fused
QKV split into heads, the output made token-major again), shared by the executed
model (autotune.execute) and its timing (python -m calibrate compute)."""
from __future__ import annotations


def causal_attention(torch, q, k, v):
    """q, k, v: [..., sequence, head_dim]; returns [..., sequence, head_dim]."""
    s = q.shape[-2]
    scores = (q @ k.transpose(-2, -1)) * (q.shape[-1] ** -0.5)
    future = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
    probs = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
    return probs @ v


def attention_layer(torch, x, seq: int, head_dim: int):
    """x: [tokens, 3 * heads * head_dim], the fused Q, K and V of whole sequences of ``seq``
    tokens, per head; returns [tokens, heads * head_dim]."""
    t, width = x.shape
    heads = width // (3 * head_dim)
    qkv = x.view(t // seq, seq, heads, 3, head_dim)
    q, k, v = (qkv[:, :, :, i].transpose(1, 2) for i in range(3))
    return causal_attention(torch, q, k, v).transpose(1, 2).reshape(t, heads * head_dim)
