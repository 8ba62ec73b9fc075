"""Place a user's nn.Module as a plan says, for the user's own training loop:

    import autotune
    plan = autotune.plan.load_plan("plan.json")       # a typed plan, or plan.json of python -m autotune
    model = autotune.apply(plan, model)               # after torch.distributed.init_process_group
    opt = torch.optim.AdamW(model.parameters())
    for batch in loader:                              # the same batch on every rank
        mbs = autotune.micro_batches(plan, batch)     # the plan's micro-batches
        for mb in mbs:
            (model(input_ids=mb, labels=mb).loss / len(mbs)).backward()
        opt.step(); opt.zero_grad()

``apply(plan, model, mesh=None, mapping=None, output="whole")``:

- ``plan``: a ``TypedPlan``, a typed-plan file, or plan.json of ``python -m autotune`` (``load_plan``).
- The mesh: one DeviceMesh over the plan's fine axes (``plan.mesh``), built from the world when
  ``mesh`` is None. A plan for another world size or mesh raises one ``UserError`` (on every rank,
  the same line) before any weight moves; so does a module whose shapes differ from the plan's model.
- Parameters become DTensors with the plan's weight placements, translated to the module's layout:
  ``nn.Linear`` stores W [k, n] as [n, k] (the plan's S0/S1 swap), GPT-2's ``Conv1D`` as [k, n];
  separate q/k/v (or gate/up) projections each take the fused layer's split (the contract's fused
  layouts are head-group / pair interleaved, so this is the same split); a single fused qkv module is
  taken to be laid out head group by head group, except GPT-2's Conv1D ([q | k | v]), which a plan
  may not split by features. Norm weights follow their hidden dimension; a bias follows W's n.
- Vocabulary: where the plan splits the embedding's table by rows (the vocabulary), over one mesh axis or
  several, each device looks up the ids in its rows and the output is a partial sum over those axes
  (Megatron-LM's vocabulary-parallel embedding, ``_vocab_embedding``; DTensor's own rule takes one axis
  only). The logits split by vocabulary are DTensor's column-parallel Linear; the user's loss gets them
  whole (below), so its cross-entropy is the one-process one.
- Data: every rank runs the model on the same (micro-)batch; where the plan splits the data, each rank takes
  its piece of the activations without communication (DTensor's Replicate -> Shard).
- Activations: a mapped module's input (a local tensor) is made a DTensor in the placement it was
  handed in and redistributed to its layer's input placement; its output is redistributed to what
  the next layer of the chain expects (the next module layer's input, an inline layer's input, the
  residual stream's placement where it is the block input) and handed on as a local tensor, so that
  code between modules (the attention core, activation x gate, the residual add) runs on the right
  local pieces. Plan dimension 0 (tokens) is the batch dimension of the module's tensors (a split
  must divide the batch; a tensor broadcast over the batch, e.g. position embeddings, is replicated
  and its gradient summed), dimension 1 (features) their last. The last module's output (the
  logits) is handed on whole (replicated), for the user's loss. Partial sums are DTensor's, and so is
  each module's own output placement (apply redistributes it to what the next layer expects, so a plan's
  declared output of a module layer is not relied on; its inline layers' placements are).
- Gradient sync: each parameter's gradient is redistributed to its placement (all-reduce of a
  replicated weight over the axes that split the data).
- FSDP: a pure FSDP, HSDP or TP + FSDP baseline (``fully_shard_layout``: weights sharded over the data
  axes, the only other split one trailing tensor-parallel axis placed column-/row-wise without sequence
  parallelism) is placed as torchtitan does: ``parallelize_module`` (``ColwiseParallel`` /
  ``RowwiseParallel``) on the tensor-parallel axis, then ``fully_shard`` on each block and the whole model
  over the data axes ((replicate, shard) for HSDP); each rank computes its data piece of the batch, the
  logits are gathered whole (the meshes are apply's own, built from the world). With ``output="local"``
  (these plans, and pure data-parallel ones: below) the model's call is cut to this rank's piece of the batch instead (ids, targets, labels:
  every input whose first dimension is the batch), its outputs and loss are that piece's, nothing is
  gathered, and fully_shard averages the gradients: torchtitan's step, and the step the plan prices (the
  whole-batch logits and loss on every rank are not in it). A loss computed outside the model takes
  ``autotune.data_piece(model, targets)``; ``python -m autotune execute`` runs these plans so. A pure
  data-parallel plan (``data_parallel_plan``) with ``output="local"`` is DDP's step: the same cut, then
  ``DistributedDataParallel`` (apply returns the DDP module; with several micro-batches run all but the last
  under its ``no_sync()``, as the plan prices one all-reduce a step). Every other plan with ``sharding_mode == "fsdp"`` stores a weight replicated on
  a sharding axis split there (its first dimension that divides), all-gathered at use by a parametrization
  whose backward reduce-scatters its gradient: ZeRO-3 expressed in DTensor on the one fine mesh (not
  ``fully_shard``, whose parameters live on a sub-mesh the per-layer hooks' DTensors do not share).
  ``placement_path(plan, model, output=...)`` says which path a plan takes (``path_of``, which
  ``autotune.apply_pipeline`` asks for each stage of a pipelined plan).
- Recomputation: ``"full"`` wraps each block in ``torch.utils.checkpoint``; ``"selective"`` each
  block's attention module.
- Module names: found by pattern for Hugging Face Llama, Mistral, Qwen2, GPT-2 and nanoGPT-style
  modules (``FAMILIES``); any other model takes ``mapping`` {plan layer name: module name pattern
  (fnmatch) or a list of them}, e.g. ``{"embedding": "tok", "ln1": "blocks.*.norm1", "qkv":
  "blocks.*.attn.[qkv]", "proj": "blocks.*.attn.out", "ln2": "blocks.*.norm2", "fc1": "blocks.*.mlp.up",
  "fc2": "blocks.*.mlp.down", "ln_f": "norm", "logits": "head"}``; layers computed inline (attention,
  gelu, swiglu, residual, loss) have no module.
- World size 1: no placement (no DTensor), but shapes are checked and recomputation applied.
- Errors (a plan for another world or mesh, shapes that differ from the plan's model, an unmapped layer):
  one ``UserError`` line naming the problem and the fix, raised alike on every rank before any weight moves.

``micro_batches(plan, batch)`` splits a tensor (or a dict of tensors) along dimension 0 into the
plan's micro-batches.
"""
from __future__ import annotations

