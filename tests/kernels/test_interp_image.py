"""The interpreter's program image and launch parameters (kernels/interp/pack.py) against
what interp.cu reads: word positions, field packing, the Params struct byte for byte."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, strategies as st

from calibrate.errors import UserError
from kernels.gc3.compiler import compile_algorithm
from kernels.gc3.ir import Protocol
from kernels.gc3.xml_io import read_xml
from kernels.interp import layout, pack
from kernels.interp.preset import PROGRAM_DIR

SOURCE = Path(pack.__file__).with_name("interp.cu").read_text()


def decode_step(words, img: pack.Image, tb: int, s: int) -> dict:
    """Step s of thread block tb, read the way interp.cu's comment documents it."""
    at = img.steps_at + (tb * img.stride + s) * pack.STEP_WORDS
    w0, w1, w2 = (int(x) for x in words[at:at + 3])
    return {"op": w0 & 0xFF, "src": (w0 >> 8) & 0xFF, "dst": (w0 >> 16) & 0xFF, "has_dep": (w0 >> 24) & 0xFF,
            "cnt": w0 >> 32, "srcoff": w1 & 0xFFFFFFFF, "dstoff": w1 >> 32, "ndeps": w2 & 0xFFFFFFFF,
            "dep_start": w2 >> 32}


def test_image_of_direct_allreduce_by_hand():
    pk = pack.pack(read_xml(PROGRAM_DIR / "direct_allreduce_2r.xml"), 0, 2)
    img = pack.image(pk, [(11, 12, 13, 0, 0, 0), (0, 0, 0, 24, 25, 26)])
    assert img.in_params and img.stride == 1 and img.steps_at == 14 and img.deps_at == 20
    assert img.words.dtype == np.uint64 and len(img.words) == 20
    assert img.words[:14].tolist() == [11, 12, 13, 0, 0, 0, 1, 0, 0, 0, 24, 25, 26, 1]
    # tb 0: s i[0] -> (o[0]), one chunk; tb 1: rrc i[0] -> o[0]
    assert img.words[14:20].tolist() == [0 | 1 << 16 | 1 << 32, 0, 0, 4 | 1 << 16 | 1 << 32, 0, 0]


def test_image_steps_and_deps_match_packed():
    prog = compile_algorithm("allpairs_allreduce", 2, protocol="LL")
    for rank in range(2):
        pk = pack.pack(prog, rank, 2)
        ends = [tuple(range(10 * tb + 1, 10 * tb + 7)) for tb in range(pk.ntb)]
        img = pack.image(pk, ends)
        assert img.stride == int(pk.tbs[:, 1].max())
        for tb in range(pk.ntb):
            rec = img.words[tb * pack.TB_WORDS:(tb + 1) * pack.TB_WORDS].tolist()
            assert rec == [*ends[tb], int(pk.tbs[tb, 1])]
            for s in range(int(pk.tbs[tb, 1])):
                row = pk.steps[pk.tbs[tb, 0] + s].tolist()
                got = decode_step(img.words, img, tb, s)
                assert [got[k] for k in ("op", "src", "srcoff", "dst", "dstoff", "cnt", "ndeps", "dep_start",
                                         "has_dep")] == row
                for d in range(got["ndeps"]):
                    w = int(img.words[img.deps_at + got["dep_start"] + d])
                    assert [w & 0xFFFFFFFF, w >> 32] == pk.deps[got["dep_start"] + d].tolist()
    # tb 0 step 1 waits on tb 1 step 1 (see test_pack_deps_of_compiled_program)
    pk = pack.pack(prog, 0, 2)
    img = pack.image(pk, [(0,) * 6] * pk.ntb)
    s01 = decode_step(img.words, img, 0, 1)
    assert s01["ndeps"] == 1 and int(img.words[img.deps_at + s01["dep_start"]]) == 1 | 1 << 32


