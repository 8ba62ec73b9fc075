"""Host side of the GC3 interpreter: packing, sizing, transport layout, selection,
presets, the CUDA source compiling for sm_90, and the report section."""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from calibrate.errors import UserError
from kernels.gc3.executor import check_program
from kernels.gc3.compiler import compile_algorithm
from kernels.gc3.ir import Buffer, Gpu, Program, Protocol, Step, StepType, ThreadBlock
from kernels.gc3.xml_io import read_xml
from calibrate.sizes import parse_size, sweep
from kernels.interp import bench, pack
from kernels.interp.records import BenchRecord
from kernels.interp.layout import LINE_BYTES, Layout
from kernels.interp.preset import PROGRAM_DIR, Entry, Fifo, Preset, load_preset
from kernels.interp.select import choose

SOURCE = Path(pack.__file__).with_name("interp.cu")
OURS = sorted(PROGRAM_DIR.glob("*.xml"))


def ring2() -> Program:
    """A 2-rank ring allreduce by hand: send my half, receive-reduce-copy-send the other, receive."""
    prog = Program("ring2", "allreduce", 2, 2, 1, inplace=True)
    for r in range(2):
        p = 1 - r
        steps = [Step(0, StepType.SEND, Buffer.INPUT, r, Buffer.INPUT, r, 1),
                 Step(1, StepType.RECV_REDUCE_COPY_SEND, Buffer.INPUT, p, Buffer.INPUT, p, 1),
                 Step(2, StepType.RECV, Buffer.INPUT, r, Buffer.INPUT, r, 1)]
        prog.gpus.append(Gpu(r, 2, 0, 0, [ThreadBlock(0, p, p, 0, steps)]))
    return prog


def test_pack_ring_by_hand():
    pk = pack.pack(ring2(), rank=1, nranks=2)
    assert pk.tbs.tolist() == [[0, 3]]
    assert pk.steps[:, 0].tolist() == [0, 5, 1]              # s, rrcs, r
    assert pk.steps[1, 1:6].tolist() == [0, 0, 0, 0, 1]      # rrcs reads i[0], writes i[0], one chunk
    assert (pk.send_peer, pk.recv_peer, pk.chan) == ((0,), (0,), (0,))
    assert pk.steps.dtype == np.int32 and pk.steps.shape == (3, pack.STEP_FIELDS)


def test_pack_deps_of_compiled_program():
    """The GC3 compiler's 2-rank all-pairs allreduce: tb0 (send) s i[1]; s i[0] after tb1's reduction;
    tb1 (receive) r into s[0]; re s[0] into i[0]; r i[1] after tb0's first send."""
    prog = compile_algorithm("allpairs_allreduce", 2, protocol="LL")
    pk = pack.pack(prog, 0, 2)
    s01 = pk.steps[pk.tbs[0, 0] + 1]
    assert s01[6] == 1 and pk.deps[s01[7]].tolist() == [1, 1]
    s12 = pk.steps[pk.tbs[1, 0] + 2]
    assert s12[6] == 1 and pk.deps[s12[7]].tolist() == [0, 0]
    assert pk.chunks == {"i": 2, "o": 0, "s": 1}


def test_wrong_rank_count_refused():
    with pytest.raises(UserError, match="for 2 ranks but the communicator has 4"):
        pack.pack(ring2(), 0, 4)


def test_mismatched_connection_refused():
    prog = ring2()
    prog.gpus[1].threadblocks[0].steps[0].cnt = 2
    prog.gpus[1].i_chunks = 3
    with pytest.raises(UserError, match="inconsistent"):
        pack.pack(prog, 0, 2)


def test_two_blocks_on_one_connection_refused():
    prog = ring2()
    g = prog.gpus[0]
    g.threadblocks.append(ThreadBlock(1, 1, -1, 0, []))
    with pytest.raises(UserError, match="give each its own channel"):
        pack.pack(prog, 0, 2)


