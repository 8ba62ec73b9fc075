"""Cutting a model into a pipeline's stages (``CUTS``): the project's reference modules (``models.modules``),
Hugging Face Llama-family and GPT-2 models and nanoGPT-style ones. The first stage holds the embedding (and a
learned position table), each stage the blocks the plan's split gives it, the last the final norm and the logits;
the stage's module names keep the model's, its blocks numbered from 0. A DTensor-path stage's hooks and its
stream's redistribution at the boundaries (``_reshard_stream``: this stage's stream placement to its route's
before the send, the route's to the next stage's after it)."""
from __future__ import annotations

import copy
import fnmatch
import functools

from calibrate.errors import UserError

from autotune.apply.dtensor import (Ends, _act, _fused_out, _fused_parts, _global_shape, _handoffs, _logits_out, _post,
                                    _pre, _redistribute, _split_fused)
from autotune.apply.layers import FAMILIES, Site, contiguous_strides, torch
from autotune.plan.typed import TypedPlan

from torch import nn  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

WHOLE = Ends((), (), 1)  # a stage's ids and logits whole on its submesh


# --- cutting the module --------------------------------------------------------------------------------------
def _reshard_stream(x, mesh, src: tuple | None, dst: tuple | None):
    """The stream's local piece in ``src`` redistributed to ``dst`` on ``mesh`` (a stage's submesh): before the
    send (this stage's stream placement to its route's) and after it (the route's to the next stage's); as is
    where the submesh is one device or the placements are equal."""
    if mesh is None or src is None or dst is None or tuple(src) == tuple(dst):
        return x
    placements, _ = _act(src, x, whole=False)
    shape = _global_shape(x, placements, mesh)
    X = DTensor.from_local(x, mesh, placements, run_check=False, shape=shape, stride=contiguous_strides(shape))
    want, grad = _act(dst, X)
    return _redistribute(X, mesh, want).to_local(grad_placements=grad)


class ReferenceStage(nn.Module):
    """A stage of ``models.modules.Transformer``: its forward is the model's, cut."""

    def __init__(self, model, lo: int, hi: int, first: bool, last: bool):
        super().__init__()
        self.embedding = model.embedding if first else None
        self.positions = model.positions if first else None
        self.blocks = nn.ModuleList(list(model.blocks)[lo:hi])
        self.ln_f = model.ln_f if last else None
        self.logits = model.logits if last else None
        self.recompute = model.recompute
        self.arrive = None
        self.depart = None

    @staticmethod
    def blocks_of(model) -> list:
        return list(model.blocks)

    def forward(self, x):
        if self.embedding is not None:
            ids = x
            x = self.embedding(ids)
            if self.positions is not None:
                x = x + self.positions(torch.arange(ids.shape[1], device=ids.device))
        elif self.arrive is not None:
            x = self.arrive(x)
        for block in self.blocks:
            if self.recompute == "full" and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        if self.logits is not None:
            return self.logits(self.ln_f(x))
        return self.depart(x) if self.depart is not None else x


class HFStage(nn.Module):
    """A stage of a Hugging Face causal LM: its base model (``BASE``: the Llama family's ``model``; a view of its
    own, the model's untouched, so that a rank may cut several chunks) with the stage's blocks (``BLOCKS``), run
    from the ids (first) or from ``inputs_embeds`` (later stages, without what only the first one adds:
    ``later``), at the positions ``positions`` gives (context parallelism's chunks; None: 0, 1, ...); the final
    norm (``NORM``) and the head in the last."""

    BASE, BLOCKS, NORM = "model", "layers", "norm"

    def __init__(self, model, lo: int, hi: int, first: bool, last: bool):
        super().__init__()
        base = copy.copy(getattr(model, self.BASE))
        base._modules = dict(base._modules)  # the view's own submodules: the model's base keeps its own
        setattr(base, self.BLOCKS, nn.ModuleList(list(getattr(base, self.BLOCKS))[lo:hi]))
        if not first:
            self.later(base)
        if not last:
            setattr(base, self.NORM, nn.Identity())
        setattr(self, self.BASE, base)  # the stage's module names keep the model's
        self.lm_head = model.lm_head if last else None
        self.first = first
        self.arrive = None
        self.depart = None
        self.positions = None  # the input's position ids, where they are not 0, 1, ... (``autotune.apply.context``)

    @staticmethod
    def later(base) -> None:
        base.embed_tokens = None

    @classmethod
    def blocks_of(cls, model) -> list:
        return list(getattr(getattr(model, cls.BASE), cls.BLOCKS))

    def forward(self, x):
        base = getattr(self, self.BASE)
        where = {} if self.positions is None else {"position_ids": self.positions(x)}
        if self.first:
            h = base(input_ids=x, use_cache=False, **where).last_hidden_state
        else:
            h = base(inputs_embeds=self.arrive(x) if self.arrive is not None else x, use_cache=False,
                     **where).last_hidden_state
        if self.lm_head is not None:
            return self.lm_head(h)
        return self.depart(h) if self.depart is not None else h


class GPT2Stage(HFStage):
    """A stage of transformers' GPT2LMHeadModel: its ``transformer``; later stages add no positions and no
    embedding dropout again."""

    BASE, BLOCKS, NORM = "transformer", "h", "ln_f"

    @staticmethod
    def later(base) -> None:
        base.wte, base.wpe, base.drop = None, _NoPositions(), nn.Identity()


