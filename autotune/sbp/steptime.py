"""Compute time of a layer under a strategy, for the step-time objective (``--objective step``).

Per device and micro-batch, forward and backward, from the profile's compute
model (``calibrate.compute.ComputeModel``), on each device's local piece:

    matmul      forward one matmul of the local (m, k, n); backward two of the same size
                (dI and dW). m and n are the output's local rows and columns; k follows from
                the flops: 2 t k n over the devices that do not repeat the work (a role
                where input, weight and output are all B repeats it)
    embedding   memory-bound: forward the gather and the mask of rows held elsewhere (4 passes
                over the local output); backward the mask, and the dense gradient zero-filled
                and scatter-added (4 passes over the output, 1 over the local weight)
    layernorm   memory-bound: forward reads the input and writes the output (2 passes),
                backward reads input and gradient and writes a gradient, then reads both again
                for the scale's and shift's gradients (5 passes)
    split       the executed ops one by one (``autotune.execute.ops.layernorm``), each reading its
    layernorm   inputs and writing its output, a = act_bytes, f = 4 (fp32 statistics): forward
                6a + 11f bytes per local element (cast, square, two row sums, centre, scale, cast,
                affine), backward 9a + 26f (the affine's two products and two column sums, the casts,
                and autograd's products, negation, two row sums and three accumulations in fp32; the
                operator list of one backward pass, tests/autotune/test_sbp_steptime.py)
    pointwise   memory-bound: 2 passes forward, 3 backward
    attention   softmax(Q K^T) V on (micro-batch / S0) sequences x (heads / S1) heads, forward
                and backward as measured (``python -m calibrate compute``; backward twice the
                forward without a measurement), plus the layer's work around the core: as measured
                (the executed layer's time less its core's, ``ComputeModel.attention_copy_seconds``),
                else ``ATTENTION_COPY_PASSES`` at the copy bandwidth (Q, K, V made contiguous and
                the output token-major forward; backward Q's, K's and V's gradients assembled into
                the fused QKV's)
    loss        the executed cross-entropy (``autotune.execute.ops._CrossEntropy``), each op one
                pass: forward a + 9f bytes per local logit (fp32 copy, max, subtract, exp, sum,
                divide), backward 3f + a (scale in place, cast)
    conv        an implicit GEMM (local images x side^2, 9 x in-channels, out-channels);
                backward twice the forward
    pool        memory-bound: 2 passes forward, 2 backward

plus, per micro-batch, PyTorch DTensor's local copies around each boxing step
(``autotune.sbp.boxing.local_copies``: the functional all-reduce's clone, the
concatenation after an all-gather along a dimension other than 0, and the like),
each a read and a write at the profile's copy bandwidth; and, once per step, the optimizer over every
locally held parameter (``ADAM_BYTES`` at the fused Adam kernel's bandwidth and, in mixed precision,
``CAST_BYTES``), and per micro-batch after the first, the gradient accumulation (``accumulate_seconds``).

Memory-bound passes are timed at the bandwidth of the kernels that make them: copies (DTensor's, the
attention's) at the profile's copy bandwidth ``memory_Bps``; the layers' elementwise work, casts and
row reductions, Adam and the embedding at the bandwidths ``calibrate compute`` measures for them
(``ComputeModel.op_seconds``; 1 H200, 2026-11-23: a GELU and the fused Adam kernel moved 77-82% of a
copy's bytes a second, the embedding's backward about a fifth of its modelled bytes' worth).

The step time of a plan (``Problem`` with objective "step") is

    step = compute + redistribution + exposed gradient sync
    exposed gradient sync = max(S - W, F)

with S the gradient all-reduces of the step, W the backward compute of the last
micro-batch (gradient accumulation syncs once, while the last micro-batch runs
backward, as DDP and FSDP overlap them) and F the all-reduce of the first
layer's gradients, which are ready only when the backward pass ends.
Redistribution (boxing between and inside layers) is on the critical path:
not hidden. Assumed: the gradient sync does not slow the backward's boxing
(they share the network), and compute kernels run at the profile's rates at
the local shapes.
"""
from __future__ import annotations

import math

from calibrate.compute import ComputeModel
from calibrate.errors import OptionError, UserError

from autotune.sbp.layers import Op, Strategy, local_elems
from autotune.sbp.memory import PRECISION, STAT_BYTES
from autotune.sbp.mesh import Cluster
from autotune.sbp.sbp import B, NdSbp, local_shape


def require_compute(profile) -> ComputeModel:
    cm = getattr(profile, "compute", None)
    if cm is None:
        raise OptionError("objective", f"step: profile {profile.name!r} has no compute figures, which this objective needs: "
                          "measure them with python -m calibrate compute --out PROFILE.json, or use {objective} comm")
    return cm


def _repeats(s: Strategy) -> int:
    """How many devices repeat the same work: the roles where every tensor is B."""
    ts = [t for t in (s.input, s.output, *s.weights) if t is not None]
    out = 1
    for r in range(len(s.mesh.sizes)):
        if all(t.sbp[r] == B for t in ts):
            out *= s.mesh.role_size(r)
    return out


