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
    / rmsnorm   backward reads input and gradient and writes a gradient, then reads both again
                for the scale's and shift's gradients (5 passes; RMSNorm counted the same)
    split norm  the norm as separate ops (the op-by-op executor's, since removed), each reading its
    layernorm   inputs and writing its output, a = act_bytes, f = 4 (fp32 statistics): forward
                6a + 11f bytes per local element (cast, square, two row sums, centre, scale, cast,
                affine), backward 9a + 26f (the affine's two products and two column sums, the casts,
                and autograd's products, negation, two row sums and three accumulations in fp32; the
                operator list of one backward pass, tests/autotune/test_sbp_steptime.py)
    pointwise   memory-bound: 2 passes forward, 3 backward
    swiglu      memory-bound, over the local output's elements: forward 5 passes (read the gate,
                write silu(gate), read it and up, write the product), backward 9 (silu(gate)
                again: 2; d up = dy silu(gate): 3; d gate = dy up silu'(gate): 4)
    residual    memory-bound, over the local output's elements: forward 3 passes (read the
                branch and the stream, write the sum), backward 3 (the stream's gradient read,
                the branch's added to it, written)
    dropout     Megatron-LM's, where its recipes set it (``layers.dropout_dims``): on the materialised
                attention's probabilities (in the core: recomputed with it), the embedding's output (each
                its own kernel: forward read, write and the 1-byte mask, backward read the gradient and
                the mask, write) and the residual adds (the bias-dropout-add: forward the mask written in
                the add's kernel, backward the same kernel as the others), ``dropout_seconds``
    embedding   with learned positions (``positions`` > 0): forward 3 more passes over the local
    positions   output (read it and the table's rows, write the sum), backward 1 over the output's
                gradient and 1 over the local table's (its column sums)
    attention   flash 1: the causal SDPA flash attention core forward and backward from the
    (flash)     profile's SDPA figures (``ComputeModel.sdpa_seconds``: measured and interpolated
                where the profile has them, else the causal flash flop count, forward 2 b h s^2 d
                and backward 2.5 times that, at the profile's matmul rate), on (micro-batch / S0)
                sequences x (heads / S1) heads, (kv_heads / S1) KV heads; with rotary, the rotation of
                Q and K (``ROTARY_PASSES`` over their local elements, forward and backward); plus
                the layer's work around the core as for flash 0
    attention   flash 0: softmax(Q K^T) V on (micro-batch / S0) sequences x (heads / S1) heads, forward
                and backward as measured (``python -m calibrate compute``; backward twice the
                forward without a measurement), plus the layer's work around the core: as measured
                (the executed layer's time less its core's, ``ComputeModel.attention_copy_seconds``),
                else ``ATTENTION_COPY_PASSES`` at the copy bandwidth (Q, K, V made contiguous and
                the output token-major forward; backward Q's, K's and V's gradients assembled into
                the fused QKV's)
    loss        the cross-entropy as separate ops (the op-by-op executor's, since removed), each op one
                pass: forward a + 9f bytes per local logit (fp32 copy, max, subtract, exp, sum,
                divide), backward 3f + a (scale in place, cast)
    conv        an implicit GEMM (local images x side^2, 9 x in-channels, out-channels);
                backward twice the forward
    pool        memory-bound: 2 passes forward, 2 backward

plus, per micro-batch, PyTorch DTensor's local copies around each boxing step
(``autotune.sbp.boxing.local_copies``: the functional all-reduce's clone, the
concatenation after an all-gather along a dimension other than 0, and the like),
each a read and a write at the profile's copy bandwidth; and the precision recipe users run
(``autotune.sbp.memory``): with act_bytes 2 (fp32 parameters under bf16 autocast), per micro-batch
every matmul weight cast to bf16 in the forward (read 4, write 2 bytes a parameter) and its bf16
gradient cast to fp32 in the backward (read 2, write 4; ``CAST_BYTES``), in the matmul's forward and
backward; per micro-batch after the first, the new fp32 gradient added into .grad (read 4 + 4, write 4:
``accumulate_seconds``); once per step, fused AdamW over every locally held parameter (``ADAM_BYTES`` at
the fused kernel's bandwidth). Under Megatron-LM's recipes (``autotune.sbp.memory.Recipe.main_grad``: half
weights, a main gradient of g bytes) no cast: per micro-batch each weight's half gradient added into its main
gradient in the backward (read 2 + g, write g), and at the step the master weights copied into the half ones
(and in fp16 the main gradients up to fp32) beside AdamW (``COPY_DOWN_BYTES``).

Recomputation (``autotune.sbp.memory.Mode``): "selective" adds the attention core's forward to the
attention layer's backward; "full" adds, to each layer inside a block, its forward (compute, its
internal forward boxing, the casts) to its backward, and the block's forward boxings between its layers
run twice (``autotune.sbp.tables.EdgeTables``'s forward factor), up to where torch.utils.checkpoint stops
re-running (``autotune.sbp.memory``'s roles): the block's closing matmul (``LAST``) its casts but not its
product, the residual adds after it (``TAIL``) nothing. FSDP (``fsdp_seconds``): per
micro-batch and occurrence each sharded weight is all-gathered (fp32, 4 bytes a gathered element) in
the forward and again in the backward, and its gradient reduce-scattered (fp32) in the backward;
prefetched, they overlap the layer's compute: exposed = max(0, all-gather - forward compute) +
max(0, all-gather + reduce-scatter - backward compute), the layer's own compute the only cover
(a prefetch one layer ahead hides behind the layer before it as much as behind this one, so the
rule is the layer's as if it prefetched its own). A single-stage plan on the fully_shard path, where the profile
has the path's host figure, prices its forward all-gathers instead as FSDP2 prefetches them, implicitly, as far as
the CPU runs ahead of the device (``implicit_prefetch_exposed``, ``fsdp_forward_exposed``; ``autotune.plan.build``);
one on the DTensor path, whose FSDP prefetches nothing, prices them in series with the compute instead
(``serial_fsdp_seconds``, ``autotune.plan.build.dtensor_fsdp``).

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
The compute that runs beside the hidden part of the sync (S less the exposed) runs slower by the profile's
measured overlap slowdown (``ComputeModel.overlap``: beside all-reduces, or reduce-scatters under FSDP), and
FSDP's layer compute beside its all-gathers and reduce-scatters likewise (``fsdp_seconds``): ``overlapped``.
Planning several devices needs those figures and the host's (``require_overheads``).
Redistribution (boxing between and inside layers) is on the critical path:
not hidden. Assumed: the gradient sync does not slow the backward's boxing
(they share the network), and compute kernels run at the profile's rates at
the local shapes.
"""
from __future__ import annotations

import math

import numpy as np

from calibrate.compute import ComputeModel
from calibrate.errors import OptionError, UserError

from autotune.sbp.boxing import Coster, Step
from autotune.sbp.layers import Op, Strategy, local_elems
from autotune.sbp.memory import (zero_elems, LAST, MATMUL_SIGNATURES, NONE, OUTSIDE, FP32, RERUN, STAT_BYTES, Mode,
                                 fsdp_axes, held_elems, loss_parallel)
from autotune.sbp.mesh import Cluster
from autotune.sbp.sbp import B, fine_of, local_shape


def require_overheads(profile, devices: int) -> None:
    """Refuse planning ``devices`` > 1 devices by step time on a profile without the host's cost of apply's paths
    or the overlap slowdown (``ComputeModel.missing_overheads``): never price them at zero. Checked where a plan
    is searched for a user (``autotune.planner.search``); pricing a given plan (a recorded run, a published
    configuration) reads the profile as it is."""
    missing = require_compute(profile).missing_overheads() if devices > 1 else []
    if missing:
        raise UserError(f"profile {profile.name!r} lacks {' and '.join(missing)}, which planning {devices} devices "
                        f"by step time needs: measure them on this machine with python -m calibrate compute --out "
                        f"PROFILE.json (2 or more GPUs visible), or plan by communication (--objective comm)")


def overlapped(S, W, F, slowdown: float):
    """The gradient sync's exposed seconds (S the step's sync, W the last backward, F the first layer's sync; numbers or
    arrays): max(S - W, F), plus the slowdown of the compute that ran beside the hidden part (S less the exposed:
    that long the backward ran beside the collectives, ``slowdown`` times slower)."""
    if isinstance(S, np.ndarray) or isinstance(W, np.ndarray) or isinstance(F, np.ndarray):
        exposed = np.maximum(np.subtract(S, W), F)  # in place below: a large search's pairs run it on big arrays
        hidden = np.subtract(S, exposed)
        np.maximum(hidden, 0.0, out=hidden)
        hidden *= slowdown - 1.0
        hidden += exposed
        return hidden
    exposed = max(S - W, F)  # numbers: the same rule without numpy's per-call cost (a plan's price, in the searches)
    return exposed + (slowdown - 1.0) * max(S - exposed, 0.0)


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


# passes over Q's and K's local elements applying the rotary embedding, forward and backward: rotate_half
# (read, write), x cos (read, write), rotate_half(x) sin added (read 2, write 1); the same transposed backward
ROTARY_PASSES = (7, 7)
def cast_bytes(s: Strategy, cluster: Cluster, act_bytes: int) -> tuple[float, float]:
    """Per micro-batch, (forward, backward) bytes of autocast's casts of a matmul's weights: to bf16 in the
    forward, the bf16 gradient to fp32 in the backward (``CAST_BYTES`` each, act_bytes 2 only). Under a
    main-gradient recipe (the strategy's "main_grad" dim, its bytes g: Megatron-LM's half-precision weights)
    no cast forward, and backward the half gradient added into the main gradient (read 2 + g, write g: the
    hook of Megatron-LM's DDP, every micro-batch, in place of the accumulation ``accumulate_seconds`` prices)."""
    if act_bytes != 2 or s.input is None or s.signature not in MATMUL_SIGNATURES:
        return 0.0, 0.0
    n = sum(local_elems(w, s.mesh, cluster) for w in s.weights)
    g = s.recipe_dim("main_grad")
    return (0.0, (act_bytes + 2 * g) * n) if g else (CAST_BYTES * n, CAST_BYTES * n)


def weight_cast_seconds(s: Strategy, cluster: Cluster, cm: ComputeModel, act_bytes: int) -> tuple[float, float]:
    """(forward, backward) seconds of autocast's casts of a matmul's weights per micro-batch: each element
    cast fp32 -> bf16 in the forward (the profile's ``cast`` piece forward: the same kernel) and its bf16
    gradient cast to fp32 in the backward (the ``cast_up`` piece forward; one H100, 2026-11-27: 3.1-3.9 ps
    an element, where the bytes at the elementwise bandwidth give 2.0), each as measured where the profile
    has it, else its bytes (``cast_bytes``) at the elementwise bandwidth."""
    cf, cb = cast_bytes(s, cluster, act_bytes)
    if s.recipe_dim("main_grad"):  # no cast: the main gradient's add (an elementwise pass)
        return 0.0, cm.op_seconds("elementwise", cb) if cb else 0.0
    if not cf:
        return 0.0, 0.0
    n = cf / CAST_BYTES
    down, up = cm.layer_seconds("cast", n), cm.layer_seconds("cast_up", n)
    return (down[0] if down is not None else cm.op_seconds("elementwise", cf),
            up[0] if up is not None else cm.op_seconds("elementwise", cb))


def context_split(s: Strategy) -> int:
    """Ranks each sequence's tokens are split over (context parallelism: an "attention-cp" strategy's role 1), 1
    for every other strategy."""
    return s.mesh.role_size(1) if s.signature == "attention-cp" else 1


def heads_split(s: Strategy) -> int:
    """Ranks an attention strategy splits the heads over: role 1, an "attention-cp" strategy's role 2."""
    return s.mesh.role_size(2 if s.signature == "attention-cp" else 1)


def _core(op: Op, s: Strategy, cluster: Cluster, cm: ComputeModel, act_bytes: int, backward: bool) -> float:
    """The attention core of (micro-batch / S0) sequences x (heads / S1) heads; under context parallelism over c
    (``context_split``) 1/c of it, the causal work balanced over the c ranks (``layers.Attention``), times the
    rank's measured excess over that ideal split (``ComputeModel.context_core_ratio``: its blocks' kernels)."""
    d = op.dims
    mb, heads = d["micro_batch"], d["heads"]
    r0, r1 = s.mesh.role_size(0), heads_split(s)
    seq, hd = d["tokens"] // mb, op.head_dim
    if d.get("flash", 0):
        c = context_split(s)
        return cm.sdpa_seconds(mb // r0, heads // r1, op.kv_heads // r1, seq, hd, act_bytes,
                               backward=backward) / c * (cm.context_core_ratio(c, seq, act_bytes) if c > 1 else 1.0)
    return cm.attention_seconds(mb // r0, heads // r1, seq, d["hidden"] // heads, act_bytes, backward=backward) + \
        (dropout_seconds(s.extra_act_elems, cm, act_bytes)[backward] if s.recipe_dim("dropout") else 0.0)


# Megatron-LM's dropout as its own elementwise kernel, bytes an element: forward the input read and the output written
# (act_bytes each) and the mask written (1), backward the gradient read, the mask read and the gradient written
DROPOUT_PASSES = (2, 2)


def dropout_seconds(elems: float, cm: ComputeModel, act_bytes: int, fused: bool = False) -> tuple[float, float]:
    """(forward, backward) seconds of Megatron-LM's dropout on ``elems`` elements at the profile's elementwise
    bandwidth (``DROPOUT_PASSES`` and the 1-byte mask); ``fused``: its forward inside Megatron-LM's bias-dropout-add
    kernel (``bias_dropout_add_fused_train``, torch.jit.script), whose reads and writes the residual add prices
    already: the mask written only (its launch the add's)."""
    f = max(cm.op_seconds("elementwise", elems) - cm.launch_s, 0.0) if fused else \
        cm.op_seconds("elementwise", elems * (DROPOUT_PASSES[0] * act_bytes + 1))
    return f, cm.op_seconds("elementwise", elems * (DROPOUT_PASSES[1] * act_bytes + 1))


# torch's ``loss_parallel`` cross entropy (logits split by vocabulary, a user's step under autocast) beyond the fused
# one on the same local logits, (forward, backward) bytes a local logit at the elementwise bandwidth: it runs
# log-softmax and its backward as separate passes over the local fp32 logits (the row max, the shift, exp, the sum,
# the log-probabilities; the backward's exp, product and difference), about 20 and 24 bytes more by their count.
# Measured on one H200, torch 2.11 (tests/gpu/loss_parallel.py, 2026-11-30): 9.3-9.5 ps more a local logit at
# 8192-32768 tokens and 64128-75968 local vocabulary entries (11.1 at 16384), 30 bytes at that GPU's elementwise
# bandwidth, split as the count splits
LOSS_PARALLEL_BYTES = (14, 16)


def layer_seconds(op: Op, s: Strategy, cluster: Cluster, cm: ComputeModel, act_bytes: int,
                  recompute: str = "none", role: str = OUTSIDE) -> tuple[float, float]:
    """(forward, backward) seconds of one occurrence of a layer for one micro-batch on one device; the
    backward with what the recomputation re-runs (``recompute``; ``role``: the layer's place in a block)."""
    f, b = _layer_seconds(op, s, cluster, cm, act_bytes)
    if loss_parallel(s):
        e = local_elems(s.input, s.mesh, cluster)
        f, b = (x + cm.op_seconds("elementwise", e * n) for x, n in zip((f, b), LOSS_PARALLEL_BYTES))
    if recompute == "full" and role in RERUN:
        b += f
    elif recompute == "full" and role == LAST:  # its casts again, not its product (``autotune.sbp.memory``'s roles)
        b += f - matmul_kernel_seconds(op, s, cluster, cm, act_bytes)
    elif recompute == "selective" and op.layer.kind == "attention":
        b += _core(op, s, cluster, cm, act_bytes, False)
    return f, b


# layer kind -> the piece of a user's step (calibrate.layers) it is charged as, per element of its input or output
USER_PIECES = {"layernorm": ("layernorm", "input"), "rmsnorm": ("rmsnorm", "input"), "pointwise": ("gelu", "input"),
               "swiglu": ("swiglu", "output"), "residual": ("residual", "output"), "loss": ("loss", "input")}


def _user_seconds(op: Op, s: Strategy, cluster: Cluster, cm: ComputeModel) -> tuple[float, float] | None:
    """(forward, backward) of a layer that runs as in a user's bf16 autocast step (``Strategy.recipe``),
    from the profile's figures of those pieces as executed (``ComputeModel.layer_seconds``); None where
    the profile has none or the layer is not such a piece (the split norms keep their own rule)."""
    kind = op.layer.kind
    if kind not in USER_PIECES or not s.recipe_dim("autocast") or s.signature.endswith("-split"):
        return None
    piece, side = USER_PIECES[kind]
    t = s.input if side == "input" else s.output
    return cm.layer_seconds(piece, local_elems(t, s.mesh, cluster))


def _user_attention(op: Op, s: Strategy, cluster: Cluster, cm: ComputeModel) -> tuple[float, float] | None:
    """The work around a user's attention core, as executed (``calibrate.layers``): rotary on the local
    query and key heads, the output made token-major, and, after a fused QKV projection, its gradient
    concatenated from q's, k's and v's; None where the profile lacks one of those figures."""
    d = op.layer.all_dims()
    out = local_elems(s.output, s.mesh, cluster)
    parts = [cm.layer_seconds("attention_out", out)]
    if d["rotary"]:
        qk = (d["tokens"] // (s.mesh.role_size(0) * context_split(s))) * ((d["heads"] + d["kv_heads"])
                                                                          // heads_split(s)) * d["head_dim"]
        parts.append(cm.layer_seconds("rotary", qk))
    if s.recipe_dim("qkv_fused"):
        parts.append(cm.layer_seconds("qkv_split", local_elems(s.input, s.mesh, cluster)))
    if any(p is None for p in parts):
        return None
    return sum(p[0] for p in parts), sum(p[1] for p in parts)


def _layer_seconds(op: Op, s: Strategy, cluster: Cluster, cm: ComputeModel, act_bytes: int) -> tuple[float, float]:
    kind, d = op.layer.kind, op.dims
    user = _user_seconds(op, s, cluster, cm) if act_bytes == 2 else None
    if user is not None:
        return user
    per = cluster.devices // _repeats(s)

    def mem(passes_fwd, passes_bwd, elems):
        return (cm.op_seconds("elementwise", passes_fwd * elems * act_bytes),
                cm.op_seconds("elementwise", passes_bwd * elems * act_bytes))

    if kind == "matmul":
        f = matmul_kernel_seconds(op, s, cluster, cm, act_bytes)
        wf, wb = weight_cast_seconds(s, cluster, cm, act_bytes)
        f, b = f + wf, 2 * f + wb
        casts = cm.layer_seconds("cast", local_elems(s.input, s.mesh, cluster)) \
            if act_bytes == 2 and s.recipe_dim("cast_input") and s.input is not None else None
        if casts is not None:  # each projection casts the fp32 norm output to bf16 (calibrate.layers)
            n = s.recipe_dim("projections") or 1
            f, b = f + n * casts[0], b + n * casts[1]
        return f, b
    if kind == "embedding":  # gather and mask forward; mask, zero-filled dense gradient and scatter-add backward
        out = local_elems(s.output, s.mesh, cluster)
        wts = sum(local_elems(w, s.mesh, cluster) for w in s.weights if w.name == "weight")
        f = cm.op_seconds("embedding", 4 * out * act_bytes)
        b = cm.op_seconds("embedding_backward", (4 * out + wts) * act_bytes)
        pos = [w for w in s.weights if w.name == "positions"]
        if pos:
            f += cm.op_seconds("elementwise", 3 * out * act_bytes)
            b += cm.op_seconds("elementwise", (out + local_elems(pos[0], s.mesh, cluster)) * act_bytes)
        if s.recipe_dim("dropout"):  # Megatron-LM's embedding dropout
            df, db = dropout_seconds(out, cm, act_bytes)
            f, b = f + df, b + db
        return f, b
    if kind in ("layernorm", "rmsnorm") and s.signature.endswith("-split"):
        e = local_elems(s.input, s.mesh, cluster)
        a, f = act_bytes, STAT_BYTES
        return cm.op_seconds("elementwise", e * (6 * a + 11 * f)), cm.op_seconds("elementwise", e * (9 * a + 26 * f))
    if kind in ("layernorm", "rmsnorm"):  # backward: dx, then the scale's and shift's gradients, each reading x and dy
        return mem(2, 5, local_elems(s.input, s.mesh, cluster))
    if kind == "pointwise":
        return mem(2, 3, local_elems(s.input, s.mesh, cluster))
    if kind == "swiglu":
        return mem(5, 9, local_elems(s.output, s.mesh, cluster))
    if kind == "residual":
        f, b = mem(3, 3, local_elems(s.output, s.mesh, cluster))
        if s.recipe_dim("dropout"):  # Megatron-LM's bias-dropout-add: the mask written in the add's kernel
            df, db = dropout_seconds(local_elems(s.output, s.mesh, cluster), cm, act_bytes, fused=True)
            f, b = f + df, b + db
        return f, b
    if kind == "attention":
        mb, heads, c = d["micro_batch"], d["heads"], context_split(s)
        shape = (mb // s.mesh.role_size(0), heads // heads_split(s), d["tokens"] // mb, d["hidden"] // heads)
        out = local_elems(s.output, s.mesh, cluster)
        f, b = (_core(op, s, cluster, cm, act_bytes, bwd) for bwd in (False, True))
        around = _user_attention(op, s, cluster, cm) if act_bytes == 2 and s.recipe_dim("autocast") else None
        if around is not None:
            return f + around[0], b + around[1]
        if d.get("rotary", 0):
            qk = (d["tokens"] // (s.mesh.role_size(0) * c)) * ((heads + op.kv_heads) // heads_split(s)) * op.head_dim
            f += cm.op_seconds("elementwise", ROTARY_PASSES[0] * qk * act_bytes)
            b += cm.op_seconds("elementwise", ROTARY_PASSES[1] * qk * act_bytes)
        cf, cb = (None if x is None else x / c for x in (cm.attention_copy_seconds(*shape, act_bytes, backward=bwd)
                                                         for bwd in (False, True)))
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


def matmul_kernel_seconds(op: Op, s: Strategy, cluster: Cluster, cm: ComputeModel, act_bytes: int) -> float:
    """A matmul layer's forward product alone (no casts) on its local (m, k, n): m and n the output's local rows
    and columns, k from the flops over the devices that do not repeat the work."""
    d = op.dims
    rows, cols = local_elems_shape(s.output, s, cluster)
    k = d["tokens"] * d["k"] * d["n"] / (cluster.devices // _repeats(s)) / (rows * cols)
    return cm.matmul_seconds(rows, max(1, round(k)), cols, act_bytes)


def local_elems_shape(t, s: Strategy, cluster: Cluster) -> tuple[int, int]:
    shape = local_shape(t.shape, fine_of(t.sbp, s.mesh, cluster), cluster)
    return shape[0], math.prod(shape[1:])


ADAM_BYTES = 28  # fused AdamW per fp32 parameter: reads weight, gradient, m, v; writes weight, m, v
COPY_DOWN_BYTES = 6  # a main-gradient recipe's fp32 master weight copied into the half weight (read 4, write 2), and
# in fp16 its fp16 main gradient copied up to fp32 for the optimizer (read 2, write 4)
CAST_BYTES = 6  # autocast's cast of a weight to bf16 (read 4, write 2) or of its bf16 gradient to fp32 (read 2, write 4)


def optimizer_seconds(s: Strategy, cluster: Cluster, cm: ComputeModel, act_bytes: int, mode: Mode = NONE,
                      tied: bool = False) -> float:
    """Once per step: fused AdamW over every locally held parameter (FSDP and ZeRO: its shards) at the fused kernel's
    bandwidth (the fp32 weights and gradients of the recipe need no cast around it; a main-gradient recipe's
    strategy, Megatron-LM's, its copies beside: ``COPY_DOWN_BYTES`` once, twice with a half main gradient, as
    elementwise passes). A tied logits layer (``tied``) has none of its own: the optimizer steps the embedding's
    weight once."""
    if tied:
        return 0.0
    params = sum(zero_elems(s, w, cluster, mode, 1) for w in s.weights)  # ZeRO: each rank steps its shard
    g = s.recipe_dim("main_grad")
    copies = cm.op_seconds("elementwise", params * COPY_DOWN_BYTES * (2 if g == 2 else 1)) if g and params else 0.0
    return cm.op_seconds("optimizer", params * ADAM_BYTES) + copies


def accumulate_seconds(s: Strategy, cluster: Cluster, cm: ComputeModel, act_bytes: int, mode: Mode = NONE) -> float:
    """Per micro-batch after the first: adding each weight's new fp32 gradient into .grad (read both, write
    one: 3 x 4 bytes per locally held parameter; FSDP: the reduce-scattered shard); none under a main-gradient
    recipe, whose add runs every micro-batch in the backward (``cast_bytes``)."""
    params = sum(held_elems(s, w, cluster, mode) for w in s.weights)
    if s.recipe_dim("main_grad"):
        return 0.0
    return cm.op_seconds("elementwise", 3 * params * FP32.gradient) if params else 0.0


def fsdp_steps(s: Strategy, cluster: Cluster, mode: Mode) -> list[tuple[str, str, Step]]:
    """(weight, direction, step) of FSDP's collectives per micro-batch and occurrence: each sharded weight
    all-gathered forward and backward (fp32: its gathered bytes), its gradient reduce-scattered backward."""
    out = []
    wb = FP32.weight  # fp32 parameters (torchtitan's fully_shard without a mixed-precision policy)
    for w in s.weights:
        axes = fsdp_axes(s, w, cluster, mode)
        if not axes:
            continue
        nbytes = local_elems(w, s.mesh, cluster) * wb
        out += [(w.name, "fwd", Step("allgather", axes, nbytes)), (w.name, "bwd", Step("allgather", axes, nbytes)),
                (w.name, "bwd", Step("reducescatter", axes, nbytes))]
    return out


def fsdp_seconds(s: Strategy, cluster: Cluster, coster: Coster, mode: Mode, fwd: float | None,
                 bwd: float | None) -> float:
    """Per micro-batch and occurrence, FSDP's communication not hidden behind the layer's own compute
    (``fwd``, ``bwd`` seconds; None: nothing hidden, the communication objective's sum), and under the step
    objective fully_shard's copies on the compute stream: each all-gather's output copied out into the
    parameters, each reduce-scatter's input copied in from the gradients (a read and a write of the gathered
    fp32 bytes each; 2 x H200, 2026-11-28: FSDP's step spent 31 ms more in copy kernels than DDP's), and each
    all-gather's input copied in from the local shards (a read and a write of a shard's bytes: 2 x H200,
    2026-11-30, `_foreach_copy_` 40 ms of a step's 113 ms of fully_shard's copies, the only one not priced)."""
    steps = fsdp_steps(s, cluster, mode)
    if not steps:
        return 0.0
    tf = sum(coster.step_time(st) for _, d, st in steps if d == "fwd")
    tb = sum(coster.step_time(st) for _, d, st in steps if d == "bwd")
    if fwd is None:
        return tf + tb
    cm = coster.profile.compute
    rs = sum(coster.step_time(st) for _, d, st in steps if st.op == "reducescatter")
    k_ag, k_rs = (cm.overlap_slowdown(c) if cm is not None else 1.0 for c in ("all_gather", "reduce_scatter"))
    k_b = (k_ag * (tb - rs) + k_rs * rs) / tb if tb > 0 else 1.0
    copies = 0.0
    if cm is not None:
        gathered = sum(cm.memory_seconds(2 * st.nbytes) for _, _, st in steps)  # out of each gather, into each scatter
        shards = sum(cm.memory_seconds(2 * st.nbytes / cluster.group(st.axes).ranks) for _, _, st in steps
                     if st.op == "allgather")  # the local shard into each all-gather
        copies = gathered + shards
    # the layer's compute beside its gathers (and reduce-scatters) runs slower by the measured overlap slowdown
    return max(0.0, tf - fwd) + max(0.0, tb - bwd) + (k_ag - 1) * min(tf, fwd) + (k_b - 1) * min(tb, bwd) + copies


def serial_fsdp_seconds(s: Strategy, cluster: Cluster, coster: Coster, mode: Mode, rerun: bool) -> float:
    """Per micro-batch and occurrence, FSDP's communication on the DTensor path (``autotune.apply.dtensor``: each
    weight stored split and all-gathered at use by a parametrization whose backward reduce-scatters): DTensor's
    redistribute waits for its collective, which waits for the work queued before it, so each runs in series with
    the compute, nothing hidden, nothing slowed beside it, no fully_shard copies. The forward's all-gathers, again
    in the backward only where the forward re-runs there (``rerun``: the backward multiplies by the forward's
    bf16 cast, saved), and the reduce-scatters (2 x H200, 2026-11-30, ``tests/gpu/dtensor_fsdp_overlap.py``: a
    stack of Linear layers took 0.99-1.59 times its collectives' time alone over its compute alone, where the device
    binds; what it takes beyond 1 is not priced)."""
    steps = fsdp_steps(s, cluster, mode)
    gather = sum(coster.step_time(st) for _, d, st in steps if d == "fwd")
    scatter = sum(coster.step_time(st) for _, _, st in steps if st.op == "reducescatter")
    return gather * (2 if rerun else 1) + scatter


# the share of a unit's host issue time (the profile's figure: forward and backward of a micro-batch) spent issuing its
# forward: the backward runs one autograd node per differentiable op the forward recorded, and fully_shard issues
# one unshard a unit in each direction, so half each (not measured apart: ``calibrate``'s host timing issues both;
# tests/gpu/fsdp_prefetch_check.py measures the share on a transformers Llama under fully_shard)
FORWARD_HOST_SHARE = 0.5


def implicit_prefetch_exposed(units, backlog: float = 0.0) -> tuple[float, float]:
    """The seconds the device waits on fully_shard's all-gathers in one micro-batch's forward, and the device's
    backlog when the CPU is done issuing it. ``units``: (device compute, host issue, all-gather) seconds per unit in
    forward order (an all-gather of 0: a part of the root unit run after its gather, nothing to wait for);
    ``backlog``: the device's work still queued when the CPU reaches the first unit (the CPU's lead; 0 where the
    user's loop synchronises): the micro-batch before, whose last collective (the root's reduce-scatter, after its
    whole backward) the gathers queue behind on the one communicator, so the first unit's gather is never hidden.

    FSDP2 prefetches the forward implicitly: unit i's all-gather is issued (on the all-gather stream) by its own
    pre-forward hook, when the CPU reaches unit i, so it overlaps unit i-1's compute only as far as the CPU has run
    ahead of the device; it also waits for the all-gather stream and for unit i-2's copy-out (fully_shard frees a
    gathered unit before the next but one gathers). With H_i the CPU's clock at unit i's hook (H_0 = 0,
    H_i+1 = H_i + h_i), F the device's end of the work before unit i (F = backlog before unit 0):

        all-gather done  E_i = max(H_i, E_i-1, S_i-2) + g_i    (E_-1 = backlog)
        device start     S_i = max(F, H_i, E_i)        exposed_i = S_i - max(F, H_i)
        device end       F  <- max(S_i + c_i, H_i + h_i)  (no sooner than the CPU issues the unit's last kernel)

    A host infinitely fast exposes the first unit's gather only (each later one hides behind the compute before it);
    a host no faster than the device's compute and gather (h >= c + g) exposes every unit's gather in full; between,
    the gathers eat the CPU's lead. The backward prefetches explicitly (one unit ahead, ``fsdp_seconds``' rule)."""
    host, free, gathered, starts, exposed = 0.0, backlog, backlog, [], 0.0
    for c, h, g in units:
        ready = start = max(free, host)
        if g > 0:
            gathered = max(host, gathered, starts[-2] if len(starts) > 1 else 0.0) + g
            start = max(ready, gathered)
            starts.append(start)
        exposed += start - ready
        free = max(start + c, host + h)
        host += h
    return exposed, free - host


def fsdp_units(chain, blocks, fwd, gather, host, share: float = FORWARD_HOST_SHARE) -> list[tuple[float, float, float]]:
    """``implicit_prefetch_exposed``'s units of one micro-batch's forward (``fsdp_forward_exposed``'s arguments): the
    root's hook (its gathers, nothing computed), then each stretch of the chain: a block, or layers outside the
    blocks (the root's, already gathered)."""
    inside = {i for start, end in blocks for i in range(start, end)}
    units = [(0.0, 0.0, sum(gather[chain[i]] for i in range(len(chain)) if i not in inside))]
    cuts = sorted({0, len(chain), *(x for b in blocks for x in b)})
    for start, end in zip(cuts, cuts[1:]):
        pos = range(start, end)
        units.append((sum(fwd[chain[i]] for i in pos), share * sum(host[i] for i in pos),
                      sum(gather[chain[i]] for i in pos) if start in inside else 0.0))
    return units


def fsdp_forward_exposed(chain, blocks, micro_batches: int, fwd, bwd, gather, host, scatter=None,
                         share: float = FORWARD_HOST_SHARE) -> float:
    """Per step, fully_shard's forward all-gathers not hidden (``implicit_prefetch_exposed``) in a model placed as
    ``autotune.apply.fsdp`` does: a unit per block (``blocks``: chain positions [start, end)) and the root over the
    layers outside them, gathered at the model's pre-forward and kept to the backward. ``fwd``, ``bwd``,
    ``gather``: per distinct layer, its forward and backward compute and forward all-gathers, seconds per occurrence
    and micro-batch; ``host``: per chain position, the host's seconds to issue it (forward and backward of a
    micro-batch), ``share`` of it the forward's; ``scatter``: per distinct layer its gradients' reduce-scatter, the
    root's (the layers outside the blocks) run after the whole backward. The step starts with the CPU's lead at zero
    (a loop that reads its loss); each later micro-batch with the lead the CPU built while the device ran the
    backward before it, and the root's reduce-scatter."""
    units = fsdp_units(chain, blocks, fwd, gather, host, share)
    inside = {i for start, end in blocks for i in range(start, end)}
    root_rs = sum(scatter[chain[i]] for i in range(len(chain)) if i not in inside) if scatter is not None else 0.0
    back_c, back_h = sum(bwd[v] for v in chain), (1.0 - share) * sum(host)
    total, backlog = 0.0, 0.0
    for _ in range(micro_batches):
        exposed, backlog = implicit_prefetch_exposed(units, backlog)
        total += exposed
        backlog = max(backlog + back_c - back_h, 0.0) + root_rs
    return total


def pipelined_fsdp_seconds(s: Strategy, cluster: Cluster, coster: Coster, mode: Mode, fwd: float,
                           bwd: float) -> tuple[float, float, float]:
    """A pipeline stage's FSDP as torchtitan runs it (``autotune.apply.pipeline``: the ``FSDPModule`` handed to
    ``PipelineStage``, resharding after backward and gradient sync off until the step's end), per occurrence:
    (one forward all-gather's seconds not hidden behind the layer's forward compute ``fwd``, one backward
    all-gather's not hidden behind its backward compute ``bwd``, the reduce-scatter of its gradients once a
    step): max(0, AG - fwd), max(0, AG - bwd), RS, with AG the all-gathers of its sharded weights (fp32) and RS
    their gradients' reduce-scatters (fp32, after the stage's last backward: nothing hides them). How many
    gathers a step runs is the stage's (``autotune.pipeline.stage``)."""
    steps = fsdp_steps(s, cluster, mode)
    ag = sum(coster.step_time(st) for _, d, st in steps if d == "fwd")
    rs = sum(coster.step_time(st) for _, _, st in steps if st.op == "reducescatter")
    return max(0.0, ag - fwd), max(0.0, ag - bwd), rs
