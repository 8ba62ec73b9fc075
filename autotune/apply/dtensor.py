"""The DTensor path: a per-layer plan that no ParallelStyle expresses. Parameters become DTensors with the
plan's weight placements on one mesh of the plan's fine axes (FSDP storage: a weight replicated on a sharding
axis stored split there, all-gathered at use by a parametrization whose backward reduce-scatters; a tied weight,
the embedding's and the head's, stored as its first use places it and redistributed likewise at the other use
where the plan places that one otherwise); each mapped module's input is made a DTensor in the placement it
arrives in and redistributed once to its layer's input placement, its output to what the next layer expects, and
handed on as a local tensor, so that the code between modules (attention core, activation x gate, residual add)
runs on local pieces. Plan dimension 0 (tokens) is the batch dimension of the module's tensors, dimension 1
(features) their last. The batch enters as each rank's piece on the data axes and the logits leave as that
piece's (``Ends``). Gradients are reduced to their weight's placements once accumulated, in every backward but
those under ``autotune.no_sync`` (``autotune.apply.grads``). The embedding split by vocabulary is Megatron-LM's
vocabulary-parallel lookup (``_vocab_embedding``); an ``nn.RMSNorm`` over split features is written out of place
(``autotune.apply.layers.split_norms``)."""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from calibrate.errors import UserError

from autotune.apply.batch import DataSplit, scale_grad
from autotune.apply.grads import GradSync, sync_grad
from autotune.apply.layers import Site, contiguous_strides, split_norms, torch, weight_placements
from autotune.plan.layouts import Tokens, logits_data_axes
from autotune.plan.typed import TypedPlan
from autotune.sbp.sbp import B, P, is_split, split_dim

from torch import nn  # noqa: E402
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor  # noqa: E402


# --- activations --------------------------------------------------------------------------------------
def _act(fine, t, whole: bool = True, tokens: Tokens | None = None) -> tuple[tuple, tuple]:
    """(forward, gradient) DTensor placements of plan placements ``fine`` on tensor ``t``: tokens are the
    batch (dimension 0; the sequence, dimension 1, where ``tokens`` says the batch does not split), features the
    last dimension; a whole tensor (``whole``: not a local piece) broadcast over the batch (no batch dimension)
    is replicated there and its gradient partial."""
    dims = tokens.dims(fine) if tokens is not None else [0] * len(fine)
    fwd, grad = [], []
    for p, d in zip(fine, dims):
        if p == B:
            fwd.append(Replicate()), grad.append(Replicate())
        elif p == P:  # the gradient of a partial sum is whole on every device (DTensor's convention)
            fwd.append(Partial()), grad.append(Replicate())
        elif split_dim(p) == 0 and whole and t.dim() < 3 and d == 1:  # a [sequence, ...] table: its positions
            fwd.append(Shard(0)), grad.append(Shard(0))
        elif split_dim(p) == 0 and whole and (t.dim() < 3 or (t.shape[0] == 1 and tokens is None)):
            fwd.append(Replicate()), grad.append(Partial())
        else:
            s = Shard(d) if split_dim(p) == 0 else Shard(t.dim() - 1)
            fwd.append(s), grad.append(s)
    return tuple(fwd), tuple(grad)


def _global_shape(local, placements, mesh) -> tuple[int, ...]:
    shape = list(local.shape)
    for p, n in zip(placements, mesh.shape):
        if isinstance(p, Shard):
            shape[p.dim] *= n
    return tuple(shape)


def _check_divides(shape, placements, mesh, where: str) -> None:
    for d in range(len(shape)):
        n = math.prod(size for p, size in zip(placements, mesh.shape) if isinstance(p, Shard) and p.dim == d)
        if shape[d] % n:
            raise UserError(f"{where}: dimension {d} of a {list(shape)} activation does not split over {n} devices as "
                            f"the plan says: use a (micro-)batch that the plan's data split divides")