def test_chunk_sizes_closed_form():
    ar = read_xml(PROGRAM_DIR / "direct_allreduce_2r.xml")
    ag = read_xml(PROGRAM_DIR / "direct_allgather_2r.xml")
    rs = read_xml(PROGRAM_DIR / "direct_reducescatter_2r.xml")
    assert pack.chunk_elems(ar, 1000, 2) == 1000
    assert pack.chunk_elems(ag, 1000, 2) == 1000          # output 2000 split into 2 chunks
    assert pack.chunk_elems(rs, 7, 2) == 7                # input 14 split into 2 chunks
    ring4 = compile_algorithm("ring_allgather", 4)
    assert pack.min_count(ring4, 4) == 1
    ap = compile_algorithm("allpairs_allreduce", 2, instances=2)
    assert pack.min_count(ap, 2) == 4
    with pytest.raises(UserError, match="multiple of 4"):
        pack.chunk_elems(ap, 6, 2)


def test_buffer_too_small_refused():
    pk = pack.pack(read_xml(PROGRAM_DIR / "direct_allgather_2r.xml"), 0, 2)
    pack.check_buffers(pk, 100, 100, 200, "ag")
    with pytest.raises(UserError, match="output buffer"):
        pack.check_buffers(pk, 100, 100, 199, "ag")


def test_scratch_sizing():
    pk = pack.pack(compile_algorithm("allpairs_allreduce", 2, instances=2, protocol="LL"), 1, 2)
    assert pack.scratch_elems(pk, 256) == 512


def test_tile_sizes_closed_form():
    assert pack.tile_elems(Protocol.SIMPLE, 131072, 4, 1) == 32768
    assert pack.tile_elems(Protocol.LL, 32768, 4, 1) == 4096          # half the slot carries data
    t = pack.tile_elems(Protocol.SIMPLE, 131072, 2, 3)
    assert t * 2 * 3 <= 131072 and (t * 2) % 16 == 0 and (t + 8) * 2 * 3 > 131072
    assert pack.tile_elems(Protocol.SIMPLE, 131072, 4, 1, cap_bytes=65536) == 16384
    with pytest.raises(UserError, match="slot"):
        pack.tile_elems(Protocol.LL, 256, 4, 16)


def test_split_closed_form():
    assert pack.split_for(1024, 16384, 16) == 1
    assert pack.split_for(16385, 16384, 16) == 2
    assert pack.split_for(1 << 30, 1 << 17, 32) == 32


def test_unsupported_request_refused():
    prog = ring2()
    with pytest.raises(UserError, match="dtype"):
        pack.check_request(prog, "int8", "sum", Protocol.SIMPLE)
    with pytest.raises(UserError, match="reduction"):
        pack.check_request(prog, "float32", "max", Protocol.SIMPLE)
    pack.check_request(prog, "float32", "sum", Protocol.LL128)   # implemented; the preset must carry its FIFO


@pytest.mark.parametrize("path", OURS, ids=lambda p: p.name)
def test_our_programs_pass_reference_executor(path):
    res = check_program(read_xml(path), seeds=4)
    assert res.seeds == 4


@settings(max_examples=60, deadline=None)
@given(nranks=st.integers(2, 8), chans=st.integers(1, 4), split=st.integers(1, 8), data=st.data())
def test_layout_ends_meet(nranks, chans, split, data):
    """The sender's FIFO is the receiver's, each end's peer line is the other end's own line,
    and slice j lies j FIFOs and j lines after slice 0 (what the kernel computes)."""
    lay = Layout(nranks, chans, split, {Protocol.SIMPLE: Fifo(4, 4096), Protocol.LL: Fifo(2, 1024)})
    a = data.draw(st.integers(0, nranks - 1))
    b = data.draw(st.integers(0, nranks - 1).filter(lambda x: x != a))
    ch, j = data.draw(st.integers(0, chans - 1)), data.draw(st.integers(0, split - 1))
    proto = data.draw(st.sampled_from([Protocol.SIMPLE, Protocol.LL]))
    bases = [(r + 1) << 40 for r in range(nranks)]
    s = lay.send_end(proto, a, b, ch, j, bases)
    r = lay.recv_end(proto, b, a, ch, j, bases)
    assert s.fifo == r.fifo and s.peer_line == r.line and r.peer_line == s.line
    assert s.line >> 40 == a + 1 and r.line >> 40 == b + 1 and s.fifo >> 40 == b + 1
    for end, at0 in ((s, lay.send_end(proto, a, b, ch, 0, bases)), (r, lay.recv_end(proto, b, a, ch, 0, bases))):
        assert end.fifo - at0.fifo == j * lay.fifo_bytes(proto)
        assert end.line - at0.line == j * LINE_BYTES and end.peer_line - at0.peer_line == j * LINE_BYTES


