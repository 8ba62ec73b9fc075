"""The nn.Module that execute's apply path trains: a factory named ``package.module:factory``,
called with the plan's model config dict (no torch needed to name or check it), or a Hugging Face
``config.json``: transformers' own class of that config (as ``calibrate module`` builds and times it), with the
plan's number of blocks."""
from __future__ import annotations

import importlib

from calibrate.errors import OptionError, UserError
from calibrate.jsonfile import read_json
from models.hf import DEFAULT_MODULE

CHECKED = ("hidden", "heads", "kv_heads", "ffn", "vocabulary")  # the plan's model against the config's


def hf_factory(spec: str):
    """transformers' class of the config.json ``spec``, called with the plan's model config: its blocks
    (``layers``: a pipeline stage's, or the model's), the rest as the config says; a plan of another model (the
    search given --hidden, --ffn, ...) is refused in one line."""
    from calibrate.usermodule import hf_module
    cfg = read_json(spec, "--module config.json", "give the Hugging Face config.json the plan was searched for")
    if not isinstance(cfg, dict):
        raise OptionError("module", f"{spec} is not a JSON object: give the Hugging Face config.json the plan was "
                                    f"searched for")
    module = hf_module(cfg, spec)

    def build(config: dict):
        wrong = [f"{k} {config[k]} (config.json: {module.model[k]})" for k in CHECKED
                 if k in config and config[k] != module.model[k]]
        if wrong:
            raise UserError(f"the plan's model is not {spec}'s: {', '.join(wrong)}; search it without those options "
                            f"or give --module pkg.mod:factory")
        return module.build(int(config["layers"]), 1)
    return build


def load_factory(spec: str):
    """The callable named by ``package.module:factory``, or a config.json's (``hf_factory``)."""
    if spec.endswith(".json"):
        return hf_factory(spec)
    name, sep, attr = spec.partition(":")
    if not sep or not name or not attr:
        raise OptionError("module", f"{spec!r} is not package.module:factory (e.g. {DEFAULT_MODULE})")
    try:
        mod = importlib.import_module(name)
    except ImportError as e:
        raise OptionError("module", f"cannot import {name!r} ({e}): put it on PYTHONPATH or fix the name") from None
    factory = getattr(mod, attr, None)
    if not callable(factory):
        raise OptionError("module", f"{name!r} has no callable {attr!r}: name the function that builds the model")
    return factory
