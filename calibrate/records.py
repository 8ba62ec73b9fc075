"""Every JSON record the project writes: one header, one loader, one class per format.

A record starts with the header ``{"kind": "commtune.<name>", "version": N}``.
``check_header`` is the one place that checks it, with one clear error naming
the file, what was expected and how to get a good one; ``load_record`` reads a
file and checks it. A format is a class deriving from ``Record`` that sets
``KIND``, ``VERSION``, ``WHAT`` (a name for errors: "profile") and ``FIX`` (how
to make a good one: "refit it with python -m calibrate fit"), writes its body in
``body()`` and reads it back in ``from_body()``::

    class Plan(Record):
        KIND, VERSION, WHAT, FIX = "commtune.reshard-plan", 1, "resharding plan", "re-plan it"
        def body(self) -> dict: ...
        @classmethod
        def from_body(cls, d: dict, origin: str) -> "Plan": ...

    plan = Plan.load("plan.json")     # header checked, then from_body
    plan.save("plan.json")            # header + body

Files written before this header (``"schema"`` instead of ``"kind"``, or an old
kind name listed in ``LEGACY_KINDS``) are still read.
"""
from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import ClassVar

from calibrate.errors import UserError
from calibrate.jsonfile import read_json, write_json


def header(kind: str, version: int) -> dict:
    """The header every record starts with."""
    return {"kind": kind, "version": version}


def kind_of(data) -> str | None:
    """The kind a parsed record declares (``kind``, or ``schema`` in files written before the one header)."""
    if not isinstance(data, dict):
        return None
    kind = data.get("kind")
    return kind if isinstance(kind, str) else data.get("schema")


def check_header(data, kind: str, version: int | tuple[int, ...], what: str, fix: str, origin: str,
                 legacy_kinds: tuple[str, ...] = ()) -> dict:
    """``data`` itself when it is a record of this kind and version (or one of the versions
    given as a tuple), else one ``UserError``."""
    found = kind_of(data)
    if found != kind and found not in legacy_kinds:
        raise UserError(f"{origin} is not a {what} (its kind is {found!r}, expected {kind!r}): {fix}")
    versions = version if isinstance(version, tuple) else (version,)
    if data.get("version") not in versions:
        raise UserError(f"{origin} is {what} version {data.get('version')!r}; this tool reads "
                        f"version {' or '.join(map(str, versions))}: {fix}")
    return data


def load_record(path: str | Path, kind: str, version: int, what: str, fix: str,
                legacy_kinds: tuple[str, ...] = ()) -> dict:
    """The parsed content of the record file ``path``, its header checked."""
    return check_header(read_json(path, what, fix), kind, version, what, fix, repr(str(path)), legacy_kinds)


class Record:
    """Base of a record format: the header and file handling written once."""

    KIND: ClassVar[str]
    VERSION: ClassVar[int]
    WHAT: ClassVar[str]
    FIX: ClassVar[str]
    LEGACY_KINDS: ClassVar[tuple[str, ...]] = ()
    LISTS: ClassVar[dict[str, type]] = {}   # a dataclass record's list fields -> the dataclass of their items

    def body(self) -> dict:
        """Everything but the header (by default a dataclass record's fields)."""
        return asdict(self)

    @classmethod
    def from_body(cls, d: dict, origin: str):
        """The record from its parsed content, header already checked (by default ``from_fields``)."""
        return cls.from_fields(d, origin, **cls.LISTS)

    @classmethod
    def from_fields(cls, d: dict, origin: str, **lists):
        """A dataclass record from its body: ``cls(**body)`` without the header, each field named in
        ``lists`` a list of that dataclass's dicts; a malformed body is one UserError naming the record."""
        body = {k: v for k, v in d.items() if k not in ("kind", "version")}
        try:
            for key, item in lists.items():
                body[key] = [item(**x) for x in body.get(key, [])]
            return cls(**body)
        except TypeError as e:
            raise UserError(f"{origin}: malformed {cls.WHAT} ({e}): {cls.FIX}") from None

    @classmethod
    def check(cls, d, origin: str) -> dict:
        return check_header(d, cls.KIND, cls.VERSION, cls.WHAT, cls.FIX, origin, cls.LEGACY_KINDS)

    def to_dict(self) -> dict:
        return {**header(self.KIND, self.VERSION), **self.body()}

    @classmethod
    def from_dict(cls, d, origin: str | None = None):
        origin = origin or cls.WHAT
        return cls.from_body(cls.check(d, origin), origin)

    @classmethod
    def load(cls, path: str | Path):
        return cls.from_dict(read_json(path, cls.WHAT, cls.FIX), repr(str(path)))

    def save(self, path: str | Path) -> Path:
        return write_json(path, self.to_dict(), self.WHAT)
