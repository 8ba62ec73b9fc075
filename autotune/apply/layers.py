"""The plan's layers on a user's modules: each plan layer's modules (found by name for Hugging Face Llama,
Mistral, Qwen2, GPT-2 and nanoGPT-style models, ``FAMILIES``, or by ``mapping`` {plan layer: module name
pattern(s)}), each parameter's placement on the module's own layout, the shapes checked against the plan's
model, and recomputation as planned (``"full"``: each block under ``torch.utils.checkpoint``; ``"selective"``:
each block's attention module). ``nn.Linear`` stores W [k, n] as [n, k] (the plan's S0/S1 swap), GPT-2's
``Conv1D`` as [k, n]; separate q/k/v (gate/up) projections each take the fused layer's split; norm weights
follow their hidden dimension, a bias W's n."""
from __future__ import annotations

import fnmatch
import functools
import inspect
import math
import re
from dataclasses import dataclass

from calibrate.allocator import EXPANDABLE_ENV, allocator_of
from calibrate.errors import UserError
from calibrate.optional import require_torch

from autotune.plan.layouts import NORMS
from autotune.plan.typed import LayerPlan, TypedPlan
from autotune.sbp.sbp import B, P, is_split, split_dim

torch = require_torch()
import torch.distributed as dist  # noqa: E402

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


def residual_adds(model) -> bool:
    """Whether ``model``'s blocks add each branch into a residual stream: every model apply maps (Hugging Face's,
    nanoGPT's, a user's) but the reference modules built without it (their config's ``"residual": false``)."""
    config = getattr(model, "config", None)
    return not (isinstance(config, dict) and config.get("residual") is False)


def check_stream(plan: TypedPlan, model, out: tuple | None = None, where: str = "it") -> None:
    """A plan searched without the residual stream (AutoDDL's graph, ``"residual": false``: no "residual" layer,
    each layer takes its input where it wants it) on a module that adds one: each add joins the stream as one
    norm takes it with the branch as the next norm takes it (or, where a stage ends, as it leaves, ``out``).
    It runs as planned only where all these placements are one and none is a partial sum (the add would count
    the replicated stream once per device; on one device it runs); else one UserError naming the fix
    (``where``: which part of the plan, e.g. "its stage 0")."""
    if any(lay.kind == "residual" for lay in plan.layers) or not residual_adds(model):
        return
    def on(fine):  # an axis of one device holds the whole value, whatever the plan calls it
        return tuple(x if n > 1 else B for x, n in zip(fine, plan.mesh.sizes))
    handed = {lay.name: on(lay.input) for lay in plan.layers if lay.kind in NORMS and lay.input is not None}
    if out is not None:
        handed["the stage's end"] = on(out)
    items = list(handed.items())
    partial = [(n, fine) for n, fine in items if P in fine]
    differ = [(x, y) for x, y in zip(items, items[1:]) if x[1] != y[1]]
    if not partial and not differ:
        return
    if partial:
        why = (f"hands the stream on as a partial sum at {partial[0][0]} ({list(partial[0][1])}), which the "
               f"{type(model).__name__}'s residual add would count once per device")
    else:
        (a, fa), (b, fb) = differ[0]
        why = (f"places the stream as {list(fa)} at {a} but as {list(fb)} at {b}, which the "
               f"{type(model).__name__}'s residual add cannot join")
    raise UserError(f"the plan was searched for a model without the residual stream (\"residual\": false, AutoDDL's "
                    f"graph, as the autoddl-* and gpt3-* presets build it), and {where} {why}: search with the "
                    f"model's config.json, or a model JSON with \"residual\": true")


def _check_heads(lay: LayerPlan, mods, plan: TypedPlan, where: str) -> None:
    """A feature split of the attention's input must keep KV head groups whole (a fused qkv laid out head group
    by head group, separate q, k, v, or GPT-2's [q | k | v] c_attn, whose thirds the DTensor path splits each:
    ``autotune.apply.dtensor._fused_out``). The qkv weight's own split need not: its output is redistributed to
    the attention's input placement."""
    if lay.name != "qkv":
        return
    attention = next((a for a in plan.layers if a.kind == "attention"), None)
    parts = math.prod(n for p, n in zip(attention.input or (), plan.mesh.sizes) if p == "S1") if attention else 1
    if parts == 1:
        return
    kv = plan.model.get("kv_heads", plan.model.get("heads"))
    if kv is not None and kv % parts:
        raise UserError(f"{where}: the plan splits the attention's features over {parts} devices but the model has "
                        f"{kv} KV heads: apply a plan whose attention split divides them")


