"""What the executed forward pass keeps for the backward pass, per layer: the
bytes of the distinct storages that autograd saves (``saved_tensors_hooks``),
measured without an allocator, so on CPUs too. The weights (parameters, counted
apart) and the small per-row tensors (indices, masks, statistics: at most two
values per row of a layer's input) are left out, as ``autotune.sbp.memory``
leaves them out; what remains is what that model calls a layer's activations.
"""
from __future__ import annotations

import contextlib

from autotune.execute.layout import torch


def saved_bytes(model, data: dict, loss_scale: float) -> list[int]:
    """Per chain position, bytes saved for the backward pass by the forward of one micro-batch
    (a storage saved by several layers is counted at the first). Runs the forward only."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: set[int] = set()
    per: list[int] = [0] * len(model.graph.chain)
    rows = {"n": 1}
    where = {"pos": 0}

    def pack(t):
        st = t.untyped_storage()
        key = st.data_ptr()
        small = t.dtype in (torch.bool, torch.int64, torch.int32) or t.numel() <= 2 * rows["n"]
        if key not in params and key not in seen and not small:
            seen.add(key)
            per[where["pos"]] += st.nbytes()
        return t

    @contextlib.contextmanager
    def around(pos):
        where["pos"] = pos
        spec = model.specs[model.graph.chain[pos]]
        shape = spec.in_shape or spec.out_shape or (1,)
        rows["n"] = shape[0]
        yield

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        share, _ = model.forward(data, loss_scale, around)
    del share
    return per
