"""Fixed-seed weights and batches, identical on every device and in the one-process reference."""
from __future__ import annotations

import math

from autotune.execute.layout import torch


def _gen(device, *keys: int):
    g = torch.Generator(device=device)
    seed = 0
    for k in keys:
        seed = (seed * 1_000_003 + k + 1) % (2**62)
    g.manual_seed(seed)
    return g


def init_weight(kind: str, shape: tuple[int, ...], seed: int, position: int, dtype, device):
    """The whole weight of the layer at chain ``position``: N(0, 1) embeddings, matmuls
    N(0, 1/k), layer norms scale 1 + N(0, 0.1^2) and shift N(0, 0.1^2)."""
    g = _gen(device, seed, position)
    w = torch.randn(shape, generator=g, device=device, dtype=torch.float64 if dtype == torch.float64 else torch.float32)
    if kind == "layernorm":
        w = 0.1 * w
        w[0] += 1.0
    elif kind == "matmul":
        w = w / math.sqrt(shape[0])
    return w.to(dtype)


def batch(graph, seed: int, step: int, micro: int, device, dtype) -> dict:
    """Micro-batch ``micro`` of step ``step``: the inputs (token ids for a model that starts
    with an embedding, N(0, 1) features otherwise) and the loss layer's target classes."""
    g = _gen(device, seed, 1_000_000 + step, micro)
    first, last = graph.layers[graph.chain[0]], graph.layers[graph.chain[-1]]
    t = first.dim("tokens")
    if first.kind == "embedding":
        out = {"ids": torch.randint(0, first.dim("k"), (t,), generator=g, device=device)}
    else:
        out = {"x": torch.randn((t, first.dim("k")), generator=g, device=device, dtype=torch.float32).to(dtype)}
    out["targets"] = torch.randint(0, last.dim("vocabulary"), (t,), generator=g, device=device)
    return out
