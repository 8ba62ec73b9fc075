"""Memory per device: the one place where a plan's memory is accounted.

On one device, a plan needs the sum over the layers of the model (a repeated
layer once per occurrence) of

    parameters   W * weight_bytes      W: the layer's weight elements held locally
    gradients    W * grad_bytes           (a weight split over an axis is divided by it,
    optimizer    W * optimizer_bytes       replicated (B) it is not; under FSDP also
                                           divided over its sharding axes)
    activations  A * act_bytes         A: what one micro-batch keeps for the backward pass

The precision recipe (``RECIPES``, a problem's ``recipe``) is by default the one users run ("autocast",
with ``act_bytes`` of the model):

    2 (bf16 autocast)  fp32 parameters under bf16 autocast with fused AdamW: weight 4
                       (fp32), gradient 4 (the bf16 weight gradient is accumulated into
                       the fp32 .grad), optimizer 8 (Adam's momentum and variance); and,
                       per micro-batch, the bf16 copy autocast makes of every matmul
                       weight (and bias) in the forward, kept alive for the backward:
                       2 bytes per element of the weight as the layer uses it (gathered,
                       under FSDP), counted with the activations (``weight_copy_bytes``)
    4 (fp32)           weight 4, gradient 4, optimizer 8, no copies

so 16 bytes per locally held parameter either way, plus the bf16 copies. Megatron-LM's recipes
("megatron-fp16", "megatron-bf16": ``Recipe.source`` cites each) hold half-precision weights (2), a
main gradient (2 or 4) and fp32 master weights with Adam's states and, in fp16, the fp32 gradient the
optimizer steps on (16 or 12): 20 and 18 bytes a parameter, no autocast copies; ZeRO-1 (Megatron's
distributed optimizer) shards the optimizer's part. Their layers keep what the generic rules below say,
all in the activation type (no fp32 stream: ``edge_bytes`` is not theirs), except the fp32 softmax of the
vocab-parallel loss (Megatron-LM casts the logits to fp32 unless --fp16-lm-cross-entropy). The
activations kept for the backward pass are, per layer (``kept_bytes``, in the
activation type unless said otherwise; where ``calibrate module`` measured the user's module, its
activations scaled to what it keeps: ``autotune.sbp.modulecal``):

    matmul, norm, GELU, SwiGLU its input (the matmul's I for dW = I^T dO, the
                               norm's, GELU's and SwiGLU's input)
    residual                   nothing (an add's backward passes its gradient on)
    attention, flash 0         its input (Q, K, V) and the probabilities softmax(Q K^T)
                               ((micro-batch / S0) x (heads / S1) x sequence^2 a device)
    attention, flash 1         its input (Q, K, V), its output O and the log-sum-exp
                               (fp32, (tokens / S0) x (heads / S1) a device)
    SUMMA matmul               its two gathered panels, which replace its input (the
                               gathered input panel is what dW needs); a SUMMA
                               embedding nothing (its backward needs the token ids only)
    column-sp matmul           its input's sequence shard, 1/t of the gathered input (Megatron-LM
                               under sequence parallelism; gathered again in the backward, the
                               gathered copy in the backward's workspace)
    loss                       the softmax probabilities in fp32 (4 bytes per local
                               logit, Megatron-LM's vocab-parallel cross-entropy); under bf16
                               autocast with the vocabulary split, torch's ``loss_parallel`` as
                               apply runs it, ``LOSS_PARALLEL_KEPT``
    dropout (Megatron-LM's     its mask, 1 byte an element of the output it drops (the residual adds'
    recipes, where set)        bias-dropout-add, the embedding's), and on the materialised attention's
                               probabilities also the dropped probabilities (``dropout_kept_bytes``)
    split layer norm / RMSNorm two fp32 copies of its input (x and x - mean, kept by
                               the products with x and with 1/sigma) and the
                               normalised input in the activation type

Recomputation (``Mode.recompute``, per tied block, ``autotune.sbp.recompute``):
"selective" drops the materialised attention's probabilities (flash attention
keeps what it keeps); "full" keeps, of a block, only its input (the first
layer's input, act_bytes an element) and no bf16 weight copy for the backward (they
are made again when the block's forward is re-run), though autocast's cache holds
the forward's copies until the forward ends (counted in the workspace there).
Megatron-LM's block method (``Mode.blocks``: ``--recompute-method block
--recompute-num-layers N``) re-runs only the first N of the blocks: those keep
what "full" keeps, the others what "none" keeps (``chain_roles``: the others'
positions lie outside every block).

A tied logits layer (dim ``tied``: it shares the embedding's weight) holds no
optimizer state (the optimizer steps the embedding's weight); the search counts
its weight and gradient as a copy in its own placement (its redistribution of the
embedding's); a plan whose logits weight is placed as the embedding's (the
transpose of the same fine placement) holds one tensor: ``Problem.memory_breakdown``
then drops the copy (``tied_saving``). So the search's sum is an upper bound of
the plan's memory.

On top of these, a step's peak holds a transient workspace (``peak_workspace``:
the gradients being computed in the backward pass of one layer while the
layers before it still keep their activations, with full recomputation the
re-run block's activations, and under FSDP two layers' gathered weights). A
plan fits when parameters + gradients + optimizer states + activations +
workspace is at most the limit: one accounting in the search's fit check and
the baselines' (``Problem.fits_plan``). Only one micro-batch's activations are
alive at a time: gradient accumulation runs the forward and backward of a
micro-batch before the next, accumulating into the gradients above.

These are AutoDDL's assumptions (§4.5.2: "since we used gradient accumulation
for all the experiments, the main bottleneck for memory was the model
parameters and its optimizer states"; §5.2.1 fp32 on Piz Daint, §5.3.1 mixed
precision on the A100s; §5.1.2 "the largest possible micro-batch"), with the
precision recipe above. Not counted: the collectives' buffers, the framework's
workspace, allocator fragmentation and the embedding's token ids; a measured
peak will sit somewhat above the prediction.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

from calibrate.errors import UserError

from models.graph import LayerGraph

from autotune.sbp.mesh import Cluster, cached_hash
from autotune.sbp.sbp import B, fine_of, is_split, local_shape, split_dim

STAT_BYTES = 4  # softmax and layer-norm statistics: fp32 in both precisions
# torch's ``loss_parallel`` (the loss on logits split by vocabulary, as apply runs it under bf16 autocast) in the
# step users run (a transformers model's own loss, ``labels``: its fp32 copy of the logits first), bytes per local
# logit: kept from its forward through its backward an fp32 logit-sized tensor (4), and while its fused nll and
# log-softmax backward runs its zeroed fp32 gradient, exp(x) and their sum (12). Measured as rank 0 of a fake group
# on one H200 (tests/gpu/memory_fake.py, 2026-11-29: the allocator's live blocks at the step's peak, 3.91 + 7.83 GiB
# of the backward for 1.05e9 local logits; tests/gpu/plans_fake.py, 2026-11-29: the step with ``labels`` 1.96 GiB
# under the one with the bf16 logits' F.cross_entropy, 2 bytes a local logit, at t = 2 and 4), where
# F.cross_entropy keeps 4 and needs 6
LOSS_PARALLEL_KEPT, LOSS_PARALLEL_WORK = 4, 12
COPY_BYTES = 2  # autocast's bf16 copy of a matmul weight, kept for the backward (act_bytes 2)

@dataclass(frozen=True)
class Recipe:
    """A precision recipe: bytes a locally held parameter takes as its weight, its gradient and its optimizer
    states, the bytes an element of its gradient's data-parallel sync is sent in (under the step objective),
    whether the users' bf16 autocast runs (fp32 weights cast per micro-batch and those casts kept for the
    backward, the fp32 residual stream: ``edge_bytes``, the layers as a user's module runs them:
    ``autotune.sbp.layers.with_recipe``), and whether the weight gradient is added into a main-gradient buffer
    (Megatron-LM's ``main_grad``) every micro-batch (no autocast casts; the optimizer copies its fp32 master
    weights back into the half-precision ones)."""

    name: str
    weight: int
    gradient: int
    optimizer: int
    sync: int
    autocast: bool = False
    main_grad: bool = False
    source: str = ""

    @property
    def parameter_bytes(self) -> int:
        return self.weight + self.gradient + self.optimizer


# every precision recipe (act_bytes 2; an fp32 model, act_bytes 4, is ``FP32`` under any of them)
RECIPES = {r.name: r for r in (
    Recipe("autocast", 4, 4, 8, 4, autocast=True, source="fp32 parameters under bf16 autocast with fused AdamW "
           "(Adam's m and v): what users of transformers' models and torchtitan run"),
    Recipe("autoddl", 2, 2, 12, 4, source="AutoDDL's (the paper reproduction's): fp16/bf16 weight and gradient, "
           "fp32 master weight and Adam m and v (ZeRO's K = 12), no autocast copies; synced as the others "
           "under the step objective (its records' pricing)"),
    Recipe("megatron-fp16", 2, 2, 16, 2, main_grad=True, source="Megatron-LM --fp16 without "
           "--accumulate-allreduce-grads-in-fp32 (the SC21 runs of Narayanan et al. 2021: examples/sc21/CONFIG.sh "
           "passes --fp16 --loss-scale 8192; megatron/model/distributed.py then makes main_grad in the parameters' "
           "fp16 and all-reduces it so): fp16 weights, activations and tensor-/pipeline-parallel communication, "
           "fp16 main gradients all-reduced in fp16, fp32 master weights, the fp32 copy of the gradients the "
           "optimizer steps on (Float16OptimizerWithFloat16Params) and Adam's m and v: 2 + 2 + 16 = 20 bytes a "
           "parameter, as the Megatron Core guide's distributed-optimizer table gives (4 + 16 / d with it)"),
    Recipe("megatron-bf16", 2, 4, 12, 4, main_grad=True, source="Megatron-LM --bf16 (which sets "
           "--accumulate-allreduce-grads-in-fp32): bf16 weights, activations and tensor-/pipeline-parallel "
           "communication, fp32 main gradients accumulated and all-reduced (reduce-scattered) in fp32, fp32 master "
           "weights and Adam's m and v: 2 + 4 + 12 = 18 bytes a parameter (Megatron Core guide: 6 + 12 / d with "
           "the distributed optimizer); Llama 3's as Dubey et al. 2024 section 3.3.2 states it (BF16, FP32 "
           "gradient accumulation over micro-batches and FP32 reduce-scatter over data-parallel ranks)"),
)}
FP32 = Recipe("fp32", 4, 4, 8, 4, source="an fp32 model (act_bytes 4): weight, gradient, Adam's m and v")


def recipe_of(name: str, act_bytes: int = 2) -> Recipe:
    """The recipe ``name`` for a model of ``act_bytes`` (4: ``FP32`` whatever the name); a one-line error for a
    name that is none."""
    if name not in RECIPES:
        raise UserError(f"unknown recipe {name!r}: use one of {', '.join(RECIPES)}")
    if act_bytes not in (2, 4):
        raise UserError(f"act_bytes {act_bytes!r} must be 2 (mixed precision) or 4 (fp32)")
    return RECIPES[name] if act_bytes == 2 else FP32


# layers whose output autocast leaves in the parameters' fp32 (a norm, the residual stream's add, the embedding's
# lookup; the matmuls', the attention's and the activations' outputs are in the activation type)
FP32_OUTPUTS = ("layernorm", "rmsnorm", "residual", "embedding")
MATMUL_SIGNATURES = ("autoddl", "transposed", "summa", "summa-lean", "column-sp")
RECOMPUTE = ("none", "selective", "full")


def edge_bytes(producer: str, consumer: str, act_bytes: int) -> tuple[int, int]:
    """(forward, backward) bytes an element of the tensor on an edge from a ``producer`` layer to a ``consumer``
    (their kinds) is sent in under the autocast recipe (fp32 parameters; ``act_bytes`` 2: bf16 autocast): forward
    the producer's output type; backward fp32 where either end is on the fp32 stream (the gradient reduced
    there is the stream's: a column-parallel layer's input gradient summed where the norm's output entered it,
    a row-parallel layer's output gradient where the stream's add took it), else the activation type."""
    if act_bytes != 2:
        return act_bytes, act_bytes
    return (4 if producer in FP32_OUTPUTS else 2), (4 if {producer, consumer} & set(FP32_OUTPUTS) else 2)


@cached_hash
@dataclass(frozen=True)
class Mode:
    """How a plan trains beyond its placements: recomputation per tied block and FSDP's sharding axes
    (None: no FSDP; otherwise every weight is sharded over those of its gradient-sync axes)."""

    recompute: str = "none"
    fsdp_axes: tuple[int, ...] | None = None
    zero: int = 0  # ZeRO stage over each weight's data-parallel (gradient-sync) axes: 1 optimizer states, 2 + grads
    blocks: int = 0  # under full recomputation, the first blocks re-run (Megatron-LM's block method); 0: every one

    def __post_init__(self):
        if self.recompute not in RECOMPUTE:
            raise UserError(f"recompute {self.recompute!r}: use one of {', '.join(RECOMPUTE)}")
        if self.zero not in (0, 1, 2) or self.zero and self.fsdp_axes is not None:
            raise UserError(f"ZeRO stage {self.zero!r}: use 0, 1 or 2, and not with FSDP (which shards everything)")
        if self.blocks and (self.blocks < 0 or self.recompute != "full" or self.fsdp_axes is not None):
            raise UserError(f"recompute blocks {self.blocks!r}: a count of blocks above 0, with full recomputation "
                            f"and without FSDP (Megatron-LM's block method, beside its distributed optimizer)")

    @property
    def takes_blocks(self) -> bool:
        """Whether block recomputation can take over this mode's: every block re-run, without FSDP."""
        return self.recompute == "full" and not self.blocks and self.fsdp_axes is None

    @property
    def whole(self) -> "Mode":
        """This mode with every block re-run (block recomputation's re-run blocks)."""
        return replace(self, blocks=0)

    @property
    def plain(self) -> "Mode":
        """This mode with nothing re-run (block recomputation's other blocks)."""
        return replace(self, recompute="none", blocks=0)

    @property
    def sharding(self) -> dict:
        """The plan's "sharding" field."""
        if self.fsdp_axes is None:
            return {"mode": "none", "axes": []}
        return {"mode": "fsdp", "axes": list(self.fsdp_axes)}


