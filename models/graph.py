"""The layer graph of a model: plain data that autotune's cost rules read.

A model is a chain of layers. Repeated blocks (the transformer layers) refer
to the same ``Layer`` objects: ``chain`` lists, in execution order, indices
into ``layers``, so a repeated layer appears once in ``layers`` and many times
in ``chain``; a search ties their SBP (AutoDDL §4.5.1).

Transformers with a residual stream (models/transformer.py) have one
"residual" layer tied across the whole model, twice in each block: its
placement is the stream's. The stream enters it from the previous residual
occurrence (the same layer: no edge, no boxing) or, in the first block, from
the embedding: that edge is in ``skips``. ``blocks`` are the chain-position
ranges [start, end) of each transformer block occurrence (recomputation,
pipeline stages). Without a residual stream (the AutoDDL graph) the stream is
taken to be added in the distribution of the layer that consumes it.

Activations are 2D: (tokens, features) for transformers and MLPs,
(batch, channels * height * width) for convolutions.

A layer may leave out a dim at its value in ``ABSENT`` (the AutoDDL graph's
layers do, so they are exactly the layers it always had); ``Layer.dim``
and ``Layer.all_dims`` fill it in.
"""
from __future__ import annotations

from dataclasses import dataclass, field

# kind -> dim -> its value when a layer leaves it out; "heads" and "hidden // heads" are read from the layer
ABSENT: dict[str, dict[str, int | str]] = {
    "matmul": {"bias": 0, "tied": 0},
    "embedding": {"positions": 0},
    "layernorm": {"bias": 1},
    "attention": {"kv_heads": "heads", "head_dim": "hidden // heads", "flash": 0, "rotary": 0},
}


@dataclass(frozen=True)
class Layer:
    name: str
    # matmul, embedding, layernorm, rmsnorm, pointwise, swiglu, attention, residual, loss, conv, pool
    kind: str
    dims: tuple[tuple[str, int], ...]

    def all_dims(self) -> dict[str, int]:
        """Every dim of the layer, those it leaves out at their ``ABSENT`` value."""
        d = dict(self.dims)
        for key, v in ABSENT.get(self.kind, {}).items():
            if key not in d:
                d[key] = d["heads"] if v == "heads" else d["hidden"] // d["heads"] if v == "hidden // heads" else v
        return d

    def dim(self, key: str) -> int:
        return self.all_dims()[key]


@dataclass
class LayerGraph:
    model: str
    layers: list[Layer]
    chain: list[int]
    batch: int
    micro_batch: int
    config: dict = field(default_factory=dict)
    skips: list[tuple[int, int]] = field(default_factory=list)  # (producer, consumer) layer indices, per occurrence
    blocks: list[tuple[int, int]] = field(default_factory=list)  # chain positions [start, end) per block occurrence

    @property
    def act_bytes(self) -> int:
        """Bytes per activation and gradient element: 2 in mixed precision (default), 4 in fp32."""
        return self.config.get("act_bytes", 2)

    @property
    def micro_batches(self) -> int:
        return self.batch // self.micro_batch

    def counts(self) -> list[int]:
        """How often each layer occurs in the chain."""
        out = [0] * len(self.layers)
        for i in self.chain:
            out[i] += 1
        return out

    def edges(self) -> dict[tuple[int, int], int]:
        """(producer, consumer) layer pairs, consecutive in the chain or a skip, and how often each occurs."""
        out: dict[tuple[int, int], int] = {}
        for a, b in list(zip(self.chain, self.chain[1:])) + list(self.skips):
            out[(a, b)] = out.get((a, b), 0) + 1
        return out

    def parameters(self) -> int:
        """Trainable parameters; a logits layer tied to the embedding shares its weight (counted once)."""
        counts = self.counts()
        total = 0
        for layer, c in zip(self.layers, counts):
            d = layer.all_dims()
            if layer.kind == "matmul":
                total += c * ((0 if d["tied"] else d["k"] * d["n"]) + d["bias"] * d["n"])
            elif layer.kind == "embedding":
                total += c * (d["k"] + d["positions"]) * d["n"]
            elif layer.kind == "layernorm":
                total += c * (1 + d["bias"]) * d["hidden"]
            elif layer.kind == "rmsnorm":
                total += c * d["hidden"]
            elif layer.kind == "conv":
                total += c * d["weights"]
        return total
