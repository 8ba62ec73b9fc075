"""The project's reference PyTorch modules of the transformer family (GPT and Llama kinds), built
from the same config as the layer graph (``models.transformer``), so that a plan searched for the
graph applies to them by name (``autotune.apply``). Only for torch users: ``import models`` does
not import this module (nor torch).

    from models.modules import build
    model = build({"kind": "llama", "layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "ffn": 176,
                   "sequence": 32, "vocabulary": 128, "batch": 8, "micro_batch": 4})
    loss = model(ids, targets)          # ids, targets: (micro_batch, sequence) token ids

Module names mirror the plan's layer names: ``embedding`` (the token table; ``positions`` the
learned position table, part of the plan's embedding layer), ``blocks.{i}.ln1``, the QKV projection,
``.attention``, ``.proj``, ``.residual``, ``.ln2``, the MLP's first projection, ``.gelu`` or
``.swiglu``, ``.fc2``, then ``ln_f``, ``logits`` and ``loss``. Pre-norm blocks add both branches into
the residual stream (one ``residual`` module called twice per block, as the graph ties one residual
layer); without ``residual`` (the AutoDDL presets) the block is a plain chain.

The projections are written as each family's users write them, the way the layer graph prices
them (its ``projections`` dim, ``models.transformer``):

- Llama (Hugging Face, torchtitan): separate ``q_proj``, ``k_proj``, ``v_proj`` Linears for the
  plan's ``qkv`` layer and separate ``gate_proj``, ``up_proj`` for its ``fc1`` (a SwiGLU of any
  family). Query head ``j`` belongs to KV head ``j // (heads / kv_heads)``, so a split of each
  projection's outputs into equal pieces hands each device whole head groups, the same split as
  the fused layer's in the plan (its contract lays the fused QKV out head group by head group and
  [gate, up] interleaved).
- GPT (nanoGPT): one fused ``qkv`` Linear (nanoGPT's ``c_attn``) and one ``fc1`` (``c_fc``).
  ``qkv``'s output is grouped head group by head group (for each KV head its key, its value, then
  its ``heads / kv_heads`` query heads, ``head_dim`` columns each): nanoGPT's [q | k | v] columns
  permuted, the same cost, so that a split by columns in whole groups hands each device whole
  heads; ``attention`` reads the number of groups from its input's width, so it runs unchanged on
  a column-parallel piece. Without the residual stream (the AutoDDL graph, one projection each)
  a SwiGLU's gate and up are one ``fc1`` of ``2 * ffn`` outputs interleaved column by column
  (column ``2j`` the gate of unit ``j``, ``2j + 1`` its up), so any even split keeps pairs.

The norms and the rotary embedding are written as Hugging Face's Llama writes them, the pieces
``calibrate compute`` times and the step model charges (``calibrate.layers``): ``RMSNorm`` in fp32
(``x.float()``, the mean square, ``rsqrt``, back to the input's type, times the weight: unfused
kernels, not ``nn.RMSNorm``'s fused one), rotary as ``q * cos + rotate_half(q) * sin`` on
full-width angle tables. (``nn.RMSNorm`` ran a 4-layer Llama 15% faster on an H100 than this, on
2026-11-27: a module written that way is a different step, which the prediction does not describe.)

``plan_mapping`` is the mapping of plan layers to these names that ``autotune.apply`` takes.

Recomputation (the plan's ``recompute``): "full" re-runs each block's forward in the backward pass
(``torch.utils.checkpoint`` around each block: only the block's input is kept), "selective" only
the attention core (the probabilities or the flash kernel's inputs).
"""
from __future__ import annotations

import math

from calibrate.errors import OptionError, UserError
from calibrate.optional import require_torch
from models.transformer import FAMILIES, TransformerConfig

torch = require_torch()
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402
from torch.utils.checkpoint import checkpoint  # noqa: E402

RECOMPUTE = ("none", "selective", "full")
ROPE_THETA = 10000.0
INIT_STD = 0.02


def family_config(cfg: dict) -> dict:
    """The transformer config with its family's defaults filled in (``models.transformer``: the same
    fields and checks as the layer graph; ``kind`` "gpt" unless given)."""
    kind = cfg.get("kind", "gpt")
    if kind not in FAMILIES:
        raise UserError(f"the reference modules build {' and '.join(FAMILIES)} models, not {kind!r}: "
                        f"pass your own module (package.module:factory)")
    return TransformerConfig.from_fields(kind, {k: v for k, v in cfg.items() if k != "kind"}, "model config").fields()


