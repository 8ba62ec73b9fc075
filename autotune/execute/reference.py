"""The same model in one process on whole tensors, with plain PyTorch ops
(F.embedding, F.layer_norm, F.cross_entropy, Adam): the yardstick a plan's
execution must match (same weights, same data, same steps)."""
from __future__ import annotations

from autotune.execute.data import batch, init_weight
from autotune.execute.layout import torch
from autotune.sbp.layers import make_op

F = torch.nn.functional


def _weights(layer) -> list[tuple[str, tuple[int, ...]]]:
    if layer.kind in ("matmul", "embedding"):
        return [("weight", (layer.dim("k"), layer.dim("n")))]
    if layer.kind == "layernorm":
        return [("weight", (2, layer.dim("hidden")))]
    return []


def _forward(graph, params, data):
    x = data.get("x")
    for pos, v in enumerate(graph.chain):
        layer = graph.layers[v]
        w = params[pos].get("weight")
        if layer.kind == "embedding":
            x = F.embedding(data["ids"], w)
        elif layer.kind == "matmul":
            x = x @ w
        elif layer.kind == "layernorm":
            x = F.layer_norm(x, (x.shape[1],), w[0], w[1], 1e-5)
        elif layer.kind == "pointwise":
            x = F.gelu(x)
        elif layer.kind == "attention":
            mb, heads, hidden = layer.dim("micro_batch"), layer.dim("heads"), layer.dim("hidden")
            seq, hd = layer.dim("tokens") // mb, hidden // heads
            qkv = x.view(mb, seq, heads, 3, hd)
            q, k, v_ = (qkv[:, :, :, i].transpose(1, 2) for i in range(3))
            x = F.scaled_dot_product_attention(q, k, v_, is_causal=True).transpose(1, 2).reshape(mb * seq, hidden)
        elif layer.kind == "loss":
            return F.cross_entropy(x, data["targets"], reduction="sum")
    raise ValueError("the model has no loss layer")


def train_reference(graph, seed: int, steps: int, lr: float, dtype=None) -> tuple[list[float], list[dict], list[dict]]:
    """(loss per step, whole weights per chain position after the steps, their gradients in the last
    step), in float64 by default."""
    dtype = dtype or torch.float64
    cpu = torch.device("cpu")
    params = []
    for pos, v in enumerate(graph.chain):
        layer = graph.layers[v]
        make_op(layer)  # a layer kind the plans know
        params.append({n: init_weight(layer.kind, s, seed, pos, dtype, cpu).requires_grad_(True)
                       for n, s in _weights(layer)})
    flat = [p for d in params for p in d.values()]
    opt = torch.optim.Adam(flat, lr=lr)
    tokens = graph.layers[graph.chain[-1]].dim("tokens") * graph.micro_batches
    losses = []
    for s in range(steps):
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for j in range(graph.micro_batches):
            out = _forward(graph, params, batch(graph, seed, s, j, cpu, dtype)) / tokens
            out.backward()
            total += float(out.detach())
        opt.step()
        losses.append(total)
    return losses, [{n: p.detach() for n, p in d.items()} for d in params], [{n: p.grad for n, p in d.items()} for d in params]