NONE = Mode()

# a layer's place in the chain for recomputation: outside every block, a block's first layer, inside one, the
# block's last layer that keeps a tensor (its closing matmul) or one after it (the residual adds closing it).
# torch.utils.checkpoint (non-reentrant, early stop, PyTorch's default) re-runs a block's forward only until its
# last saved tensor is packed, and an op's inputs are saved before its kernel runs: LAST re-runs what precedes its
# kernel (autocast's casts), TAIL nothing (one H100, 2026-11-27, development D1 and D3 recomputed: the re-run added
# 13.9 and 16.4 ms of kernels where the whole blocks' forward would be 18.8 and 19.2)
OUTSIDE, FIRST, INSIDE, LAST, TAIL = "outside", "first", "inside", "last", "tail"
RERUN = (FIRST, INSIDE)  # the places whose whole forward the re-run repeats


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


def precision(act_bytes: int, recipe: str = "autocast") -> tuple[int, int, int]:
    """(weight, gradient, optimizer) bytes a locally held parameter takes under ``recipe`` (``recipe_of``)."""
    r = recipe_of(recipe, act_bytes)
    return r.weight, r.gradient, r.optimizer


@functools.lru_cache(maxsize=None)
def _elems(t, mesh, cluster: Cluster) -> int:
    """Elements of ``t`` a device holds (pure, memoised)."""
    return math.prod(local_shape(t.shape, fine_of(t.sbp, mesh, cluster), cluster))