import fnmatch
import functools
import math
import re
from dataclasses import dataclass

from calibrate.errors import UserError
from calibrate.optional import require_torch

from autotune.plan.layouts import TP_WEIGHTS, FullyShard, data_parallel_plan, fsdp_dims, fully_shard_layout, plan_path
from autotune.plan.search import load_plan
from autotune.plan.typed import LayerPlan, TypedPlan
from autotune.sbp.sbp import B, P, is_split, split_dim

torch = require_torch()
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor  # noqa: E402

HEAD, TAIL = ("embedding",), ("ln_f", "logits", "loss")
INLINE_KINDS = ("attention", "pointwise", "gelu", "swiglu", "residual", "loss")

_HF_LLAMA = {"embedding": "model.embed_tokens", "ln1": "model.layers.*.input_layernorm",
             "qkv": ["model.layers.*.self_attn.q_proj", "model.layers.*.self_attn.k_proj",
                     "model.layers.*.self_attn.v_proj"],
             "proj": "model.layers.*.self_attn.o_proj", "ln2": "model.layers.*.post_attention_layernorm",
             "fc1": ["model.layers.*.mlp.gate_proj", "model.layers.*.mlp.up_proj"],
             "fc2": "model.layers.*.mlp.down_proj", "ln_f": "model.norm", "logits": "lm_head"}
_GPT = {"embedding": ["transformer.wte", "transformer.wpe"], "ln1": "transformer.h.*.ln_1",
        "qkv": "transformer.h.*.attn.c_attn", "proj": "transformer.h.*.attn.c_proj", "ln2": "transformer.h.*.ln_2",
        "fc1": "transformer.h.*.mlp.c_fc", "fc2": "transformer.h.*.mlp.c_proj", "ln_f": "transformer.ln_f",
        "logits": "lm_head"}
# family: (how to recognise it, its mapping)
FAMILIES = {
    "llama": (lambda m: getattr(getattr(m, "config", None), "model_type", None) in ("llama", "mistral", "qwen2"),
              _HF_LLAMA),
    "gpt2": (lambda m: getattr(getattr(m, "config", None), "model_type", None) == "gpt2", _GPT),
    "nanogpt": (lambda m: hasattr(m, "transformer") and hasattr(m.transformer, "wte") and hasattr(m.transformer, "h"),
                _GPT),
}
_EXAMPLE = ('{"embedding": "tok", "ln1": "blocks.*.norm1", "qkv": "blocks.*.attn.qkv", "proj": "blocks.*.attn.out", '
            '"ln2": "blocks.*.norm2", "fc1": "blocks.*.mlp.up", "fc2": "blocks.*.mlp.down", "ln_f": "norm", '
            '"logits": "head"}')


# --- the module's layers ------------------------------------------------------------------------------
@dataclass
class Site:
    """One occurrence of a plan layer in the chain and the modules that compute it (none: inline)."""

    layer: LayerPlan
    block: int | None
    modules: list  # [(name, module)]


def _block_of(name: str) -> int | None:
    m = re.search(r"(?:^|\.)(\d+)(?:\.|$)", name)
    return int(m.group(1)) if m else None


