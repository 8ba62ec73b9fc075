"""Plug-ins by name: a registry maps a name to ``"package.module:attribute"``,
imported on first use so that a plug-in's heavy imports (cupy, torch, mpi4py)
cost nothing until it is picked.

    BACKENDS = Registry("backend", {"mpi": "calibrate.backends.mpi:MpiBackend"})
    cls = BACKENDS.get("mpi")        # imported now; unknown names: one UserError
"""
from __future__ import annotations

import importlib
from enum import Enum

from calibrate.errors import UserError


def load(target: str):
    """The object named by ``"package.module:attribute"`` (or the module, without ``:``)."""
    module, _, attr = target.partition(":")
    obj = importlib.import_module(module)
    return getattr(obj, attr) if attr else obj


class Registry:
    """Names of one kind of plug-in (``what``: "backend", "command") to their import targets."""

    def __init__(self, what: str, targets: dict[str, str]):
        self.what = what
        self.targets = dict(targets)

    def __contains__(self, name) -> bool:
        return name in self.targets

    def __iter__(self):
        return iter(self.targets)

    def names(self) -> list[str]:
        return list(self.targets)

    def get(self, name: str):
        if name not in self.targets:
            raise UserError(f"unknown {self.what} {name!r}: choose from {', '.join(self.targets)}")
        return load(self.targets[name])


class NamedEnum(str, Enum):
    """A str Enum read from user text: ``parse`` ignores case, ``_`` and ``-`` and knows the
    subclass's ``__aliases__``; unknown names are one ``UserError`` naming ``__what__``."""

    @classmethod
    def parse(cls, name):
        if isinstance(name, cls):
            return name
        key = str(name).strip().lower().replace("_", "").replace("-", "")
        key = getattr(cls, "__aliases__", {}).get(key, key)
        for member in cls:
            if member.value == key:
                return member
        raise UserError(f"unknown {cls.__what__} {name!r}: choose from {', '.join(m.value for m in cls)}")
