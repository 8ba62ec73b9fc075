"""The embedding as the plans account for it: the rows of a vocabulary-split weight that this
device holds, looked up by token id, and zero for ids held elsewhere; shared by the executed
model (autotune.execute) and its timing (python -m calibrate compute)."""
from __future__ import annotations


def masked_embedding(torch, ids, w, off: int):
    """ids: [tokens] token ids; w: [n, hidden], the weight's rows off .. off + n - 1; returns
    [tokens, hidden], the looked-up rows for ids in that range and zeros for the others."""
    n = w.shape[0]
    mine = (ids >= off) & (ids < off + n)
    return torch.nn.functional.embedding((ids - off).clamp(0, n - 1), w) * mine.unsqueeze(1).to(w.dtype)
