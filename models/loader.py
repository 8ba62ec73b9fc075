"""Load a model (a preset of a kind, or a JSON file) and validate its fields."""
from __future__ import annotations

import json
import os
from importlib import resources

from calibrate.errors import OptionError, UserError
from calibrate.jsonfile import read_json

from models import transformer
from models.builders import BUILDERS
from models.graph import LayerGraph
from models.hf import is_hf_config, read_hf

# kind -> field -> type: "int" (positive), "ints" (a list of them), "bool", "str" (one of CHOICES[field]);
# every field of a preset is overridable
FIELDS: dict[str, dict[str, str]] = {
    "gpt": dict(transformer.FIELDS),
    "llama": dict(transformer.FIELDS),
    "mlp": {"dims": "ints", "batch": "int", "micro_batch": "int", "act_bytes": "int"},
    "vgg13": {"batch": "int", "micro_batch": "int", "image": "int", "classes": "int", "act_bytes": "int"},
    "u-transformer": {"widths": "ints", "layers_per_stage": "int", "head_dim": "int", "sequence": "int",
                      "vocabulary": "int", "batch": "int", "micro_batch": "int", "act_bytes": "int"},
}
CHOICES: dict[str, tuple[str, ...]] = dict(transformer.CHOICES)
# field -> what it is, one line (the command's help)
HELP: dict[str, str] = {
    **transformer.HELP,
    "dims": "layer widths of the MLP, input first",
    "image": "image side in pixels (a multiple of 32)",
    "classes": "output classes",
    "widths": "stage widths of the U-Transformer",
    "layers_per_stage": "transformer blocks per stage",
}
# act_bytes: bytes per activation and gradient element, 2 (fp16/bf16 mixed precision, the default) or 4 (fp32)
OPTIONAL = (set(transformer.FIELDS) - set(transformer.REQUIRED["gpt"])) | {"act_bytes"}


def model_kinds() -> list[str]:
    return sorted(BUILDERS)


def _preset_file(kind: str) -> dict:
    # through the models package: importing the models.presets subpackage would rebind models.presets,
    # the function, to the subpackage for every later "from models import presets"
    return json.loads(resources.files("models").joinpath("presets", f"{kind}.json").read_text())


def presets(kind: str) -> tuple[str, list[str]]:
    """(default preset, all preset names) of a model kind."""
    d = _preset_file(kind)
    return d["default"], sorted(d["presets"])


def validate(kind: str, cfg: dict, origin: str) -> dict:
    """``cfg`` checked (a UserError naming the field and the fix); a transformer's with every field filled in."""
    if kind in transformer.FAMILIES:
        c = transformer.TransformerConfig.from_fields(kind, cfg, origin)
        return {k: v for k, v in cfg.items() if k in transformer.META} | c.fields()
    fields = FIELDS[kind]
    unknown = sorted(set(cfg) - set(fields) - {"kind", "name", "description", "source"})
    if unknown:
        raise UserError(f"{origin}: unknown field {unknown[0]!r} for a {kind} model; fields are {', '.join(fields)}")
    missing = sorted(set(fields) - set(cfg) - OPTIONAL)
    if missing:
        raise UserError(f"{origin}: missing field {missing[0]!r}; a {kind} model needs {', '.join(sorted(set(fields) - OPTIONAL))}")
    for key, typ in fields.items():
        if key not in cfg:
            continue
        v = cfg[key]
        ok = (isinstance(v, int) and not isinstance(v, bool) and v > 0) if typ == "int" else (
            isinstance(v, list) and len(v) >= 2 and all(isinstance(x, int) and x > 0 for x in v))
        if not ok:
            want = "a positive integer" if typ == "int" else "a list of at least two positive integers"
            raise UserError(f"{origin}: field {key!r} is {v!r}; it must be {want}")
    if cfg["batch"] % cfg["micro_batch"]:
        raise UserError(f"{origin}: batch {cfg['batch']} is not a multiple of micro_batch {cfg['micro_batch']}; change one of them")
    if cfg.get("act_bytes", 2) not in (2, 4):
        raise UserError(f"{origin}: act_bytes {cfg['act_bytes']!r} must be 2 (fp16/bf16 mixed precision) or 4 (fp32)")
    if kind == "u-transformer" and any(w % cfg["head_dim"] for w in cfg["widths"]):
        raise UserError(f"{origin}: every width must be a multiple of head_dim {cfg['head_dim']}")
    if kind == "vgg13" and cfg["image"] % 32:
        raise UserError(f"{origin}: image side {cfg['image']} must be a multiple of 32 (five 2x2 poolings)")
    return cfg


def is_model_file(model: str) -> bool:
    """``model`` names a file when it ends in .json or holds a path separator; otherwise it is a kind."""
    return model.endswith(".json") or "/" in model or os.sep in model or bool(os.altsep and os.altsep in model)


def read_model_file(model: str):
    """The JSON of the model file ``model``, refused in one line where it cannot be read."""
    return read_json(model, "model file", f"give a JSON file or one of {', '.join(model_kinds())}")


def check_model(model: str) -> None:
    """``model`` is a readable model file or a known kind (one line otherwise): what a command checks before it
    starts its devices."""
    if is_model_file(model):
        read_model_file(model)
    elif model not in BUILDERS:
        raise UserError(f"unknown model {model!r}: use one of {', '.join(model_kinds())} or a JSON file")


def load_model(model: str, preset: str | None = None, overrides: dict | None = None, devices: int = 1) -> LayerGraph:
    """A model kind (with a preset) or a JSON file; ``overrides`` replace fields; ``devices``: the cluster's, where
    a Hugging Face config's micro-batch is left open (``HfModel.config``)."""
    overrides = {k: v for k, v in (overrides or {}).items() if v is not None}
    if is_model_file(model):
        cfg = read_model_file(model)
        origin = f"model file {model!r}"
        if preset:
            raise OptionError("preset", "applies to a model kind, not to a model file: drop it or the file")
        if isinstance(cfg, dict) and is_hf_config(cfg):
            hf = read_hf(cfg, origin)
            return BUILDERS[hf.kind](validate(hf.kind, hf.config(overrides, devices), origin))
        if not isinstance(cfg, dict) or "kind" not in cfg:
            raise UserError(f"model file {model!r} needs a \"kind\" field, one of {', '.join(model_kinds())}, "
                            f"or is a Hugging Face config.json (with \"architectures\")")
        if cfg["kind"] not in BUILDERS:
            raise UserError(f"{origin}: unknown kind {cfg['kind']!r}; use one of {', '.join(model_kinds())}")
        kind = cfg["kind"]
    else:
        kind = model
        check_model(kind)
        default, names = presets(kind)
        name = preset or default
        if name not in names:
            raise UserError(f"unknown preset {name!r} for {kind}: use one of {', '.join(names)}")
        cfg = dict(_preset_file(kind)["presets"][name], name=name)
        origin = f"{kind} preset {name!r}"
    cfg = dict(cfg, **overrides)
    return BUILDERS[kind](validate(kind, cfg, origin))