def rotate_half(x):
    """(-b, a) of each head's halves (a, b)."""
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def rotate(x, cos, sin):
    """Rotary position embedding of ``x`` (..., seq, heads, head_dim) as Hugging Face's Llama writes it:
    the two halves of each head rotated by the position's angles; ``cos`` and ``sin`` (seq, 1, head_dim)
    hold each half's angles twice."""
    return x * cos + rotate_half(x) * sin


class RMSNorm(nn.Module):
    """Hugging Face's LlamaRMSNorm: in fp32 (float64 stays float64), back to the input's type, times the
    weight (module doc)."""

    def __init__(self, hidden: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x):
        y = x.to(torch.promote_types(x.dtype, torch.float32))
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * y.to(x.dtype)


def separate_projections(c: dict) -> tuple[bool, bool]:
    """(q, k, v separate, gate and up separate) for config ``c``: as the layer graph prices them
    (Llama's separate projections, GPT's fused c_attn; a SwiGLU's gate and up separate; one fused
    projection each without the residual stream)."""
    return c["kind"] == "llama" and c["residual"], c["mlp"] == "swiglu" and c["residual"]


class Attention(nn.Module):
    """Causal (grouped-query) self-attention core. Input: the fused QKV (batch, seq, groups * (2 +
    q_per_kv) * head_dim), head group by head group, or separate q (batch, seq, heads * head_dim),
    k and v (batch, seq, kv_heads * head_dim); output: the heads' outputs (batch, seq, heads *
    head_dim). The number of heads is read from the inputs' widths (a column-parallel piece runs
    unchanged). No weights."""

    def __init__(self, head_dim: int, q_per_kv: int, flash: bool, rotary: bool, max_positions: int):
        super().__init__()
        self.head_dim, self.q_per_kv, self.flash, self.rotary = head_dim, q_per_kv, flash, rotary
        if rotary:
            inv = 1.0 / ROPE_THETA ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
            angles = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv)
            angles = torch.cat((angles, angles), dim=-1)
            self.register_buffer("cos", angles.cos(), persistent=False)
            self.register_buffer("sin", angles.sin(), persistent=False)

    def _split(self, qkv):
        b, s, width = qkv.shape
        r, hd = self.q_per_kv, self.head_dim
        groups = width // ((r + 2) * hd)
        x = qkv.view(b, s, groups, r + 2, hd)
        return x[:, :, :, 0], x[:, :, :, 1], x[:, :, :, 2:].reshape(b, s, groups * r, hd)

    def forward(self, *qkv):
        hd = self.head_dim
        if len(qkv) == 1:
            k, v, q = self._split(qkv[0])
        else:
            q, k, v = (t.unflatten(-1, (t.shape[-1] // hd, hd)) for t in qkv)
        b, s, heads, _ = q.shape
        r = heads // k.shape[2]
        if self.rotary:
            cos, sin = (t[:s, None, :].to(q.dtype) for t in (self.cos, self.sin))
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (batch, heads, seq, head_dim)
        if self.flash:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=r > 1)
        else:  # the probabilities materialised, as AutoDDL counts them
            k, v = (t.repeat_interleave(r, dim=1) for t in (k, v))
            scores = q @ k.transpose(-2, -1) / math.sqrt(hd)
            mask = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
            out = scores.masked_fill(mask, float("-inf")).softmax(dim=-1) @ v
        return out.transpose(1, 2).reshape(b, s, heads * hd)


class SwiGLU(nn.Module):
    """silu(gate) * up: of separate gate and up, or of fc1's interleaved output (column 2j gate j,
    2j + 1 up j)."""

    def forward(self, *x):
        gate, up = x if len(x) == 2 else (x[0][..., 0::2], x[0][..., 1::2])
        return F.silu(gate) * up


class Residual(nn.Module):
    """The residual stream's addition (one module per block, called after each branch)."""

    def forward(self, stream, branch):
        return stream + branch


def _norm(c: dict):
    if c["norm"] == "rmsnorm":
        return RMSNorm(c["hidden"], eps=1e-5)
    # without the residual stream (the AutoDDL graph) LayerNorms keep their shift, as AutoDDL counts them
    return nn.LayerNorm(c["hidden"], eps=1e-5, bias=c["bias"] or not c["residual"])


class Block(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        h, hd, heads, kv = c["hidden"], c["head_dim"], c["heads"], c["kv_heads"]
        self.residual_stream = c["residual"]
        self.separate_qkv, self.separate_mlp = separate_projections(c)
        self.selective = False
        self.ln1 = _norm(c)
        if self.separate_qkv:
            self.q_proj = nn.Linear(h, heads * hd, bias=c["qkv_bias"])
            self.k_proj = nn.Linear(h, kv * hd, bias=c["qkv_bias"])
            self.v_proj = nn.Linear(h, kv * hd, bias=c["qkv_bias"])
        else:
            self.qkv = nn.Linear(h, (heads + 2 * kv) * hd, bias=c["qkv_bias"])
        self.attention = Attention(hd, heads // kv, c["attention"] == "flash", c["positions"] == "rotary",
                                   c["max_positions"])
        self.proj = nn.Linear(heads * hd, h, bias=c["bias"])
        if self.residual_stream:
            self.residual = Residual()
        self.ln2 = _norm(c)
        if self.separate_mlp:
            self.gate_proj = nn.Linear(h, c["ffn"], bias=c["bias"])
            self.up_proj = nn.Linear(h, c["ffn"], bias=c["bias"])
        else:
            self.fc1 = nn.Linear(h, (2 if c["mlp"] == "swiglu" else 1) * c["ffn"], bias=c["bias"])
        if c["mlp"] == "swiglu":
            self.swiglu = SwiGLU()
        else:
            self.gelu = nn.GELU()
        self.fc2 = nn.Linear(c["ffn"], h, bias=c["bias"])
        self.mlp = c["mlp"]

    def _attend(self, *qkv):
        if self.selective and torch.is_grad_enabled():
            return checkpoint(self.attention, *qkv, use_reentrant=False)
        return self.attention(*qkv)

    def forward(self, x):
        y = self.ln1(x)
        qkv = (self.q_proj(y), self.k_proj(y), self.v_proj(y)) if self.separate_qkv else (self.qkv(y),)
        a = self.proj(self._attend(*qkv))
        x = self.residual(x, a) if self.residual_stream else a
        y = self.ln2(x)
        up = (self.gate_proj(y), self.up_proj(y)) if self.separate_mlp else (self.fc1(y),)
        m = self.fc2(getattr(self, self.mlp)(*up))
        return self.residual(x, m) if self.residual_stream else m


class Transformer(nn.Module):
    """A GPT or Llama model of the family; ``forward(ids)`` gives the logits (batch, seq, vocabulary),
    ``forward(ids, targets)`` the mean cross-entropy loss."""

    def __init__(self, cfg: dict, recompute: str = "none"):
        super().__init__()
        c = self.config = family_config(cfg)
        self.embedding = nn.Embedding(c["vocabulary"], c["hidden"])
        self.positions = nn.Embedding(c["max_positions"], c["hidden"]) if c["positions"] == "learned" else None
        self.blocks = nn.ModuleList(Block(c) for _ in range(c["layers"]))
        self.ln_f = _norm(c)
        self.logits = nn.Linear(c["hidden"], c["vocabulary"], bias=False)
        if c["tied"]:
            self.logits.weight = self.embedding.weight
        self.loss = nn.CrossEntropyLoss()
        self.recompute = "none"
        self.set_recompute(recompute)

    @property
    def plan_mapping(self) -> dict:
        """Plan layer -> module name pattern, for ``autotune.apply(plan, model, mapping=model.plan_mapping)``."""
        qkv, mlp = separate_projections(self.config)
        out = {"embedding": ["embedding", "positions"] if self.positions is not None else "embedding",
               **{name: f"blocks.*.{name}" for name in ("ln1", "qkv", "proj", "ln2", "fc1", "fc2")}}
        if qkv:
            out["qkv"] = [f"blocks.*.{p}_proj" for p in "qkv"]
        if mlp:
            out["fc1"] = ["blocks.*.gate_proj", "blocks.*.up_proj"]
        return dict(out, ln_f="ln_f", logits="logits")

    def set_recompute(self, mode: str) -> None:
        if mode not in RECOMPUTE:
            raise OptionError("recompute", f"{mode!r} is unknown: use one of {', '.join(RECOMPUTE)}")
        self.recompute = mode
        for block in self.blocks:
            block.selective = mode == "selective"

    def forward(self, ids, targets=None):
        x = self.embedding(ids)
        if self.positions is not None:
            x = x + self.positions(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            if self.recompute == "full" and torch.is_grad_enabled():
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        logits = self.logits(self.ln_f(x))
        if targets is None:
            return logits
        return self.loss(logits.flatten(0, 1), targets.flatten())


def init_weights(model: nn.Module, seed: int) -> nn.Module:
    """Fixed-seed weights, the same on every process: Linear and Embedding weights N(0, 0.02^2)
    (GPT-2's), biases zero, norms' scales one. Parameters are drawn in name order."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if name.endswith("bias"):
                p.zero_()
            elif p.dim() == 1:
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * INIT_STD)
    return model


def build(config: dict, recompute: str = "none", seed: int = 0) -> Transformer:
    """The reference module of a model config (the plan's ``model`` section), weights from ``seed``
    (the factory ``python -m autotune execute`` calls by default)."""
    return init_weights(Transformer(config, recompute), seed)
