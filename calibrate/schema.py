"""A record's body checked against a small schema before a reader uses it: one ``UserError``
naming the file, the field and the fix, instead of a KeyError or TypeError deep in the reader.

A schema is one of:

- a type (``str``, ``bool``, ``dict``, ``list``): the value is of it (a bool is no number);
- a ``Kind`` below: ``COUNT`` (an integer >= 1), ``AMOUNT`` (a finite number >= 0), ``REAL``
  (a finite number), each with a ``MAYBE_`` form that also takes null;
- ``{"key": schema, "key?": schema}``: an object holding those keys (``?``: optional), others allowed;
- ``[schema]``: a list of values of that schema; ``{str: schema}``: an object of any keys, values of it.

    check(data, {"rows": [{"strategy": str, "step_s": MAYBE_AMOUNT}]}, "'summary.json'", "re-run it")
"""
from __future__ import annotations

import math
from enum import Enum

from calibrate.errors import UserError


class Kind(Enum):
    COUNT = "an integer >= 1"
    AMOUNT = "a finite number >= 0"
    REAL = "a finite number"


COUNT, AMOUNT, REAL = Kind.COUNT, Kind.AMOUNT, Kind.REAL
MAYBE_COUNT, MAYBE_AMOUNT, MAYBE_REAL = (COUNT, None), (AMOUNT, None), (REAL, None)
NAMES = {str: "a string", bool: "true or false", dict: "an object", list: "a list"}


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _fits(value, kind: Kind) -> bool:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        return False
    if kind is COUNT:
        return isinstance(value, int) and value >= 1
    return kind is REAL or value >= 0


def check(value, schema, origin: str, fix: str, where: str = "") -> None:
    """Raise one ``UserError`` ("<origin>: <where> is <value>, not <what>: <fix>") where ``value``
    does not have ``schema``; return None where it does."""
    def fail(what: str):
        raise UserError(f"{origin}: {where or 'the record'} is {_short(value)}, not {what}: {fix}")

    if isinstance(schema, tuple):  # (kind, None): the kind or null
        if value is not None:
            check(value, schema[0], origin, fix, where)
    elif isinstance(schema, Kind):
        if not _fits(value, schema):
            fail(schema.value)
    elif isinstance(schema, type):
        if not isinstance(value, schema) or (isinstance(value, bool) and schema is not bool):
            fail(NAMES.get(schema, schema.__name__))
    elif isinstance(schema, list):
        if not isinstance(value, list):
            fail("a list")
        for i, item in enumerate(value):
            check(item, schema[0], origin, fix, f"{where}/{i}" if where else str(i))
    elif isinstance(schema, dict) and set(schema) == {str}:
        if not isinstance(value, dict):
            fail("an object")
        for key, item in value.items():
            check(item, schema[str], origin, fix, f"{where}/{key}" if where else str(key))
    else:
        if not isinstance(value, dict):
            fail("an object")
        for key, sub in schema.items():
            name, optional = key.rstrip("?"), key.endswith("?")
            path = f"{where}/{name}" if where else name
            if name not in value:
                if not optional:
                    raise UserError(f"{origin}: {path} is missing: {fix}")
                continue
            check(value[name], sub, origin, fix, path)