@functools.lru_cache(maxsize=None)
def grad_sync_axes(s, w, cluster: Cluster) -> tuple[int, ...]:
    """The fine axes over which weight ``w``'s gradient is all-reduced: where the weight is B and the
    layer's data is split (each device's tokens give partial sums). A layer without an input tensor (an
    embedding) has its data split as its output's tokens. A bias is summed over the output's rows: its
    data is the output's tokens (a role where the output is partial sums holds the whole bias gradient
    on each device)."""
    wf = fine_of(w.sbp, s.mesh, cluster)
    if w.name == "bias":
        data = s.fine_out
        return tuple(a for a in range(len(wf)) if wf[a] == B and is_split(data[a]) and split_dim(data[a]) == 0)
    data = s.fine_in or s.fine_out
    return tuple(a for a in range(len(wf)) if wf[a] == B and data and is_split(data[a]))


@functools.lru_cache(maxsize=None)
def fsdp_axes(s, w, cluster: Cluster, mode: Mode) -> tuple[int, ...]:
    """The axes weight ``w`` is sharded over under FSDP: its gradient-sync axes among the mode's."""
    if mode.fsdp_axes is None:
        return ()
    return tuple(a for a in grad_sync_axes(s, w, cluster) if a in mode.fsdp_axes)


def zero_elems(s, w, cluster: Cluster, mode: Mode, stage: int) -> float:
    """Elements of weight ``w``'s optimizer state (``stage`` 1) or gradient (2) a device keeps: under ZeRO at
    least ``stage`` (Megatron-LM's distributed optimizer, DeepSpeed's ZeRO-1/2), its 1 / (data-parallel size)
    share: the gradient reduce-scattered over the gradient-sync axes, each rank stepping its shard and
    all-gathering the weights (together the all-reduce's bytes, priced as it)."""
    n = held_elems(s, w, cluster, mode)
    if mode.zero >= stage:
        n /= math.prod(cluster.axis_sizes[a] for a in grad_sync_axes(s, w, cluster))
    return n


