"""Decoder-only transformers as layer graphs: the "gpt" and "llama" families, one builder.

A family only sets defaults: GPT (LayerNorm with shift, GELU MLP of 4 x hidden, learned
positions, biases, tied logits) and Llama (RMSNorm, SwiGLU MLP, rotary positions, no biases,
untied logits). Every field can be set in either family, so Mistral (grouped-query attention)
and Qwen2 (a QKV bias) are Llama configs.

Chain per block with the residual stream: ln1, qkv, attention, proj, residual, ln2, fc1,
(gelu | swiglu), fc2, residual; the whole chain: embedding, the blocks, ln_f, logits, loss.
The residual layer is one layer tied across the model (see models/graph.py). The attention's
input, the fused QKV of (heads + 2 kv_heads) x head_dim columns, is laid out head group by head
group (each KV head followed by its query heads), so a split along features in whole
groups keeps heads whole; swiglu's input, fc1's fused [gate, up], interleaves them column by
column (2j gate j, 2j + 1 up j), so any even split keeps pairs. Without the
residual stream ("residual": false, the AutoDDL graph) a block is ln1, qkv, attention, proj,
ln2, fc1, gelu, fc2, its layers leave out dims at their absent value, and its LayerNorms keep
their shift whatever ``bias`` says (AutoDDL's model counts it), so the AutoDDL presets build
the graph they always had.
"""
from __future__ import annotations

from dataclasses import dataclass, fields as dataclass_fields
from enum import Enum
from functools import partial

from calibrate.errors import UserError

from models.graph import ABSENT, Layer, LayerGraph

FAMILIES = ("gpt", "llama")


class Attention(str, Enum):
    FLASH = "flash"  # SDPA flash attention: the probabilities are never stored
    NAIVE = "naive"  # materialised (tokens x sequence) probabilities per head


class Norm(str, Enum):
    LAYERNORM = "layernorm"
    RMSNORM = "rmsnorm"


class Mlp(str, Enum):
    GELU = "gelu"
    SWIGLU = "swiglu"


class Positions(str, Enum):
    LEARNED = "learned"  # a table of max_positions rows in the embedding
    ROTARY = "rotary"  # applied inside attention, no parameters
    NONE = "none"  # not modelled (the AutoDDL graph)


ENUMS = {"attention": Attention, "norm": Norm, "mlp": Mlp, "positions": Positions}

# field -> type: "int" (positive), "bool" (true | false), "str" (one of CHOICES)
FIELDS: dict[str, str] = {
    "layers": "int", "hidden": "int", "heads": "int", "sequence": "int", "vocabulary": "int", "batch": "int",
    "micro_batch": "int", "kv_heads": "int", "head_dim": "int", "ffn": "int", "act_bytes": "int", "tied": "bool",
    "attention": "str", "residual": "bool", "norm": "str", "mlp": "str", "positions": "str", "bias": "bool",
    "qkv_bias": "bool", "max_positions": "int",
}
CHOICES: dict[str, tuple[str, ...]] = {name: tuple(e.value for e in enum) for name, enum in ENUMS.items()}
# the largest values planned for, each far above any model trained today (Llama 3 405B: 126 blocks, 16,384 wide,
# sequence 131,072 after its long-context stage; GPT-3's batch 3.2M tokens)
LIMITS = {"layers": 4096, "hidden": 1 << 20, "ffn": 1 << 22, "heads": 1 << 14, "sequence": 1 << 24, "vocabulary": 1 << 24,
          "batch": 1 << 24, "micro_batch": 1 << 24}
LIMIT_WHY = {"layers": "the layer graph holds ten chain positions a block", "hidden": "model width",
             "ffn": "MLP width", "heads": "attention heads", "sequence": "tokens per sequence",
             "vocabulary": "embedding rows", "batch": "sequences a step", "micro_batch": "sequences a micro-batch"}
REQUIRED: dict[str, tuple[str, ...]] = {
    "gpt": ("layers", "hidden", "heads", "sequence", "vocabulary", "batch", "micro_batch"),
    "llama": ("layers", "hidden", "heads", "ffn", "sequence", "vocabulary", "batch", "micro_batch"),
}
HELP: dict[str, str] = {
    "layers": "transformer blocks",
    "hidden": "model width (d_model)",
    "heads": "attention (query) heads",
    "sequence": "tokens per sequence",
    "vocabulary": "vocabulary size (embedding and logits rows)",
    "batch": "sequences per step (global batch)",
    "micro_batch": "sequences per micro-batch (divides batch)",
    "kv_heads": "key/value heads, dividing heads (grouped-query attention; default heads)",
    "head_dim": "width of a head (gpt, llama: default hidden / heads)",
    "ffn": "MLP inner width (gpt default 4 x hidden; llama: required)",
    "act_bytes": "bytes per activation element: 2 (bf16/fp16 mixed precision, default) or 4 (fp32)",
    "tied": "logits share the embedding's weight (gpt default true, llama false)",
    "attention": "flash: SDPA flash attention (default); naive: materialised probabilities",
    "residual": "model the residual stream (default true; false: the AutoDDL graph)",
    "norm": "layernorm (gpt default) or rmsnorm (llama default)",
    "mlp": "gelu (gpt default) or swiglu (llama default)",
    "positions": "learned table (gpt default), rotary (llama default) or none",
    "bias": "biases of the linear layers and LayerNorms (gpt default true, llama false)",
    "qkv_bias": "bias of the QKV projection (default: bias; true for Qwen2)",
    "max_positions": "rows of the learned position table, at least sequence (default sequence)",
}
META = ("kind", "name", "source", "description")  # fields that describe, not size, a model


