"""MSCCL XML reader and writer: every reference file loads and round-trips; bad files fail clearly."""
from __future__ import annotations

import pytest

from calibrate.errors import UserError
from msccl_reference import msccl_dir, reference_xml_files
from kernels.gc3.ir import Buffer, Gpu, Program, Step, StepType, ThreadBlock
from kernels.gc3.xml_io import read_xml, write_xml

MSCCL_DIR = msccl_dir()
MSCCL_FILES = reference_xml_files()

needs_files = pytest.mark.skipif(not MSCCL_FILES, reason=f"no MSCCL XML files in {MSCCL_DIR}")


@needs_files
@pytest.mark.parametrize("path", MSCCL_FILES, ids=lambda p: p.stem)
def test_reference_file_loads_and_round_trips(path):
    prog = read_xml(path)
    assert prog.ngpus == len(prog.gpus) > 1
    assert sum(len(tb.steps) for g in prog.gpus for tb in g.threadblocks) > 0
    text = write_xml(prog)
    assert 'commtune_ir="1"' in text
    again = read_xml(text)
    assert again == prog
    assert write_xml(again) == text


@needs_files
def test_reader_matches_known_values():
    prog = read_xml(MSCCL_DIR / "ring_allreduce_2r.xml")
    assert (prog.collective, prog.ngpus, prog.nchunksperloop, prog.inplace) == ("allreduce", 2, 2, True)
    assert [s.type for s in prog.gpus[0].threadblocks[0].steps] == [
        StepType.SEND, StepType.RECV_REDUCE_COPY_SEND, StepType.RECV]
    rs = read_xml(MSCCL_DIR / "allpairs_reducescatter_4r.xml")
    assert rs.gpus[0].threadblocks[0].steps[0].deps == [(2, 1)]
    assert rs.gpus[0].threadblocks[1].steps[1].has_dep


GOOD = """<algo name="t" proto="Simple" nchannels="1" nchunksperloop="2" ngpus="2" coll="allreduce" inplace="1">
  <gpu id="0" i_chunks="2" o_chunks="0" s_chunks="0">
    <tb id="0" send="1" recv="1" chan="0">
      <step s="0" type="s" srcbuf="i" srcoff="0" dstbuf="i" dstoff="0" cnt="1" depid="-1" deps="-1" hasdep="0"/>
    </tb>
  </gpu>
  <gpu id="1" i_chunks="2" o_chunks="0" s_chunks="0">
    <tb id="0" send="0" recv="0" chan="0">
      <step s="0" type="r" srcbuf="i" srcoff="0" dstbuf="i" dstoff="0" cnt="1" depid="-1" deps="-1" hasdep="0"/>
    </tb>
  </gpu>
</algo>"""


def test_good_snippet_loads():
    assert read_xml(GOOD).gpus[1].threadblocks[0].steps[0].type == StepType.RECV


@pytest.mark.parametrize("text, match", [
    (GOOD[: len(GOOD) // 2], r"malformed or truncated XML at line \d+"),
    (GOOD.replace('type="r"', 'type="zz"'), r"gpu 1 tb 0 step 0: unknown type='zz'"),
    (GOOD.replace('srcoff="0" dstbuf="i" dstoff="0" cnt="1" depid="-1" deps="-1" hasdep="0"/>\n    </tb>\n  </gpu>\n  <gpu id="1"',
                  'srcoff="1" dstbuf="i" dstoff="0" cnt="2" depid="-1" deps="-1" hasdep="0"/>\n    </tb>\n  </gpu>\n  <gpu id="1"'),
     r"gpu 0 tb 0 step 0 \(s\): src i\[1:3\] is outside the buffer of 2 chunks"),
    (GOOD.replace('srcbuf="i"', 'srcbuf="q"', 1), r"unknown srcbuf='q'"),
    (GOOD.replace('cnt="1"', 'cnt="x"', 1), r"cnt='x' is not an integer"),
    (GOOD.replace("<algo", "<alg").replace("</algo>", "</alg>"), r"expected <algo>"),
    (GOOD.replace('send="0" recv="0"', 'send="5" recv="0"'), r"send peer 5 is not another"),
    (GOOD.replace('deps="-1" hasdep="0"/>\n    </tb>\n  </gpu>\n</algo>',
                  'deps="3" hasdep="0"/>\n    </tb>\n  </gpu>\n</algo>').replace(
                  'depid="-1" deps="3"', 'depid="0" deps="3"'), r"depends on tb 0 step 3, which does not exist"),
    (GOOD.replace('commtune', '').replace('<algo ', '<algo commtune_ir="9" '), r"commtune_ir='9'"),
])
def test_bad_xml_is_rejected_with_place(text, match):
    with pytest.raises(UserError, match=match):
        read_xml(text)


def test_missing_file():
    with pytest.raises(UserError, match="no such XML file"):
        read_xml("/nonexistent/x.xml")


def single_dep_form(program: Program) -> Program:
    """The reference for write_xml's nops: a copy of ``program`` where no step has more than one dependency (nops carry the extras)."""
    out = Program(**{k: getattr(program, k) for k in ("name", "collective", "ngpus", "nchunksperloop",
                                                         "nchannels", "protocol", "inplace", "min_bytes",
                                                         "max_bytes")})
    for gpu in program.gpus:
        # new index of every old (tb, step)
        newidx: dict[tuple[int, int], int] = {}
        for tb in gpu.threadblocks:
            k = 0
            for i, st in enumerate(tb.steps):
                k += max(len(st.deps) - 1, 0)
                newidx[(tb.id, i)] = k
                k += 1
        ng = Gpu(gpu.id, gpu.i_chunks, gpu.o_chunks, gpu.s_chunks)
        for tb in gpu.threadblocks:
            steps: list[Step] = []
            for st in tb.steps:
                deps = [(d, newidx[(d, s)]) for d, s in st.deps]
                for extra in deps[:-1]:
                    steps.append(Step(len(steps), StepType.NOP, Buffer.INPUT, -1, Buffer.OUTPUT, -1, 0,
                                      deps=[extra]))
                steps.append(Step(len(steps), st.type, st.srcbuf, st.srcoff, st.dstbuf, st.dstoff, st.cnt,
                                  deps=deps[-1:], has_dep=st.has_dep))
            ng.threadblocks.append(ThreadBlock(tb.id, tb.send, tb.recv, tb.chan, steps))
        out.gpus.append(ng)
    return out


def test_multi_deps_become_nops():
    prog = read_xml(GOOD)
    st = prog.gpus[0].threadblocks[0].steps[0]
    prog.gpus[0].threadblocks.append(
        type(prog.gpus[0].threadblocks[0])(id=1, send=-1, recv=-1, chan=0, steps=[]))
    prog.gpus[0].threadblocks[1].steps = [
        type(st)(0, StepType.NOP, st.srcbuf, -1, st.dstbuf, -1, 0)]
    prog.gpus[0].threadblocks[0].steps.append(
        type(st)(1, StepType.SEND, st.srcbuf, 1, st.dstbuf, 1, 1, deps=[(1, 0), (0, 0)]))
    single = single_dep_form(prog)
    steps = single.gpus[0].threadblocks[0].steps
    assert [s.type for s in steps] == [StepType.SEND, StepType.NOP, StepType.SEND]
    assert steps[1].deps == [(1, 0)] and steps[2].deps == [(0, 0)]
    assert read_xml(write_xml(prog)) == single