class _ToPartial(torch.autograd.Function):
    """Replicate -> Partial on ``axes`` on a local piece: the value kept on coordinate 0 of those axes, zeros
    elsewhere. The gradient of a partial sum is whole on every device (DTensor's convention for Partial), as
    is the gradient of the replicated input: the backward passes it on."""

    @staticmethod
    def forward(ctx, y, coords, axes):
        return torch.zeros_like(y) if any(coords[a] != 0 for a in axes) else y.clone()

    @staticmethod
    def backward(ctx, g):
        return g, None, None


def _redistribute(x, mesh, placements):
    """``x`` in ``placements``: DTensor's redistribute, with a partial sum (the embedding's masked one) reduced
    first and a Replicate -> Partial (DTensor's public redistribute has none) done by ``_ToPartial``."""
    dst = tuple(placements)
    if x.placements == dst:
        return x
    if any(isinstance(p, Partial) and type(p) is not Partial for p in x.placements):
        x = x.redistribute(mesh, [Replicate() if isinstance(p, Partial) and type(p) is not Partial else p
                                  for p in x.placements])
    zero = tuple(a for a, (s, d) in enumerate(zip(x.placements, dst)) if isinstance(d, Partial) and
                 not isinstance(s, Partial))
    if not zero:
        return x.redistribute(mesh, dst)
    mid = tuple(Replicate() if a in zero else d for a, d in enumerate(dst))
    y = x.redistribute(mesh, mid)
    shape, stride = tuple(y.shape), tuple(y.stride())
    z = _ToPartial.apply(y.to_local(), mesh.get_coordinate(), zero)
    return DTensor.from_local(z, mesh, dst, run_check=False, shape=shape, stride=stride)


def _handoffs(chain: list[Site]) -> list[tuple | None]:
    """Per chain position, the plan placement the local tensor arrives in (modules) or is computed on (inline)."""
    residual = next((s.layer for s in chain if s.layer.kind == "residual"), None)
    first = next((s.layer.name for s in chain if s.block is not None), None)
    out: list[tuple | None] = []
    for i, site in enumerate(chain):
        prev = chain[i - 1] if i else None
        if not site.modules:
            out.append(site.layer.input)
        elif prev is None:
            out.append(None)  # the embedding: token ids, replicated
        elif not prev.modules:
            out.append(prev.layer.output)
        elif residual is not None and site.layer.name == first:
            out.append(residual.input)
        elif i + 1 < len(chain) and chain[i + 1].layer.kind == "attention" and site.layer.input is not None:
            # inline attention code shapes its output by its input's batch: hand it the attention's batch split
            att = chain[i + 1].layer.input
            out.append(tuple("S0" if a == "S0" else B if q == "S0" else q for q, a in zip(site.layer.input, att)))
        else:
            out.append(site.layer.input)
    return out


def _install_hooks(chain: list[Site], mesh, ends: "Ends", model, tokens: Tokens) -> None:
    arrive = _handoffs(chain)
    names = dict(model.named_modules())
    for i, site in enumerate(chain):
        if not site.modules:
            continue
        last = not any(s.modules for s in chain[i + 1:])
        for name, module in site.modules:
            module.register_forward_pre_hook(
                functools.partial(_pre, mesh=mesh, arrive=arrive[i], want=site.layer.input, where=name, ends=ends,
                                  tokens=tokens), with_kwargs=True)
            fused = _fused_parts(site, chain[i + 1] if i + 1 < len(chain) else None, mesh)
            module.register_forward_hook(
                functools.partial(_logits_out, mesh=mesh, ends=ends) if last else
                functools.partial(_fused_out, mesh=mesh, leave=arrive[i + 1], tokens=tokens) if fused else
                functools.partial(_post, mesh=mesh, leave=arrive[i + 1], tokens=tokens))
            if fused:  # the attention splits its local [q | k | v] in thirds of its own heads
                _split_fused(names[name.rsplit(".", 1)[0]], fused)


def _split_fused(attention, parts: int) -> None:
    """GPT-2's attention (``GPT2Attention``, the fused ``c_attn``'s parent) told that its local [q | k | v] holds
    1 / ``parts`` of its heads."""
    attention.split_size //= parts


