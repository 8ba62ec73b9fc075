"""The training techniques of a plan, as Megatron-LM and torchtitan users set them: one small record the plan
carries beside its placements (``Techniques.to_dict``, the plan's "techniques" field), priced by the step model
(``autotune.pipeline``, ``autotune.sbp.memory.Mode``) and run by the execution layer (``autotune.apply``):
recomputation, block recomputation, the schedules (interleaved 1F1B on each rank's chunks), ZeRO-1/2 in a
pipeline's stages, sequence parallelism on the tensor path (one stage or a pipeline's), context parallelism in a
plan of one stage on the DDP, tensor and fully_shard paths (``autotune.apply.context``; not in a pipeline's
stages: ``autotune.pipeline.threed.applies``).

- ``recompute``: "none", "selective" (Megatron's: the attention core, its probabilities not kept) or "full";
  ``recompute_blocks``: with "full", only each stage's first that many blocks (Megatron-LM's ``--recompute-method
  block --recompute-num-layers``; 0: every block);
- ``schedule`` and ``virtual_stages``: the pipeline schedule, chunks a rank under interleaved 1F1B;
- ``sequence_parallel``: norms, residual adds and dropout on sequence shards of the tensor-parallel group;
- ``zero_stage``: 1 optimizer states, 2 also gradients, sharded over the data-parallel group (3 is FSDP,
  the plan's "sharding" field);
- ``overlap_grad_reduce``: the data-parallel gradient reduce overlaps the backward (torch's DDP and FSDP,
  Megatron-LM's --overlap-grad-reduce); False: it runs after the step's last backward with nothing hiding it
  (Megatron-LM's default without that flag, and its 2021 local DDP: ``train_step`` calls
  ``allreduce_gradients`` after ``forward_backward_func`` returns);
- ``context_parallel``: ranks a sequence is split over, Megatron-LM's ``--context-parallel-size`` (Llama 3's
  all-gather attention: each rank's queries against the sequence's K and V, all-gathered over the group;
  ``autotune.sbp.layers.Attention``'s "attention-cp"); a graph takes it by ``context_parallel``.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict, dataclass

from calibrate.errors import UserError
from models.graph import LayerGraph


@dataclass(frozen=True)
class Techniques:
    recompute: str = "none"
    schedule: str = "1f1b"
    virtual_stages: int = 1
    sequence_parallel: bool = False
    zero_stage: int = 0
    context_parallel: int = 1
    overlap_grad_reduce: bool = True
    recompute_blocks: int = 0

    @classmethod
    def of(cls, d: dict) -> "Techniques":
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})

    def to_dict(self) -> dict:
        return asdict(self)


# the context-parallel sizes tried where a sequence is this long and none is asked for (Llama 3's 131,072-token stage
# ran CP 16; its 8,192-token ones none)
LONG_SEQUENCE, CONTEXT_CHOICES = 32768, (2, 4, 8, 16)


def context_sizes(graph: LayerGraph, devices: int, asked: tuple[int, ...] | None = None) -> tuple[int, ...]:
    """The context-parallel sizes (above 1) a search tries: ``asked``, or where none is asked, each of
    ``CONTEXT_CHOICES`` that divides ``devices`` for a sequence of at least ``LONG_SEQUENCE``."""
    if asked is not None:
        return tuple(c for c in asked if c > 1)
    long = (graph.config.get("sequence") or 0) >= LONG_SEQUENCE
    return tuple(c for c in CONTEXT_CHOICES if long and devices % c == 0)


def context_role(data: tuple, cp: int) -> tuple | None:
    """The context-parallel role of ``cp`` ranks inside a data role ``data`` (sizes on the nodes and the GPUs
    axes), a node's GPUs first as Megatron-LM orders them; None where ``cp`` does not divide it so."""
    inside = math.gcd(cp, data[1])
    outside = cp // inside
    return (outside, inside) if data[0] % outside == 0 else None


def context_parallel_of(graph: LayerGraph) -> int:
    """The context-parallel size a graph's attention layers carry (1: none)."""
    return next((dict(x.dims).get("context_parallel", 1) for x in graph.layers if x.kind == "attention"), 1)


def context_parallel(graph: LayerGraph, size: int) -> LayerGraph:
    """``graph`` whose attention layers offer context parallelism over ``size`` ranks (the "attention-cp"
    strategies, beside the others); a UserError naming the fix where it cannot: a model without flash
    attention, or a sequence that does not split into 2 x ``size`` chunks (the load-balanced causal split)."""
    if size == 1:
        return graph
    attention = [x for x in graph.layers if x.kind == "attention"]
    seq = graph.config.get("sequence")
    if size < 1 or not attention or not all(x.all_dims()["flash"] for x in attention):
        raise UserError(f"context parallelism {size}: needs a model with flash attention and a size of at least 1: "
                        f"pick a transformer preset with flash attention, or context parallelism 1")
    if seq is None or seq % (2 * size):
        raise UserError(f"context parallelism {size}: the sequence {seq} does not split into {2 * size} equal chunks "
                        f"(the causal split balanced over {size} ranks): pick a size whose double divides it")
    layers = [dataclasses.replace(x, dims=tuple(kv for kv in x.dims if kv[0] != "context_parallel")
                                  + (("context_parallel", size),)) if x.kind == "attention" else x
              for x in graph.layers]
    return dataclasses.replace(graph, layers=layers)
