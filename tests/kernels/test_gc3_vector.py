"""The DSL's vector form and the columnar IR: the same ops and programs as scalar calls, the same errors."""
from __future__ import annotations

import numpy as np
import pytest

from calibrate.errors import UserError
from kernels.gc3.algorithms import build
from kernels.gc3.compiler import compile_program, compile_table
from kernels.gc3.dsl import CollectiveSpec, GC3Program
from kernels.gc3.ir import Buffer
from kernels.gc3.table import IRTable
from kernels.gc3.verify import verify
from kernels.gc3.xml_io import write_xml

I, O, S = Buffer.INPUT, Buffer.OUTPUT, Buffer.SCRATCH


def _ring_scalar(R: int) -> GC3Program:
    """Ring allreduce traced chunk by chunk with scalar calls, as the library traced it before."""
    prog = GC3Program("allreduce_ring_1ch", CollectiveSpec("allreduce", R, R, True))
    for r in range(R):
        order = [(r + 1 + k) % R for k in range(R)]
        c = prog.chunk(order[0], I, r)
        for q in order[1:]:
            c = prog.chunk(q, I, r).reduce(c, ch=0)
        for q in order[:-1]:
            c = c.copy(q, I, r, ch=0)
    return prog


@pytest.mark.parametrize("ranks", [2, 3, 6])
def test_vector_trace_compiles_like_scalar_calls(ranks):
    vector, scalar = build("ring_allreduce", ranks), _ring_scalar(ranks)
    assert len(vector.ops) == len(scalar.ops) == 2 * ranks * (ranks - 1)
    assert write_xml(compile_program(vector)) == write_xml(compile_program(scalar))


def test_vector_ops_touching_one_slot_are_traced_one_by_one():
    """Two ops of one call write the same slot: the second overwrites the first, as two scalar calls do."""
    prog = GC3Program("ag", CollectiveSpec("allgather", 2, 2, inplace=False))
    ref = prog.chunk(np.array([0, 1]), I, 0).copy(np.array([1, 1]), S, 0)
    assert prog.state(1, S, 0) == ((0, 0b10),)            # rank 1's input chunk 0 was written last
    with pytest.raises(UserError, match=r"stale reference chunk\(rank 1, scratch\[0:1\]\)"):
        ref._element(0).copy(0, O, 1)


def test_vector_errors_name_the_element():
    prog = GC3Program("ar", CollectiveSpec("allreduce", 4, 4))
    r = np.arange(4)
    c = prog.chunk((r + 1) % 4, I, r).reduce(prog.chunk(r, I, r))
    with pytest.raises(UserError, match=r"reducing chunk\(rank 0, input\[0:1\]\) into chunk\(rank 1, input\[0:1\]\) "
                                        r"would add input chunks \[\(0, 0\)\] twice"):
        c.reduce(prog.chunk(r, I, r))
    with pytest.raises(UserError, match=r"rank 4 outside 0..3"):
        prog.chunk(r + 1, I, 0)
    with pytest.raises(UserError, match="3 channel directives for 4 chunk ranges"):
        prog.chunk(r, I, r).copy((r + 1) % 4, S, 0, ch=[0, 1, 2])


def test_table_round_trip_and_verify_agree():
    ir = compile_program(build("allpairs_allreduce", 4, 2, 2, "LL"))
    table = IRTable.from_program(ir)
    assert table.to_program() == ir
    assert verify(table) == verify(ir)
    assert write_xml(compile_table(build("allpairs_allreduce", 4, 2, 2, "LL"))) == write_xml(ir)