def _defaults(kind: str, c: dict) -> dict:
    gpt = kind == "gpt"
    bias = c.get("bias", gpt)
    return {
        "kv_heads": c["heads"], "head_dim": c["hidden"] // c["heads"], "ffn": 4 * c["hidden"], "act_bytes": 2,
        "tied": gpt, "attention": "flash", "residual": True, "norm": "layernorm" if gpt else "rmsnorm",
        "mlp": "gelu" if gpt else "swiglu", "positions": "learned" if gpt else "rotary", "bias": bias,
        "qkv_bias": bias, "max_positions": c["sequence"],
    }


def _check_type(key: str, v, origin: str) -> None:
    typ = FIELDS[key]
    if typ == "int" and not (isinstance(v, int) and not isinstance(v, bool) and v > 0):
        raise UserError(f"{origin}: field {key!r} is {v!r}; it must be a positive integer")
    if typ == "bool" and not isinstance(v, bool):
        raise UserError(f"{origin}: field {key!r} is {v!r}; it must be true or false")
    if typ == "str" and v not in CHOICES[key]:
        raise UserError(f"{origin}: field {key!r} is {v!r}; it must be one of {', '.join(CHOICES[key])}")


@dataclass(frozen=True)
class TransformerConfig:
    kind: str
    layers: int
    hidden: int
    heads: int
    sequence: int
    vocabulary: int
    batch: int
    micro_batch: int
    kv_heads: int
    head_dim: int
    ffn: int
    act_bytes: int
    tied: bool
    attention: Attention
    residual: bool
    norm: Norm
    mlp: Mlp
    positions: Positions
    bias: bool
    qkv_bias: bool
    max_positions: int

    @classmethod
    def from_fields(cls, kind: str, cfg: dict, origin: str) -> TransformerConfig:
        """The config of a ``kind`` model from its JSON fields (the family's defaults for those left
        out); a UserError naming the field and the fix for any bad one. ``META`` fields are ignored."""
        if kind not in FAMILIES:
            raise UserError(f"{origin}: unknown transformer kind {kind!r}; use one of {', '.join(FAMILIES)}")
        unknown = sorted(set(cfg) - set(FIELDS) - set(META))
        if unknown:
            raise UserError(f"{origin}: unknown field {unknown[0]!r} for a {kind} model; fields are {', '.join(FIELDS)}")
        missing = [k for k in REQUIRED[kind] if k not in cfg]
        if missing:
            raise UserError(f"{origin}: missing field {missing[0]!r}; a {kind} model needs {', '.join(REQUIRED[kind])}")
        for key, v in cfg.items():
            if key in FIELDS:
                _check_type(key, v, origin)
        if "head_dim" not in cfg and cfg["hidden"] % cfg["heads"]:
            raise UserError(f"{origin}: hidden {cfg['hidden']} is not a multiple of heads {cfg['heads']}; "
                            f"change one of them or give head_dim")
        c = {**_defaults(kind, cfg), **{k: v for k, v in cfg.items() if k in FIELDS}}
        if c["heads"] % c["kv_heads"]:
            raise UserError(f"{origin}: field 'kv_heads' is {c['kv_heads']}, which does not divide heads "
                            f"{c['heads']}; give a kv_heads that divides heads")
        if c["batch"] % c["micro_batch"]:
            raise UserError(f"{origin}: batch {c['batch']} is not a multiple of micro_batch {c['micro_batch']}; "
                            f"change one of them")
        for key, most in LIMITS.items():  # work bounded before it starts: the layer graph and its tables grow with these
            if c[key] > most:
                raise UserError(f"{origin}: field {key!r} is {c[key]:,}, above the {most:,} this tool plans for "
                                f"({LIMIT_WHY[key]}); give a smaller {key}")
        if c["act_bytes"] not in (2, 4):
            raise UserError(f"{origin}: act_bytes {c['act_bytes']!r} must be 2 (fp16/bf16 mixed precision) or 4 (fp32)")
        if c["positions"] == "learned" and c["max_positions"] < c["sequence"]:
            raise UserError(f"{origin}: field 'max_positions' is {c['max_positions']}, fewer rows than sequence "
                            f"{c['sequence']}; raise max_positions or lower sequence")
        return cls(kind=kind, **{k: ENUMS[k](v) if k in ENUMS else v for k, v in c.items()})

    def fields(self) -> dict:
        """Every field as JSON values (a model file that builds this config again)."""
        out = {f.name: getattr(self, f.name) for f in dataclass_fields(self)}
        return {k: v.value if isinstance(v, Enum) else v for k, v in out.items()}


