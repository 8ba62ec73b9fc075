"""Typed plans written by hand for the transformer family's layer graph (shared by the tests of
execute's apply path and of the README's training script)."""
from __future__ import annotations

from autotune.plan import FineMesh, LayerPlan, ModelSpec, TypedPlan, WeightPlan
from autotune.sbp.mesh import Cluster
from models.transformer import build as build_graph


def weights(layer) -> dict:
    d = layer.all_dims()
    if layer.kind in ("matmul", "embedding"):
        return {"weight": (d["k"], d["n"])}
    if layer.kind == "layernorm":
        return {"weight": (2, d["hidden"])}
    return {"weight": (d["hidden"],)} if layer.kind == "rmsnorm" else {}


def typed_plan(cfg: dict, nodes: int, gpus: int, placements, strategy: str, recompute: str = "none",
               fsdp_axes: tuple[int, ...] = ()) -> TypedPlan:
    """The plan of ``cfg``'s layer graph with ``placements(layer) -> (input, output, weight placements)``."""
    graph = build_graph(cfg["kind"], {k: v for k, v in cfg.items() if k != "kind"})
    counts = graph.counts()
    layers = []
    for layer, count in zip(graph.layers, counts):
        i, o, w = placements(layer)
        layers.append(LayerPlan(layer.name, layer.kind, count, layer.all_dims(), "hand", i, o,
                                tuple(WeightPlan(n, s, w) for n, s in weights(layer).items())))
    cluster = Cluster(nodes, gpus)
    return TypedPlan(ModelSpec(cfg["kind"], {k: v for k, v in cfg.items() if k != "kind"}), cluster,
                     FineMesh.of(cluster), tuple(layers), micro_batches=cfg["batch"] // cfg["micro_batch"],
                     recompute=recompute, sharding_mode="fsdp" if fsdp_axes else "none", sharding_axes=fsdp_axes,
                     strategy=strategy)


def data_parallel(layer):
    s0, b = ("S0",) * 2, ("B",) * 2
    return (None if layer.kind == "embedding" else s0, None if layer.kind == "loss" else s0, b)


def megatron(layer):
    """Fine axis 0 splits the data, axis 1 is Megatron's tensor parallelism (the embedding replicated)."""
    col, row, data = ("S0", "S1"), ("S0", "P"), ("S0", "B")
    name = layer.name
    if name == "embedding":
        return None, data, ("B", "B")
    if name in ("qkv", "fc1", "logits"):
        return data, col, ("B", "S1")
    if name in ("proj", "fc2"):
        return col, row, ("B", "S0")
    if layer.kind in ("attention", "swiglu", "pointwise"):
        return col, col, ()
    if layer.kind == "loss":
        return col, None, ()
    return data, data, ("B", "B")  # norms and the residual stream


def vocab_parallel(layer):
    """``megatron``, with the embedding's and the logits' weights split by vocabulary over both fine axes (the
    embedding's output a partial sum on both, the logits split by vocabulary on both)."""
    if layer.name == "embedding":
        return None, ("P", "P"), ("S0", "S0")
    if layer.name == "logits":
        return ("B", "B"), ("S1", "S1"), ("S1", "S1")
    if layer.kind == "loss":
        return ("S1", "S1"), None, ()
    return megatron(layer)


def split_norm(layer):
    """``megatron``, with the last norm's input, output and weight split by features on fine axis 1."""
    if layer.name == "ln_f":
        return ("S0", "S1"), ("S0", "S1"), ("B", "S0")
    return megatron(layer)


def build_with_torch_rmsnorm(config: dict):
    """The reference module (``models.modules.build``) with torch's ``nn.RMSNorm`` in place of each Hugging
    Face-style RMSNorm, the same weights: a module written as torchtitan writes its norms."""
    from torch import nn

    from models.modules import RMSNorm, build
    model = build(config)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, RMSNorm):
                fused = nn.RMSNorm(child.weight.shape[0], eps=child.eps)
                fused.weight.data.copy_(child.weight.data)
                setattr(parent, name, fused)
    return model
