"""The nn.Module that execute's apply path trains: a factory named ``package.module:factory``,
called with the plan's model config dict (no torch needed to name or check it)."""
from __future__ import annotations

import importlib

from calibrate.errors import OptionError

DEFAULT_MODULE = "models.modules:build"  # the project's reference modules of the transformer family


def load_factory(spec: str):
    """The callable named by ``package.module:factory``."""
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