@pytest.mark.parametrize("ll128", [False, True])
def test_layout_regions_disjoint(ll128):
    fifos = {Protocol.SIMPLE: Fifo(8, 1024), Protocol.LL: Fifo(4, 512)} | ({Protocol.LL128: Fifo(2, 2048)} if ll128
                                                                        else {})
    lay = Layout(2, 2, 4, fifos)
    assert lay.protos == tuple(fifos)
    spans = []
    for proto in lay.protos:
        for c in range(lay.nconn):
            spans.append((lay.fifo_off(proto, c), lay.fifo_bytes(proto)))
            spans += [(lay.send_line_off(proto, c), LINE_BYTES), (lay.recv_line_off(proto, c), LINE_BYTES)]
    spans.sort()
    for (o1, n1), (o2, _) in zip(spans, spans[1:]):
        assert o1 + n1 <= o2
    assert spans[-1][0] + spans[-1][1] <= lay.nbytes


def test_layout_refuses_slot_count_not_power_of_two():
    with pytest.raises(UserError, match="power of two"):
        Layout(2, 1, 1, {Protocol.SIMPLE: Fifo(6, 4096), Protocol.LL: Fifo(8, 1024)})


def loaded():
    preset = load_preset()
    return preset, [(e, read_xml(e.path())) for e in preset.entries]


def test_selection_by_size_and_fallback():
    preset, progs = loaded()
    small = choose(progs, "allreduce", 256, "float32", 2, preset.max_split)
    assert small.protocol == Protocol.LL and small.split == 1 and "direct_allreduce_2r" in small.reason
    big = choose(progs, "allreduce", 1 << 28, "float32", 2, preset.max_split)
    assert big.protocol == Protocol.SIMPLE and big.split == 64
    other = choose(progs, "allreduce", 256, "float32", 4, preset.max_split)
    assert other.uses_nccl and "for 2 ranks" in other.reason
    none = choose(progs, "broadcast", 256, "float32", 2, preset.max_split)
    assert none.uses_nccl and "no broadcast program loaded" in none.reason


def test_selection_range_reason():
    preset, _ = loaded()
    prog = read_xml(PROGRAM_DIR / "direct_allreduce_2r.xml")
    only_small = [(Entry("x", Protocol.LL, 0, 4096), prog)]
    c = choose(only_small, "allreduce", 4096, "float32", 2, preset.max_split)
    assert c.uses_nccl and "outside [0, 4096)" in c.reason


def test_preset_round_trip_and_errors(tmp_path):
    preset = load_preset()
    again = Preset.from_json(json.loads(json.dumps(preset.to_json())), name=preset.name)
    assert again == preset
    bad = preset.to_json()
    bad["threads"] = 1000
    f = tmp_path / "bad.json"
    f.write_text(json.dumps(bad))
    with pytest.raises(UserError, match="threads"):
        load_preset(str(f))
    with pytest.raises(UserError, match="no interpreter preset"):
        load_preset("nope")


def test_bench_sizes_and_counts():
    assert sweep(1024, 1 << 20, 4) == [1024, 4096, 16384, 65536, 262144, 1 << 20]
    assert parse_size("1G") == 1 << 30 and parse_size("64K") == 65536
    assert bench.count_for("allgather", 1 << 20, 4, 2) == 1 << 17
    assert bench.count_for("allreduce", 1 << 20, 4, 2) == 1 << 18
    with pytest.raises(UserError):
        sweep(0, 10, 2)