@functools.lru_cache(maxsize=None)
def held_elems(s, w, cluster: Cluster, mode: Mode = NONE) -> float:
    """Elements of weight ``w`` a device holds between uses (sharded over its FSDP axes)."""
    n = _elems(w, s.mesh, cluster)
    for a in fsdp_axes(s, w, cluster, mode):
        n /= cluster.axis_sizes[a]
    return n


def kept_bytes(s, cluster: Cluster, act_bytes: int, recompute: str = "none", role: str = OUTSIDE) -> float:
    """Bytes one micro-batch of a layer under strategy ``s`` keeps for the backward pass (autograd's
    saved tensors), given the recomputation and the layer's place (``OUTSIDE``, ``FIRST``, ``INSIDE``
    a block)."""
    inp = _elems(s.input, s.mesh, cluster) if s.input else 0
    user = act_bytes == 2 and s.recipe_dim("autocast")
    if recompute == "full" and role != OUTSIDE:
        return inp * (STAT_BYTES if user else act_bytes) if role == FIRST else 0.0
    if act_bytes == 2 and s.recipe:
        kept = user_kept(s, inp, _elems(s.output, s.mesh, cluster) if s.output else 0)
        if kept is not None:
            return kept
    if s.signature in ("loss", "loss-replicated"):
        return inp * STAT_BYTES
    if s.signature.endswith("norm-split"):
        return inp * (2 * STAT_BYTES + act_bytes)
    if s.signature == "summa":
        return s.extra_act_elems * act_bytes if s.input else 0
    if s.signature == "summa-lean":  # the local blocks only; the panels are broadcast again in backward
        return inp * act_bytes
    if s.signature == "column-sp":  # the input's sequence shard (1/t of it), gathered again in backward
        return inp // s.mesh.role_size(1) * act_bytes
    if s.signature == "residual":
        return dropout_kept_bytes(s, cluster, act_bytes)
    if s.signature.startswith("attention") and recompute == "selective" and not s.extra_act_bytes:
        return inp * act_bytes  # the probabilities (and their dropout) are recomputed
    return (inp + s.extra_act_elems) * act_bytes + s.extra_act_bytes + dropout_kept_bytes(s, cluster, act_bytes)