def find_layers(plan: TypedPlan, model, mapping: dict | None = None) -> tuple[list[Site], dict]:
    """The chain of ``plan``'s layers on ``model``'s modules, and each block's module name prefix."""
    if mapping is None:
        family = next((f for f, (match, _) in FAMILIES.items() if match(model)), None)
        if family is None:
            raise UserError(f"apply does not know the layers of a {type(model).__name__}: pass mapping= "
                            f"{{plan layer: module name pattern}}, e.g. mapping={_EXAMPLE}")
        mapping = FAMILIES[family][1]
    names = dict(model.named_modules())
    known = {lay.name for lay in plan.layers}
    unknown = sorted(set(mapping) - known)
    if unknown:
        raise UserError(f"mapping names {unknown[0]!r}, not a layer of the plan ({', '.join(sorted(known))}): "
                        f"use the plan's layer names")
    found: dict[str, list[str]] = {}
    for layer, pats in mapping.items():
        pats = [pats] if isinstance(pats, str) else list(pats)
        hits = [n for n in names if n and any(fnmatch.fnmatchcase(n, p) for p in pats)]
        if not hits:
            raise UserError(f"no module of the {type(model).__name__} matches {pats} for plan layer {layer!r}: "
                            f"give mapping={{{layer!r}: 'module name pattern', ...}} with names from "
                            f"model.named_modules(), e.g. {_EXAMPLE}")
        found[layer] = hits
    missing = [lay.name for lay in plan.layers if lay.name not in found and lay.kind not in INLINE_KINDS]
    if missing:
        raise UserError(f"no module mapped for plan layer {missing[0]!r} ({plan.layer(missing[0]).kind}): add it to "
                        f"mapping=, e.g. {_EXAMPLE}")
    blocks_want = plan.model.get("layers")
    block_layers = [lay for lay in plan.layers if lay.name not in HEAD + TAIL]
    per_block: dict[int, dict[str, list]] = {}
    for lay in block_layers:
        for n in found.get(lay.name, []):
            b = _block_of(n)
            if b is None:
                raise UserError(f"module {n!r} (plan layer {lay.name}) is in no numbered block: map block layers to "
                                f"modules named like 'blocks.0.mlp.up'")
            per_block.setdefault(b, {}).setdefault(lay.name, []).append((n, names[n]))
    blocks = sorted(per_block)
    if blocks_want is not None and len(blocks) != blocks_want:
        raise UserError(f"the {type(model).__name__} has {len(blocks)} blocks but the plan's model has {blocks_want} "
                        f"layers: apply a plan searched for a model of {len(blocks)} layers")
    residual = next((lay for lay in plan.layers if lay.kind == "residual"), None)
    chain: list[Site] = []
    for name in HEAD:
        if plan.layer(name):
            chain.append(Site(plan.layer(name), None, [(n, names[n]) for n in found.get(name, [])]))
    for b in blocks:
        for lay in block_layers:
            mods = per_block[b].get(lay.name, [])
            if not mods and lay.name in found:
                raise UserError(f"block {b} has no module for plan layer {lay.name!r}: check the mapping's pattern")
            chain.append(Site(lay, b, mods))
        if residual is not None:
            chain.append(Site(residual, b, []))
    for name in TAIL:
        if plan.layer(name):
            chain.append(Site(plan.layer(name), None, [(n, names[n]) for n in found.get(name, [])]))
    prefixes = {}
    for b in blocks:
        first = next(n for mods in per_block[b].values() for n, _ in mods)
        parts = first.split(".")
        prefixes[b] = ".".join(parts[:parts.index(str(b)) + 1])
    return chain, prefixes


# --- weights ------------------------------------------------------------------------------------------
def _is_conv1d(module) -> bool:
    return type(module).__name__ == "Conv1D"


def _swap(p: str) -> str:
    return {"S0": "S1", "S1": "S0"}.get(p, p)


def _hidden_only(fine, last: int) -> tuple[str, ...]:
    """A norm weight's or bias's placement: split where the plan splits its last dimension."""
    return tuple("S0" if is_split(p) and split_dim(p) == last else B for p in fine)


def weight_placements(site: Site, pname: str, module, param) -> tuple[str, ...]:
    """The placements (per fine axis, on the module's own layout) of parameter ``pname`` of ``module``."""
    lay = site.layer
    own = lay.weight(pname) if pname != "weight" else None
    if own is not None and len(own.shape) == param.dim():
        return own.placements
    w = lay.weight("weight")
    if w is None:
        raise UserError(f"plan layer {lay.name} places no weight but module parameter {pname!r} exists: map it "
                        f"to a layer with weights")
    if lay.kind in ("matmul", "embedding"):
        if param.dim() == 1:  # a bias: W's n
            return _hidden_only(w.placements, 1)
        if lay.kind == "embedding":
            if param.shape[0] != w.shape[0]:  # the position table: the plan's, else the hidden split of W's
                pos = lay.weight("positions")
                return pos.placements if pos is not None else tuple(p if p == "S1" else B for p in w.placements)
            return w.placements
        return w.placements if _is_conv1d(module) else tuple(_swap(p) for p in w.placements)
    return _hidden_only(w.placements, len(w.shape) - 1)