# passes over the attention's local output (t x h a device) around the core, forward and backward:
# forward Q, K and V, strided views of the fused QKV, copied contiguous for the batched matmuls
# (3 x 2) and the output made token-major (2); backward the output's gradient made contiguous (2),
# each of Q's, K's and V's gradients written into a zero-filled QKV-shaped gradient (3 x (3 + 2)),
# and the three summed (2 additions of QKV-shaped tensors, 3 x 3 each)
ATTENTION_COPY_PASSES = (3 * 2 + 2, 2 + 3 * (3 + 2) + 2 * 9)


def layer_seconds(op: Op, s: Strategy, cluster: Cluster, cm: ComputeModel, act_bytes: int) -> tuple[float, float]:
    """(forward, backward) seconds of one occurrence of a layer for one micro-batch on one device."""
    kind, d = op.layer.kind, op.dims
    per = cluster.devices // _repeats(s)

    def mem(passes_fwd, passes_bwd, elems):
        return (cm.op_seconds("elementwise", passes_fwd * elems * act_bytes),
                cm.op_seconds("elementwise", passes_bwd * elems * act_bytes))

    if kind == "matmul":
        rows, cols = local_elems_shape(s.output, s, cluster)
        k = d["tokens"] * d["k"] * d["n"] / per / (rows * cols)
        f = cm.matmul_seconds(rows, max(1, round(k)), cols, act_bytes)
        return f, 2 * f
    if kind == "embedding":  # gather and mask forward; mask, zero-filled dense gradient and scatter-add backward
        out = local_elems(s.output, s.mesh, cluster)
        wts = sum(local_elems(w, s.mesh, cluster) for w in s.weights)
        return (cm.op_seconds("embedding", 4 * out * act_bytes),
                cm.op_seconds("embedding_backward", (4 * out + wts) * act_bytes))
    if kind == "layernorm" and s.signature == "layernorm-split":
        e = local_elems(s.input, s.mesh, cluster)
        a, f = act_bytes, STAT_BYTES
        return cm.op_seconds("elementwise", e * (6 * a + 11 * f)), cm.op_seconds("elementwise", e * (9 * a + 26 * f))
    if kind == "layernorm":  # backward: dx, then the scale's and shift's gradients, each reading x and dy
        return mem(2, 5, local_elems(s.input, s.mesh, cluster))
    if kind == "pointwise":
        return mem(2, 3, local_elems(s.input, s.mesh, cluster))
    if kind == "attention":
        mb, heads = d["micro_batch"], d["heads"]
        shape = (mb // s.mesh.role_size(0), heads // s.mesh.role_size(1), d["tokens"] // mb, d["hidden"] // heads)
        out = local_elems(s.output, s.mesh, cluster)
        f, b = cm.attention_seconds(*shape, act_bytes), cm.attention_seconds(*shape, act_bytes, backward=True)
        cf, cb = (cm.attention_copy_seconds(*shape, act_bytes, backward=bwd) for bwd in (False, True))
        return (f + (cf if cf is not None else cm.memory_seconds(ATTENTION_COPY_PASSES[0] * out * act_bytes)),
                b + (cb if cb is not None else cm.memory_seconds(ATTENTION_COPY_PASSES[1] * out * act_bytes)))
    if kind == "loss":
        e = local_elems(s.input, s.mesh, cluster)
        a, f = act_bytes, STAT_BYTES
        return cm.op_seconds("elementwise", e * (a + 9 * f)), cm.op_seconds("elementwise", e * (3 * f + a))
    if kind == "conv":
        side, ch = d["side"], d["in_channels"]
        v = d["out_features"] // (side * side)
        f = cm.matmul_seconds(d["batch"] // per * side * side, 9 * ch, v, act_bytes)
        return f, 2 * f
    if kind == "pool":
        return mem(2, 2, local_elems(s.input, s.mesh, cluster))
    raise UserError(f"layer {op.layer.name}: no compute rule for kind {kind!r}")


def local_elems_shape(t, s: Strategy, cluster: Cluster) -> tuple[int, int]:
    shape = local_shape(t.shape, NdSbp(t.sbp, s.mesh).fine(cluster), cluster)
    return shape[0], math.prod(shape[1:])


ADAM_BYTES = 28  # fused Adam per fp32 parameter: reads weight, gradient, m, v; writes weight, m, v
CAST_BYTES = {  # bytes moved per locally held parameter by the casts around Adam, by act_bytes
    2: 6 + 6,  # the gradient's fp32 copy (2 read, 4 written), the 16-bit weight's copy (4 read, 2 written)
    4: 0,
}


def optimizer_seconds(s: Strategy, cluster: Cluster, cm: ComputeModel, act_bytes: int) -> float:
    """Once per step: the optimizer over every locally held parameter (fused Adam at the fused
    kernel's bandwidth, the casts around it elementwise, as ``autotune.execute.train`` steps it)."""
    params = sum(local_elems(w, s.mesh, cluster) for w in s.weights)
    return cm.op_seconds("optimizer", params * ADAM_BYTES) + cm.op_seconds("elementwise", params * CAST_BYTES[act_bytes])


def accumulate_seconds(s: Strategy, cluster: Cluster, cm: ComputeModel, act_bytes: int) -> float:
    """Per micro-batch after the first: adding each weight's new gradient to the step's
    (read both, write one: 3 x the gradient's bytes per locally held parameter)."""
    params = sum(local_elems(w, s.mesh, cluster) for w in s.weights)
    return cm.op_seconds("elementwise", 3 * params * PRECISION[act_bytes][1]) if params else 0.0