def dropout_kept_bytes(s, cluster: Cluster, act_bytes: int) -> float:
    """What Megatron-LM's dropout on a layer's output keeps (the strategy's "dropout" dim: ``layers.dropout_dims``):
    its mask, 1 byte an element (torch's dropout and Megatron's fused bias-dropout-add keep a bool mask), and on the
    materialised attention's probabilities also the dropped probabilities (the batched matmul with V keeps its
    input): Korthikanti et al. 2022, section 4.1, a s^2 b for the mask and 2 a s^2 b for the output; 0 without."""
    if not s.recipe_dim("dropout"):
        return 0.0
    if s.signature == "attention":
        return s.extra_act_elems * (1 + act_bytes)
    return _elems(s.output, s.mesh, cluster)


def user_kept(s, inp: int, out: int) -> float | None:
    """What autograd keeps of a layer in a user's bf16 autocast step (``calibrate.layers`` says how each
    piece runs), or None where the generic rule holds (the attention: Q, K, V, O and the log-sum-exp):

        a matmul reading an fp32 norm output   one bf16 copy of it per projection (each nn.Linear
                                               casts its input on its own and keeps the copy)
        layernorm                              its fp32 input (the residual stream)
        rmsnorm (as Llama's reference)         its fp32 input and the fp32 normalised product
        GELU                                   its bf16 input
        SwiGLU silu(gate) * up                 gate (silu's input), silu(gate) and up: three bf16
        residual add                           nothing
        loss (F.cross_entropy on bf16)         the fp32 log-probabilities (torch's loss_parallel on split
                                               logits: ``LOSS_PARALLEL_KEPT``)"""
    if s.recipe_dim("cast_input"):
        return (s.recipe_dim("projections") or 1) * inp * 2
    if not s.recipe_dim("autocast"):
        return None
    return {"layernorm": inp * STAT_BYTES, "rmsnorm": 2 * inp * STAT_BYTES, "pointwise": inp * 2,
            "swiglu": 3 * out * 2, "residual": 0.0,
            "loss": inp * (LOSS_PARALLEL_KEPT if loss_parallel(s) else STAT_BYTES),
            "loss-replicated": inp * STAT_BYTES}.get(s.signature)


def loss_parallel(s) -> bool:
    """Whether a loss strategy runs as torch's ``loss_parallel`` (apply's loss where the logits are split by vocabulary,
    under bf16 autocast): its vocabulary role over more than one device."""
    return s.signature == "loss" and s.recipe_dim("autocast") and s.mesh.role_size(1) > 1


def weight_copy_bytes(s, cluster: Cluster, act_bytes: int, unsharded_in: Mode | None = None) -> float:
    """Autocast's bf16 copies of a matmul's weights (as the layer uses them), kept for its backward (none where
    the weights are half precision already: a main-gradient recipe's strategy, ``Recipe.main_grad``);
    ``unsharded_in``: of the weights FSDP does not shard in that mode only."""
    if act_bytes != 2 or s.input is None or s.signature not in MATMUL_SIGNATURES or s.recipe_dim("main_grad"):
        return 0.0
    return COPY_BYTES * sum(_elems(w, s.mesh, cluster) for w in s.weights
                            if unsharded_in is None or not fsdp_axes(s, w, cluster, unsharded_in))


def kept_copy_bytes(s, cluster: Cluster, act_bytes: int, mode: Mode = NONE, role: str = OUTSIDE) -> float:
    """Autocast's weight copies a layer occurrence keeps for its backward (``weight_copy_bytes``), counted with its
    activations: none of a block's layers under full recomputation (the re-run forward makes them again)."""
    return 0.0 if mode.recompute == "full" and role != OUTSIDE else weight_copy_bytes(s, cluster, act_bytes)


def strategy_memory(s, cluster: Cluster, act_bytes: int, mode: Mode = NONE, role: str = OUTSIDE,
                    tied: bool = False, recipe: str = "autocast") -> Memory:
    """One occurrence of a layer under strategy ``s`` (an ``autotune.sbp.layers.Strategy``); ``tied``: a
    logits layer sharing the embedding's weight (no optimizer state; its weight and gradient a copy);
    ``recipe``: one of ``RECIPES`` (its bytes a parameter; autocast's copies only under "autocast")."""
    w, g, o = precision(act_bytes, recipe)
    params = sum(held_elems(s, t, cluster, mode) for t in s.weights)
    grads, states = (sum(zero_elems(s, t, cluster, mode, k) for t in s.weights) for k in (2, 1)) if mode.zero \
        else (params, params)
    copies = kept_copy_bytes(s, cluster, act_bytes, mode, role) if recipe == "autocast" else 0.0
    return Memory(params * w, grads * g, 0.0 if tied else states * o,
                  kept_bytes(s, cluster, act_bytes, mode.recompute, role) + copies)


