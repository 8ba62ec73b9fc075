"""The attention core as the plans account for it: causal softmax(Q K^T / sqrt(d)) V
with the probabilities kept for the backward pass (no flash attention, no
recomputation: autotune.sbp.memory counts them), shared by the executed model
(autotune.execute) and its timing (python -m calibrate compute)."""
from __future__ import annotations


def causal_attention(torch, q, k, v):
    """q, k, v: [..., sequence, head_dim]; returns [..., sequence, head_dim]."""
    s = q.shape[-2]
    scores = (q @ k.transpose(-2, -1)) * (q.shape[-1] ** -0.5)
    future = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
    probs = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
    return probs @ v
