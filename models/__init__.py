"""Model presets (JSON data files in models/presets/) and their layer graphs.

    load_model("gpt")                            # the default GPT preset
    load_model("gpt", "gpt3-175b", {"batch": 1536})
    load_model("llama", "llama3-8b", {"kv_heads": 4})
    load_model("path/to/model.json")             # {"kind": "gpt", "hidden": ..., ...}
    load_model("path/to/config.json")            # a Hugging Face config (Llama, Mistral, Qwen2, GPT-2)
"""
from models.graph import Layer, LayerGraph
from models.loader import CHOICES, FIELDS, HELP, load_model, model_kinds, presets

__all__ = ["Layer", "LayerGraph", "CHOICES", "FIELDS", "HELP", "load_model", "model_kinds", "presets"]