# --- recomputation --------------------------------------------------------------------------------------
CACHE_ARGS = ("cache", "past_key_values", "past_key_value", "layer_past")  # transformers' names across versions


def _cache_slots(forward) -> tuple[int, ...]:
    """The positions at which ``forward`` takes an inference cache (``CACHE_ARGS``) when passed positionally
    (GPT-2's blocks take it second)."""
    positional = [p.name for p in inspect.signature(forward).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return tuple(i for i, name in enumerate(positional) if name in CACHE_ARGS)


def _rerun(forward, slots, *args, **kwargs):
    """``forward`` under torch's checkpoint, its re-run in the backward recomputing what it keeps, and without an
    inference cache (by keyword, or at ``slots``: ``_cache_slots``), as transformers' own gradient checkpointing
    runs a layer: a key/value cache written in the forward is kept past the block (2 x H200, 2026-11-30: 4.00 GiB
    alive at Llama 3 8B's loss under full recomputation) and is written again by the re-run."""
    from torch.utils.checkpoint import checkpoint
    args = [None if i in slots else a for i, a in enumerate(args)]
    for name in CACHE_ARGS:
        if kwargs.get(name) is not None:
            kwargs[name] = None
    if kwargs.get("use_cache"):
        kwargs["use_cache"] = False
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def _recompute(model, chain: list[Site], prefixes: dict, how: str, blocks: int = 0) -> None:
    """Checkpoint the blocks (``prefixes``: block -> module name) as ``how`` says: "full" each whole block,
    "selective" each block's attention; ``blocks`` (a plan's ``recompute_blocks``): the first that many only."""
    if how == "none":
        return
    if blocks > len(prefixes):
        raise UserError(f"the plan re-runs the first {blocks} blocks, but this part of the model has "
                        f"{len(prefixes)}: apply a plan searched for this model")
    names = dict(model.named_modules())
    targets = []
    for b, prefix in sorted(prefixes.items())[:blocks] if blocks else prefixes.items():
        if how == "full":
            targets.append(names[prefix])
        else:  # selective: the attention module, the common parent of the block's qkv and proj modules
            mods = [n for s in chain if s.block == b and s.layer.name in ("qkv", "proj") for n, _ in s.modules]
            parent = ".".join(_common(n.split(".") for n in mods)) if mods else prefix
            targets.append(names[parent])
    for m in targets:
        m.forward = functools.partial(_rerun, m.forward, _cache_slots(m.forward))


def _common(parts) -> list[str]:
    parts = list(parts)
    out = []
    for xs in zip(*parts):
        if len(set(xs)) != 1:
            break
        out.append(xs[0])
    return out


def device_type() -> str:
    """"cuda" where the default process group runs NCCL (alone or beside gloo), else "cpu"."""
    return "cuda" if "nccl" in str(dist.get_backend()) else "cpu"


def check_allocator(plan, environ, device: str | None = None) -> None:
    """A plan searched for expandable segments (its memory limit left their smaller allowance) runs on the GPU
    (``device``; None: this job's) only under them: one line naming the fix, before any weight moves."""
    if plan.allocator != "expandable_segments" or allocator_of(environ) == plan.allocator:
        return
    if device is None:
        device = device_type() if _world() > 1 else "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        raise UserError(f"the plan was searched for torch's expandable segments (--expandable-segments: the memory "
                        f"limit left their allowance), which this process does not run under: start the job with "
                        f"{EXPANDABLE_ENV[0]}={EXPANDABLE_ENV[1]} (torchrun passes it on), or apply a plan searched "
                        f"without --expandable-segments")


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def contiguous_strides(shape) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape``."""
    out, acc = [], 1
    for s in reversed(shape):
        out.append(acc)
        acc *= s
    return tuple(reversed(out))


def _rms_norm(module, x):
    """``nn.RMSNorm``'s function written out of place: its composite kernel adds eps in place to the mean of
    squares, which DTensor refuses when the mean is a partial sum (the features split)."""
    eps = module.eps if module.eps is not None else torch.finfo(x.dtype).eps
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y * module.weight if module.weight is not None else y


def split_norms(chain: list[Site]) -> None:
    """Every ``nn.RMSNorm`` whose plan layer takes its input split by features computed by ``_rms_norm`` (the
    DTensor path's)."""
    for site in chain:
        if site.layer.kind == "rmsnorm" and any(p == "S1" for p in site.layer.input or ()):
            for _, module in site.modules:
                # a parametrized one is a subclass
                if isinstance(module, torch.nn.RMSNorm) and len(module.normalized_shape) == 1:
                    module.forward = functools.partial(_rms_norm, module)
