"""Layer cost rules: each layer kind lists its legal SBP signatures on a cluster.

A strategy fixes a role mesh and the placements of the layer's input, output
and weights, plus any redistribution inside the layer (SUMMA's panel
all-gathers, the softmax statistics of a vocabulary-split loss). Costs are
derived generically (``autotune.sbp.cost``): internal boxings forward and,
where marked, backward (the gradient's dual boxing); weight-gradient
all-reduce over the axes where a weight is B while the layer's input is split
(the work is divided there, so each device holds only part of the gradient).

Matmul roles (AutoDDL §4.2.2, I W = O, I [m, k], W [k, n]):
    role m: I S0, W B,  O S0      role n: I B, W S1, O S1      role k: I S1, W S0, O P
Signature "autoddl" orders the roles (m, n, k): I (S0, B, S1), W (B, S1, S0),
O (S0, S1, P), the paper's; "transposed" orders them (m, k, n): I (S0, S1, B),
W (B, S0, S1), O (S0, P, S1) (Megatron's row-parallel layer is one instance);
"summa" is the 2D algorithm of Xu et al. (baseline only), keeping every gathered panel for the backward
pass; "summa-lean" the 2-D SUMMA that keeps only its local blocks and broadcasts the panels again in the
backward pass (baseline only). "column-sp" (``COLUMN_SP``) is Megatron-LM's column-parallel layer under
sequence parallelism: placed as "autoddl" on (d, t, 1) (its input gathered over t), it keeps only its input's
sequence shard (tokens split over d and t: 1/t of the gathered input) and all-gathers it again in the backward
for dW, beside the input-gradient GEMM that hides it, then reduce-scatters the input's gradient into the sequence
shard it returns beside the weight-gradient GEMM (``LinearWithGradAccumulationAndAsyncCommunication``;
Korthikanti et al. 2022, section 4.2.2: the qkv and fc1 inputs 2 s b h / t each); offered only where a
problem's signatures name it (a Megatron recipe's 3-D layouts: ``autotune.pipeline.stage.Layout``).
"""
from __future__ import annotations

import functools
import dataclasses
import math
from dataclasses import dataclass, field

from calibrate.errors import UserError
from models.graph import Layer

from autotune.sbp.memory import RECIPES, recipe_of
from autotune.sbp.mesh import Cluster, RoleMesh, cached_hash, role_meshes
from autotune.sbp.sbp import B, P, NdSbp, divides, dual, fine_of, local_shape

ACT_BYTES = 2  # default bytes per activation/gradient element (bf16/fp16); a model may give 4 (fp32)
# bytes per locally held parameter (weight, gradient, optimizer) in the users' recipe: 16 in either precision
# (autotune.sbp.memory)
PARAM_BYTES = RECIPES["autocast"].parameter_bytes


@cached_hash
@dataclass(frozen=True)
class Tensor:
    name: str
    shape: tuple[int, ...]
    sbp: tuple[str, ...]  # one placement per role


@cached_hash
@dataclass(frozen=True)
class Internal:
    """A redistribution inside a layer, per micro-batch."""

    tensor: str
    shape: tuple[int, ...]
    itemsize: int
    src: tuple[str, ...]
    dst: tuple[str, ...]
    backward: bool = True  # the gradient's dual boxing runs in the backward pass too
    direction: str = "fwd"  # the pass this boxing runs in
    # "dgrad" / "wgrad": it runs beside the layer's input-gradient / weight-gradient GEMM, which hides it (Megatron-LM's
    # asynchronous re-gather of a sequence-parallel input and reduce-scatter of its gradient, ``COLUMN_SP``); "": on
    # the critical path
    overlap: str = ""