def _check_shapes(chain: list[Site], plan: TypedPlan) -> None:
    """Every mapped module's parameters against the plan's layer dims (one error naming both)."""
    for site in chain:
        if not site.modules:
            continue
        lay, d = site.layer, site.layer.dims
        mods = site.modules
        where = f"plan layer {lay.name} ({', '.join(n for n, _ in mods)})"
        if lay.kind == "matmul":
            ins, outs = set(), 0
            for n, m in mods:
                w = m.weight
                k, nn_ = (w.shape[0], w.shape[1]) if _is_conv1d(m) else (w.shape[1], w.shape[0])
                ins.add(k)
                outs += nn_
            if ins != {d.get("k")} or outs != d.get("n"):
                raise UserError(f"{where}: the module computes [{'/'.join(map(str, sorted(ins)))} -> {outs}] but the "
                                f"plan's model has [{d.get('k')} -> {d.get('n')}]: apply a plan searched for this "
                                f"model's config")
            _check_heads(lay, mods, plan, where)
        elif lay.kind == "embedding":
            tok = mods[0][1].weight
            if tuple(tok.shape) != (d.get("k"), d.get("n")):
                raise UserError(f"{where}: the embedding is {list(tok.shape)} but the plan's model has "
                                f"[{d.get('k')}, {d.get('n')}] (vocabulary, hidden): apply a plan for this model")
            for n, m in mods[1:]:
                if m.weight.shape[1] != d.get("n"):
                    raise UserError(f"{where}: {n} is {list(m.weight.shape)}, not [*, {d.get('n')}]")
        else:
            for n, m in mods:
                for pn, p in m.named_parameters(recurse=False):
                    if p.dim() != 1 or p.shape[0] != d.get("hidden"):
                        raise UserError(f"{where}: {n}.{pn} is {list(p.shape)} but the plan's {lay.kind} has hidden "
                                        f"{d.get('hidden')}: apply a plan for this model")


def _check_heads(lay: LayerPlan, mods, plan: TypedPlan, where: str) -> None:
    """A feature split of the attention's input must keep KV head groups whole (a fused qkv laid out head group
    by head group, or separate q, k, v); GPT-2's [q | k | v] c_attn cannot be split by features there. The qkv
    weight's own split need not: its output is redistributed to the attention's input placement."""
    if lay.name != "qkv":
        return
    attention = next((a for a in plan.layers if a.kind == "attention"), None)
    parts = math.prod(n for p, n in zip(attention.input or (), plan.mesh.sizes) if p == "S1") if attention else 1
    if parts == 1:
        return
    if len(mods) == 1 and _is_conv1d(mods[0][1]):
        raise UserError(f"{where}: GPT-2's fused c_attn is laid out [q | k | v], which the plan's split of the "
                        f"attention's features over {parts} devices does not keep whole: search with the attention's "
                        f"features unsplit, or give the model separate q/k/v projections")
    kv = plan.model.get("kv_heads", plan.model.get("heads"))
    if kv is not None and kv % parts:
        raise UserError(f"{where}: the plan splits the attention's features over {parts} devices but the model has "
                        f"{kv} KV heads: apply a plan whose attention split divides them")


# --- activations --------------------------------------------------------------------------------------
def _act(fine, t, whole: bool = True) -> tuple[tuple, tuple]:
    """(forward, gradient) DTensor placements of plan placements ``fine`` on tensor ``t``: tokens are the
    batch (dimension 0), features the last dimension; a whole tensor (``whole``: not a local piece) broadcast
    over the batch (no batch dimension, or one of 1) is replicated there and its gradient partial."""
    fwd, grad = [], []
    for p in fine:
        if p == B:
            fwd.append(Replicate()), grad.append(Replicate())
        elif p == P:  # the gradient of a partial sum is whole on every device (DTensor's convention)
            fwd.append(Partial()), grad.append(Replicate())
        elif split_dim(p) == 0 and whole and (t.dim() < 3 or t.shape[0] == 1):
            fwd.append(Replicate()), grad.append(Partial())
        else:
            s = Shard(0) if split_dim(p) == 0 else Shard(t.dim() - 1)
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


def _install_hooks(chain: list[Site], mesh) -> list:
    arrive = _handoffs(chain)
    handles = []
    for i, site in enumerate(chain):
        if not site.modules:
            continue
        last = not any(s.modules for s in chain[i + 1:])
        leave = None if last else arrive[i + 1]
        for name, module in site.modules:
            handles.append(module.register_forward_pre_hook(
                functools.partial(_pre, mesh=mesh, arrive=arrive[i], want=site.layer.input, where=name),
                with_kwargs=True))
            handles.append(module.register_forward_hook(functools.partial(_post, mesh=mesh, leave=leave)))
    return handles