def _fused_parts(site: Site, nxt: Site | None, mesh) -> int:
    """The parts a GPT-2 fused [q | k | v] ``Conv1D`` (one qkv module) is split into by the attention's input
    placement after it (0: not such a module, or unsplit)."""
    if site.layer.name != "qkv" or len(site.modules) != 1 or type(site.modules[0][1]).__name__ != "Conv1D" or \
            nxt is None or nxt.layer.kind != "attention":
        return 0
    parts = math.prod(n for p, n in zip(nxt.layer.input or (), mesh.shape) if p == "S1")
    return parts if parts > 1 else 0


def _fused_out(module, args, out, *, mesh, leave, tokens=None):
    """GPT-2's fused [q | k | v] output in the attention's feature split: each third redistributed to it on its
    own (one explicit redistribution: no ParallelStyle splits a fused qkv by thirds) and this rank's pieces
    handed on side by side, [q_r | k_r | v_r]."""
    if not isinstance(out, DTensor):
        return None
    pieces = []
    for third in out.chunk(3, dim=-1):
        dst, grad = _act(leave, third, tokens=tokens)
        _check_divides(third.shape, dst, mesh, "the attention's q, k or v")
        pieces.append(_redistribute(third, mesh, dst).to_local(grad_placements=grad))
    return torch.cat(pieces, dim=-1)


@dataclass(frozen=True)
class Ends:
    """Where the batch enters and the logits leave the DTensor path: the data axes (the logits split by the
    batch: each rank feeds its piece of the batch there, ``DataSplit``) and the vocabulary axes (the logits
    split by vocabulary: handed out as a DTensor on those axes for ``loss_parallel``)."""

    data: tuple[int, ...]
    vocab: tuple[int, ...]
    parts: int

    @staticmethod
    def of(plan: TypedPlan) -> "Ends":
        out = plan.layer("logits").output if plan.layer("logits") else None
        data = logits_data_axes(plan)  # a sequence's split gathered
        return Ends(data, tuple(a for a, p in enumerate(out or ()) if p == "S1"),
                    math.prod(plan.mesh.sizes[a] for a in data))

    def split(self, mesh) -> DataSplit:
        rank = 0
        for a in self.data:  # row-major over the data axes, as DTensor's Shard(0) on each in turn
            rank = rank * mesh.shape[a] + mesh.get_local_rank(a)
        return DataSplit(rank, self.parts)

    def batch(self, ndim: int) -> list:
        return [Shard(0) if a in self.data else Replicate() for a in range(ndim)]


def _pre(module, args, kwargs, *, mesh, arrive, want, where, ends, tokens=None):
    x = args[0]
    if isinstance(x, DTensor):
        return None
    if arrive is None or not x.is_floating_point():  # token ids: this rank's piece; position ids: whole
        src = ends.batch(mesh.ndim) if x.dim() >= 2 else [Replicate()] * mesh.ndim
        shape = _global_shape(x, src, mesh)
        return (DTensor.from_local(x, mesh, src, run_check=False, shape=shape, stride=contiguous_strides(shape)),
                ) + args[1:], kwargs
    src, _ = _act(arrive, x, whole=False, tokens=tokens)
    shape = _global_shape(x, src, mesh)
    X = DTensor.from_local(x, mesh, src, run_check=False, shape=shape, stride=contiguous_strides(shape))
    dst, _ = _act(want, X, tokens=tokens) if want is not None else (src, None)
    _check_divides(shape, dst, mesh, where)
    return (_redistribute(X, mesh, dst),) + args[1:], kwargs


def _post(module, args, out, *, mesh, leave, tokens=None):
    if not isinstance(out, DTensor):
        return None
    dst, grad = _act(leave, out, tokens=tokens)
    _check_divides(out.shape, dst, mesh, "an activation handed on")
    return _redistribute(out, mesh, dst).to_local(grad_placements=grad)


