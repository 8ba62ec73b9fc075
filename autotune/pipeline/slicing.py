"""The layer graph cut into pipeline stages.

A stage is a run of whole transformer blocks (``blocks``: chain-position ranges, one per block
occurrence); the first stage also holds what comes before the first block (the embedding), the last
what follows the last block (final norm, logits, loss). ``stage_graph`` is the stage's own
``LayerGraph`` (its distinct layers, its chain), which the SBP search takes as it takes a whole model;
``signature`` is what makes two stages the same problem (equal layers in the same order).
"""
from __future__ import annotations

from calibrate.errors import UserError
from models.builders import BUILDERS
from models.graph import LayerGraph
from models.loader import validate

from autotune.sbp.techniques import context_parallel, context_parallel_of


def blocks(graph: LayerGraph) -> list[tuple[int, int]]:
    """(start, end) chain positions of each block occurrence: ``graph.blocks`` where the graph lists them,
    else the runs of the repeated layers (a block starts where a repeated layer follows a layer that is
    not its predecessor in the block)."""
    if graph.blocks:
        return [tuple(b) for b in graph.blocks]
    counts, chain = graph.counts(), graph.chain
    starts = [i for i in range(len(chain)) if counts[chain[i]] > 1
              and (i == 0 or chain[i - 1] != chain[i] - 1 or counts[chain[i - 1]] != counts[chain[i]])]
    out = []
    for i in starts:
        j = i + 1
        while j < len(chain) and j not in starts and counts[chain[j]] == counts[chain[i]]:
            j += 1
        out.append((i, j))
    return out


def stage_spans(graph: LayerGraph, split: list[int]) -> list[tuple[int, int]]:
    """Chain-position ranges of the stages holding ``split[i]`` blocks each (the head with the first stage,
    the tail with the last)."""
    bl = blocks(graph)
    if sum(split) != len(bl) or any(k < 1 for k in split):
        raise UserError(f"a split into stages {split} must give every stage at least one of the {len(bl)} blocks")
    out, b = [], 0
    for i, k in enumerate(split):
        lo = 0 if i == 0 else bl[b][0]
        hi = len(graph.chain) if i == len(split) - 1 else bl[b + k - 1][1]
        out.append((lo, hi))
        b += k
    return out


def stage_graph(graph: LayerGraph, lo: int, hi: int) -> LayerGraph:
    """Chain positions [lo, hi) as a layer graph of their own (the same batch, micro-batch and config), with
    the skips whose two layers it holds (the embedding's into the residual stream: the first stage's) and
    its blocks. The residual stream enters a later stage's first residual occurrence from the previous
    stage: its placement there is the boundary's (``autotune.pipeline.boundary``)."""
    used = sorted(set(graph.chain[lo:hi]))
    index = {v: i for i, v in enumerate(used)}
    skips = [(index[a], index[b]) for a, b in graph.skips if a in index and b in index]
    inner = [(a - lo, b - lo) for a, b in graph.blocks if lo <= a and b <= hi]
    return LayerGraph(graph.model, [graph.layers[v] for v in used], [index[v] for v in graph.chain[lo:hi]],
                      graph.batch, graph.micro_batch, graph.config, skips, inner)


def signature(graph: LayerGraph, lo: int, hi: int) -> tuple:
    """Equal for two ranges of the chain that are the same problem (the same layers in the same order)."""
    return tuple(graph.layers[v] for v in graph.chain[lo:hi])


def with_micro_batches(graph: LayerGraph, micro_batches: int) -> LayerGraph:
    """The model rebuilt with ``micro_batches`` micro-batches per step (the micro-batch batch / that)."""
    if micro_batches == graph.micro_batches:
        return graph
    if micro_batches < 1 or graph.batch % micro_batches:
        raise UserError(f"{micro_batches} micro-batches do not divide the batch {graph.batch}: pick a divisor of it")
    cfg = dict(graph.config, micro_batch=graph.batch // micro_batches)
    built = BUILDERS[graph.model](validate(graph.model, cfg, f"{graph.model} with {micro_batches} micro-batches"))
    return context_parallel(built, context_parallel_of(graph))  # a technique the config does not hold