class _NoPositions(nn.Module):
    """A later stage's position table: the positions were added once, in the first stage."""

    def forward(self, positions):
        return torch.zeros((), device=positions.device)


class NanoGPTStage(nn.Module):
    """A stage of a nanoGPT-style model (``transformer.wte``, ``wpe``, optional ``drop``, blocks ``h`` called on
    the stream alone, ``ln_f``, ``lm_head``): the model's forward written out over the stage's blocks, the
    logits of every position in the last (nanoGPT's own forward returns the last position's without targets)."""

    def __init__(self, model, lo: int, hi: int, first: bool, last: bool):
        super().__init__()
        t = model.transformer
        self.transformer = nn.Module()
        if first:
            self.transformer.wte, self.transformer.wpe = t.wte, getattr(t, "wpe", None)
            self.transformer.drop = getattr(t, "drop", None)
        self.transformer.h = nn.ModuleList(list(t.h)[lo:hi])
        if last:
            self.transformer.ln_f = t.ln_f
        self.lm_head = model.lm_head if last else None
        self.first = first
        self.arrive = None
        self.depart = None

    @staticmethod
    def blocks_of(model) -> list:
        return list(model.transformer.h)

    def forward(self, x):
        t = self.transformer
        if self.first:
            ids = x
            x = t.wte(ids)
            if t.wpe is not None:
                x = x + t.wpe(torch.arange(ids.shape[1], device=ids.device))
            if t.drop is not None:
                x = t.drop(x)
        elif self.arrive is not None:
            x = self.arrive(x)
        for block in t.h:
            x = block(x)
        if self.lm_head is not None:
            return self.lm_head(t.ln_f(x))
        return self.depart(x) if self.depart is not None else x


def _is_reference(model) -> bool:
    return type(model).__name__ == "Transformer" and type(model).__module__ == "models.modules"


def _is_hf_llama(model) -> bool:
    return FAMILIES["llama"][0](model) and hasattr(model, "model") and hasattr(model, "lm_head")


# name: (recognise, the stage module's class, the mapping of plan layers to module names)
CUTS = {
    "reference": (_is_reference, ReferenceStage, lambda m: m.plan_mapping),
    "hf-llama": (_is_hf_llama, HFStage, lambda m: FAMILIES["llama"][1]),
    "hf-gpt2": (lambda m: FAMILIES["gpt2"][0](m) and hasattr(m, "lm_head"), GPT2Stage, lambda m: FAMILIES["gpt2"][1]),
    "nanogpt": (lambda m: FAMILIES["nanogpt"][0](m) and hasattr(m, "lm_head") and hasattr(m.transformer, "ln_f"),
                NanoGPTStage, lambda m: FAMILIES["nanogpt"][1]),
}


def _cut_of(model):
    for name, (match, cls, mapping) in CUTS.items():
        if match(model):
            return cls, mapping(model)
    raise UserError(f"apply_pipeline cuts the reference modules (models.modules), Hugging Face Llama-family and "
                    f"GPT-2 models and nanoGPT-style ones, not a {type(model).__name__}: use one of those, or a "
                    f"single-stage plan with autotune.apply (search with --pipeline off)")


def _tied(model, mapping: dict) -> set[int]:
    """The ids of the parameters shared between the embedding's modules and the logits' (a tied head)."""
    names = dict(model.named_modules())

    def params(layer):
        pats = mapping.get(layer, [])
        pats = [pats] if isinstance(pats, str) else list(pats)
        return {id(p) for n, m in names.items() if n and any(fnmatch.fnmatchcase(n, pat) for pat in pats)
                for p in m.parameters()}
    return params("embedding") & params("logits")


def _install_stage_hooks(chain: list[Site], mesh, first: bool, last: bool, stream_in, stream_out, stage,
                         ends: Ends = WHOLE) -> None:
    """``apply``'s hooks on a stage: the first module of a later stage takes the stream as it arrives
    (``stream_in``), the last module of an earlier stage hands on what its chain expects next (the stream's
    placement where the chain ends in a module), the last stage's logits leave as ``ends`` says."""
    arrive = _handoffs(chain)
    names = dict(stage.named_modules())
    mods = [i for i, s in enumerate(chain) if s.modules]
    if not first:
        arrive[mods[0]] = stream_in
    for i in mods:
        site = chain[i]
        if i != mods[-1]:
            leave = arrive[i + 1]
        elif last:
            leave = None
        else:
            leave = arrive[i + 1] if i + 1 < len(chain) else stream_out
        fused = _fused_parts(site, chain[i + 1] if i + 1 < len(chain) else None, mesh)
        for name, module in site.modules:
            module.register_forward_pre_hook(
                functools.partial(_pre, mesh=mesh, arrive=arrive[i], want=site.layer.input, where=name,
                                  ends=WHOLE),
                with_kwargs=True)
            module.register_forward_hook(functools.partial(_logits_out, mesh=mesh, ends=ends) if leave is None
                                         else functools.partial(_fused_out, mesh=mesh, leave=leave) if fused
                                         else functools.partial(_post, mesh=mesh, leave=leave))
            if fused:  # GPT-2's attention splits its local [q | k | v] in thirds of its own heads (as apply's)
                _split_fused(names[name.rsplit(".", 1)[0]], fused)


def _mapping_for(plan: TypedPlan, mapping: dict) -> dict:
    names = {lay.name for lay in plan.layers}
    return {k: v for k, v in mapping.items() if k in names}


def _blocks(model, cls) -> list:
    return cls.blocks_of(model)
