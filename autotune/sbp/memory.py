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
the backward pass are, per layer, its input (the tensor its backward needs:
the matmul's I for dW = I^T dO, the layer norm's and GELU's input), the
attention probabilities softmax(Q K^T) ((micro-batch / S0) x (heads / S1) x
sequence^2 a device) and SUMMA's gathered panels. Only one micro-batch's
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

    @property
    def total(self) -> float:
        return self.parameters + self.gradients + self.optimizer + self.activations

    def __add__(self, o: "Memory") -> "Memory":
        return Memory(self.parameters + o.parameters, self.gradients + o.gradients,
                      self.optimizer + o.optimizer, self.activations + o.activations)

    def scaled(self, k: float) -> "Memory":
        return Memory(self.parameters * k, self.gradients * k, self.optimizer * k, self.activations * k)

    def to_dict(self) -> dict:
        return {"parameters_bytes": self.parameters, "gradients_bytes": self.gradients,
                "optimizer_bytes": self.optimizer, "activations_bytes": self.activations}


def precision(act_bytes: int) -> tuple[int, int, int]:
    if act_bytes not in PRECISION:
        raise UserError(f"act_bytes {act_bytes!r} must be 2 (mixed precision) or 4 (fp32)")
    return PRECISION[act_bytes]


def _elems(t, mesh, cluster: Cluster) -> int:
    return math.prod(local_shape(t.shape, NdSbp(t.sbp, mesh).fine(cluster), cluster))


def strategy_memory(s, cluster: Cluster, act_bytes: int) -> Memory:
    """One occurrence of a layer under strategy ``s`` (an ``autotune.sbp.layers.Strategy``)."""
    w, g, o = precision(act_bytes)
    params = sum(_elems(t, s.mesh, cluster) for t in s.weights)
    acts = (_elems(s.input, s.mesh, cluster) if s.input else 0) + s.extra_act_elems
    return Memory(params * w, params * g, params * o, acts * act_bytes)
