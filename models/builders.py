"""Build the layer graph of each model kind from its (validated) fields. Every model ends in a
loss layer, whose input (the last layer's output) must not be partial."""
from __future__ import annotations

from models import transformer
from models.graph import Layer, LayerGraph


def _L(name, kind, **dims) -> Layer:
    return Layer(name, kind, tuple(sorted(dims.items())))


def _block(prefix: str, t: int, mb: int, h: int, heads: int, ffn: int) -> list[Layer]:
    return [
        _L(f"{prefix}ln1", "layernorm", tokens=t, hidden=h),
        _L(f"{prefix}qkv", "matmul", tokens=t, k=h, n=3 * h),
        _L(f"{prefix}attention", "attention", tokens=t, hidden=h, heads=heads, micro_batch=mb),
        _L(f"{prefix}proj", "matmul", tokens=t, k=h, n=h),
        _L(f"{prefix}ln2", "layernorm", tokens=t, hidden=h),
        _L(f"{prefix}fc1", "matmul", tokens=t, k=h, n=ffn),
        _L(f"{prefix}gelu", "pointwise", tokens=t, hidden=ffn),
        _L(f"{prefix}fc2", "matmul", tokens=t, k=ffn, n=h),
    ]


def build_mlp(c: dict) -> LayerGraph:
    dims = c["dims"]
    t = c["micro_batch"]
    layers = [_L(f"fc{i}", "matmul", tokens=t, k=a, n=b) for i, (a, b) in enumerate(zip(dims, dims[1:]))]
    layers.append(_L("loss", "loss", tokens=t, vocabulary=dims[-1]))  # a loss over the last layer's outputs
    return LayerGraph("mlp", layers, list(range(len(layers))), c["batch"], c["micro_batch"], c)


VGG13 = [64, 64, "M", 128, 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"]


def build_vgg13(c: dict) -> LayerGraph:
    b, side, ch = c["micro_batch"], c["image"], 3
    layers = []
    for i, v in enumerate(VGG13):
        if v == "M":
            layers.append(_L(f"pool{i}", "pool", batch=b, in_features=ch * side * side,
                             out_features=ch * (side // 2) ** 2))
            side //= 2
        else:
            layers.append(_L(f"conv{i}", "conv", batch=b, in_features=ch * side * side,
                             out_features=v * side * side, weights=ch * v * 9 + v, in_channels=ch, side=side))
            ch = v
    feat = ch * side * side
    for i, (a, o) in enumerate(zip([feat, 4096, 4096], [4096, 4096, c["classes"]])):
        layers.append(_L(f"fc{i}", "matmul", tokens=b, k=a, n=o))
    layers.append(_L("loss", "loss", tokens=b, vocabulary=c["classes"]))  # softmax cross-entropy over the classes
    return LayerGraph("vgg13", layers, list(range(len(layers))), c["batch"], c["micro_batch"], c)


def build_u_transformer(c: dict) -> LayerGraph:
    """Transformer stages whose width narrows then widens again (a U), joined by
    linear projections; the U's skip connections are not modelled."""
    t, mb, v, hd = c["micro_batch"] * c["sequence"], c["micro_batch"], c["vocabulary"], c["head_dim"]
    widths = c["widths"]
    layers = [_L("embedding", "embedding", tokens=t, k=v, n=widths[0])]
    chain, blocks = [0], []
    for s, w in enumerate(widths):
        if s:
            layers.append(_L(f"s{s}.down" if w < widths[s - 1] else f"s{s}.up", "matmul", tokens=t, k=widths[s - 1], n=w))
            chain.append(len(layers) - 1)
        start = len(layers)
        layers += _block(f"s{s}.", t, mb, w, w // hd, 4 * w)
        for _ in range(c["layers_per_stage"]):
            blocks.append((len(chain), len(chain) + len(layers) - start))
            chain += range(start, len(layers))
    tail = [_L("ln_f", "layernorm", tokens=t, hidden=widths[-1]),
            _L("logits", "matmul", tokens=t, k=widths[-1], n=v), _L("loss", "loss", tokens=t, vocabulary=v)]
    start = len(layers)
    layers += tail
    chain += list(range(start, len(layers)))
    return LayerGraph("u-transformer", layers, chain, c["batch"], c["micro_batch"], c, blocks=blocks)


def build_gpt(c: dict) -> LayerGraph:
    return transformer.build("gpt", c)


def build_llama(c: dict) -> LayerGraph:
    return transformer.build("llama", c)


BUILDERS = {"gpt": build_gpt, "llama": build_llama, "mlp": build_mlp, "vgg13": build_vgg13, "u-transformer": build_u_transformer}