def shares_tied_weight(s_logits, s_embedding, cluster: Cluster, mode: Mode = NONE) -> bool:
    """Whether a tied logits layer's weight is placed as the embedding's (the transposed fine placement: S0
    and S1 swapped, the same FSDP axes): then the two are one tensor (one copy, one gradient)."""
    lw = next(w for w in s_logits.weights if w.name == "weight")
    ew = next(w for w in s_embedding.weights if w.name == "weight")
    swap = {"S0": "S1", "S1": "S0"}
    lf = fine_of(lw.sbp, s_logits.mesh, cluster)
    ef = fine_of(ew.sbp, s_embedding.mesh, cluster)
    return tuple(swap.get(p, p) for p in lf) == ef and fsdp_axes(s_logits, lw, cluster, mode) == fsdp_axes(
        s_embedding, ew, cluster, mode)


def tied_saving(s_logits, s_embedding, cluster: Cluster, act_bytes: int, mode: Mode = NONE,
                recipe: str = "autocast") -> Memory:
    """What a tied logits layer's copy costs when it is not needed: its weight placed as the embedding's
    (``shares_tied_weight``), one tensor, so its weight and gradient go."""
    if not shares_tied_weight(s_logits, s_embedding, cluster, mode):
        return Memory()
    lw = next(w for w in s_logits.weights if w.name == "weight")
    w, g, _ = precision(act_bytes, recipe)
    n = held_elems(s_logits, lw, cluster, mode)
    return Memory(n * w, n * g)


def _local(t, s, cluster: Cluster) -> int:
    return _elems(t, s.mesh, cluster) if t is not None else 0


def work_bytes(s, cluster: Cluster, act_bytes: int, accumulate: bool) -> float:
    """Bytes a layer allocates beyond what it keeps while its backward runs (its forward
    needs no more): the gradients of its output and of its input, the materialised
    attention's gradients of the probabilities and of the scores (flash attention: its fp32
    dQ accumulator, 4 bytes per output element), the split norm's fp32 gradients (two
    input-sized), SUMMA's gradients of its gathered panels, and each weight's new gradient:
    with bf16 autocast (act_bytes 2) the bf16 gradient every micro-batch, and, when
    ``accumulate`` (micro-batches after the first), its fp32 cast before it is added to .grad
    (the first micro-batch's cast becomes .grad); in fp32 the new gradient when ``accumulate``."""
    inp, out = _local(s.input, s, cluster), _local(s.output, s, cluster)
    weights = sum(_local(w, s, cluster) for w in s.weights)
    if s.signature in ("loss", "loss-replicated"):
        if act_bytes == 2 and loss_parallel(s):
            return inp * LOSS_PARALLEL_WORK
        if act_bytes == 2 and s.recipe_dim("autocast"):
            # F.cross_entropy of the fp32 copy: nll's fp32 gradient and log_softmax's fp32 gradient of its input at
            # once (then the bf16 cast, nll's freed). The user's module's measured peak was 2 bytes an element of the
            # logits above the 6 counted before, at all 24 shapes of two transformers Llamas (2 x H200, 2026-11-30)
            return inp * 2 * STAT_BYTES
        return inp * act_bytes  # the probabilities become the gradient in place; its cast
    if act_bytes == 2 and s.recipe_dim("main_grad"):  # the half gradient, added into the main gradient
        wbytes = weights * act_bytes
    elif act_bytes == 2:
        wbytes = weights * (act_bytes + (FP32.gradient if accumulate else 0))
    else:
        wbytes = weights * act_bytes if accumulate else 0
    elems = inp + out
    extra = 2 * STAT_BYTES * inp if s.signature.endswith("norm-split") else 0
    if s.signature.startswith("attention"):
        if s.extra_act_bytes:
            extra += STAT_BYTES * out
        else:
            elems += 2 * s.extra_act_elems
    if s.signature in ("summa", "summa-lean"):  # lean: the panels gathered again, and their gradients
        elems += s.extra_act_elems * (2 if s.signature == "summa-lean" else 1)
    if s.signature == "column-sp":  # the input gathered again for dW
        elems += inp
    return elems * act_bytes + extra + wbytes


def loss_forward_bytes(s, cluster: Cluster, act_bytes: int) -> float:
    """Bytes a loss layer's forward holds beyond what it keeps, at the end of the forward: its input (the
    logits, kept by no layer but held by the model's output) and, under bf16 autocast, the fp32 copy of them the
    loss computes on (transformers' loss upcasts them; F.cross_entropy under autocast does too): one H100,
    2026-11-27: 3 x 0.49 GiB alive at the loss's line for 0.98 GiB of fp32 log-probabilities kept; 2 x H200,
    2026-11-30, Llama 3 8B's peak inside cross_entropy: the bf16 logits 3.91 GiB and their fp32 copy 7.83 beside
    the log-probabilities 7.83 (reports/records/plans_h200x2.md, session 30). 0 for other layers."""
    if s.signature not in ("loss", "loss-replicated"):
        return 0.0
    inp = _local(s.input, s, cluster)
    return inp * (act_bytes + STAT_BYTES) if act_bytes == 2 and s.recipe_dim("autocast") else inp * act_bytes


