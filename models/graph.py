"""The layer graph of a model: plain data that autotune's cost rules read.

A model is a chain of layers. Repeated blocks (the transformer layers) refer
to the same ``Layer`` objects: ``chain`` lists, in execution order, indices
into ``layers``, so a repeated layer appears once in ``layers`` and many times
in ``chain``; a search ties their SBP (AutoDDL §4.5.1). Residual branches are
not modelled: the residual stream is taken to be added in the distribution of
the layer that consumes it.

Activations are 2D: (tokens, features) for transformers and MLPs,
(batch, channels * height * width) for convolutions.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Layer:
    name: str
    kind: str  # matmul, embedding, layernorm, pointwise, attention, loss, conv, pool
    dims: tuple[tuple[str, int], ...]

    def dim(self, key: str) -> int:
        return dict(self.dims)[key]


@dataclass
class LayerGraph:
    model: str
    layers: list[Layer]
    chain: list[int]
    batch: int
    micro_batch: int
    config: dict = field(default_factory=dict)

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
        """Consecutive (producer, consumer) layer pairs and how often each occurs."""
        out: dict[tuple[int, int], int] = {}
        for a, b in zip(self.chain, self.chain[1:]):
            out[(a, b)] = out.get((a, b), 0) + 1
        return out

    def parameters(self) -> int:
        counts = self.counts()
        total = 0
        for layer, c in zip(self.layers, counts):
            d = dict(layer.dims)
            if layer.kind in ("matmul", "embedding"):
                total += c * d["k"] * d["n"]
            elif layer.kind == "layernorm":
                total += c * 2 * d["hidden"]
            elif layer.kind == "conv":
                total += c * d["weights"]
        return total
