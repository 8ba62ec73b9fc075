"""The one record header and loader."""
from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

from calibrate.errors import UserError
from calibrate.records import Record, check_header, kind_of, load_record


@dataclass
class Demo(Record):
    KIND, VERSION, WHAT, FIX = "commtune.demo", 2, "demo record", "write one with python -m demo"
    LEGACY_KINDS = ("demo",)
    value: int

    def body(self) -> dict:
        return {"value": self.value}

    @classmethod
    def from_body(cls, d, origin):
        return cls(d["value"])


def test_round_trip_writes_the_header_first(tmp_path):
    path = Demo(7).save(tmp_path / "sub" / "d.json")
    data = json.loads(path.read_text())
    assert list(data)[:2] == ["kind", "version"] and data == {"kind": "commtune.demo", "version": 2, "value": 7}
    assert Demo.load(path) == Demo(7)


def test_old_files_are_read():
    assert Demo.from_dict({"schema": "commtune.demo", "version": 2, "value": 1}) == Demo(1)
    assert Demo.from_dict({"kind": "demo", "version": 2, "value": 1}) == Demo(1)
    assert kind_of({"schema": "x"}) == "x" and kind_of([1]) is None


@pytest.mark.parametrize("data, msg", [
    ({"kind": "commtune.other", "version": 2}, "is not a demo record (its kind is 'commtune.other', expected "
                                               "'commtune.demo'): write one with python -m demo"),
    ({"version": 2}, "its kind is None"),
    ([1, 2], "its kind is None"),
    ({"kind": "commtune.demo", "version": 1}, "is demo record version 1; this tool reads version 2: write one"),
])
def test_one_clear_error(data, msg, tmp_path):
    path = tmp_path / "d.json"
    path.write_text(json.dumps(data))
    with pytest.raises(UserError, match=msg.replace("(", r"\(").replace(")", r"\)")):
        Demo.load(path)
    with pytest.raises(UserError, match="demo record"):
        load_record(path, Demo.KIND, Demo.VERSION, Demo.WHAT, Demo.FIX)


def test_check_header_returns_the_data():
    d = {"kind": "commtune.demo", "version": 2, "value": 3}
    assert check_header(d, "commtune.demo", 2, "demo", "fix", "here") is d
