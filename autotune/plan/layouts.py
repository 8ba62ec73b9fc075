"""The plans apply runs on a local path, read from the typed plan alone (no torch): ``fully_shard_layout``
(FSDP, HSDP, TP + FSDP as torchtitan composes them), ``tp_layout`` (data x tensor parallelism), each tensor
axis Megatron's with or without sequence parallelism (``tp_axis_ok``, ``sequence_axes``), ``data_parallel_plan``
(DDP), a pipeline stage's ``local_twin`` (the same with a first stage's embedding split by features or a last
stage's logits split by vocabulary), ``local_stream`` (the stream such a stage holds), and the path each gives
(``plan_path``, ``twin_path``). ``autotune.apply`` and ``autotune.apply.pipeline`` place by them;
``autotune.pipeline.paths`` reads a searched stage plan's path by them."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from autotune.plan.typed import ApplyPath, TypedPlan
from autotune.sbp.mesh import RoleMesh
from autotune.sbp.sbp import B, P


@dataclass(frozen=True)
class FullyShard:
    """A plan that torchtitan's composition expresses: data axes (every activation split by the data, the
    weights sharded over ``shard`` of them and replicated over the others) and at most one trailing tensor
    parallel axis placed as ``parallelize_module``'s column- and row-wise styles (``sequence_parallel``: with the
    norms and the residual stream split by tokens on it, ``tp_axis_ok``)."""

    data: tuple[int, ...]
    shard: tuple[int, ...]
    tp: int | None
    sequence_parallel: bool = False


# TP_WEIGHTS: plan layer -> {its weight's placement on the tensor-parallel axis: its module's style (None:
# replicated, no style)}; TP_INLINE: inline layer kind -> the activation placement it takes on that axis
TP_WEIGHTS = {"qkv": {"S1": "colwise"}, "fc1": {"S1": "colwise"}, "proj": {"S0": "rowwise"},
              "fc2": {"S0": "rowwise"}, "embedding": {"S0": "rowwise", B: None}, "logits": {"S1": "colwise", B: None}}
TP_INLINE = {"attention": "S1", "swiglu": "S1", "pointwise": "S1", "residual": B}
# style -> (input placements, output placements) it computes on the tensor-parallel axis
TP_ACTS = {"colwise": ((B,), ("S1",)), "rowwise": (("S1",), (P, B)), None: ((B,), (B,))}
NORMS = ("layernorm", "rmsnorm")


def tp_axis_ok(plan: TypedPlan, axis: int, sequence: bool = False) -> bool:
    """Whether every layer's placements on ``axis`` are Megatron's (torchtitan's): without sequence parallelism,
    or with it (``sequence``: Megatron-LM's ``--sequence-parallel``, Korthikanti et al. 2022: the norms and the
    residual stream between the tensor-parallel regions split by tokens, S0, the row-parallel layers' partial
    sums reduce-scattered onto them and the column-parallel layers' input all-gathered from them)."""
    stream = "S0" if sequence else B  # the norms' and the residual add's placement on the axis
    for lay in plan.layers:
        w = lay.weight("weight")
        if lay.name in TP_WEIGHTS:
            if w is None or w.placements[axis] not in TP_WEIGHTS[lay.name]:
                return False
            ins, outs = TP_ACTS[TP_WEIGHTS[lay.name][w.placements[axis]]]
            if lay.kind == "embedding":
                ins, outs = (B,), (P, B, stream)
            if (lay.input is not None and lay.input[axis] not in ins) or (
                    lay.output is not None and lay.output[axis] not in outs):
                return False
        elif any(x.placements[axis] != B for x in lay.weights):
            return False
        want = stream if lay.kind in NORMS or lay.kind == "residual" else TP_INLINE.get(lay.kind)
        if want is not None and any(f is not None and f[axis] != want for f in (lay.input, lay.output)):
            return False
    return True


def tp_axis(plan: TypedPlan, axis: int) -> bool | None:
    """Whether ``axis`` is Megatron's tensor-parallel axis with sequence parallelism (True) or without it (False)
    (``tp_axis_ok``); None where it is neither."""
    return next((sp for sp in (False, True) if tp_axis_ok(plan, axis, sp)), None)


def fully_shard_layout(plan: TypedPlan) -> FullyShard | None:
    """The ``FullyShard`` of a pure FSDP, HSDP or TP + FSDP baseline (``sharding_mode`` "fsdp"; weights
    sharded over data axes: all of them, or the trailing ones with the leading replicated; at most one
    trailing tensor-parallel axis as ``tp_axis_ok``); None for every other plan, which takes the DTensor
    placement path (``_place``)."""
    n = len(plan.mesh.sizes)
    if plan.sharding_mode != "fsdp" or not plan.sharding_axes or plan.world == 1:
        return None

    def data_axis(a: int) -> bool:
        return all(w.placements[a] == B for lay in plan.layers for w in lay.weights) and all(
            f is None or f[a] == "S0" for lay in plan.layers for f in (lay.input, lay.output))

    data = tuple(a for a in range(n) if data_axis(a))
    rest = tuple(a for a in range(n) if a not in data)
    sp = tp_axis(plan, rest[0]) if len(rest) == 1 and rest[0] == n - 1 else None
    tp = rest[0] if sp is not None else None
    if (rest and tp is None) or data != tuple(range(len(data))) or not data:
        return None
    shard = tuple(sorted(plan.sharding_axes))
    if tp is not None and shard != data:  # TP + FSDP: sharded over every data axis (torchtitan's 2-D)
        return None
    if shard != data[len(data) - len(shard):]:
        return None
    return FullyShard(data, shard, tp, bool(sp))


def data_parallel_plan(plan: TypedPlan) -> bool:
    """Whether ``plan`` is pure data parallelism (no FSDP; every weight replicated and every activation split by
    the data on every axis): what DDP runs, which ``autotune.apply`` places it with."""
    if plan.world == 1 or plan.sharding_mode == "fsdp":
        return False
    return all(all(w.placements[a] == B for lay in plan.layers for w in lay.weights) and all(
        f is None or f[a] == "S0" for lay in plan.layers for f in (lay.input, lay.output))
        for a in range(len(plan.mesh.sizes)))


def fully_shard_plan(plan: TypedPlan) -> bool:
    """Whether ``plan`` takes the ``fully_shard`` path (``fully_shard_layout``)."""
    return fully_shard_layout(plan) is not None


def plan_path(plan: TypedPlan) -> str:
    """The path ``autotune.apply`` places ``plan`` by, read from the plan alone, in the order apply asks them:
    "fully_shard" where ``fully_shard_layout`` expresses it, "tensor" for data x tensor parallelism without FSDP
    (``tp_layout``), "ddp" for pure data parallelism, "fully_shard" again for FSDP with the embedding split by
    columns (``column_twin``), else "dtensor"; "none" on one device
    (``autotune.apply.place.path_of`` takes it where the modules take its tensor-parallel styles: a model
    whose layers are not ``nn.Linear`` runs such a plan on the DTensor path)."""
    if plan.world == 1:
        return ApplyPath.NONE.value
    if fully_shard_layout(plan) is not None:
        return ApplyPath.FULLY_SHARD.value
    if tp_layout(plan) is not None:
        return ApplyPath.TENSOR.value
    if data_parallel_plan(plan):
        return ApplyPath.DDP.value
    return (ApplyPath.FULLY_SHARD if column_twin(plan) is not None else ApplyPath.DTENSOR).value


@dataclass(frozen=True)
class TensorParallel:
    """Data axes, then tensor-parallel axes (one flattened mesh dimension "tp", ranks row-major over them as
    DTensor nests one dimension split over several axes); ``tp`` the first of them (their placements alike)."""

    data: tuple[int, ...]
    tp_axes: tuple[int, ...]
    stream: str = B  # the residual stream's features on the tensor-parallel axes: whole (torchtitan's), or split
    sequence_parallel: bool = False  # the residual stream's and the norms' tokens split on them (``tp_axis_ok``)

    @property
    def tp(self) -> int:
        return self.tp_axes[0]

    def dims(self, plan: TypedPlan) -> dict[str, int]:
        """fully_shard's mesh: a replicate dimension (the data axes) and "tp"; "shard" of one device."""
        sizes = plan.mesh.sizes
        return {"replicate": math.prod(sizes[a] for a in self.data), "shard": 1,
                "tp": math.prod(sizes[a] for a in self.tp_axes)}


def tp_layout(plan: TypedPlan) -> TensorParallel | None:
    """The layout of a plan without FSDP that is data parallel on its leading axes and tensor parallel on the
    others as ``tp_axis_ok`` (Megatron's, with or without sequence parallelism), the same on each; None
    otherwise."""
    n = len(plan.mesh.sizes)
    if plan.world == 1 or plan.sharding_mode == "fsdp":
        return None

    def data_axis(a: int) -> bool:
        return all(w.placements[a] == B for lay in plan.layers for w in lay.weights) and all(
            f is None or f[a] == "S0" for lay in plan.layers for f in (lay.input, lay.output))

    data = 0
    while data < n and data_axis(data):
        data += 1
    tp = tuple(a for a in range(data, n) if plan.mesh.sizes[a] > 1)
    residual = plan.layer("residual")
    stream = residual.input[tp[0]] if tp and residual is not None and residual.input else B
    if stream not in (B, "S1", "S0") or (residual is not None and residual.output != residual.input):
        return None
    sequence = stream == "S0"
    # the stream split by features read as whole: the styles' boundaries
    whole = plan if stream != "S1" else replace(plan, layers=tuple(
        replace(lay, input=tuple(B if a in tp else p for a, p in enumerate(lay.input)),
                output=tuple(B if a in tp else p for a, p in enumerate(lay.output)))
        if lay is residual else lay for lay in plan.layers))
    if not tp or not all(tp_axis_ok(whole, a, sequence) for a in tp) or any(
            lay.weight(w.name).placements[a] != lay.weight(w.name).placements[tp[0]]
            for lay in plan.layers for w in lay.weights for a in tp) or any(
            f is not None and f[a] != f[tp[0]] for lay in plan.layers for f in (lay.input, lay.output) for a in tp):
        return None
    return TensorParallel(tuple(range(data)), tp, B if sequence else stream, sequence)


def sequence_axes(plan: TypedPlan) -> tuple[int, ...]:
    """The tensor-parallel axes of a plan with sequence parallelism on the tensor or fully_shard path: there
    torch's ``SequenceParallel`` splits the tokens by the sequence, whatever the micro-batch; () for any other."""
    for layout in (tp_layout(plan), fully_shard_layout(plan)):
        if layout is not None and layout.sequence_parallel:
            return getattr(layout, "tp_axes", (layout.tp,))
    return ()


# the paths apply runs context parallelism on
CONTEXT_PATHS = (ApplyPath.DDP.value, ApplyPath.TENSOR.value, ApplyPath.FULLY_SHARD.value)
CONTEXT_STAGE_PATHS = (ApplyPath.DDP.value, ApplyPath.FULLY_SHARD.value)  # those of a pipeline's stages


def context_axes(plan: TypedPlan) -> tuple[int, ...]:
    """The fine axes each sequence's tokens are split over by context parallelism: role 1 of the plan's
    "attention-cp" layer (``autotune.sbp.layers.Attention``), the innermost of its data axes; () without it."""
    lay = next((x for x in plan.layers if x.signature == "attention-cp"), None)
    if lay is None:
        return ()
    roles = RoleMesh(lay.roles).roles_of_axes(plan.cluster)
    return tuple(a for a, r in enumerate(roles) if r == 1 and plan.mesh.sizes[a] > 1)


def context_size(plan: TypedPlan) -> int:
    """The ranks each sequence is split over (``context_axes``'), 1 without context parallelism."""
    return math.prod(plan.mesh.sizes[a] for a in context_axes(plan))


def fsdp_dims(plan: TypedPlan, layout: FullyShard) -> dict[str, int]:
    """The mesh ``fully_shard`` runs on, its dimension names and sizes in rank order: "replicate" (HSDP's
    leading data axes), "shard", "tp"; those of one device left out except "shard"."""
    sizes = plan.mesh.sizes
    shard = math.prod(sizes[a] for a in layout.shard)
    replicate = math.prod(sizes[a] for a in layout.data) // shard
    dims = {"replicate": replicate, "shard": shard, "tp": sizes[layout.tp] if layout.tp is not None else 1}
    return {k: v for k, v in dims.items() if v > 1 or k == "shard"}


@dataclass(frozen=True)
class LocalPlan:
    """A stage's placement on apply's local path (``local_plan``): the plan DDP or fully_shard runs, and the
    layers outside it that the stage computes itself: ``columns``, the first stage's embedding split by features
    (``_column_lookup``); ``vocabulary``, the last stage's logits split by vocabulary rows and their loss
    vocabulary-parallel (``_vocab_logits``, ``_vocab_loss``)."""

    plan: TypedPlan  # data parallel or fully_shard-shaped
    columns: bool = False
    vocabulary: bool = False


def local_twin(typed: TypedPlan) -> LocalPlan | None:
    """The ``LocalPlan`` of a stage plan that DDP or fully_shard runs (``data_parallel_plan``,
    ``fully_shard_layout``) as it is, or once two layers the stage computes itself are read as data parallel:

    - an embedding split by features on every axis (S1 table columns and output: each device looks the whole
      micro-batch up in its columns, then the S1 -> S0 boxing to the first block; ``_column_lookup``);
    - logits split by vocabulary on every axis (weight S1: the rows of ``nn.Linear``'s [vocabulary, hidden]
      weight; input B: the stream gathered S0 -> B before them; output S1) and a vocabulary-parallel loss (input
      S1): ``_vocab_logits`` and ``_vocab_loss``.

    Such a twin must be data parallel (DDP) or fully_shard-shaped without tensor parallelism (and, with the
    vocabulary-parallel logits, over one data dimension: not HSDP); the searched 2 x 2 plans of a 1.1 B Llama
    have both (FSDP or DDP blocks). A stage plan without such layers may also be TP + FSDP or data x tensor
    parallel (``tp_layout``: Megatron's 3-D stages, torchtitan's PP + TP) with the residual stream whole on the
    tensor axes (a graph without the residual stream, AutoDDL's, hands a partial sum across a boundary, which
    the styles' all-reduce would not leave: DTensor's path), also with sequence parallelism (its boundaries'
    stream split by the sequence on the tensor axis, ``local_stream``). None: the DTensor path."""
    tensor = tp_layout(typed)
    if tensor is not None and tensor.stream == B and typed.layer("residual"):
        return LocalPlan(typed)  # its styles split the embedding and the logits by vocabulary themselves
    n = len(typed.mesh.sizes)
    cols, batch, whole = ("S1",) * n, ("S0",) * n, (B,) * n
    swap: dict[str, object] = {}
    emb = typed.layer("embedding")
    if emb is not None and emb.output == cols and [w.placements for w in emb.weights] == [cols]:
        swap["embedding"] = replace(emb, output=batch, weights=(replace(emb.weights[0], placements=whole),))
    logits, loss = typed.layer("logits"), typed.layer("loss")
    if logits is not None and loss is not None and logits.input == whole and logits.output == cols and \
            [w.placements for w in logits.weights] == [cols] and loss.input == cols:
        swap["logits"] = replace(logits, input=batch, output=batch,
                                 weights=(replace(logits.weights[0], placements=whole),))
        swap["loss"] = replace(loss, input=batch)
    twin = replace(typed, layers=tuple(swap.get(lay.name, lay) for lay in typed.layers)) if swap else typed
    layout = fully_shard_layout(twin)
    if swap and layout is not None:
        ok = layout.tp is None and ("logits" not in swap or "replicate" not in fsdp_dims(twin, layout))
    else:
        ok = layout is not None or data_parallel_plan(twin)
    return LocalPlan(twin, "embedding" in swap, "logits" in swap) if ok else None


def local_stream(typed: TypedPlan) -> tuple[str, ...]:
    """The stream placement in which a stage on apply's local path holds it: split by the batch (S0) over the
    data axes, whole (B) on the tensor-parallel axes (with sequence parallelism split there too, by the
    sequence: each rank's sequence shard of its piece of the batch)."""
    layout = fully_shard_layout(typed) or tp_layout(typed)
    tp = (layout.tp,) if isinstance(layout, FullyShard) else getattr(layout, "tp_axes", ())
    sequence = layout is not None and layout.sequence_parallel
    return tuple("S0" if a not in tp or sequence else B for a in range(len(typed.mesh.sizes)))


def column_twin(plan: TypedPlan) -> LocalPlan | None:
    """The ``local_twin`` of a single-stage plan that fully_shard runs once its embedding split by features on every
    axis is read as data parallel, as a pipeline's first stage runs it (``autotune.apply.fsdp.place``: the table
    split by columns beside fully_shard, each device looking up every rank's ids in its columns): FSDP or
    HSDP-shaped without tensor parallelism, the table not tied to the logits; None for any other plan."""
    if plan.model.get("tied"):
        return None
    local = local_twin(plan)
    if local is None or not local.columns or local.vocabulary:
        return None
    layout = fully_shard_layout(local.plan)
    return local if layout is not None and layout.tp is None else None


def twin_path(local: LocalPlan | None) -> str:
    """The path of a pipeline stage of several devices from its ``local_twin`` (None: "dtensor")."""
    return ApplyPath.DTENSOR.value if local is None else plan_path(local.plan)


@dataclass(frozen=True)
class Tokens:
    """How a plan's token split (S0) falls on the modules' [batch, sequence, ...] tensors: over the batch while
    the micro-batch ``batch`` divides the axes so far (in mesh order), then over the sequence (dimension 1)."""

    batch: int
    sizes: tuple[int, ...]

    def dims(self, fine) -> list[int]:
        out, parts = [], 1
        for p, n in zip(fine, self.sizes):
            if p == "S0" and self.batch % (parts * n) == 0:
                parts *= n
                out.append(0)
            else:
                out.append(1)
        return out


def logits_data_axes(plan: TypedPlan) -> tuple[int, ...]:
    """The fine axes over which the devices each hold their own piece of the batch's logits (split by whole
    sequences there, ``Tokens``): where each rank feeds its piece of the batch on the DTensor path
    (``autotune.apply.dtensor.Ends``)."""
    lay = plan.layer("logits")
    out = (lay.output if lay is not None else None) or (B,) * len(plan.mesh.sizes)
    dims = Tokens(plan.model.get("micro_batch") or 1, plan.mesh.sizes).dims(out)
    return tuple(a for a, p in enumerate(out) if p == "S0" and dims[a] == 0)