def _layer(sparse: bool, name: str, kind: str, **dims) -> Layer:
    """A layer; ``sparse`` leaves out the dims at their ``ABSENT`` value."""
    if sparse:
        full = Layer(name, kind, tuple(sorted((k, v) for k, v in dims.items() if k not in ABSENT.get(kind, {}))))
        absent = full.all_dims()
        dims = {k: v for k, v in dims.items() if k not in ABSENT.get(kind, {}) or v != absent[k]}
    return Layer(name, kind, tuple(sorted(dims.items())))


def build_transformer(c: TransformerConfig, meta: dict | None = None) -> LayerGraph:
    """The layer graph of ``c``; ``meta`` (name, source, ...) goes into the graph's config beside the fields."""
    sparse = not c.residual
    L = partial(_layer, sparse)
    t, h, v = c.micro_batch * c.sequence, c.hidden, c.vocabulary
    width = c.heads * c.head_dim
    norm_dims = {"tokens": t, "hidden": h, "autocast": int(c.residual)}
    if c.norm is Norm.LAYERNORM:
        norm_dims["bias"] = int(c.bias or not c.residual)
    # how a user writes the projections (models.graph.ABSENT): GPT's fused c_attn and c_fc, Llama's separate
    # q, k, v and gate, up (Hugging Face, torchtitan); with the residual stream each reads an fp32 norm output
    qkv_projections = 1 if c.kind == "gpt" else 3
    user = {"autocast": int(c.residual)}

    def norm(name: str) -> Layer:
        return L(name, c.norm.value, **norm_dims)

    swiglu = c.mlp is Mlp.SWIGLU
    attention = L("attention", "attention", tokens=t, hidden=width, heads=c.heads, kv_heads=c.kv_heads,
                  head_dim=c.head_dim, micro_batch=c.micro_batch, flash=int(c.attention is Attention.FLASH),
                  rotary=int(c.positions is Positions.ROTARY), qkv_fused=int(c.residual and qkv_projections == 1),
                  **user)
    branch = [
        norm("ln1"),
        L("qkv", "matmul", tokens=t, k=h, n=(c.heads + 2 * c.kv_heads) * c.head_dim, bias=int(c.qkv_bias),
          projections=qkv_projections if c.residual else 1, cast_input=int(c.residual)),
        attention,
        L("proj", "matmul", tokens=t, k=width, n=h, bias=int(c.bias)),
    ]
    mlp = [
        norm("ln2"),
        L("fc1", "matmul", tokens=t, k=h, n=(2 if swiglu else 1) * c.ffn, bias=int(c.bias),
          projections=(2 if swiglu else 1) if c.residual else 1, cast_input=int(c.residual)),
        L("swiglu", "swiglu", tokens=t, hidden=c.ffn, **user) if swiglu
        else L("gelu", "pointwise", tokens=t, hidden=c.ffn, **user),
        L("fc2", "matmul", tokens=t, k=c.ffn, n=h, bias=int(c.bias)),
    ]
    rows = c.max_positions if c.positions is Positions.LEARNED else 0
    logits = dict(tokens=t, k=h, n=v, bias=0, projections=1, cast_input=int(c.residual)) | ({"tied": 1} if c.tied else {})
    head = [L("embedding", "embedding", tokens=t, k=v, n=h, positions=rows)]
    tail = [norm("ln_f"), L("logits", "matmul", **logits), L("loss", "loss", tokens=t, vocabulary=v, **user)]
    if c.residual:
        residual = L("residual", "residual", tokens=t, hidden=h, **user)
        layers = head + branch + [residual] + mlp + tail
        r = len(head) + len(branch)
        block = list(range(1, r + 1)) + list(range(r + 1, r + 1 + len(mlp))) + [r]
        skips = [(0, r)]
    else:
        layers = head + branch + mlp + tail
        block = list(range(1, 1 + len(branch) + len(mlp)))
        skips = []
    nb = len(block)
    chain = [0] + block * c.layers + list(range(len(layers) - len(tail), len(layers)))
    blocks = [(1 + i * nb, 1 + (i + 1) * nb) for i in range(c.layers)]
    config = {k: v for k, v in (meta or {}).items() if k in META and k != "kind"} | c.fields()
    del config["kind"]
    return LayerGraph(c.kind, layers, chain, c.batch, c.micro_batch, config, skips, blocks)


def build(kind: str, cfg: dict, origin: str = "model") -> LayerGraph:
    """The graph of a ``kind`` model from its JSON fields (a preset, a file, a plan's model)."""
    return build_transformer(TransformerConfig.from_fields(kind, cfg, origin), cfg)