def _logits_out(module, args, out, *, mesh, ends: Ends):
    """The logits of this rank's piece of the batch (split by the batch on the data axes, nothing gathered
    there), its gradient scaled to the whole batch's mean (DDP's average); split by vocabulary on the plan's
    vocabulary axes, a DTensor on them (flattened to one) for ``torch.distributed.tensor.parallel.loss_parallel``
    (Megatron's vocabulary-parallel cross entropy)."""
    if not isinstance(out, DTensor):
        return None
    last = out.dim() - 1
    dst = [Shard(last) if a in ends.vocab else p for a, p in enumerate(ends.batch(mesh.ndim))]
    local = scale_grad(_redistribute(out, mesh, dst).to_local(grad_placements=dst), factor=1 / ends.parts)
    if not ends.vocab:
        return local
    names = tuple(mesh.mesh_dim_names[a] for a in ends.vocab)
    sub = mesh[names] if len(names) == 1 else mesh[names]._flatten()
    shape = tuple(local.shape[:-1]) + (out.shape[-1],)
    return DTensor.from_local(local, sub, [Shard(last)], run_check=False, shape=shape,
                              stride=contiguous_strides(shape))


# --- placing parameters ---------------------------------------------------------------------------------
def _dtensor_placements(fine) -> list:
    return [Shard(split_dim(p)) if is_split(p) else Replicate() for p in fine]


def _fsdp_placements(compute: list, shape, mesh, axes, where: str) -> list:
    """Storage placements: split on each FSDP axis where the weight is replicated, along its first dimension
    that still divides."""
    out = list(compute)
    for a in axes:
        if not isinstance(out[a], Replicate):
            continue
        for d in range(len(shape)):
            n = math.prod(size for p, size in zip(out, mesh.shape) if isinstance(p, Shard) and p.dim == d)
            if shape[d] % (n * mesh.shape[a]) == 0:
                out[a] = Shard(d)
                break
        else:
            raise UserError(f"{where}: no dimension of its {list(shape)} splits over FSDP axis {a}: apply a plan "
                            f"without FSDP on that axis, or a model whose widths divide it")
    return out


class _Gather(nn.Module):
    """FSDP's all-gather at use (a parametrization): the stored shard redistributed to the compute placement;
    its backward reduce-scatters the gradient."""

    def __init__(self, mesh, placements):
        super().__init__()
        self.mesh, self.placements = mesh, tuple(placements)

    def forward(self, w):
        return w.redistribute(self.mesh, self.placements)


def _place(chain: list[Site], plan: TypedPlan, mesh, model, sync: GradSync) -> None:
    from torch.nn.utils import parametrize
    placed: dict[int, tuple] = {}
    uses: dict[tuple, tuple] = {}  # (id(module), attribute) -> the placement a tied weight's other use computes in
    axes = plan.sharding_axes if plan.sharding_mode == "fsdp" else ()
    todo = []
    for site in chain:
        for name, module in site.modules:
            for pname, param in list(module.named_parameters(recurse=False)):
                fine = weight_placements(site, pname, module, param)
                if P in fine:
                    raise UserError(f"plan layer {site.layer.name} places weight {pname} as a partial sum: apply "
                                    f"places weights split or replicated only; re-run the search")
                if id(param) in placed:  # a tied weight's second use (the logits): placed as it says at use
                    uses[(id(module), pname)] = fine
                    continue
                placed[id(param)] = fine
                todo.append((module, pname, param, fine, f"{name}.{pname}"))
    seen = {id(p) for _, _, p, _, _ in todo}
    stray = [n for n, p in model.named_parameters() if id(p) not in seen]
    if stray:
        raise UserError(f"parameter {stray[0]} is in no module the plan's layers map: map its module in mapping=")
    owners: dict[int, list] = {}  # id(parameter) -> [(module, attribute)], a tied one in several
    for m in model.modules():
        for attr, p in m._parameters.items():
            if p is not None:
                owners.setdefault(id(p), []).append((m, attr))
    for _, _, param, fine, where in todo:
        compute = _dtensor_placements(fine)
        _check_divides(tuple(param.shape), compute, mesh, where)
        store = _fsdp_placements(compute, tuple(param.shape), mesh, axes, where) if axes else compute
        dt = nn.Parameter(distribute_tensor(param.detach(), mesh, store), requires_grad=param.requires_grad)
        dt.register_post_accumulate_grad_hook(functools.partial(sync_grad, sync=sync))
        for module, attr in owners[id(param)]:
            setattr(module, attr, dt)
            use = _dtensor_placements(uses.get((id(module), attr), fine))
            if store != use:  # FSDP's all-gather, or a tied weight's other use placed otherwise: at use
                _check_divides(tuple(param.shape), use, mesh, where)
                parametrize.register_parametrization(module, attr, _Gather(mesh, use), unsafe=True)