def gathered_weight_bytes(s, cluster: Cluster, mode: Mode) -> float:
    """Under FSDP, the bytes of a layer's sharded weights gathered for use (fp32: the parameters' type), whole:
    the gathered weight is an allocation of its own beside the shard (fully_shard's unsharded parameters, the
    DTensor path's all-gather at use; 2 x H200, 2026-11-30: Llama 3 8B's root unit, its embedding and head,
    3.91 GiB unsharded beside their shards at the loss)."""
    if mode.fsdp_axes is None:
        return 0.0
    return sum(_elems(t, s.mesh, cluster) * FP32.weight for t in s.weights
               if held_elems(s, t, cluster, mode) < _elems(t, s.mesh, cluster))


def largest_block(graph: LayerGraph, devices: int) -> float:
    """Bytes of the step's largest single allocation where the devices each hold their own piece of a micro-batch
    (data parallelism on every device): the loss's fp32 copy of the local logits (``STAT_BYTES`` each: a
    transformers model's loss upcasts them). The default caching allocator cannot merge its cached blocks into a
    request larger than any of them: such a request needs that much memory beyond what it has reserved (2 x H200,
    2026-11-30: three plans priced 0.1-7.5 GiB under their limits ran out asking 15.66 GiB for this copy, one with
    15.08 GiB reserved but unallocated; reports/records/plans_h200x2.md, session 29). 0 for a graph without logits."""
    c = graph.config
    if not c.get("vocabulary") or not c.get("sequence"):
        return 0.0
    return float(STAT_BYTES * max(1, c.get("micro_batch", 1) // devices) * c["sequence"] * c["vocabulary"])


def peak_workspace(chain_strategies, cluster: Cluster, act_bytes: int, micro_batches: int,
                   mode: Mode = NONE, roles=None, recipe: str = "autocast", shared_gradients: float = 0.0,
                   forward_transient: float = 0.0, cached_gathered: bool = True) -> float:
    """Bytes above parameters, gradients, optimizer states and kept activations at a step's
    peak. The backward of chain position i runs while positions 0..i still keep their
    activations (the later ones are freed), so the activations peak at
    max over i of (kept by 0..i + work of i). With full recomputation (``roles``: each
    position's place, ``OUTSIDE``, ``FIRST`` or ``INSIDE`` a block) a block's forward is re-run
    before its backward: at position i inside a block, what the block's positions up to i keep
    without recomputation is alive too (less the block input, kept already). Under FSDP
    (``mode.fsdp_axes``), two layers' gathered weights (the one in use and the one prefetched)
    are alive throughout: twice the largest. At the end of the forward (the loss's forward) everything kept
    is alive with the loss's input and its forward's transient (``loss_forward_bytes``) and, with full
    recomputation under autocast, the bf16 copies of every re-run block's weights: autocast caches a
    weight's cast until its context exits, after the loss (one H100, 2026-11-27, development D2 and D4
    recomputed: that peak, 0.3-0.9 GiB above the backward's). The fused AdamW step on fp32 gradients needs no
    more. Gradients are set to None after each step (``zero_grad(set_to_none=True)``, PyTorch's
    default), so with one micro-batch the backward of position i runs while only the gradients of
    the positions after it exist; with gradient accumulation every gradient exists from the first
    micro-batch on. A position's activations are what ``strategy_memory`` counts (autocast's bf16 weight
    copies with them: each is freed with its layer's backward, as the rest of what the layer keeps), so
    that the peak and the breakdown it completes count the same bytes. The workspace is the peak minus
    all kept activations and all gradients: with one micro-batch it can be negative (the gradients not
    yet made at the peak, or, at an optimizer-step peak, the activations already freed). ``shared_gradients``:
    the bytes of gradients two positions count of one tensor (a tied logits weight placed as the embedding's:
    ``tied_saving``), which exist once: so that the breakdown's gradients, which drop them, plus this
    workspace make the peak (they were once subtracted from every peak: one H100, development D2 recomputed,
    0.31 GiB under). ``forward_transient``: bytes the blocks hold at the forward's end beyond what they keep, as
    the user's module was measured to (``calibrate module``: a transformers model's key/value cache).
    ``cached_gathered``: whether autocast's cache holds the copies of FSDP-gathered weights too: fully_shard's
    unsharded parameters are leaves, whose casts it caches; the DTensor path gathers a weight at use by a
    parametrization, whose casts it does not (``autotune.apply.dtensor``)."""
    acc = micro_batches > 1
    roles = roles or [OUTSIDE] * len(chain_strategies)
    full = mode.recompute == "full"
    made: dict[tuple[int, str], tuple[float, ...]] = {}  # a block's layers recur: each (strategy, role) once

    def parts(s, role: str) -> tuple[float, ...]:
        key = (id(s), role)
        if key not in made:
            m = strategy_memory(s, cluster, act_bytes, mode, role, recipe=recipe)
            g = m.gradients if recipe != "autoddl" else strategy_memory(s, cluster, act_bytes, mode, role).gradients
            copy = weight_copy_bytes(s, cluster, act_bytes)
            cached = copy if cached_gathered else weight_copy_bytes(s, cluster, act_bytes, unsharded_in=mode)
            made[key] = (m.activations, g, loss_forward_bytes(s, cluster, act_bytes),
                         cached if full and role != OUTSIDE and recipe == "autocast" else None,
                         kept_bytes(s, cluster, act_bytes) + copy - m.activations,
                         work_bytes(s, cluster, act_bytes, acc), gathered_weight_bytes(s, cluster, mode))
        return made[key]
    figs = [parts(s, role) for s, role in zip(chain_strategies, roles)]
    after = sum(f[1] for f in figs)  # the gradients of the positions after the current one
    total_grads = after - shared_gradients
    kept = peak = 0.0
    block = 0.0  # the re-run block's activations, up to the current position
    alive = []  # per position: the activations alive while its backward runs
    forward_end = 0.0  # beyond what is kept, at the end of the forward: the loss's and autocast's cached copies
    for role, (k, _, end, cached, rerun, _, _) in zip(roles, figs):
        kept += k
        forward_end += end
        if cached is not None:
            forward_end += cached
        if full:
            block = 0.0 if role in (FIRST, OUTSIDE) else block
            block += rerun if role != OUTSIDE else 0.0
        alive.append(kept + block)
    for a, (_, g, _, _, _, work, _) in zip(alive, figs):
        after -= g
        peak = max(peak, a + work + (total_grads if acc else after))
    gathered = sorted([0.0] + [f[6] for f in figs])
    peak = max(peak, kept + forward_end + forward_transient + (total_grads if acc else 0.0),
               total_grads)  # the forward's end; the step
    return peak - kept - total_grads + gathered[-1] + (gathered[-2] if len(gathered) > 1 else 0.0)


def pipelined_fsdp_memory(s, cluster: Cluster, act_bytes: int, mode: Mode, role: str = OUTSIDE, tied: bool = False,
                          recipe: str = "autocast") -> Memory:
    """One occurrence of a layer in a pipeline stage in FSDP mode as torchtitan runs it (``autotune.apply.pipeline``:
    fully_shard without a MixedPrecisionPolicy, a block's unit resharded after each forward, resharding after
    backward and gradient sync off until the step's end): its weights' fp32 shards (``weight`` bytes an element
    of the shard), and, outside the blocks (``role`` ``OUTSIDE``: the root unit, kept gathered from its first
    forward), the whole gathered weights too; its gradients accumulated unsharded from the first backward on
    (``gradient`` bytes an element of the whole local weight); the optimizer states of the shards only (none
    for a tied logits layer); a weight FSDP does not shard (no FSDP axis) held once, with its optimizer states;
    activations as ``strategy_memory``'s. A block's gathered weights are transient (the stage's workspace)."""
    w, g, o = precision(act_bytes, recipe)
    whole = sum(_elems(t, s.mesh, cluster) for t in s.weights)
    sharded = sum(_elems(t, s.mesh, cluster) for t in s.weights if fsdp_axes(s, t, cluster, mode))
    held = sum(held_elems(s, t, cluster, mode) for t in s.weights)
    acts = strategy_memory(s, cluster, act_bytes, mode, role, tied, recipe).activations
    return Memory((held + (sharded if role == OUTSIDE else 0)) * w, whole * g, 0.0 if tied else held * o, acts)


def chain_roles(graph: LayerGraph, blocks: int = 0) -> list[str]:
    """Each chain position's place for recomputation (``autotune.sbp.memory``'s roles): ``OUTSIDE`` every
    block, a block's ``FIRST`` layer, ``INSIDE`` one, the residual adds that close it ``TAIL`` and the matmul
    before them ``LAST`` (``LayerGraph.blocks``: [start, end) chain positions; absent: no blocks). ``blocks``
    (``Mode.blocks``): only the first that many blocks re-run, the others' positions ``OUTSIDE``."""
    roles = [OUTSIDE] * len(graph.chain)
    spans = getattr(graph, "blocks", None) or []
    for start, end in spans[:blocks] if blocks else spans:
        roles[start] = FIRST
        for p in range(start + 1, end):
            roles[p] = INSIDE
        p = end - 1
        while p > start and graph.layers[graph.chain[p]].kind == "residual":
            roles[p] = TAIL
            p -= 1
        if p > start and graph.layers[graph.chain[p]].kind == "matmul":
            roles[p] = LAST
    return roles


def layer_roles(graph: LayerGraph) -> list[str]:
    """Each distinct layer's place: the same at every occurrence, else ``OUTSIDE`` (nothing recomputed); a layer
    both ``INSIDE`` a block and at its ``TAIL`` (the residual add, one layer tied across the model) is ``INSIDE``:
    its add at the tail, which the re-run skips, is counted as re-run (one residual add's forward a block)."""
    out: list[str | None] = [None] * len(graph.layers)
    for v, r in zip(graph.chain, chain_roles(graph)):
        if out[v] is None or out[v] == r:
            out[v] = r
        elif {out[v], r} == {INSIDE, TAIL}:
            out[v] = INSIDE
        else:
            out[v] = OUTSIDE
    return [r or OUTSIDE for r in out]