def _pre(module, args, kwargs, *, mesh, arrive, want, where):
    x = args[0]
    if isinstance(x, DTensor):
        return None
    if arrive is None or not x.is_floating_point():  # token or position ids: replicated
        return (DTensor.from_local(x, mesh, [Replicate()] * mesh.ndim, run_check=False),) + args[1:], kwargs
    src, _ = _act(arrive, x, whole=False)
    shape = _global_shape(x, src, mesh)
    X = DTensor.from_local(x, mesh, src, run_check=False, shape=shape, stride=contiguous_strides(shape))
    dst, _ = _act(want, X) if want is not None else (src, None)
    _check_divides(shape, dst, mesh, where)
    return (_redistribute(X, mesh, dst),) + args[1:], kwargs


def _post(module, args, out, *, mesh, leave):
    if not isinstance(out, DTensor):
        return None
    if leave is None:
        return out.redistribute(mesh, [Replicate()] * mesh.ndim).to_local()
    dst, grad = _act(leave, out)
    _check_divides(out.shape, dst, mesh, "an activation handed on")
    return _redistribute(out, mesh, dst).to_local(grad_placements=grad)


def contiguous_strides(shape) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape``."""
    out, acc = [], 1
    for s in reversed(shape):
        out.append(acc)
        acc *= s
    return tuple(reversed(out))


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


def _sync_hook(mesh, placements):
    def hook(g):
        return g.redistribute(mesh, placements) if isinstance(g, DTensor) and g.placements != placements else g
    return hook


def _place(chain: list[Site], plan: TypedPlan, mesh, model) -> None:
    from torch.nn.utils import parametrize
    placed: dict[int, tuple] = {}
    axes = plan.sharding_axes if plan.sharding_mode == "fsdp" else ()
    todo = []
    for site in chain:
        for name, module in site.modules:
            for pname, param in list(module.named_parameters(recurse=False)):
                fine = weight_placements(site, pname, module, param)
                if P in fine:
                    raise UserError(f"plan layer {site.layer.name} places weight {pname} as a partial sum: apply "
                                    f"places weights split or replicated only; re-run the search")
                prev = placed.get(id(param))
                if prev is not None:
                    if prev != fine:
                        raise UserError(f"{name}.{pname} is tied to another layer's weight that the plan places "
                                        f"differently ({list(prev)} vs {list(fine)}): apply a plan that places both "
                                        f"alike")
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
        dt.register_hook(_sync_hook(mesh, tuple(store)))
        for module, attr in owners[id(param)]:
            setattr(module, attr, dt)
            if store != compute:
                parametrize.register_parametrization(module, attr, _Gather(mesh, compute), unsafe=True)


# --- vocabulary-parallel embedding ------------------------------------------------------------------------
def _vocab_embedding(module, ids, *, mesh, compute: tuple):
    """``module``'s (an ``nn.Embedding``) lookup with its table split by rows (the vocabulary) over one or more
    mesh axes, as Megatron-LM's vocabulary-parallel embedding: each device looks up the ids in its rows, zeros
    the others, and the output is a partial sum over the vocabulary axes (split by features where the table's
    columns are, replicated elsewhere). Its gradient (whole on every device: DTensor's convention for Partial)
    reaches only the local rows. DTensor's own embedding rule handles one vocabulary axis only."""
    weight = module.weight
    local_w = weight.to_local()
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    _, offset = compute_local_shape_and_global_offset(tuple(weight.shape), mesh, compute)
    lo, rows = offset[0], local_w.shape[0]
    ids = ids.to_local() if isinstance(ids, DTensor) else ids
    local = ids - lo
    outside = (local < 0) | (local >= rows)
    pad = module.padding_idx
    pad = pad - lo if pad is not None and lo <= pad < lo + rows else None
    out = nn.functional.embedding(local.masked_fill(outside, 0), local_w, pad)
    out = out.masked_fill(outside.unsqueeze(-1), 0)
    placements = [Partial() if isinstance(c, Shard) and c.dim == 0 else Shard(out.dim() - 1) if isinstance(c, Shard)
                  else Replicate() for c in compute]
    shape = tuple(ids.shape) + (weight.shape[1],)
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


# --- norms over split features ------------------------------------------------------------------------------
def _rms_norm(module, x):
    """``nn.RMSNorm``'s function written out of place: its composite kernel adds eps in place to the mean of
    squares, which DTensor refuses when the mean is a partial sum (the features split)."""
    eps = module.eps if module.eps is not None else torch.finfo(x.dtype).eps
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y * module.weight if module.weight is not None else y


def _split_norms(chain: list[Site]) -> None:
    """Every ``nn.RMSNorm`` whose plan layer takes its input split by features computed by ``_rms_norm``."""
    for site in chain:
        if site.layer.kind == "rmsnorm" and any(p == "S1" for p in site.layer.input or ()):
            for _, module in site.modules:
                if isinstance(module, nn.RMSNorm) and len(module.normalized_shape) == 1:  # parametrized: a subclass
                    module.forward = functools.partial(_rms_norm, module)


# --- FSDP through fully_shard ----------------------------------------------------------------------------
def _tp_modules(chain: list[Site], tp: int) -> dict | None:
    """module name -> ``parallelize_module`` style for the plan's tensor-parallel axis; None where the modules
    cannot take them (not ``nn.Linear`` / ``nn.Embedding``, or a weight tied between two mapped modules)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    styles, owners = {}, {}
    for site in chain:
        for i, (name, module) in enumerate(site.modules):
            for p in module.parameters(recurse=False):
                if id(p) in owners:
                    return None
                owners[id(p)] = name
            style = None
            if site.layer.name in TP_WEIGHTS and not (site.layer.kind == "embedding" and i > 0):
                style = TP_WEIGHTS[site.layer.name][site.layer.weight("weight").placements[tp]]
            if style is None:
                continue
            if type(module) not in (nn.Linear, nn.Embedding) or (type(module) is nn.Embedding and style != "rowwise"):
                return None
            if site.layer.name == "logits":  # whole logits for the user's loss
                styles[name] = ColwiseParallel(output_layouts=Replicate())
            elif site.layer.kind == "embedding":  # token ids, whole on every device
                styles[name] = RowwiseParallel(input_layouts=Replicate())
            else:
                styles[name] = ColwiseParallel() if style == "colwise" else RowwiseParallel()
    return styles


def placement_path(plan, model, mapping: dict | None = None, output: str = "whole") -> str:
    """"fully_shard", "ddp" or "dtensor": the path ``apply(..., output=output)`` places ``model`` by (see
    ``fully_shard_layout`` and ``data_parallel_plan``)."""
    plan = load_plan(plan)
    return path_of(plan, find_layers(plan, model, mapping)[0], output)


def path_of(plan: TypedPlan, chain: list[Site], output: str) -> str:
    """The path of ``plan`` (of several devices) on the modules of ``chain``: the plan's own (``plan_path``),
    except "dtensor" where a fully_shard plan's tensor-parallel axis falls on modules ``parallelize_module`` does
    not take, or a data-parallel plan is asked for whole outputs (``output`` "whole")."""
    path = plan_path(plan)
    if path == "fully_shard":
        tp = fully_shard_layout(plan).tp
        return path if tp is None or _tp_modules(chain, tp) is not None else "dtensor"
    return "dtensor" if path == "ddp" and output != "local" else path


def _data_piece(module, args, kwargs, *, split: DataSplit, where: str):
    """The rank's piece of the whole batch (token ids) that every rank feeds; tensors without a batch
    dimension (position ids) pass whole."""
    x = args[0]
    if x.dim() < 2:
        return None
    return (split.piece(x, where),) + args[1:], kwargs


@dataclass(frozen=True)
class DataSplit:
    """This rank's piece of every batch under ``apply(..., output="local")``: piece ``rank`` of ``world``."""

    rank: int
    world: int

    def piece(self, t, where: str):
        if t.shape[0] % self.world:
            raise UserError(f"{where}: a micro-batch of {t.shape[0]} does not split over the plan's {self.world} "
                            f"data-parallel devices: use a micro-batch that {self.world} divides")
        return t.chunk(self.world)[self.rank]

    def cut_calls(self, model) -> None:
        """``model``'s calls cut to this piece (``_local_batch``), and ``data_piece`` told which piece it is."""
        model._autotune_data_split = self
        model.register_forward_pre_hook(functools.partial(_local_batch, split=self), with_kwargs=True, prepend=True)


def _batch_of(args, kwargs) -> int | None:
    first = next((t for t in (*args, *kwargs.values()) if hasattr(t, "dim") and t.dim() >= 1), None)
    return None if first is None else first.shape[0]


def _local_batch(module, args, kwargs, *, split: DataSplit):
    """Every tensor of the model's call whose first dimension is the batch (ids, targets, labels, masks)
    cut to this rank's piece; the rest (position ids of one row, flags) pass whole."""
    batch = _batch_of(args, kwargs)
    if batch is None:
        return None

    def cut(t):
        return split.piece(t, "the model's input") if hasattr(t, "dim") and t.dim() >= 1 and t.shape[0] == batch \
            else t
    return tuple(cut(a) for a in args), {k: cut(v) for k, v in kwargs.items()}


def data_piece(model, t):
    """``t`` (a whole batch, e.g. the targets of a loss computed outside the model) cut to the piece this
    rank's outputs are of, for a model placed by ``apply(..., output="local")``; ``t`` itself otherwise."""
    split = getattr(model, "_autotune_data_split", None)
    return t if split is None else split.piece(t, "data_piece")


def _whole_batch(module, args, out, *, mesh):
    """The data pieces of the output (the logits) gathered whole on every rank, for the user's loss; the
    backward hands each rank its piece's gradient (summed over ranks by FSDP's reduction, divide factor 1)."""
    placements = [Shard(0)] * mesh.ndim
    shape = _global_shape(out, placements, mesh)
    whole = DTensor.from_local(out, mesh, placements, run_check=False, shape=shape, stride=contiguous_strides(shape))
    return whole.redistribute(mesh, [Replicate()] * mesh.ndim).to_local()


def _fully_shard(model, chain: list[Site], prefixes: dict, plan: TypedPlan, layout: FullyShard, world_mesh,
                 output: str, ignored: tuple = ()):
    """torchtitan's composition: ``parallelize_module`` on the tensor-parallel axis (if any), then
    ``fully_shard`` on each block and on the whole model over the data axes, a (replicate, shard) mesh for
    HSDP. ``world_mesh``: a DeviceMesh with ``fsdp_dims``' dimensions (and any others, e.g. a pipeline's).
    ``output`` "whole": gradients summed (each rank's is its piece's share of the whole batch's loss);
    "local": averaged (fully_shard's default, torchtitan's step). Returns (this rank's ``DataSplit``, the data
    mesh); the caller cuts the calls or gathers the outputs. ``ignored``: parameters fully_shard leaves as they
    are (placed by the caller)."""
    from torch.distributed import get_backend
    from torch.distributed.fsdp import fully_shard
    dims = fsdp_dims(plan, layout)
    data = tuple(k for k in dims if k != "tp")
    parts = math.prod(dims[k] for k in data)
    micro = plan.model.get("micro_batch")
    if micro is not None and micro % parts:
        raise UserError(f"the plan's micro-batch of {micro} does not split over its {parts} data-parallel "
                        f"devices: apply a plan searched for a micro-batch that {parts} divides")
    if layout.tp is not None:
        from torch.distributed.tensor.parallel import parallelize_module
        parallelize_module(model, world_mesh["tp"], _tp_modules(chain, layout.tp))
    _recompute(model, chain, prefixes, plan.recompute)
    mesh = world_mesh[data]
    names = dict(model.named_modules())
    units = [names[prefix] for prefix in prefixes.values()] + [model]
    for unit in units:
        fully_shard(unit, mesh=mesh, ignored_params=set(ignored) or None)
    gloo = get_backend(mesh.get_group(0)) == "gloo"
    for unit in units:
        if output == "whole":  # each rank's gradient is already its piece's share of the whole batch's loss
            unit.set_gradient_divide_factor(1.0)
        if gloo:  # gloo has neither the pre-multiplied sum nor the average fully_shard asks for
            unit.set_force_sum_reduction_for_comms(True)
    rank = 0
    for k in data:  # row-major over the data dimensions, as DTensor's Shard(0) on each in turn
        rank = rank * dims[k] + world_mesh.get_local_rank(k)
    return DataSplit(rank, parts), mesh


def _gather_outputs(chain: list[Site], split: DataSplit, mesh) -> None:
    """``apply``'s whole-batch contract on a fully_shard model: its first module takes this rank's piece of the
    batch every rank feeds, its last hands the outputs (the logits) whole to every rank."""
    for name, module in next(s for s in chain if s.modules).modules:
        module.register_forward_pre_hook(functools.partial(_data_piece, split=split, where=name), with_kwargs=True,
                                         prepend=True)
    last = [m for site in chain for _, m in site.modules][-1]
    last.register_forward_hook(functools.partial(_whole_batch, mesh=mesh))


# --- data parallelism through DDP ---------------------------------------------------------------------------
def _ddp(model, chain: list[Site], prefixes: dict, plan: TypedPlan, device: str, split: DataSplit, group=None,
         ignored: tuple = ()):
    """A pure data-parallel plan as users run it: recomputation as planned, then ``DistributedDataParallel``
    over ``group`` (None: the world; its gradients averaged, all-reduced in buckets during the backward, each
    gradient a view into its bucket: one copy of the gradients, as the plan's memory counts them; DDP's default
    keeps a second one in its buckets, 4 bytes a parameter more); returns the DDP module, which ``data_piece``
    asks for this rank's piece ``split`` (the caller cuts the calls). ``ignored``: parameters DDP leaves as they
    are (neither broadcast nor all-reduced: placed by the caller, as fully_shard's ``ignored``)."""
    from torch.nn.parallel import DistributedDataParallel
    _recompute(model, chain, prefixes, plan.recompute)
    skip = {id(p) for p in ignored}
    if skip:
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
            model, [n for n, p in model.named_parameters() if id(p) in skip])
    ddp = DistributedDataParallel(model, device_ids=[torch.cuda.current_device()] if device == "cuda" else None,
                                  process_group=group, gradient_as_bucket_view=True)
    ddp._autotune_data_split = split
    return ddp