# --- vocabulary-parallel embedding ------------------------------------------------------------------------
def _vocab_embedding(module, ids, *, mesh, compute: tuple):
    """``module``'s (an ``nn.Embedding``) lookup with its table split by rows (the vocabulary) over one or more
    mesh axes, as Megatron-LM's vocabulary-parallel embedding: each device looks up the ids in its rows, zeros
    the others, and the output is a partial sum over the vocabulary axes (split by features where the table's
    columns are, replicated elsewhere). Its gradient (whole on every device: DTensor's convention for Partial)
    reaches only the local rows. DTensor's own embedding rule handles one vocabulary axis only. The ids (this
    rank's piece on the data axes) are gathered on the axes that split the table."""
    weight = module.weight
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    _, offset = compute_local_shape_and_global_offset(tuple(weight.shape), mesh, compute)
    if isinstance(ids, DTensor):
        ids = ids.redistribute(mesh, [Replicate() if isinstance(c, Shard) else p for c, p in zip(compute, ids.placements)])
    shape = tuple(ids.shape) + (weight.shape[1],)
    batch = ids.placements if isinstance(ids, DTensor) else [Replicate()] * mesh.ndim
    # where each device looks up its piece of the batch, the table's gradient is a partial sum there
    local_w = weight.to_local(grad_placements=[Partial() if isinstance(b, Shard) else c for c, b in zip(compute, batch)])
    lo, rows = offset[0], local_w.shape[0]
    ids = ids.to_local() if isinstance(ids, DTensor) else ids
    local = ids - lo
    outside = (local < 0) | (local >= rows)
    pad = module.padding_idx
    pad = pad - lo if pad is not None and lo <= pad < lo + rows else None
    out = nn.functional.embedding(local.masked_fill(outside, 0), local_w, pad)
    out = out.masked_fill(outside.unsqueeze(-1), 0)
    placements = [Partial() if isinstance(c, Shard) and c.dim == 0 else Shard(out.dim() - 1) if isinstance(c, Shard)
                  else b for c, b in zip(compute, batch)]
    return DTensor.from_local(out, mesh, placements, run_check=False, shape=shape, stride=contiguous_strides(shape))


def _vocab_parallel(chain: list[Site], plan: TypedPlan, mesh) -> None:
    """The embedding's token table, where the plan splits it by vocabulary, looked up by ``_vocab_embedding``."""
    site = next((s for s in chain if s.layer.kind == "embedding" and s.modules), None)
    if site is None:
        return
    name, module = site.modules[0]
    compute = tuple(_dtensor_placements(weight_placements(site, "weight", module, module.weight)))
    if not any(isinstance(c, Shard) and c.dim == 0 for c in compute):
        return
    if not isinstance(module, nn.Embedding) or module.max_norm is not None:
        raise UserError(f"{name}: the plan splits the embedding by vocabulary, which apply does for a plain "
                        f"nn.Embedding (no max_norm) only: apply a plan with the vocabulary unsplit "
                        f"(embedding weight placements without S0)")
    module.forward = functools.partial(_vocab_embedding, module, mesh=mesh, compute=compute)


def place(job) -> DataSplit:
    """Place ``job.model`` on ``job.mesh`` (the plan's fine axes) by DTensor; returns this rank's data piece."""
    ends = Ends.of(job.plan)
    job.model.to(job.mesh.device_type)
    _place(job.chain, job.plan, job.mesh, job.model, GradSync.of(job.model))
    _vocab_parallel(job.chain, job.plan, job.mesh)
    split_norms(job.chain)
    _install_hooks(job.chain, job.mesh, ends, job.model,
                   Tokens(job.plan.model.get("micro_batch") or 1, job.plan.mesh.sizes))
    return ends.split(job.mesh)
