"""A Hugging Face ``config.json`` as a transformer model of models/transformer.py.

Supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM (kind llama) and GPT2LMHeadModel
(kind gpt), found by ``architectures`` or else ``model_type``. The config gives the architecture;
sequence, batch and micro_batch are not in it: they come from ``DEFAULTS`` or the caller's overrides; the
micro-batch (global, over all devices) by default holds one sequence a device of the cluster planned for, as far as
the batch divides (the data-parallel plans need at least that).

A sliding attention window (Mistral's ``sliding_window``, Qwen2's with ``use_sliding_window``) makes
attention cheaper only when it is shorter than the sequence, which the model does not express: a
window shorter than the sequence is refused, one at least as long (or none) is full attention.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from calibrate.errors import UserError
from calibrate.jsonfile import read_json
from calibrate.module import DEFAULT_SEQUENCE

ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
                 "GPT2LMHeadModel": "gpt2"}  # architecture -> model_type
DEFAULTS = {"batch": 64}  # micro_batch: global (all devices), by default one sequence a device (``HfModel.config``)
# a mixture of experts' fields (Mixtral, Qwen2-MoE, DeepSeek): its expert MLPs are not modelled
EXPERT_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size")
GELU_ACTIVATIONS = ("gelu_new", "gelu", "gelu_pytorch_tanh", "gelu_fast", "relu")  # GPT-2's MLP, likewise
# the activations of a Llama-family gated MLP that the SwiGLU cost rule prices (each one elementwise pass)
GATED_ACTIVATIONS = ("silu", "swish", "gelu", "gelu_new", "gelu_pytorch_tanh", "relu")

DEFAULT_MODULE = "models.modules:build"  # the project's reference modules of the transformer family


def is_hf_config(cfg: dict) -> bool:
    return "kind" not in cfg and ("architectures" in cfg or "model_type" in cfg)


def is_hf_file(model: str) -> bool:
    """Whether ``--model`` names a Hugging Face config.json (one that cannot be read: no, the search says why)."""
    if not (model.endswith(".json") and Path(model).is_file()):
        return False
    try:
        cfg = read_json(model, "model file", "")
    except UserError:
        return False
    return isinstance(cfg, dict) and is_hf_config(cfg)


def default_module(model: str) -> str:
    """The module a plan searched for ``--model`` runs by default (``autotune tune``, ``execute --module``): the
    config.json itself where it is a Hugging Face config (transformers' class of it), else the reference modules."""
    return str(Path(model)) if is_hf_file(model) else DEFAULT_MODULE


def _model_type(cfg: dict, origin: str) -> str:
    archs = cfg.get("architectures") or []
    supported = f"supported: {', '.join(sorted(ARCHITECTURES))}"
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise UserError(f"{origin}: 'architectures' is {archs!r}; it must be a list of names ({supported})")
    if archs:
        if len(archs) > 1 or archs[0] not in ARCHITECTURES:
            raise UserError(f"{origin}: architecture {', '.join(archs)} is not supported; {supported}")
        return ARCHITECTURES[archs[0]]
    if cfg.get("model_type") not in ARCHITECTURES.values():
        raise UserError(f"{origin}: model_type {cfg.get('model_type')!r} is not supported; {supported} "
                        f"(model_type {', '.join(sorted(ARCHITECTURES.values()))})")
    return cfg["model_type"]


def _int(cfg: dict, key: str, origin: str, default: int | None = None) -> int:
    v = cfg.get(key)
    if v is None and default is not None:
        return default
    if v is None:
        raise UserError(f"{origin}: missing {key!r}; a Hugging Face config of this architecture needs it")
    if not (isinstance(v, int) and not isinstance(v, bool) and v > 0):
        raise UserError(f"{origin}: {key!r} is {v!r}; a Hugging Face config needs it as a positive integer")
    return v


def _bool(cfg: dict, key: str, origin: str, default: bool) -> bool:
    v = cfg.get(key, default)
    if not isinstance(v, bool):
        raise UserError(f"{origin}: {key!r} is {v!r}; it must be true or false")
    return v


@dataclass(frozen=True)
class HfModel:
    kind: str  # gpt | llama
    fields: dict  # the architecture's transformer fields (no sequence, batch, micro_batch)
    window: int | None  # sliding attention window
    positions: int  # max_position_embeddings (GPT-2: n_positions): the longest sequence trained
    origin: str

    def config(self, overrides: dict, devices: int = 1) -> dict:
        """The transformer fields with sequence, batch and micro_batch from ``overrides`` or the defaults (for
        ``devices`` devices: the micro-batch the largest divisor of the batch of at most one sequence a device)."""
        cfg = {"sequence": min(DEFAULT_SEQUENCE, self.positions), **DEFAULTS, **self.fields, **overrides}
        b = cfg["batch"]
        if "micro_batch" not in cfg:  # a batch that is not a positive integer: 1, and the loader says what is wrong
            whole = isinstance(b, int) and not isinstance(b, bool) and b > 0
            cfg["micro_batch"] = max(m for m in range(1, min(devices, b) + 1) if b % m == 0) if whole else 1
        seq = cfg["sequence"]
        if isinstance(seq, int) and not isinstance(seq, bool) and seq > self.positions:
            raise UserError(f"{self.origin}: sequence {seq} is longer than the config's "
                            f"{'n_positions' if self.kind == 'gpt' else 'max_position_embeddings'} {self.positions}, the longest it was trained on; give a sequence of at most "
                            f"{self.positions}")
        if self.window is not None and isinstance(cfg["sequence"], int) and self.window < cfg["sequence"]:
            raise UserError(f"{self.origin}: sliding_window {self.window} is shorter than sequence {cfg['sequence']}, "
                            f"and a sliding window's cheaper attention is not modelled; give a sequence of at most "
                            f"{self.window}")
        return cfg


def read_hf(cfg: dict, origin: str) -> HfModel:
    """The transformer of a Hugging Face config (a parsed config.json)."""
    mt = _model_type(cfg, origin)
    experts = [k for k in EXPERT_FIELDS if cfg.get(k) not in (None, 0)]
    if experts:
        raise UserError(f"{origin}: {', '.join(experts)} describe a mixture of experts, which is not modelled "
                        f"(supported: dense {', '.join(sorted(ARCHITECTURES))}); remove them for a dense model")
    if mt == "gpt2":
        act = cfg.get("activation_function", "gelu_new")
        if act not in GELU_ACTIVATIONS:
            raise UserError(f"{origin}: activation_function {act!r} is not modelled; GPT-2's MLP is priced with "
                            f"{', '.join(GELU_ACTIVATIONS)}: give one of them")
        hidden = _int(cfg, "n_embd", origin)
        fields = {"layers": _int(cfg, "n_layer", origin), "hidden": hidden,
                  "heads": _int(cfg, "n_head", origin), "ffn": _int(cfg, "n_inner", origin, 4 * hidden),
                  "vocabulary": _int(cfg, "vocab_size", origin), "max_positions": _int(cfg, "n_positions", origin),
                  "tied": _bool(cfg, "tie_word_embeddings", origin, True)}
        return HfModel("gpt", _named(fields, cfg), None, fields["max_positions"], origin)
    act = cfg.get("hidden_act", "silu")
    if act not in GATED_ACTIVATIONS:
        raise UserError(f"{origin}: hidden_act {act!r} is not modelled; the gated MLP is priced with "
                        f"{', '.join(GATED_ACTIVATIONS)} (elementwise, the same cost): give one of them")
    hidden = _int(cfg, "hidden_size", origin)
    heads = _int(cfg, "num_attention_heads", origin)
    fields = {"layers": _int(cfg, "num_hidden_layers", origin), "hidden": hidden, "heads": heads,
              "kv_heads": _int(cfg, "num_key_value_heads", origin, heads),
              "head_dim": _int(cfg, "head_dim", origin, hidden // heads),
              "ffn": _int(cfg, "intermediate_size", origin), "vocabulary": _int(cfg, "vocab_size", origin),
              "tied": _bool(cfg, "tie_word_embeddings", origin, False)}
    positions = _int(cfg, "max_position_embeddings", origin, DEFAULT_SEQUENCE)
    if mt == "qwen2":
        fields |= {"qkv_bias": True, "bias": False}  # Qwen2: q, k, v projections with a bias, none elsewhere
        window = cfg.get("sliding_window") if _bool(cfg, "use_sliding_window", origin, False) else None
    else:
        attention_bias = _bool(cfg, "attention_bias", origin, False)  # Llama: q, k, v and o projections
        mlp_bias = _bool(cfg, "mlp_bias", origin, False)
        if attention_bias != mlp_bias:
            raise UserError(f"{origin}: attention_bias {str(attention_bias).lower()} with mlp_bias "
                            f"{str(mlp_bias).lower()} is not expressible (bias covers o_proj and the MLP together); "
                            f"set both alike")
        fields |= {"qkv_bias": attention_bias, "bias": attention_bias}
        window = cfg.get("sliding_window") if mt == "mistral" else None
    if window is not None:
        window = _int(cfg, "sliding_window", origin)
    return HfModel("llama", _named(fields, cfg), window, positions, origin)


def _named(fields: dict, cfg: dict) -> dict:
    name = cfg.get("_name_or_path")
    arch = (cfg.get("architectures") or [cfg["model_type"]])[0]
    return fields | ({"name": name} if isinstance(name, str) and name else {}) | {"source": f"Hugging Face {arch} config"}
