"""DSL and compiler: fusion, rejected programs, random routes (hypothesis), the algorithm library."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from calibrate.errors import UserError
from kernels.gc3.algorithms import ALGORITHMS, build
from kernels.gc3.compiler import compile_program
from kernels.gc3.dsl import CollectiveSpec, GC3Program
from kernels.gc3.executor import check_program
from kernels.gc3.ir import Buffer, StepType
from kernels.gc3.verify import VerifyError
from kernels.gc3.xml_io import read_xml, write_xml

I, O, S = Buffer.INPUT, Buffer.OUTPUT, Buffer.SCRATCH


def test_three_rank_ring_fuses():
    ir = compile_program(build("ring_allreduce", 3))
    for g in ir.gpus:
        assert [s.type for s in g.threadblocks[0].steps] == [
            StepType.SEND, StepType.RECV_REDUCE_SEND, StepType.RECV_REDUCE_COPY_SEND,
            StepType.RECV_COPY_SEND, StepType.RECV]
        assert len(g.threadblocks) == 1
    check_program(ir, seeds=6)


def test_instances_use_disjoint_channels_and_round_trip():
    ir = compile_program(build("ring_allreduce", 4, channels=2, instances=2))
    assert ir.nchannels == 4 and ir.nchunksperloop == 16
    assert sorted({tb.chan for tb in ir.gpus[0].threadblocks}) == [0, 1, 2, 3]
    assert read_xml(write_xml(ir)) == ir


ALGO_CASES = [
    ("ring_allreduce", r, 2, 1, 1) for r in (2, 3, 5)] + [
    ("allpairs_allreduce", r, 2, 1, 1) for r in (2, 3, 4)] + [
    ("hierarchical_allreduce", 4, 1, 1, 2), ("hierarchical_allreduce", 6, 1, 2, 2), ("hierarchical_allreduce", 6, 1, 1, 3),
    ("rdh_allreduce", 2, 1, 1, 1), ("rdh_allreduce", 4, 1, 2, 1), ("rdh_allreduce", 8, 1, 1, 1),
    ("ring_allgather", 3, 1, 1, 1), ("ring_allgather", 4, 2, 2, 1),
    ("ring_reducescatter", 3, 1, 1, 1), ("ring_reducescatter", 5, 2, 1, 1),
    ("twostep_alltoall", 4, 1, 1, 2), ("twostep_alltoall", 6, 2, 1, 3),
    ("alltonext", 6, 2, 1, 2), ("alltonext", 12, 2, 1, 3),
] + [(f"direct_{c}", r, ch, inst, 1) for c in ("allreduce", "allgather", "reducescatter", "alltoall")
     for r, ch, inst in ((2, 1, 1), (3, 1, 1), (4, 2, 2), (8, 1, 1))
] + [(f"oneshot_{c}", r, ch, inst, 1) for c in ("allreduce", "reducescatter")
     for r, ch, inst in ((2, 1, 1), (3, 1, 1), (4, 2, 2), (8, 1, 1))]


@pytest.mark.parametrize("name, ranks, channels, instances, nodes", ALGO_CASES)
def test_library_algorithm_is_correct(name, ranks, channels, instances, nodes):
    ir = compile_program(build(name, ranks, channels, instances, "LL", nodes))
    check_program(read_xml(write_xml(ir)), seeds=4)


def test_every_algorithm_is_tested():
    assert {c[0] for c in ALGO_CASES} == set(ALGORITHMS)


def _allgather2():
    return GC3Program("ag", CollectiveSpec("allgather", 2, 2, inplace=False))


def test_postcondition_not_met():
    prog = _allgather2()
    prog.chunk(0, I, 0).copy(0, O, 0)
    with pytest.raises(UserError, match=r"postcondition not met: rank 0 output\[1\] holds nothing"):
        compile_program(prog)


def test_uninitialised_read_names_the_place():
    prog = _allgather2()
    with pytest.raises(UserError, match=r"reads an uninitialised chunk: rank 1 scratch\[3\]"):
        prog.chunk(1, S, 3).copy(0, O, 1)


def test_stale_reference_rejected():
    prog = _allgather2()
    c = prog.chunk(0, I, 0).copy(1, O, 0)
    prog.chunk(1, I, 0).copy(1, O, 0)  # overwrites what c refers to
    with pytest.raises(UserError, match=r"stale reference .* output\[0\] of rank 1 was overwritten"):
        c.copy(0, O, 0)


def test_double_reduction_rejected():
    prog = GC3Program("ar", CollectiveSpec("allreduce", 2, 1))
    c = prog.chunk(1, I, 0).reduce(prog.chunk(0, I, 0))
    with pytest.raises(UserError, match="would add input chunks .* twice"):
        c.reduce(prog.chunk(0, I, 0))


def test_conflicting_channel_directive_rejected():
    """Rank 1 forwards to rank 2 what it gets from 0 and from 3, all on channel 0: one thread block
    would need two receive peers."""
    prog = GC3Program("ag", CollectiveSpec("allgather", 4, 4, inplace=True))
    prog.chunk(0, I, 0).copy(1, O, 0, ch=0).copy(2, O, 0, ch=0)
    prog.chunk(3, I, 0).copy(1, O, 3, ch=0).copy(2, O, 3, ch=0)
    for src in range(4):
        for dst in range(4):
            if prog.state(dst, O, src) is None:
                prog.chunk(src, I, 0).copy(dst, O, src)
    with pytest.raises(UserError, match=r"rank 1: rcs \(send to 2, receive from 3\) does not fit channel 0"):
        compile_program(prog)


def test_too_many_threadblocks_rejected():
    with pytest.raises(VerifyError, match="too many thread blocks: gpu 0 uses"):
        compile_program(build("allpairs_allreduce", 4, 3), sm_count=2)


def test_bad_algorithm_arguments():
    with pytest.raises(UserError, match="unknown algorithm"):
        build("nope", 4)
    with pytest.raises(UserError, match="power-of-2"):
        build("rdh_allreduce", 6)
    with pytest.raises(UserError, match="not a multiple of nodes"):
        build("hierarchical_allreduce", 5, nodes=2)


@st.composite
def allgather_routes(draw):
    """An allgather where every input chunk travels to every rank along a random route."""
    ranks = draw(st.integers(2, 4))
    prog = GC3Program("random_allgather", CollectiveSpec("allgather", ranks, ranks, inplace=False),
                      instances=draw(st.integers(1, 2)))
    for src in range(ranks):
        c = prog.chunk(src, I, 0).copy(src, O, src)
        order = draw(st.permutations([r for r in range(ranks) if r != src]))
        hops = draw(st.lists(st.integers(0, ranks - 1), max_size=2))  # detours via scratch
        for h in hops:
            if h != c.rank:
                c = c.copy(h, S, src, ch=draw(st.sampled_from([None, 0, 1])))
        for dst in order:
            c = c.copy(dst, O, src, ch=draw(st.sampled_from([None, 0])))
    return prog


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(allgather_routes())
def test_random_routes_compile_and_verify(prog):
    try:
        ir = compile_program(prog)
    except UserError as e:  # a random channel directive may be unplaceable: it must say so clearly
        assert "does not fit channel" in str(e)
        return
    check_program(read_xml(write_xml(ir)), seeds=3)