# --- recomputation --------------------------------------------------------------------------------------
def _recompute(model, chain: list[Site], prefixes: dict, how: str) -> None:
    if how == "none":
        return
    from torch.utils.checkpoint import checkpoint
    names = dict(model.named_modules())
    targets = []
    for b, prefix in prefixes.items():
        if how == "full":
            targets.append(names[prefix])
        else:  # selective: the attention module, the common parent of the block's qkv and proj modules
            mods = [n for s in chain if s.block == b and s.layer.name in ("qkv", "proj") for n, _ in s.modules]
            parent = ".".join(_common(n.split(".") for n in mods)) if mods else prefix
            targets.append(names[parent])
    for m in targets:
        m.forward = functools.partial(checkpoint, m.forward, use_reentrant=False)


def _common(parts) -> list[str]:
    parts = list(parts)
    out = []
    for xs in zip(*parts):
        if len(set(xs)) != 1:
            break
        out.append(xs[0])
    return out


# --- the call --------------------------------------------------------------------------------------------
def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


OUTPUTS = ("whole", "local")


def apply(plan, model, mesh=None, mapping: dict | None = None, output: str = "whole"):
    """Place ``model``'s parameters and activations as ``plan`` says; returns ``model`` (see the module doc)."""
    if output not in OUTPUTS:
        raise UserError(f"output={output!r} is unknown: use 'whole' (every rank gets the whole batch's outputs) or "
                        f"'local' (each rank its piece's, FSDP plans)")
    plan = load_plan(plan)
    world = _world()
    if plan.world != world:
        raise UserError(f"the plan is for {plan.cluster} = {plan.world} devices but {world} processes run: launch "
                        f"{plan.world} (torchrun --nproc-per-node ...) or apply a plan searched for {world}")
    if mesh is not None and tuple(mesh.shape) != plan.mesh.sizes:
        raise UserError(f"the mesh given is {list(mesh.shape)} but the plan's fine mesh is {list(plan.mesh.sizes)}: "
                        f"pass mesh=None (apply builds it) or a mesh of that shape")
    chain, prefixes = find_layers(plan, model, mapping)
    _check_shapes(chain, plan)
    if world > 1:
        device = mesh.device_type if mesh is not None else "cuda" if dist.get_backend() == "nccl" else "cpu"
        from torch.distributed.device_mesh import init_device_mesh
        path = path_of(plan, chain, output)
        if path == "fully_shard":
            layout = fully_shard_layout(plan)
            dims = fsdp_dims(plan, layout)
            split, data_mesh = _fully_shard(model, chain, prefixes, plan, layout, init_device_mesh(
                device, tuple(dims.values()), mesh_dim_names=tuple(dims)), output)
            if output == "local":
                split.cut_calls(model)
            else:
                _gather_outputs(chain, split, data_mesh)
            return model
        if output == "local":
            if path != "ddp":
                raise UserError(f"output='local' needs a data-parallel or FSDP plan (DDP, FSDP, HSDP, TP + FSDP); "
                                f"{plan.strategy!r} is placed by DTensor: use output='whole'")
            split = DataSplit(dist.get_rank(), plan.world)
            split.cut_calls(model)
            return _ddp(model, chain, prefixes, plan, device, split)
        if mesh is None:
            mesh = init_device_mesh(device, plan.mesh.sizes, mesh_dim_names=plan.mesh.names)
        _place(chain, plan, mesh, model)
        _vocab_parallel(chain, plan, mesh)
        _split_norms(chain)
        _install_hooks(chain, mesh)
    _recompute(model, chain, prefixes, plan.recompute)
    return model


