"""Memory per device: the one place where a plan's memory is accounted.

On one device, a plan needs the sum over the layers of the model (a repeated
layer once per occurrence) of

    parameters   W * weight_bytes      W: the layer's weight elements held locally
    gradients    W * grad_bytes           (a weight split over an axis is divided by it,
    optimizer    W * optimizer_bytes       replicated (B) it is not)
    activations  A * act_bytes         A: what one micro-batch keeps for the backward pass

with, per precision (``act_bytes`` of the model: 2 mixed precision, 4 fp32),

    mixed precision  weight 2 (fp16/bf16), gradient 2, optimizer 12: the fp32
                     master weight, Adam's momentum and variance (ZeRO's K = 12)
    fp32             weight 4, gradient 4, optimizer 8: Adam's momentum and variance

so 16 bytes per locally held parameter either way. The activations kept for
the backward pass are, per layer (``kept_bytes``, in the activation type
unless said otherwise; what the executed step keeps, counted by
``autotune.execute.saved`` and checked by tests/autotune/test_execute_memory.py):

    matmul, layer norm, GELU   its input (the matmul's I for dW = I^T dO, the
                               layer norm's and GELU's input)
    attention                  its input (Q, K, V) and the probabilities softmax(Q K^T)
                               ((micro-batch / S0) x (heads / S1) x sequence^2 a device)
    SUMMA matmul               its two gathered panels, which replace its input (the
                               gathered input panel is what dW needs); a SUMMA
                               embedding nothing (its backward needs the token ids only)
    loss                       the softmax probabilities in fp32 (4 bytes per local
                               logit, Megatron-LM's vocab-parallel cross-entropy)
    split layer norm           two fp32 copies of its input (x and x - mean, kept by
                               the products with x and with 1/sigma) and the
                               normalised input in the activation type

On top of these, a step's peak holds a transient workspace (``peak_workspace``:
the gradients being computed in the backward pass of one layer while the
layers before it still keep their activations, or the optimizer step's fp32
gradient of one weight); the search constrains the sum of the per-layer
figures, and a plan's totals report its peak with the workspace. Only one micro-batch's
activations are alive at a time: gradient accumulation runs the forward and
backward of a micro-batch before the next, accumulating into the gradients
above. No activation recomputation.

These are AutoDDL's assumptions (§4.5.2: "since we used gradient accumulation
for all the experiments, the main bottleneck for memory was the model
parameters and its optimizer states"; §5.2.1 fp32 on Piz Daint, §5.3.1 mixed
precision on the A100s; §5.1.2 "the largest possible micro-batch"). The paper
measured memory in OneFlow; what it does not say, we assume: Adam (the optimizer
of Megatron-LM, whose models §5.1.2 takes). Not counted: the collectives'
buffers, the framework's workspace, allocator fragmentation and the
embedding's token ids; a measured peak will sit somewhat above the prediction.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from calibrate.errors import UserError

from autotune.sbp.mesh import Cluster
from autotune.sbp.sbp import NdSbp, local_shape

STAT_BYTES = 4  # softmax and layer-norm statistics: fp32 in both precisions

# bytes per locally held parameter: (weight, gradient, optimizer state), by act_bytes
PRECISION = {
    2: (2, 2, 12),  # mixed precision: fp16/bf16 weight and gradient; fp32 master weight, Adam m and v
    4: (4, 4, 8),   # fp32: weight, gradient, Adam m and v
}


@dataclass(frozen=True)
class Memory:
    """Bytes per device, by kind."""

    parameters: float = 0.0
    gradients: float = 0.0
    optimizer: float = 0.0
    activations: float = 0.0
    workspace: float = 0.0  # a plan's transient peak beyond the kept activations (``peak_workspace``)

    @property
    def total(self) -> float:
        return self.parameters + self.gradients + self.optimizer + self.activations + self.workspace

    def __add__(self, o: "Memory") -> "Memory":
        return Memory(self.parameters + o.parameters, self.gradients + o.gradients,
                      self.optimizer + o.optimizer, self.activations + o.activations, self.workspace + o.workspace)

    def scaled(self, k: float) -> "Memory":
        return Memory(self.parameters * k, self.gradients * k, self.optimizer * k, self.activations * k,
                      self.workspace * k)

    def to_dict(self) -> dict:
        return {"parameters_bytes": self.parameters, "gradients_bytes": self.gradients,
                "optimizer_bytes": self.optimizer, "activations_bytes": self.activations,
                "workspace_bytes": self.workspace}


def precision(act_bytes: int) -> tuple[int, int, int]:
    if act_bytes not in PRECISION:
        raise UserError(f"act_bytes {act_bytes!r} must be 2 (mixed precision) or 4 (fp32)")
    return PRECISION[act_bytes]


def _elems(t, mesh, cluster: Cluster) -> int:
    return math.prod(local_shape(t.shape, NdSbp(t.sbp, mesh).fine(cluster), cluster))


def kept_bytes(s, cluster: Cluster, act_bytes: int) -> float:
    """Bytes one micro-batch of a layer under strategy ``s`` keeps for the backward pass."""
    inp = _elems(s.input, s.mesh, cluster) if s.input else 0
    if s.signature in ("loss", "loss-replicated"):
        return inp * STAT_BYTES
    if s.signature == "layernorm-split":
        return inp * (2 * STAT_BYTES + act_bytes)
    if s.signature == "summa":
        return s.extra_act_elems * act_bytes if s.input else 0
    return (inp + s.extra_act_elems) * act_bytes


def strategy_memory(s, cluster: Cluster, act_bytes: int) -> Memory:
    """One occurrence of a layer under strategy ``s`` (an ``autotune.sbp.layers.Strategy``)."""
    w, g, o = precision(act_bytes)
    params = sum(_elems(t, s.mesh, cluster) for t in s.weights)
    return Memory(params * w, params * g, params * o, kept_bytes(s, cluster, act_bytes))


def _local(t, s, cluster: Cluster) -> int:
    return _elems(t, s.mesh, cluster) if t is not None else 0


def work_bytes(s, cluster: Cluster, act_bytes: int, accumulate: bool) -> float:
    """Bytes a layer allocates beyond what it keeps while its backward runs (its forward
    needs no more): the gradients of its output and of its input, the attention's
    gradients of the probabilities and of the scores, the split layer norm's fp32
    gradients (two input-sized), SUMMA's gradients of its gathered panels, and, when
    ``accumulate`` (micro-batches after the first), each weight's new gradient before it
    is added to the accumulated one."""
    inp, out = _local(s.input, s, cluster), _local(s.output, s, cluster)
    weights = sum(_local(w, s, cluster) for w in s.weights)
    if s.signature in ("loss", "loss-replicated"):
        return inp * act_bytes  # the probabilities become the gradient in place; its cast
    elems = inp + out + (weights if accumulate else 0)
    if s.signature == "attention":
        elems += 2 * s.extra_act_elems
    if s.signature == "summa":
        elems += s.extra_act_elems
    extra = 2 * STAT_BYTES * inp if s.signature == "layernorm-split" else 0
    return elems * act_bytes + extra


def peak_workspace(chain_strategies, cluster: Cluster, act_bytes: int, micro_batches: int) -> float:
    """Bytes above parameters, gradients, optimizer states and kept activations at a step's
    peak. The backward of chain position i runs while positions 0..i still keep their
    activations (the later ones are freed), so the activations peak at
    max over i of (kept by 0..i + work of i); the optimizer step (mixed precision)
    holds one weight's fp32 gradient at a time, 4 bytes per element of the largest
    local weight, when no activation is kept. The workspace is the larger of the
    two peaks minus all kept activations (never negative)."""
    acc = micro_batches > 1
    kept = peak = largest = 0.0
    for s in chain_strategies:
        kept += kept_bytes(s, cluster, act_bytes)
        peak = max(peak, kept + work_bytes(s, cluster, act_bytes, acc))
        largest = max([largest] + [_local(w, s, cluster) for w in s.weights])
    step = 4 * largest if act_bytes == 2 else 0.0
    return max(peak, step) - kept