@cached_hash
@dataclass(frozen=True)
class Strategy:
    signature: str
    mesh: RoleMesh
    input: Tensor | None
    output: Tensor | None
    weights: tuple[Tensor, ...] = ()
    internal: tuple[Internal, ...] = ()
    extra_act_elems: int = 0  # locally kept activations beyond the input (SUMMA panels, attention probabilities)
    extra_act_bytes: int = 0  # locally kept bytes beyond those (flash attention's fp32 log-sum-exp)
    grad_in: tuple[str, ...] | None = None  # placement of the input's gradient it returns (None: the dual of the input)
    fine_in: tuple[str, ...] = field(default=(), compare=False)
    fine_out: tuple[str, ...] = field(default=(), compare=False)
    fine_grad_in: tuple[str, ...] = field(default=(), compare=False)
    # how a user's module runs the layer (models.graph.ABSENT's "autocast", "projections", "cast_input",
    # "qkv_fused"), or, under a main-gradient recipe, ("main_grad", its bytes): (key, value) pairs; empty for the
    # AutoDDL graph (``with_recipe``)
    recipe: tuple[tuple[str, int], ...] = field(default=(), compare=False)

    def recipe_dim(self, key: str) -> int:
        return dict(self.recipe).get(key, 0)

    @property
    def uses_partial(self) -> bool:
        def partial(sbp):
            return any(p == P and self.mesh.role_size(r) > 1 for r, p in enumerate(sbp))
        ts = [t for t in (self.input, self.output, *self.weights) if t is not None]
        return any(partial(t.sbp) for t in ts) or any(partial(i.src) or partial(i.dst) for i in self.internal)

    def sbp(self, t: Tensor, cluster: Cluster) -> str:
        return NdSbp(t.sbp, self.mesh).format(cluster)


def finish(s: Strategy, cluster: Cluster) -> Strategy | None:
    """Expand to fine axes; None if some tensor does not divide."""
    for t in (s.input, s.output, *s.weights):
        if t is not None and not divides(t.shape, fine_of(t.sbp, s.mesh, cluster), cluster):
            return None
    fi = fine_of(s.input.sbp, s.mesh, cluster) if s.input else ()
    fo = fine_of(s.output.sbp, s.mesh, cluster) if s.output else ()
    fg = fine_of(s.grad_in, s.mesh, cluster) if s.grad_in else tuple(dual(p) for p in fi)
    return Strategy(s.signature, s.mesh, s.input, s.output, s.weights, s.internal, s.extra_act_elems,
                    s.extra_act_bytes, s.grad_in, fi, fo, fg)


def fine_key(s: Strategy, cluster: Cluster) -> tuple:
    """What a strategy does on the fine axes: equal keys are the same plan for the layer."""
    return (s.fine_in, s.fine_out, s.fine_grad_in, tuple(fine_of(w.sbp, s.mesh, cluster) for w in s.weights),
            s.internal, s.extra_act_elems, s.extra_act_bytes)


def _dedupe(strats, cluster) -> list[Strategy]:
    out, seen = [], set()
    for s in strats:
        s = finish(s, cluster)
        if s is None:
            continue
        key = fine_key(s, cluster)
        if key not in seen:
            seen.add(key)
            out.append(s)
    return out


MATMUL_ROLES = {"m": ("S0", B, "S0"), "n": (B, "S1", "S1"), "k": ("S1", "S0", P)}
MATMUL_ORDERS = {"autoddl": "mnk", "transposed": "mkn"}


class Op:
    """One layer kind; ``strategies`` enumerates its legal signatures on a cluster."""

    def __init__(self, layer: Layer, act_bytes: int = ACT_BYTES):
        self.layer = layer
        self.dims = layer.all_dims()
        self.act_bytes = act_bytes

    @property
    def in_shape(self) -> tuple[int, ...] | None:
        raise NotImplementedError

    @property
    def out_shape(self) -> tuple[int, ...] | None:
        raise NotImplementedError

    def strategies(self, cluster: Cluster, signatures=None) -> list[Strategy]:
        raise NotImplementedError


