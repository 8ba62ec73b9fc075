"""The columnar compiler writes byte-identical MSCCL XML to the object compiler it replaced, for the
algorithm library at 4 and 8 ranks (hashes recorded from commit 4abcf08 in data/gc3_golden_xml.json; the one-shot
"direct_*" and "oneshot_*" programs from the commits that added them)."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from kernels.gc3.algorithms import build
from kernels.gc3.compiler import compile_program
from kernels.gc3.xml_io import write_xml

GOLDEN = json.loads((Path(__file__).parent / "data" / "gc3_golden_xml.json").read_text())["cases"]


def _case(key: str):
    name, ranks, nodes, channels, instances, protocol = key.split()
    val = lambda s: int(s.split("=")[1])  # noqa: E731
    return name, val(ranks), val(channels), val(instances), protocol, val(nodes)


@pytest.mark.parametrize("key", sorted(GOLDEN))
def test_xml_is_byte_identical_to_the_recorded_one(key):
    name, ranks, channels, instances, protocol, nodes = _case(key)
    text = write_xml(compile_program(build(name, ranks, channels, instances, protocol, nodes)))
    assert hashlib.sha256(text.encode()).hexdigest() == GOLDEN[key]


def test_golden_set_covers_the_library():
    from kernels.gc3.algorithms import ALGORITHMS
    assert {k.split()[0] for k in GOLDEN} == set(ALGORITHMS) and len(GOLDEN) >= 90