def test_large_image_goes_to_global_memory():
    pk = pack.pack(compile_algorithm("allpairs_allreduce", 8, instances=2, protocol="LL"), 0, 8)
    img = pack.image(pk, [(0,) * 6] * pk.ntb)
    assert len(img.words) > pack.IMG_WORDS and not img.in_params
    p = pack.params(img, 0xABC000, (1, 2, 3), 1024, 2, 4, 256, Protocol.LL, 8, 32768, 5, 6)
    assert int(p["gimg"][0]) == 0xABC000 and not p["img"].any()
    small = pack.image(pack.pack(read_xml(PROGRAM_DIR / "direct_allreduce_2r.xml"), 0, 2), [(7,) * 6] * 2)
    p = pack.params(small, 0xABC000, (1, 2, 3), 1024, 2, 4, 256, Protocol.LL, 8, 32768, 5, 6)
    assert int(p["gimg"][0]) == 0 and p["img"][0, :len(small.words)].tolist() == small.words.tolist()


def test_image_needs_one_end_tuple_per_block():
    pk = pack.pack(read_xml(PROGRAM_DIR / "direct_allreduce_2r.xml"), 0, 2)
    with pytest.raises(UserError, match="one tuple per block"):
        pack.image(pk, [(0,) * 6])


def test_params_fields():
    img = pack.image(pack.pack(read_xml(PROGRAM_DIR / "direct_allreduce_2r.xml"), 1, 2), [(0,) * 6] * 2)
    p = pack.params(img, 0, (0x100, 0x200, 0x300), 1000, 3, 4, 512, Protocol.SIMPLE, 8, 131072, 0x400, 0x500)
    assert p.shape == (1,) and p.dtype == pack.PARAMS and p.nbytes == pack.PARAMS.itemsize
    assert p["buf"][0].tolist() == [0x100, 0x200, 0x300]
    assert int(p["slice"][0]) == 336                      # ceil(1000 / 3) = 334, rounded up to 4 floats
    assert (int(p["slot_mask"][0]), int(p["proto"][0]), int(p["split"][0])) == (7, 0, 3)
    assert (int(p["sems"][0]), int(p["epochs"][0]), int(p["stride"][0])) == (0x400, 0x500, 1)


@given(chunk=st.integers(1, 1 << 24), split=st.integers(1, 64), esize=st.sampled_from([2, 4]))
def test_slices_cover_the_chunk_aligned(chunk, split, esize):
    sl = pack.slice_elems(chunk, split, esize)
    v = 16 // esize
    assert sl % v == 0 and sl * split >= chunk and sl - v < -(-chunk // split)


def _defines() -> dict[str, int]:
    return {m[1]: int(m[2]) for m in re.finditer(r"^#define (\w+) (\d+)\s*$", SOURCE, re.M)}


def test_params_struct_matches_cuda_source():
    """PARAMS_AT(field, offset) lines in interp.cu are static_asserts of the C struct (checked by the
    compile test); here every field of pack.PARAMS sits at the same offset, and the sizes agree."""
    at = {m[1]: int(m[2]) for m in re.finditer(r"^PARAMS_AT\((\w+), (\d+)\);", SOURCE, re.M)}
    assert at == {name: pack.PARAMS.fields[name][1] for name in pack.PARAMS.names}
    d = _defines()
    assert (d["IMG_WORDS"], d["TB_WORDS"], d["STEP_WORDS"]) == (pack.IMG_WORDS, pack.TB_WORDS, pack.STEP_WORDS)
    assert d["LINE_BYTES"] == layout.LINE_BYTES
    assert re.search(r"sizeof\(Params\) == (\d+) \+ 8 \* IMG_WORDS", SOURCE)[1] == str(pack.PARAMS.fields["img"][1])
    assert pack.PARAMS.itemsize == pack.PARAMS.fields["img"][1] + 8 * pack.IMG_WORDS
    assert pack.PARAMS.itemsize <= 4096                   # the kernel parameter limit before CUDA 12.1