SUMMAS = ("summa", "summa-lean")
COLUMN_SP = "column-sp"
# in a problem's ``signatures``: a matmul's 3-role strategies only on meshes with a role of one device, where
# Megatron's layouts lie ((d, t, 1) column- and row-parallel, (d, 1, t) the vocabulary-parallel embedding): the
# 3-D baseline's stage layouts, a few of the matmul's many meshes on a large submesh
UNIT_ROLE = "unit-role"


class Matmul(Op):
    """linear / matmul, and embedding (k = vocabulary, the input one-hot token ids)."""

    @property
    def in_shape(self):
        return (self.dims["tokens"], self.dims["k"])

    @property
    def out_shape(self):
        return (self.dims["tokens"], self.dims["n"])

    def _extra_weights(self, out_sbp: tuple[str, ...], w_sbp: tuple[str, ...]) -> tuple[Tensor, ...]:
        """A matmul's bias (n,), placed as the output's feature split (S0 where the output is S1, B
        elsewhere); an embedding's learned positions (positions, n), split as the token table's n (S1
        where the table is S1, B elsewhere)."""
        n = self.dims["n"]
        out = []
        if self.layer.kind == "matmul" and self.dims.get("bias", 0):
            out.append(Tensor("bias", (n,), tuple("S0" if p == "S1" else B for p in out_sbp)))
        if self.layer.kind == "embedding" and self.dims.get("positions", 0):
            out.append(Tensor("positions", (self.dims["positions"], n),
                              tuple("S1" if p == "S1" else B for p in w_sbp)))
        return tuple(out)

    def build(self, sig: str, mesh: RoleMesh) -> Strategy:
        t, k, n = self.dims["tokens"], self.dims["k"], self.dims["n"]
        if sig in SUMMAS:
            sb = ("S0", "S1")
            weights = (Tensor("weight", (k, n), sb),) + self._extra_weights(sb, sb)
            gather_w = Internal("weight", (k, n), self.act_bytes, sb, (B, "S1"))
            if self.layer.kind == "embedding":
                return Strategy(sig, mesh, None, Tensor("output", (t, n), sb), weights,
                                (gather_w,), extra_act_elems=k * (n // mesh.role_size(1)))
            gather_x = Internal("input", (t, k), self.act_bytes, sb, ("S0", B))
            again = () if sig == "summa" else tuple(  # the backward's own broadcasts of both panels
                Internal(g.tensor, g.shape, g.itemsize, g.src, g.dst, backward=False, direction="bwd")
                for g in (gather_x, gather_w))
            return Strategy(
                sig, mesh, Tensor("input", (t, k), sb), Tensor("output", (t, n), sb), weights,
                (gather_x, gather_w) + again,
                extra_act_elems=(t // mesh.role_size(0)) * k + k * (n // mesh.role_size(1)),
            )
        if sig == COLUMN_SP:  # "autoddl" keeping the sequence shard, re-gathered over role 1 for dW
            s = self.build("autoddl", mesh)
            shard = ("S0", "S0", "S1")
            again = Internal("input", (t, k), self.act_bytes, shard, s.input.sbp, backward=False,
                             direction="bwd", overlap="dgrad")
            scatter = Internal("input-grad", (t, k), self.act_bytes, tuple(dual(p) for p in s.input.sbp), shard,
                               backward=False, direction="bwd", overlap="wgrad")
            return dataclasses.replace(s, signature=COLUMN_SP, internal=(again, scatter), grad_in=shard)
        roles = MATMUL_ORDERS[sig]
        i, w, o = (tuple(MATMUL_ROLES[r][j] for r in roles) for j in range(3))
        inp = None if self.layer.kind == "embedding" else Tensor("input", (t, k), i)
        return Strategy(sig, mesh, inp, Tensor("output", (t, n), o),
                        (Tensor("weight", (k, n), w),) + self._extra_weights(o, w))

    def strategies(self, cluster, signatures=None):
        sigs = [x for x in signatures or () if x not in (UNIT_ROLE, COLUMN_SP)] or tuple(MATMUL_ORDERS)
        three = role_meshes(cluster, 3)
        if signatures and UNIT_ROLE in signatures:
            three = [m for m in three if min(m.role_size(r) for r in range(3)) == 1]
        out = []
        for sig in sigs:
            if sig in SUMMAS:
                out += [self.build(sig, m) for m in role_meshes(cluster, 2)]
            else:
                out += [self.build(sig, m) for m in three]
        if signatures and COLUMN_SP in signatures and self.layer.kind == "matmul":  # on Megatron's (d, t, 1), t > 1
            out += [self.build(COLUMN_SP, m) for m in three if m.role_size(2) == 1 and m.role_size(1) > 1]
        return _dedupe(out, cluster)


class LayerNorm(Op):
    """Normalises each token over the hidden dimension. Signature "layernorm":
    tokens split over role 0, role 1 computes redundantly (B), the hidden
    dimension whole. Signature "layernorm-split" (3 roles, AutoDDL's qkv input
    (S0, B, S1) of §4.2.2 without a boxing): the hidden dimension split over
    role 2; each token's statistics then need the other pieces: the forward
    all-reduces the partial sum and sum of squares (2 fp32 per token) over role
    2, the backward the two sums its gradient needs, mean(dy) and mean(dy * x_hat)
    (derived from first principles, as Megatron's sequence-parallel layer norm).
    Its weight: the scale and, with ``bias`` (absent: 1, the AutoDDL presets' layer
    norm), the shift, (1 + bias, hidden).

    RMSNorm (kind "rmsnorm", signatures "rmsnorm" and "rmsnorm-split") is the same
    without the mean and the shift: its weight the scale (1, hidden); split, the
    forward all-reduces one partial sum of squares a token and the backward one sum,
    mean(dy * x_hat) (1 fp32 per token each)."""

    @property
    def in_shape(self):
        return (self.dims["tokens"], self.dims["hidden"])

    out_shape = in_shape

    def strategies(self, cluster, signatures=None):
        t, h = self.in_shape
        kind = self.layer.kind
        rms = kind == "rmsnorm"
        rows = 1 if rms else 1 + self.dims.get("bias", 1)
        nstat = 1 if rms else 2
        out = [Strategy(kind, m, Tensor("input", (t, h), ("S0", B)), Tensor("output", (t, h), ("S0", B)),
                        (Tensor("weight", (rows, h), (B, B)),))
               for m in role_meshes(cluster, 2)]
        sb = ("S0", B, "S1")
        for m in role_meshes(cluster, 3):
            if m.role_size(2) == 1:
                continue
            stats = tuple(Internal(name, (t, nstat), 4, ("S0", B, P), ("S0", B, B), backward=False, direction=d)
                          for name, d in ((f"{kind}-stats", "fwd"), (f"{kind}-grad-stats", "bwd")))
            out.append(Strategy(f"{kind}-split", m, Tensor("input", (t, h), sb), Tensor("output", (t, h), sb),
                                (Tensor("weight", (rows, h), (B, B, "S1")),), stats))
        return _dedupe(out, cluster)


class Pointwise(Op):
    """Elementwise ops and activations: any split of the input, no communication. Kind "residual"
    (the residual stream's add, one layer tied over the model) has the same strategies, signature
    "residual", and besides them the stream whole on role 1 (each device of role 1 adds the whole
    stream, as Megatron-LM's tensor-parallel ranks do between their regions)."""

    @property
    def in_shape(self):
        return (self.dims["tokens"], self.dims["hidden"])

    out_shape = in_shape

    def strategies(self, cluster, signatures=None):
        residual = self.layer.kind == "residual"
        sig = "residual" if residual else "pointwise"
        splits = [("S0", "S1")] + [("S0", B)] * residual  # the stream whole on role 1 as well: Megatron's
        return _dedupe([
            Strategy(sig, m, Tensor("input", self.in_shape, p), Tensor("output", self.out_shape, p))
            for p in splits for m in role_meshes(cluster, 2)
        ], cluster)


class SwiGLU(Pointwise):
    """silu(gate) * up on fc1's fused output (tokens, 2 ffn), gate and up interleaved column by column:
    any split of the input's features into whole pairs (S1 dividing ffn, which the output's (tokens,
    ffn) S1 checks) keeps each pair on one device, and the output's S1 halves it."""

    @property
    def in_shape(self):
        return (self.dims["tokens"], 2 * self.dims["hidden"])

    @property
    def out_shape(self):
        return (self.dims["tokens"], self.dims["hidden"])

    def strategies(self, cluster, signatures=None):
        return _dedupe([
            Strategy("swiglu", m, Tensor("input", self.in_shape, ("S0", "S1")), Tensor("output", self.out_shape, ("S0", "S1")))
            for m in role_meshes(cluster, 2)
        ], cluster)


class Attention(Op):
    """Self-attention core softmax(Q K^T) V: heads split (S1 of the fused QKV,
    (tokens, (heads + 2 kv_heads) head_dim), laid out in whole KV groups, so S1
    must divide kv_heads), tokens split only at sequence boundaries (S0 must
    divide the micro-batch).

    flash 0 (materialised probabilities; the AutoDDL presets): besides its input
    it keeps the attention probabilities for the backward pass: (micro-batch /
    S0) x (heads / S1) x sequence^2 elements a device. flash 1 (SDPA flash
    attention): it keeps Q, K, V (its input), the output O and the log-sum-exp
    (fp32, one a token and local head), no probabilities. Flash attention may
    also run on three roles, the third computing redundantly (B): on clusters
    larger than micro-batch x kv_heads devices (Llama 3 405B's batch of 32 on
    16,384 GPUs) replication is the only way to place it (no context parallelism)."""

    @property
    def kv_heads(self) -> int:
        return self.dims.get("kv_heads", self.dims["heads"])

    @property
    def head_dim(self) -> int:
        return self.dims.get("head_dim", self.dims["hidden"] // self.dims["heads"])

    @property
    def in_shape(self):
        return (self.dims["tokens"], (self.dims["heads"] + 2 * self.kv_heads) * self.head_dim)

    @property
    def out_shape(self):
        return (self.dims["tokens"], self.dims["hidden"])

    def strategies(self, cluster, signatures=None):
        out = []
        mb, heads, kv = self.dims["micro_batch"], self.dims["heads"], self.kv_heads
        t = self.dims["tokens"]
        seq = t // mb
        flash = self.dims.get("flash", 0)
        meshes = role_meshes(cluster, 2) + ([m for m in role_meshes(cluster, 3) if m.role_size(2) > 1] if flash else [])
        for m in meshes:
            r0, r1 = m.role_size(0), m.role_size(1)
            if mb % r0 or heads % r1 or kv % r1:
                continue
            if flash:
                extra = (t // r0) * (self.dims["hidden"] // r1)  # O
                lse = (t // r0) * (heads // r1) * 4
            else:
                extra, lse = mb // r0 * (heads // r1) * seq * seq, 0
            sbp = ("S0", "S1") if len(m.sizes) == 2 else ("S0", "S1", B)
            out.append(Strategy("attention", m, Tensor("input", self.in_shape, sbp),
                                Tensor("output", self.out_shape, sbp), extra_act_elems=extra, extra_act_bytes=lse))
        return _dedupe(out + self._context_parallel(cluster), cluster)

    def _context_parallel(self, cluster) -> list[Strategy]:
        """Context parallelism over c = the layer's ``context_parallel`` ranks (Megatron-LM's
        ``--context-parallel-size``, Llama 3's all-gather attention: Dubey et al. 2024, section 3.3.2), flash
        attention only. Signature "attention-cp" on a 3-role mesh (d / c, c, t), Megatron-LM's rank order (the
        tensor-parallel ranks innermost, then the context-parallel ones): whole sequences over d / c, each
        sequence's tokens over c (input, output S0 on roles 0 and 1: the token split of the layers around it, on
        the d data-parallel ranks) and heads over t, in 2c chunks a sequence so that the causal work balances
        (each rank the chunks i and 2c - 1 - i): every rank computes its queries against the sequence's keys, 1/c
        of the sequence's attention; its K and V all-gathered over c forward (the ``kv`` internal boxing, the
        fused QKV's K and V columns: 2 kv_heads head_dim) and their gradients reduce-scattered backward
        (``autotune.apply.context`` runs it). It keeps its local input and output, the log-sum-exp, and the
        gathered K and V (for the backward)."""
        c = self.dims.get("context_parallel", 1)
        if c < 2 or not self.dims.get("flash", 0):
            return []
        mb, heads, kv, hd, t = self.dims["micro_batch"], self.dims["heads"], self.kv_heads, self.head_dim, self.dims["tokens"]
        if (t // mb) % (2 * c):
            return []
        out = []
        sbp, kv_shape = ("S0", "S0", "S1"), (t, 2 * kv * hd)
        for m in role_meshes(cluster, 3):
            r0, r1 = m.role_size(0), m.role_size(2)
            if m.role_size(1) != c or mb % r0 or heads % r1 or kv % r1:
                continue
            local = t // (r0 * c)
            extra = local * (self.dims["hidden"] // r1) + (t // r0) * (2 * kv // r1) * hd  # O, the gathered K and V
            gather = Internal("kv", kv_shape, self.act_bytes, sbp, ("S0", B, "S1"))
            out.append(Strategy("attention-cp", m, Tensor("input", self.in_shape, sbp),
                                Tensor("output", self.out_shape, sbp), internal=(gather,), extra_act_elems=extra,
                                extra_act_bytes=local * (heads // r1) * 4))
        return out


class Loss(Op):
    """Softmax cross-entropy; its input (the logits) must not be partial.
    Signature "loss": the vocabulary split on role 1 (Megatron's
    vocabulary-parallel cross-entropy): the row max and sum (2 fp32 per token)
    are all-reduced over it; the gradient is local, split as the input.
    Signature "loss-replicated": the logits whole on role 1 (B), the loss
    computed redundantly there, so every device holds the whole gradient: it
    is returned as B, not as the dual P (no all-reduce owed backward; e.g.
    after Megatron's row-parallel last layer, whose output is all-reduced)."""

    @property
    def in_shape(self):
        return (self.dims["tokens"], self.dims["vocabulary"])

    @property
    def out_shape(self):
        return None

    def strategies(self, cluster, signatures=None):
        t = self.dims["tokens"]
        out = []
        for m in role_meshes(cluster, 2):
            stats = (Internal("softmax-stats", (t, 2), 4, ("S0", P), ("S0", B), backward=False),) if m.role_size(1) > 1 else ()
            out.append(Strategy("loss", m, Tensor("input", self.in_shape, ("S0", "S1")), None, (), stats))
            if m.role_size(1) > 1:
                out.append(Strategy("loss-replicated", m, Tensor("input", self.in_shape, ("S0", B)), None,
                                    grad_in=("S0", B)))
        return _dedupe(out, cluster)


class DataParallel(Op):
    """Convolution and pooling: data parallel, the batch split over every device."""

    @property
    def in_shape(self):
        return (self.dims["batch"], self.dims["in_features"])

    @property
    def out_shape(self):
        return (self.dims["batch"], self.dims["out_features"])

    def strategies(self, cluster, signatures=None):
        mesh = RoleMesh(((cluster.nodes, cluster.gpus_per_node),))
        w = self.dims.get("weights", 0)
        weights = (Tensor("weight", (w,), (B,)),) if w else ()
        s = finish(Strategy(self.layer.kind, mesh, Tensor("input", self.in_shape, ("S0",)),
                             Tensor("output", self.out_shape, ("S0",)), weights), cluster)
        if s is None:
            raise UserError(
                f"layer {self.layer.name}: batch {self.dims['batch']} does not divide over {cluster.devices} devices; "
                f"pick a (micro-)batch that is a multiple of {cluster.devices}"
            )
        return [s]


OPS: dict[str, type[Op]] = {
    "matmul": Matmul,
    "embedding": Matmul,
    "layernorm": LayerNorm,
    "rmsnorm": LayerNorm,
    "pointwise": Pointwise,
    "residual": Pointwise,
    "swiglu": SwiGLU,
    "attention": Attention,
    "loss": Loss,
    "conv": DataParallel,
    "pool": DataParallel,
}


RECIPE_DIMS = ("autocast", "projections", "cast_input", "qkv_fused")


NO_DROPOUT = (0.0, 0.0)


def dropout_dims(layer: Layer, dropout: tuple[float, float]) -> tuple[tuple[str, int], ...]:
    """(("dropout", 1),) where Megatron-LM's dropout runs on the layer's output, given ``dropout`` = (on the attention
    probabilities, on the hidden states: ``--attention-dropout``, ``--hidden-dropout``): the materialised attention's
    probabilities (flash attention draws its mask inside its kernel and keeps none: not priced), the residual adds
    (the bias-dropout-add after the projection and after fc2) and the embedding's output; () elsewhere."""
    kind, dims = layer.kind, layer.all_dims()
    on = (kind == "attention" and not dims.get("flash", 0) and dropout[0] > 0) or \
        (kind in ("residual", "embedding") and dropout[1] > 0)
    return (("dropout", 1),) if on else ()


def with_recipe(s: Strategy, layer: Layer, recipe: str = "autocast", act_bytes: int = ACT_BYTES,
                dropout: tuple[float, float] = NO_DROPOUT) -> Strategy:
    """``s`` carrying the layer's recipe dims (how a user's module runs it under bf16 autocast), which the memory
    and step models read; under a main-gradient recipe (``autotune.sbp.memory.Recipe.main_grad``: Megatron-LM's
    half-precision modules, no autocast) only ("main_grad", the main gradient's bytes) and, with ``dropout``
    (Megatron-LM's, in its recipes only: a UserError elsewhere), ("dropout", 1) where it runs (``dropout_dims``)."""
    r = recipe_of(recipe, act_bytes)
    if any(dropout) and not r.main_grad:
        raise UserError(f"dropout {dropout} is priced in Megatron-LM's recipes only, not in {recipe!r}: use "
                        f"megatron-fp16 or megatron-bf16, or no dropout")
    if r.main_grad:
        return dataclasses.replace(s, recipe=(("main_grad", r.gradient),) + dropout_dims(layer, dropout))
    dims = layer.all_dims()
    if not dims.get("autocast") and not dims.get("cast_input"):
        return s
    return dataclasses.replace(s, recipe=tuple((k, dims[k]) for k in RECIPE_DIMS if k in dims))


def make_op(layer: Layer, act_bytes: int = ACT_BYTES) -> Op:
    cls = OPS.get(layer.kind)
    if cls is None:
        raise UserError(f"layer {layer.name}: unknown kind {layer.kind!r}; use one of {', '.join(OPS)}")
    return cls(layer, act_bytes)


@functools.lru_cache(maxsize=None)
def local_elems(t: Tensor, mesh: RoleMesh, cluster: Cluster) -> int:
    """Elements of ``t`` a device holds (a pure function of its arguments, memoised: the modes of a search
    re-price the same strategies)."""
    return math.prod(local_shape(t.shape, fine_of(t.sbp, mesh, cluster), cluster))