def param_groups(module) -> list[dict]:
    """``module``'s trainable parameters as optimizer parameter groups of one kind each: the DTensors (a local
    stage's embedding by features or logits by vocabulary beside its DDP parameters) and the plain tensors;
    torch's fused AdamW refuses a group that mixes them. Pass them where the parameters go:
    ``torch.optim.AdamW(param_groups(stage_module), fused=True)``."""
    params = [p for p in module.parameters() if p.requires_grad]
    groups = [[p for p in params if isinstance(p, DTensor)], [p for p in params if not isinstance(p, DTensor)]]
    return [{"params": g} for g in groups if g]


def micro_batches(plan, batch) -> list:
    """``batch`` (a tensor, or a dict of tensors) split along dimension 0 into the plan's micro-batches."""
    n = load_plan(plan).micro_batches
    if isinstance(batch, dict):
        parts = {k: micro_batches_of(v, n) for k, v in batch.items()}
        return [{k: v[i] for k, v in parts.items()} for i in range(n)]
    return micro_batches_of(batch, n)


def micro_batches_of(t, n: int) -> list:
    if t.shape[0] % n:
        raise UserError(f"a batch of {t.shape[0]} does not split into the plan's {n} micro-batches: use a batch "
                        f"that {n} divides")
    return list(t.chunk(n, dim=0))