def test_report_section(tmp_path):
    from reports.html import write_report
    from reports.sections import builder
    rows = [{"collective": c, "bytes": b, "count": b // 4, "dtype": "float32", "program": "p", "protocol": "LL",
             "split": 1, "calls_per_graph": 10, "interp_us": 5.0, "nccl_us": 6.0 + i, "interp_busbw_gbs": 1.0,
             "nccl_busbw_gbs": 0.9, "speedup": (6.0 + i) / 5.0, "correct": True, "max_rel_err": 0.0}
            for c in ("allreduce", "allgather") for i, b in enumerate((1024, 4096))]
    (tmp_path / "bench.json").write_text(json.dumps(BenchRecord("H200", 2, "h200x2", rows).to_dict()))
    secs = builder(BenchRecord.KIND)([tmp_path])
    out = write_report(tmp_path / "r.html", "t", secs)
    text = out.read_text()
    assert "<svg" in text and "speedup" in text


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_cuda_source_compiles_for_sm90(tmp_path):
    r = subprocess.run(["nvcc", "-arch=sm_90", "-c", str(SOURCE), "-o", str(tmp_path / "interp.o"),
                        "-Xptxas", "-v"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "spill" in r.stderr and "0 bytes spill stores" in r.stderr


def test_ll128_tiles_are_whole_lines():
    """120 data bytes per 128-byte line; a tile is a multiple of 240 bytes (whole lines, 16-byte aligned)."""
    assert pack.tile_elems(Protocol.LL128, 65536, 4, 1) == 512 * 120 // 4          # 512 lines of the slot
    assert pack.tile_elems(Protocol.LL128, 65536, 2, 3) * 2 == 61440 // 3 // 240 * 240
    assert pack.tile_elems(Protocol.LL128, 65536, 4, 1, cap_bytes=1000) * 4 == 960
    assert pack.tile_elems(Protocol.LL128, 65536, 4, 1, cap_bytes=16) * 4 == 240
    with pytest.raises(UserError, match="cannot hold"):
        pack.tile_elems(Protocol.LL128, 256, 4, 2)


def test_ll128_needs_its_fifo_in_the_preset():
    from kernels.interp.preset import fifo_for

    base = load_preset("h200x2-twoshot")   # a table without LL128 carries no LL128 FIFO
    with pytest.raises(UserError, match="no LL128 FIFO"):
        fifo_for(base, Protocol.LL128)
    data = base.to_json()
    data["programs"][0]["protocol"] = "LL128"
    with pytest.raises(UserError, match="has no LL128 FIFO"):
        Preset.from_json(data, "x")
    cand = load_preset("h200x2-ll128")
    assert fifo_for(cand, Protocol.LL128) == Fifo(8, 65536)
    assert {e.protocol for e in cand.entries} == {Protocol.LL128}
    lay = Layout(2, cand.max_channels, cand.max_split, cand.fifo)
    assert lay.nbytes > Layout(2, base.max_channels, base.max_split, base.fifo).nbytes
    assert pack.params(pack.image(pack.pack(ring2(), 0, 2), [(0,) * 6]), 0, (0, 0, 0), 960, 1, 4, 240,
                       Protocol.LL128, 8, 65536, 0, 0)["proto"][0] == 2


@pytest.mark.parametrize("name", ["h200x2-twoshot", "h200x2-ll128", "h200x2-twoshot-ll128"])
def test_candidate_tables_fit_one_block_per_sm(name):
    """All CUDA blocks of a launch must be co-resident: at 512 threads and ~128 registers one block
    per SM, 132 on an H200; every candidate's widest launch stays under that."""
    preset = load_preset(name)
    for e in preset.entries:
        prog = read_xml(e.path())
        assert len(prog.gpus[0].threadblocks) * e.max_split <= 132, e
